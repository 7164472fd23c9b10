//! The closed label sets of the counters: every value a label can take,
//! declared up front so each series exists (at 0) from the first scrape,
//! and the mapping of a compaction's reason to its kind and trigger.

/// Endpoint labels of `compactor_requests_total`; anything else counts as `other`.
pub const ENDPOINTS: &[&str] = &[
    "chat",
    "responses",
    "responses_compact",
    "responses_websocket",
    "messages",
    "messages_count_tokens",
    "gemini",
    "gemini_count_tokens",
    "passthrough",
    "admin",
    "metrics",
    "healthz",
    "readyz",
    "other",
];

/// Rung labels of the compaction counters; anything else counts as `other`.
pub const RUNGS: &[&str] = &[
    "truncate", "prune", "summary", "fallback", "handoff", "other",
];

/// Reason labels of `compactor_compactions_total`; anything else counts as `other`.
pub const REASONS: &[&str] = &[
    "threshold",
    "overflow",
    "hard_limit",
    "manual",
    "requested",
    "agent",
    "cold",
    "handoff",
    "other",
];

/// Trigger labels of `compactor_compaction_triggers_total`: what made a
/// compaction happen, or where a waiting one was first applied.
///
/// - `threshold`: a background compaction computed because an exchange
///   crossed the trigger (it then applies on the next request that
///   extends it);
/// - `boundary`: a waiting compaction first applied under the hard limit:
///   a threshold one on the next request that extends it, the model's at
///   a turn boundary (the request's last item a new user message);
/// - `hard`: a request over the hard limit cut inside a turn (a waiting
///   compaction applied before its boundary, or one computed at once);
/// - `reactive`: the upstream refused a request as too long;
/// - `agent`: the model asked, with `compactor_compact`;
/// - `manual`: the CLI, the admin API or the client's request header;
/// - `provider`: the provider compacted (its compaction item or block);
/// - `cold`: a background compaction computed for a conversation idle for
///   most of its cache's lifetime (it then applies when the conversation
///   comes back after the cache expired).
pub const TRIGGERS: &[&str] = &[
    "threshold",
    "cold",
    "boundary",
    "hard",
    "reactive",
    "agent",
    "manual",
    "provider",
];

/// The trigger of a compaction the proxy computed, from its reason string
/// (see [`reason_kind`]): `threshold`, `hard_limit` → `hard`, `overflow` →
/// `reactive`, `agent`, and `manual` or `requested` → `manual`.
pub fn trigger_of(reason: &str) -> Option<&'static str> {
    match reason_kind(reason) {
        "threshold" => Some("threshold"),
        "hard_limit" => Some("hard"),
        "overflow" => Some("reactive"),
        "agent" => Some("agent"),
        "cold" => Some("cold"),
        "manual" | "requested" => Some("manual"),
        _ => None,
    }
}

/// Goal labels of `compactor_unfittable_total` (what the compaction had to
/// reach); anything else counts as `other`.
pub const GOALS: &[&str] = &["overflow", "hard_limit", "shrink", "other"];

/// Reasons of `compactor_provider_compaction_fallbacks_total`: why the
/// provider's compaction gave way to the local summarizer (its answer's
/// status, no answer in time, an answer that is no compaction, the
/// endpoint missing, a result that does not fit, a refused compacted
/// request); anything else counts as `other`.
pub const PROVIDER_FALLBACK_REASONS: &[&str] = &[
    "status",
    "timeout",
    "invalid",
    "unsupported",
    "too_large",
    "refused",
    "other",
];

/// Kinds of `compactor_input_tokens_total`: what the upstream received,
/// what it would have received without compaction, of those it received
/// the ones it reported read from its prompt cache, and (observe mode)
/// what compaction would have saved, and the ones it reported written to
/// its cache. Counted for exchanges that reported usage.
pub const INPUT_KINDS: &[&str] = &[
    "received",
    "uncompacted",
    "cached",
    "potential_saved",
    "cache_written",
];

/// Kinds of `compactor_bill_dollars_total`: what was paid (exchanges,
/// recall rounds, summarizer and provider-compaction calls), of it the
/// summarizer's and provider's compaction calls, and what the exchanges
/// would have cost without compaction.
pub const BILL_KINDS: &[&str] = &["paid", "summaries", "uncompacted"];

/// Kind labels of `compactor_compaction_facts_total`.
pub const FACT_KINDS: &[&str] = &[
    "task",
    "file",
    "failure",
    "decision",
    "constraint",
    "next_step",
    "command",
    "rule",
    "system",
];

/// State labels of `compactor_compaction_facts_total`.
pub const FACT_STATES: &[&str] = &["kept", "repaired", "forgotten"];

/// The reason kind of a compaction reason string: `"threshold: reported …"`
/// → `threshold`; `"overflow: …"` → `overflow`; `manual…` → `manual`.
pub fn reason_kind(reason: &str) -> &'static str {
    let head = reason
        .split(|c: char| c == ':' || c == ';' || c.is_whitespace())
        .next()
        .unwrap_or_default();
    REASONS
        .iter()
        .find(|&&r| r == head)
        .copied()
        .unwrap_or("other")
}
