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
    /// Tokens at which compaction triggers: the trigger ratio of the
    /// effective limit ([`trigger_tokens`]).
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
    let threshold = trigger_tokens(limits);
    Decision {
        compact: used >= threshold,
        warn: used as f64 >= window as f64 * warn_ratio,
        used,
        estimated,
        threshold,
        window,
    }
}

/// Tokens at which a conversation compacts: the trigger ratio of the
/// effective limit (the window less the answer's budget, [`hard_limit`]),
/// not of the window. Taken of the window, a trigger above the effective
/// limit (0.9 of a 200k window is 180k, past the 168k a 32k answer leaves)
/// would never fire before the request stops fitting, and every compaction
/// would be a synchronous one inside a turn; taken of the effective limit,
/// any configured ratio fires before it.
///
/// On a large window it is capped (`compaction.trigger_max_tokens`): under
/// prompt caching every turn pays for reading its whole prompt, so past a
/// size the reads a compaction saves over the turns that follow outweigh
/// its summary call and the write of the smaller prefix, however large the
/// window (see `docs/PERFORMANCE.md`, "Economics").
pub fn trigger_tokens(limits: &ModelLimits) -> u64 {
    let by_ratio = (hard_limit(limits) as f64 * limits.trigger_ratio) as u64;
    match limits.trigger_max_tokens {
        0 => by_ratio,
        cap => by_ratio.min(cap),
    }
}

/// Tokens past which an idle conversation gets a compaction for when it
/// comes back after its cache expired (`compaction.cold_ratio` of the
/// effective limit, as [`trigger_tokens`]): its prefix is written again
/// then anyway, so the compaction's own write costs nothing extra.
pub fn cold_tokens(limits: &ModelLimits, cold_ratio: f64) -> u64 {
    let by_ratio = (hard_limit(limits) as f64 * cold_ratio) as u64;
    by_ratio.min(trigger_tokens(limits))
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
            trigger_max_tokens: 0,
        }
    }

    #[test]
    fn triggers_at_the_ratio_of_the_effective_limit() {
        // 0.75 of the 900 the answer's 100 leave of the window.
        let d = decide(674, false, &limits(), 0.6);
        assert!(!d.compact && d.warn);
        let d = decide(675, true, &limits(), 0.6);
        assert!(d.compact);
        assert!(
            d.reason().contains("estimated 675 tokens of 1000"),
            "{}",
            d.reason()
        );
        assert!(!decide(10, false, &limits(), 0.6).warn);
        assert_eq!(hard_limit(&limits()), 900);
    }

    #[test]
    fn any_trigger_fires_before_the_hard_limit() {
        // Claude's shape: a 200k window, a 32k answer.
        for ratio in [0.5, 0.75, 0.9, 0.95, 1.0] {
            let l = ModelLimits {
                context_window: 200_000,
                max_output_tokens: 32_000,
                trigger_ratio: ratio,
                trigger_max_tokens: 0,
            };
            assert!(trigger_tokens(&l) <= hard_limit(&l), "{ratio}");
            assert!(decide(hard_limit(&l), false, &l, 0.6).compact, "{ratio}");
        }
        let l = ModelLimits {
            context_window: 200_000,
            max_output_tokens: 32_000,
            trigger_ratio: 0.9,
            trigger_max_tokens: 0,
        };
        assert_eq!(trigger_tokens(&l), 151_200);
    }

    #[test]
    fn a_large_window_triggers_at_the_cap_a_small_one_at_its_ratio() {
        let mut l = ModelLimits {
            context_window: 1_000_000,
            max_output_tokens: 32_000,
            trigger_ratio: 0.75,
            trigger_max_tokens: 85_000,
        };
        assert_eq!(trigger_tokens(&l), 85_000);
        assert!(decide(85_000, false, &l, 0.6).compact);
        // The cold threshold is a ratio of the limit, never past the trigger.
        assert_eq!(cold_tokens(&l, 0.25), 85_000);
        l.trigger_max_tokens = 0;
        assert_eq!(trigger_tokens(&l), 726_000);
        assert_eq!(cold_tokens(&l, 0.25), 242_000);
        let small = ModelLimits {
            trigger_max_tokens: 85_000,
            ..limits()
        };
        assert_eq!(trigger_tokens(&small), 675);
        assert_eq!(cold_tokens(&small, 0.25), 225);
    }
}

/// Whether an upstream answer says the prompt does not fit the context
/// window, across providers: OpenAI/Azure `context_length_exceeded`,
/// llama.cpp `exceed_context_size_error`, vLLM and OpenRouter "maximum
/// context length", Anthropic-compatible "prompt is too long", and the same
/// wrapped by LiteLLM (`ContextWindowExceededError`).
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
        "contextwindowexceedederror",
        "input is too long for requested model",
        "too many tokens",
        "reduce the length of the messages",
        "maximum model length",
        "is too long and exceeds limit",
        "exceeds the maximum number of tokens",
        "too large for model with",
        "tokens + `max_new_tokens` must be <=",
        // Anthropic: "input length and `max_tokens` exceed context limit: A + B > C"
        "exceed context limit",
    ];
    NEEDLES.iter().any(|n| text.contains(n))
}

/// What an overflow answer says about the sizes, in the upstream's tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stated {
    /// The context window (or prompt maximum) the upstream enforces.
    pub limit: Option<u64>,
    /// How large it says the refused request was.
    pub requested: Option<u64>,
}

/// Stated windows outside this range are misreads, not windows.
const STATED_LIMIT_RANGE: std::ops::RangeInclusive<u64> = 16..=100_000_000;

/// The phrases that state the window, per provider; the number is group 1.
/// Checked in order, lowercased text.
const LIMIT_PATTERNS: &[&str] = &[
    // OpenAI, Azure, vLLM, OpenRouter, Groq, and LiteLLM relaying them.
    r"maximum context length is ([0-9]+)",
    // llama.cpp
    r"available context size \(([0-9]+) tokens?\)",
    r#""n_ctx"\s*:\s*([0-9]+)"#,
    r"\bn_ctx\s*[:=]\s*([0-9]+)",
    // Anthropic-compatible: "prompt is too long: 210000 tokens > 200000 maximum"
    r"tokens? > ([0-9]+) maximum",
    // Anthropic, when the prompt fits but not with the answer's room:
    // "input length and `max_tokens` exceed context limit: 187254 + 20000 > 204698"
    r"exceed context limit: [0-9]+ \+ [0-9]+ > ([0-9]+)",
    // vLLM's other wordings
    r"maximum model length of ([0-9]+)",
    r"exceeds limit of ([0-9]+)",
    r"max_model_len[^0-9]{0,4}([0-9]+)",
    // Gemini's OpenAI-compatible endpoint
    r"maximum number of tokens allowed \(([0-9]+)\)",
    // Mistral
    r"too large for model with ([0-9]+) maximum context length",
    // Text Generation Inference
    r"must be <= ([0-9]+)",
    r"context window (?:of|is) ([0-9]+)",
];

/// The phrases that state the refused request's size; group 1.
const REQUESTED_PATTERNS: &[&str] = &[
    r"request \(([0-9]+) tokens?\)",
    r#""n_prompt_tokens"\s*:\s*([0-9]+)"#,
    r"resulted in ([0-9]+) tokens",
    r"your request has ([0-9]+) input tokens",
    r"requested (?:about )?([0-9]+) tokens",
    r"prompt is too long: ([0-9]+) tokens",
    r"exceed context limit: ([0-9]+) \+",
    r"prompt \(length ([0-9]+)\)",
    r"prompt \(([0-9]+) tokens?\)",
    r"input token count \(([0-9]+)\)",
    r"prompt contains ([0-9]+) tokens",
    r"given: ([0-9]+) `inputs` tokens",
];

fn compiled(patterns: &'static [&'static str]) -> Vec<regex::Regex> {
    patterns
        .iter()
        .filter_map(|p| regex::Regex::new(p).ok())
        .collect()
}

static LIMIT_RES: std::sync::LazyLock<Vec<regex::Regex>> =
    std::sync::LazyLock::new(|| compiled(LIMIT_PATTERNS));
static REQUESTED_RES: std::sync::LazyLock<Vec<regex::Regex>> =
    std::sync::LazyLock::new(|| compiled(REQUESTED_PATTERNS));

fn first_number(res: &[regex::Regex], text: &str) -> Option<u64> {
    res.iter().find_map(|re| {
        re.captures(text)
            .and_then(|c| c.get(1))
            .and_then(|m| m.as_str().parse().ok())
    })
}

/// Reads the window and the refused request's size from an overflow answer
/// (an error body or a streamed `response.failed` event). Only numbers the
/// text states are returned, and a window only within a plausible range.
pub fn stated_limits(body: &[u8]) -> Stated {
    let text = String::from_utf8_lossy(body).to_ascii_lowercase();
    Stated {
        limit: first_number(&LIMIT_RES, &text).filter(|n| STATED_LIMIT_RANGE.contains(n)),
        requested: first_number(&REQUESTED_RES, &text),
    }
}

/// Share of the refused request a reactive compaction must take off at
/// least, whatever the window says: estimates and the upstream's tokenizer
/// differ, and a retry that lands a few tokens short of fitting fails again.
pub const FIT_MARGIN: f64 = 0.1;

/// The prompt size a reactive compaction must reach, in the upstream's
/// tokens: the stated window (else the known one) less the answer's room
/// (the request's own max output, else the model's, never more than half
/// the window), and in any case [`FIT_MARGIN`] below the refused size
/// (`refused`: the proxy's own figure in the upstream's tokens, else the
/// one stated).
pub fn fit_limit(
    stated: Stated,
    limits: &ModelLimits,
    request_max_output: Option<u64>,
    refused: Option<u64>,
) -> u64 {
    let window = stated
        .limit
        .map_or(limits.context_window, |s| s.min(limits.context_window));
    let answer = request_max_output
        .unwrap_or(limits.max_output_tokens)
        .min(window / 2);
    let mut limit = window.saturating_sub(answer);
    if let Some(r) = refused.or(stated.requested) {
        limit = limit.min((r as f64 * (1.0 - FIT_MARGIN)) as u64);
    }
    limit
}

#[cfg(test)]
mod overflow_tests {
    use super::*;
    use proptest::prelude::*;

    /// The corpus of real overflow answers (and a few look-alikes that are
    /// not), one file per provider and wording.
    fn corpus() -> Vec<(String, Value)> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/corpus/overflow");
        let mut out: Vec<(String, Value)> = std::fs::read_dir(dir)
            .expect("corpus directory")
            .map(|e| e.expect("corpus entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .map(|p| {
                let text = std::fs::read_to_string(&p).expect("corpus file");
                let v = serde_json::from_str(&text).expect("corpus file is JSON");
                (p.file_name().unwrap().to_string_lossy().into_owned(), v)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    use serde_json::Value;

    #[test]
    fn the_corpus_is_classified_and_its_limits_read() {
        let corpus = corpus();
        assert!(corpus.len() >= 15, "{}", corpus.len());
        for (name, case) in &corpus {
            let status = case["status"].as_u64().unwrap() as u16;
            let body = case["body"].as_str().unwrap().as_bytes();
            assert_eq!(
                is_context_overflow(status, body),
                case["overflow"].as_bool().unwrap(),
                "{name}"
            );
            let stated = stated_limits(body);
            if case["overflow"] == true {
                assert_eq!(stated.limit, case["limit"].as_u64(), "{name}: limit");
                assert_eq!(
                    stated.requested,
                    case["requested"].as_u64(),
                    "{name}: requested"
                );
            }
        }
    }

    #[test]
    fn the_limit_to_fit_takes_the_smaller_window_and_a_margin() {
        let limits = ModelLimits {
            context_window: 8192,
            max_output_tokens: 2048,
            trigger_ratio: 0.75,
            trigger_max_tokens: 0,
        };
        let llama = Stated {
            limit: Some(2048),
            requested: Some(2052),
        };
        // The stated 2048 wins over the table's 8192; the answer keeps half
        // of it at most; the refused size does not bind here.
        assert_eq!(fit_limit(llama, &limits, None, None), 1024);
        assert_eq!(fit_limit(llama, &limits, Some(100), None), 1846);
        // Nothing stated: the table's window less the output, and 10% under
        // the refused request.
        assert_eq!(fit_limit(Stated::default(), &limits, None, None), 6144);
        assert_eq!(
            fit_limit(Stated::default(), &limits, None, Some(5000)),
            4500
        );
        // A stated window larger than an explicit smaller one does not widen it.
        let big = Stated {
            limit: Some(100_000),
            requested: None,
        };
        assert_eq!(fit_limit(big, &limits, Some(0), None), 8192);
    }

    /// The numbers written in `text`, as the parser could read them.
    fn numbers(text: &str) -> Vec<u64> {
        text.split(|c: char| !c.is_ascii_digit())
            .filter_map(|d| d.parse().ok())
            .collect()
    }

    fn mutated() -> impl Strategy<Value = Vec<u8>> {
        let bodies: Vec<Vec<u8>> = corpus()
            .into_iter()
            .map(|(_, c)| c["body"].as_str().unwrap().as_bytes().to_vec())
            .collect();
        (
            prop::sample::select(bodies),
            prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 0..12),
        )
            .prop_map(|(mut body, edits)| {
                for (at, byte, op) in edits {
                    let i = at.index(body.len() + 1);
                    match op {
                        0 => body.insert(i, byte),
                        1 if i < body.len() => {
                            body.remove(i);
                        }
                        _ if i < body.len() => body[i] = byte,
                        _ => {}
                    }
                }
                body
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// A fuzz target, bounded in cases: random bytes and mutated corpus
        /// answers never panic, and what is read is a number the text states.
        #[test]
        fn the_parser_reads_only_numbers_the_text_states(
            body in prop_oneof![prop::collection::vec(any::<u8>(), 0..400), mutated()],
            status in 100u16..600,
        ) {
            let _ = is_context_overflow(status, &body);
            let stated = stated_limits(&body);
            let text = String::from_utf8_lossy(&body).to_ascii_lowercase();
            let written = numbers(&text);
            for n in [stated.limit, stated.requested].into_iter().flatten() {
                prop_assert!(written.contains(&n), "{n} not in {text:?}");
            }
            if let Some(l) = stated.limit {
                prop_assert!(STATED_LIMIT_RANGE.contains(&l));
            }
        }
    }

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
