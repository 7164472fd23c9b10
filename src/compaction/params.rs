//! The budgets of one compaction ([`Params`]), from the config and the
//! model's window, and the constants they are made of.

use super::ladder::TruncateLimits;
use super::policy;
use crate::config::{CompactionConfig, ModelLimits};

/// Budgets for one compaction, derived from the config and the model.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Tokens of verbatim tail to keep.
    pub tail_budget: u64,
    /// Tokens of verbatim user messages kept from the compacted part.
    pub recent_user_budget: u64,
    /// The request should end up at or under this many tokens.
    pub target_tokens: u64,
    /// Rung 1 limits.
    pub truncate: TruncateLimits,
    /// Largest summary message, bytes.
    pub summary_max_bytes: usize,
    /// Largest the summaries of one request may be together, bytes: a
    /// later summary is appended after the earlier ones while they stay
    /// within it, else they are rewritten into one ([`append`](super::append)).
    pub summaries_max_bytes: usize,
    /// Largest answer asked of the summarizer, tokens.
    pub summary_output_tokens: u64,
    /// Largest transcript chunk per summarizer call, tokens.
    pub summary_chunk_tokens: u64,
}

/// Hysteresis: a compaction's cheap rungs must bring the request to at
/// most this share of the trigger ([`policy::trigger_tokens`]), so that
/// one compaction buys at least as many tokens of turns as it leaves
/// rather than a prune that lands just under the trigger and is due again
/// a turn later.
pub const HYSTERESIS: f64 = 0.5;

/// Largest summary message, bytes, on a large window: about 6k tokens, so
/// that a compacted conversation restarts small (its summary, the
/// proxy's facts, the newest turn), as a client's own compaction does.
pub const SUMMARY_MAX_BYTES: usize = 24_000;

/// The summaries of one request together, in summary budgets: a later
/// summary is appended while the earlier ones and it fit (see [`append`](super::append)).
/// Two: one summary appended, then a rewrite. Measured on the economics
/// bench's Claude-Code-shaped sessions, the bill is the same as rewriting
/// every time ($7.58 against $7.58, three seeds) with later compactions
/// reading 68–74% of their first prompt from the cache instead of 51–61%
/// and a few more facts kept; three budgets cost 2% more (every later
/// request reads the summaries kept, at 0.1× each).
pub const SUMMARIES_BUDGET: usize = 2;

impl Params {
    /// Budgets for `limits`, scaled down for small windows so a compacted
    /// request always has room left.
    pub fn new(cfg: &CompactionConfig, limits: &ModelLimits) -> Params {
        let w = limits.context_window;
        let frac = |f: f64| (w as f64 * f) as u64;
        let summary_output_tokens = frac(0.12).clamp(128, 4096);
        let summary_max_bytes = (frac(0.15) * 4).clamp(1024, SUMMARY_MAX_BYTES as u64) as usize;
        let hysteresis = (policy::trigger_tokens(limits) as f64 * HYSTERESIS) as u64;
        Params {
            tail_budget: cfg.tail_tokens.min(frac(0.2)),
            recent_user_budget: cfg.recent_user_tokens.min(frac(0.1)),
            target_tokens: frac(cfg.target_ratio).min(hysteresis),
            truncate: TruncateLimits {
                max_bytes: cfg.tool_output_max_bytes,
                keep_head: cfg.tool_output_keep_bytes * 2 / 3,
                keep_tail: cfg.tool_output_keep_bytes / 3,
            },
            summary_max_bytes,
            summaries_max_bytes: summary_max_bytes * SUMMARIES_BUDGET,
            summary_output_tokens,
            // Room for the prompt, the previous summary and the answer.
            summary_chunk_tokens: w.saturating_sub(summary_output_tokens * 3 + 400).max(256),
        }
    }
}

#[cfg(test)]
mod params_tests {
    use super::*;

    #[test]
    fn the_target_leaves_half_the_trigger_to_grow_into() {
        let cfg = CompactionConfig {
            target_ratio: 0.6,
            trigger_ratio: 0.75,
            ..CompactionConfig::default()
        };
        let limits = ModelLimits {
            context_window: 200_000,
            max_output_tokens: 32_000,
            trigger_ratio: 0.75,
            trigger_max_tokens: 0,
        };
        // 0.6 of the window would be 120k, just under the 126k trigger: a
        // prune landing there would be due again a turn later.
        let p = Params::new(&cfg, &limits);
        assert_eq!(p.target_tokens, 63_000);
        // The defaults restart small on Claude's window.
        let p = Params::new(&CompactionConfig::default(), &limits);
        assert_eq!(p.target_tokens, 30_000);
        assert!(p.tail_budget + p.recent_user_budget <= 8_000);
        assert_eq!(p.summary_max_bytes, SUMMARY_MAX_BYTES);
    }
}
