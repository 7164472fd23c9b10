//! Token usage as an upstream reports it ([`Usage`]), read from either
//! API's usage object.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Token usage as the upstream reported it, normalised across both APIs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt / input tokens.
    pub input_tokens: u64,
    /// Completion / output tokens.
    pub output_tokens: u64,
    /// Prompt tokens served from the upstream's cache, when reported.
    pub cached_tokens: Option<u64>,
    /// Prompt tokens written to the upstream's cache, when reported
    /// (Anthropic `cache_creation_input_tokens`; an OpenAI-compatible
    /// `cache_write_tokens` or `cache_creation_tokens` in the details).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    /// Of `cache_write_tokens`, those written for an hour (Anthropic
    /// `cache_creation.ephemeral_1h_input_tokens`); the rest were written
    /// for five minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_1h_tokens: Option<u64>,
}

impl Usage {
    /// Reads either API's usage object (`prompt_tokens`/`completion_tokens`
    /// or `input_tokens`/`output_tokens`). `null` or no figures: `None`.
    pub fn from_value(v: &Value) -> Option<Usage> {
        let obj = v.as_object()?;
        let get = |k: &str| obj.get(k).and_then(Value::as_u64);
        let input = get("prompt_tokens").or_else(|| get("input_tokens"))?;
        let output = get("completion_tokens")
            .or_else(|| get("output_tokens"))
            .unwrap_or(0);
        let details = obj
            .get("prompt_tokens_details")
            .or_else(|| obj.get("input_tokens_details"));
        let detail = |k: &str| details.and_then(|d| d.get(k)).and_then(Value::as_u64);
        let cached = detail("cached_tokens");
        let written = ["cache_write_tokens", "cache_creation_tokens"]
            .into_iter()
            .find_map(detail);
        Some(Usage {
            input_tokens: input,
            output_tokens: output,
            cached_tokens: cached,
            cache_write_tokens: written,
            cache_write_1h_tokens: None,
        })
    }

    /// Input plus output: what the conversation occupies after this exchange.
    pub fn total(&self) -> u64 {
        self.input_tokens + self.output_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_of_both_apis() {
        let chat = json!({"prompt_tokens": 32, "completion_tokens": 8, "total_tokens": 40,
                          "prompt_tokens_details": {"cached_tokens": 4}});
        assert_eq!(
            Usage::from_value(&chat),
            Some(Usage {
                input_tokens: 32,
                output_tokens: 8,
                cached_tokens: Some(4),
                ..Usage::default()
            })
        );
        // A cache write, where an OpenAI-compatible upstream reports one.
        let written = json!({"prompt_tokens": 3000, "completion_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 1024, "cache_write_tokens": 1900}});
        let u = Usage::from_value(&written).unwrap();
        assert_eq!(
            (u.cached_tokens, u.cache_write_tokens),
            (Some(1024), Some(1900))
        );
        let resp = json!({"input_tokens": 10, "output_tokens": 3, "total_tokens": 13});
        assert_eq!(Usage::from_value(&resp).unwrap().total(), 13);
        assert_eq!(Usage::from_value(&Value::Null), None);
    }
}
