//! Should this conversation compact? A pure decision from the figures.

use serde::Serialize;

use crate::config::ModelLimits;

/// The verdict on one exchange, with the figures that led to it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// Compact now.
    pub compact: bool,
    /// Past the warning ratio.
    pub warn: bool,
    /// Tokens the conversation occupies after the exchange.
    pub used: u64,
    /// `used` is a tokenizer estimate, not the upstream's report.
    pub estimated: bool,
    /// Tokens at which compaction triggers.
    pub threshold: u64,
    /// The model's window.
    pub window: u64,
}

impl Decision {
    /// A human-readable reason carrying the figures.
    pub fn reason(&self) -> String {
        format!(
            "{} {} tokens of {} window ({:.0}%) {} threshold {}",
            if self.estimated {
                "estimated"
            } else {
                "reported"
            },
            self.used,
            self.window,
            100.0 * self.used as f64 / self.window.max(1) as f64,
            if self.compact { "≥" } else { "<" },
            self.threshold
        )
    }
}

/// Decides from the tokens an exchange used (`prompt + completion`).
pub fn decide(used: u64, estimated: bool, limits: &ModelLimits, warn_ratio: f64) -> Decision {
    let window = limits.context_window;
    let threshold = (window as f64 * limits.trigger_ratio) as u64;
    Decision {
        compact: used >= threshold,
        warn: used as f64 >= window as f64 * warn_ratio,
        used,
        estimated,
        threshold,
        window,
    }
}

/// Largest prompt that still leaves room for the model's answer.
pub fn hard_limit(limits: &ModelLimits) -> u64 {
    // A max output larger than half the window would leave no prompt at all;
    // the upstream decides how much output fits then.
    limits
        .context_window
        .saturating_sub(limits.max_output_tokens.min(limits.context_window / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ModelLimits {
        ModelLimits {
            context_window: 1000,
            max_output_tokens: 100,
            trigger_ratio: 0.75,
        }
    }

    #[test]
    fn triggers_at_the_ratio() {
        let d = decide(749, false, &limits(), 0.6);
        assert!(!d.compact && d.warn);
        let d = decide(750, true, &limits(), 0.6);
        assert!(d.compact);
        assert!(
            d.reason().contains("estimated 750 tokens of 1000"),
            "{}",
            d.reason()
        );
        assert!(!decide(10, false, &limits(), 0.6).warn);
        assert_eq!(hard_limit(&limits()), 900);
    }
}

/// Whether an upstream answer says the prompt does not fit the context
/// window, across providers: OpenAI/Azure `context_length_exceeded`,
/// llama.cpp `exceed_context_size_error`, vLLM and OpenRouter "maximum
/// context length", Anthropic-compatible "prompt is too long".
pub fn is_context_overflow(status: u16, body: &[u8]) -> bool {
    if !(400..500).contains(&status) {
        return false;
    }
    let text = String::from_utf8_lossy(body).to_ascii_lowercase();
    const NEEDLES: &[&str] = &[
        "context_length_exceeded",
        "exceed_context_size_error",
        "exceeds the available context size",
        "maximum context length",
        "prompt is too long",
        "context window",
        "input is too long for requested model",
        "too many tokens",
        "reduce the length of the messages",
    ];
    NEEDLES.iter().any(|n| text.contains(n))
}

#[cfg(test)]
mod overflow_tests {
    use super::is_context_overflow;

    #[test]
    fn overflow_answers_across_providers() {
        let yes: &[&[u8]] = &[
            br#"{"error":{"message":"This model's maximum context length is 128000 tokens.","code":"context_length_exceeded"}}"#,
            br#"{"error":{"code":400,"message":"request (4601 tokens) exceeds the available context size (2048 tokens), try increasing it","type":"exceed_context_size_error"}}"#,
            br#"{"object":"error","message":"This model's maximum context length is 2048 tokens. However, you requested 3000 tokens","code":400}"#,
            br#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#,
            br#"{"error":{"message":"This endpoint's maximum context length is 131072 tokens. However, you requested about 140000 tokens","code":400}}"#,
        ];
        for body in yes {
            assert!(
                is_context_overflow(400, body),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(!is_context_overflow(
            400,
            br#"{"error":{"message":"Invalid value for 'model'"}}"#
        ));
        assert!(!is_context_overflow(500, br#"context_length_exceeded"#));
        assert!(!is_context_overflow(
            429,
            br#"{"error":{"message":"Rate limit reached"}}"#
        ));
    }
}
