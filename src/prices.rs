//! What tokens cost: a model's prices per million tokens for input, cache
//! writes (five-minute and one-hour), cache reads and output, the dated
//! built-in list for common families, and the cost of one call's usage.
//!
//! The built-in list is the providers' published list prices as of
//! [`AS_OF`], for standard processing: no batch or priority tiers, no
//! long-context surcharges (Gemini 2.5 Pro past 200k tokens, Claude Sonnet
//! past 200k), no cache storage fees. List prices change: a `[[models]]`
//! entry's `*_price_per_mtok` keys override any of them ([`of`]). A model
//! the list does not know and no entry prices has no prices: its tokens
//! are shown, never dollars.

use serde::Serialize;

use crate::config::{glob_match, Config};

/// When the built-in list was taken.
pub const AS_OF: &str = "2025-11-24";

/// A model's prices per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Prices {
    /// Input tokens neither read from nor written to the prompt cache.
    pub input: f64,
    /// Input tokens written to the cache for five minutes (Anthropic
    /// 1.25× input; the input price where writes cost nothing extra).
    pub cache_write: f64,
    /// Input tokens written to the cache for an hour (Anthropic 2×).
    pub cache_write_1h: f64,
    /// Input tokens read from the cache.
    pub cache_read: f64,
    /// Output tokens.
    pub output: f64,
}

/// One call's tokens, as its upstream reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tokens {
    /// The whole prompt: uncached, read and written tokens together.
    pub input: u64,
    /// Of those, read from the cache.
    pub cache_read: u64,
    /// Of those, written to the cache.
    pub cache_write: u64,
    /// Of the written ones, those written for an hour.
    pub cache_write_1h: u64,
    /// Output tokens.
    pub output: u64,
}

impl Tokens {
    /// Calls that resent this call's prompt (`compactor_recall` rounds),
    /// `input` and `output` tokens in all: read from the cache in the
    /// share this prompt was.
    pub fn resent(&self, input: u64, output: u64) -> Tokens {
        let share = if self.input > 0 {
            self.cache_read.min(self.input) as f64 / self.input as f64
        } else {
            0.0
        };
        Tokens {
            input,
            cache_read: (input as f64 * share) as u64,
            output,
            ..Tokens::default()
        }
    }

    /// Input tokens neither read nor written.
    pub fn uncached(&self) -> u64 {
        self.input
            .saturating_sub(self.cache_read)
            .saturating_sub(self.cache_write)
    }
}

impl Prices {
    /// Anthropic's multipliers of `input`: writes 1.25× (five minutes)
    /// and 2× (an hour), reads 0.1×.
    const fn anthropic(input: f64, output: f64) -> Prices {
        Prices {
            input,
            cache_write: input * 1.25,
            cache_write_1h: input * 2.0,
            cache_read: input / 10.0,
            output,
        }
    }

    /// Prices where a cache write costs what input does.
    const fn free_writes(input: f64, cache_read: f64, output: f64) -> Prices {
        Prices {
            input,
            cache_write: input,
            cache_write_1h: input,
            cache_read,
            output,
        }
    }

    /// What a call of `t` tokens cost, in dollars.
    pub fn cost(&self, t: &Tokens) -> f64 {
        let read = t.cache_read.min(t.input);
        let write = t.cache_write.min(t.input - read);
        let hour = t.cache_write_1h.min(write);
        ((t.input - read - write) as f64 * self.input
            + read as f64 * self.cache_read
            + (write - hour) as f64 * self.cache_write
            + hour as f64 * self.cache_write_1h
            + t.output as f64 * self.output)
            / 1e6
    }
}

/// How long a prompt cache lives unless a breakpoint asks for an hour, ms.
pub const CACHE_TTL_MS: i64 = 5 * 60 * 1000;
/// How long it lives at an hour's breakpoints, ms.
pub const CACHE_TTL_1H_MS: i64 = 60 * 60 * 1000;

/// What a conversation's upstream reported of its prompt cache: whether
/// it caches at all, bills writes, and writes for an hour.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheSeen {
    /// Tokens reported read.
    pub reads: u64,
    /// Tokens reported written.
    pub writes: u64,
    /// Of those, written for an hour.
    pub writes_1h: u64,
}

impl CacheSeen {
    /// Adds one call's figures.
    pub fn add(&mut self, t: &Tokens) {
        self.reads += t.cache_read;
        self.writes += t.cache_write;
        self.writes_1h += t.cache_write_1h;
    }

    /// Whether the upstream caches (it reported a read or a write).
    pub fn caches(&self) -> bool {
        self.reads + self.writes > 0
    }

    /// How long its cache lives: an hour once it wrote for an hour.
    pub fn ttl_ms(&self) -> i64 {
        if self.writes_1h > 0 {
            CACHE_TTL_1H_MS
        } else {
            CACHE_TTL_MS
        }
    }
}

/// The exchange before, as the counterfactual reads it: its prompt without
/// compaction, and when its answer ended (Unix ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Previous {
    /// Its uncompacted prompt, tokens.
    pub whole: u64,
    /// When its answer ended.
    pub ended_ms: i64,
}

/// The tokens a compacted call would have been billed for without its
/// compaction (`saved` tokens more), with the cache it would have had
/// (the assumptions are `store::savings`'s): an uncompacted call is its
/// own counterfactual.
pub fn uncompacted(
    actual: Tokens,
    saved: u64,
    started_ms: i64,
    previous: Option<Previous>,
    cache: &CacheSeen,
) -> Tokens {
    if saved == 0 {
        return actual;
    }
    let whole = actual.input + saved;
    // A clock that went backwards counts as no gap.
    let read = match previous {
        Some(p) if cache.caches() && started_ms.saturating_sub(p.ended_ms) <= cache.ttl_ms() => {
            p.whole.min(whole)
        }
        _ => 0,
    };
    let write = if cache.writes > 0 { whole - read } else { 0 };
    let hour_share = if cache.writes > 0 {
        cache.writes_1h as f64 / cache.writes as f64
    } else {
        0.0
    };
    Tokens {
        input: whole,
        cache_read: read,
        cache_write: write,
        cache_write_1h: (write as f64 * hour_share) as u64,
        output: actual.output,
    }
}

/// The built-in list, first match wins: (glob over the lowercased model
/// name without any `provider/` prefix, prices). Dated [`AS_OF`].
const BUILTIN: &[(&str, Prices)] = &[
    // Anthropic: writes 1.25× (5 min) and 2× (1 h), reads 0.1×.
    ("claude-opus-4-5*", Prices::anthropic(5.0, 25.0)),
    ("claude-opus-4*", Prices::anthropic(15.0, 75.0)),
    ("claude-3-opus*", Prices::anthropic(15.0, 75.0)),
    ("claude-sonnet-4*", Prices::anthropic(3.0, 15.0)),
    ("claude-3-7-sonnet*", Prices::anthropic(3.0, 15.0)),
    ("claude-3-5-sonnet*", Prices::anthropic(3.0, 15.0)),
    ("claude-haiku-4*", Prices::anthropic(1.0, 5.0)),
    ("claude-3-5-haiku*", Prices::anthropic(0.8, 4.0)),
    ("claude-3-haiku*", Prices::anthropic(0.25, 1.25)),
    // OpenAI: automatic caching, writes at the input price.
    ("gpt-5*-pro*", Prices::free_writes(15.0, 15.0, 120.0)),
    ("gpt-5*-mini*", Prices::free_writes(0.25, 0.025, 2.0)),
    ("gpt-5*-nano*", Prices::free_writes(0.05, 0.005, 0.4)),
    ("gpt-5*", Prices::free_writes(1.25, 0.125, 10.0)),
    ("gpt-4.1-mini*", Prices::free_writes(0.4, 0.1, 1.6)),
    ("gpt-4.1-nano*", Prices::free_writes(0.1, 0.025, 0.4)),
    ("gpt-4.1*", Prices::free_writes(2.0, 0.5, 8.0)),
    ("gpt-4o-mini*", Prices::free_writes(0.15, 0.075, 0.6)),
    ("gpt-4o*", Prices::free_writes(2.5, 1.25, 10.0)),
    ("o1-mini*", Prices::free_writes(1.1, 0.55, 4.4)),
    ("o1*", Prices::free_writes(15.0, 7.5, 60.0)),
    ("o3-pro*", Prices::free_writes(20.0, 20.0, 80.0)),
    ("o3-mini*", Prices::free_writes(1.1, 0.55, 4.4)),
    ("o3*", Prices::free_writes(2.0, 0.5, 8.0)),
    ("o4-mini*", Prices::free_writes(1.1, 0.275, 4.4)),
    // Google (prompts up to 200k tokens; implicit caching).
    ("gemini-2.5-pro*", Prices::free_writes(1.25, 0.125, 10.0)),
    (
        "gemini-2.5-flash-lite*",
        Prices::free_writes(0.1, 0.01, 0.4),
    ),
    ("gemini-2.5-flash*", Prices::free_writes(0.3, 0.03, 2.5)),
];

/// `model`'s prices from the built-in list, if it names one of its
/// families.
pub fn builtin(model: &str) -> Option<Prices> {
    let lower = model.to_ascii_lowercase();
    let name = lower.rsplit('/').next().unwrap_or(&lower);
    BUILTIN
        .iter()
        .find(|(glob, _)| glob_match(glob, name))
        .map(|(_, p)| *p)
}

/// `model`'s prices: its `[[models]]` entry's prices where it gives them,
/// the rest from the built-in list. A model the list does not know needs
/// an entry with an input price; the other prices then default to it
/// (a cache read or write at the input price, output at the input price).
pub fn of(config: &Config, model: &str) -> Option<Prices> {
    let entry = config.model_entry(model);
    let base = builtin(model).or_else(|| {
        let input = entry?.input_price_per_mtok?;
        Some(Prices::free_writes(input, input, input))
    })?;
    let Some(m) = entry else { return Some(base) };
    let input = m.input_price_per_mtok.unwrap_or(base.input);
    // A write defaults to its multiple of the entry's input price, when
    // the entry gives one.
    let scaled = |p: f64| p / base.input * input;
    let scale = |p: f64| if base.input > 0.0 { scaled(p) } else { p };
    Some(Prices {
        input,
        cache_write: m
            .cache_write_price_per_mtok
            .unwrap_or(scale(base.cache_write)),
        cache_write_1h: m
            .cache_write_1h_price_per_mtok
            .unwrap_or(scale(base.cache_write_1h)),
        cache_read: m
            .cached_input_price_per_mtok
            .unwrap_or(scale(base.cache_read)),
        output: m.output_price_per_mtok.unwrap_or(base.output),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_knows_the_common_families_and_nothing_else() {
        let p = builtin("claude-sonnet-4-5-20250929").unwrap();
        assert_eq!((p.input, p.output), (3.0, 15.0));
        assert_eq!(
            (p.cache_write, p.cache_write_1h, p.cache_read),
            (3.75, 6.0, 0.3)
        );
        assert_eq!(builtin("claude-opus-4-5").unwrap().input, 5.0);
        assert_eq!(builtin("claude-opus-4-1-20250805").unwrap().input, 15.0);
        assert_eq!(builtin("gpt-5-mini").unwrap().cache_read, 0.025);
        assert_eq!(builtin("gpt-5.1-codex").unwrap().input, 1.25);
        assert_eq!(builtin("openai/gpt-4.1-nano").unwrap().input, 0.1);
        assert_eq!(builtin("models/Gemini-2.5-Flash").unwrap().output, 2.5);
        assert_eq!(builtin("o4-mini-2025-04-16").unwrap().cache_read, 0.275);
        for unknown in ["llama-3.1-8b", "smollm2-135m", "my-model", "gpt-oss-20b"] {
            assert_eq!(builtin(unknown), None, "{unknown}");
        }
    }

    #[test]
    fn an_entry_overrides_what_it_gives() {
        let c = Config::from_toml(
            "[[models]]\nmatch = \"m\"\ncontext_window = 1000\ninput_price_per_mtok = 3.0\n\
             [[models]]\nmatch = \"free\"\ncontext_window = 1000\n\
             [[models]]\nmatch = \"claude-sonnet-4*\"\ncontext_window = 200000\n\
             output_price_per_mtok = 20.0\ncache_write_1h_price_per_mtok = 7.0\n\
             [[models]]\nmatch = \"claude-haiku-4*\"\ncontext_window = 200000\n\
             input_price_per_mtok = 2.0\n",
        )
        .unwrap();
        let m = of(&c, "m").unwrap();
        assert_eq!(
            (m.cache_read, m.cache_write, m.cache_write_1h, m.output),
            (3.0, 3.0, 3.0, 3.0)
        );
        assert_eq!(of(&c, "free"), None);
        let s = of(&c, "claude-sonnet-4-5").unwrap();
        assert_eq!((s.input, s.output, s.cache_write_1h), (3.0, 20.0, 7.0));
        assert_eq!((s.cache_write, s.cache_read), (3.75, 0.3));
        // A new input price keeps the family's multipliers.
        let h = of(&c, "claude-haiku-4-5").unwrap();
        assert_eq!((h.cache_write, h.cache_write_1h, h.output), (2.5, 4.0, 5.0));
        assert!((h.cache_read - 0.2).abs() < 1e-12);
        assert_eq!(of(&Config::default(), "gpt-4o").unwrap().input, 2.5);
        assert!(Config::from_toml(
            "[[models]]\nmatch = \"m\"\ncontext_window = 1\ncache_write_price_per_mtok = -1.0\n"
        )
        .is_err());
    }

    #[test]
    fn the_uncompacted_call_reads_the_previous_one_while_the_cache_lives() {
        let actual = Tokens {
            input: 3_000,
            cache_read: 1_000,
            cache_write: 2_000,
            cache_write_1h: 0,
            output: 10,
        };
        let cache = CacheSeen {
            reads: 1_000,
            writes: 4_000,
            writes_1h: 0,
        };
        let before = |ended_ms| {
            Some(Previous {
                whole: 8_000,
                ended_ms,
            })
        };
        // No compaction: the call itself.
        assert_eq!(uncompacted(actual, 0, 0, before(0), &cache), actual);
        // 7,000 fewer: 10,000 in all, the previous 8,000 read, 2,000 written.
        let warm = uncompacted(actual, 7_000, 60_000, before(0), &cache);
        assert_eq!(
            (warm.input, warm.cache_read, warm.cache_write),
            (10_000, 8_000, 2_000)
        );
        // Past five minutes: all written again.
        let cold = uncompacted(actual, 7_000, CACHE_TTL_MS + 1, before(0), &cache);
        assert_eq!((cold.cache_read, cold.cache_write), (0, 10_000));
        // A clock gone backwards is no gap; an hour's writes live an hour.
        let back = uncompacted(actual, 7_000, 0, before(90_000), &cache);
        assert_eq!(back.cache_read, 8_000);
        let hour = CacheSeen {
            writes_1h: 1_000,
            ..cache
        };
        let kept = uncompacted(actual, 7_000, 30 * 60_000, before(0), &hour);
        assert_eq!((kept.cache_read, kept.cache_write_1h), (8_000, 500));
        // An upstream without cache figures: nothing read or written.
        let none = uncompacted(actual, 7_000, 1, before(0), &CacheSeen::default());
        assert_eq!(
            (none.cache_read, none.cache_write, none.input),
            (0, 0, 10_000)
        );
    }

    #[test]
    fn a_call_costs_each_part_at_its_price() {
        let p = Prices::anthropic(3.0, 15.0);
        let t = Tokens {
            input: 1_000_000 + 2_000_000 + 400_000,
            cache_read: 2_000_000,
            cache_write: 400_000,
            cache_write_1h: 100_000,
            output: 10_000,
        };
        // 1M uncached, 2M read, 300k 5-min writes, 100k 1-h writes.
        let want = 3.0 + 2.0 * 0.3 + 0.3 * 3.75 + 0.1 * 6.0 + 0.01 * 15.0;
        assert!((p.cost(&t) - want).abs() < 1e-9, "{}", p.cost(&t));
        assert_eq!(t.uncached(), 1_000_000);
        // Figures that do not add up are bounded by the prompt.
        let odd = Tokens {
            input: 10,
            cache_read: 50,
            cache_write: 50,
            cache_write_1h: 50,
            output: 0,
        };
        assert!((p.cost(&odd) - 10.0 * 0.3 / 1e6).abs() < 1e-15);
    }
}
