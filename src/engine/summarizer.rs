//! The summarizer call: the prompt in chunks within the model's window, the
//! request to the configured summarizer and what can go wrong with it.

use std::sync::Arc;

use http::HeaderMap;
use serde_json::{json, Value};

use super::context::Context;
use super::input::Input;
use crate::compaction::summary;
use crate::compaction::{Params, SummaryCache};
use crate::wire::Api;

/// What the summarizer calls of one compaction cost.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SummaryCost {
    /// Calls made.
    pub(super) calls: u32,
    /// Their tokens, prompt and answer (as reported, else estimated).
    pub(super) tokens: u64,
    /// Of those, the answers'.
    pub(super) output_tokens: u64,
    /// What their prompts read from and wrote to the upstream's cache.
    pub(super) cache: SummaryCache,
    /// Older chunks past the call cap, left to the extracted facts.
    pub(super) chunks_skipped: usize,
    /// A summary call repeated the request the upstream last saw: it gave
    /// the summary (`Some(None)`), or missed and today's calls followed.
    pub(super) cached: Option<Option<CachedMiss>>,
}

impl SummaryCost {
    /// Adds one call's tokens.
    fn add(&mut self, call: &CallTokens) {
        self.tokens += call.tokens;
        self.output_tokens += call.output;
        self.cache.read += call.cache.read;
        self.cache.write += call.cache.write;
        self.cache.write_1h += call.cache.write_1h;
    }
}

/// One summary call's tokens: prompt and answer (as reported, else
/// estimated), of those the answer's, and what its prompt read from and
/// wrote to the cache (as reported).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CallTokens {
    pub(super) tokens: u64,
    pub(super) output: u64,
    pub(super) cache: SummaryCache,
}

impl CallTokens {
    /// From an answer's reported `usage` (none: zero).
    fn reported(usage: Option<crate::wire::Usage>) -> CallTokens {
        let mut call = CallTokens::default();
        if let Some(u) = usage {
            call.tokens = u.total();
            call.output = u.output_tokens.min(call.tokens);
            call.cache.add(&u);
        }
        call
    }
}

/// Runs the summarizer over `part`, chunk by chunk, within
/// `compaction.max_summary_calls`; `None` when the model wrote no
/// usable section for a chunk (after one retry per chunk, if the cap leaves
/// room, which names the sections missing from the first answer).
///
/// Past the cap the first chunk (which carries the previous summary, when
/// there is one) and the newest are summarized, and the chunks between are
/// left to the deterministic facts, which the summary always carries: what
/// happened last is what the next turn needs most. A cap of 0 makes every
/// summary the facts alone.
///
/// First, when `cached` (the request the upstream last saw, [`cached_body`],
/// which fits the window with the instruction and the answer), one call
/// that repeats it with the instruction appended, so that its history is a
/// prompt-cache read; today's calls follow only when its answer is a tool
/// call, lacks the sections, or the call fails (counted).
pub(super) async fn summarize<S: Context>(
    state: &Arc<S>,
    input: &Input,
    part: &[Value],
    params: &Params,
    cached: Option<Value>,
) -> (Option<String>, SummaryCost) {
    let cap = state.config().compaction.max_summary_calls;
    let mut spent = SummaryCost::default();
    if let (Some(body), true) = (cached, cap > 0) {
        spent.calls = 1;
        match call_cached(state, input, &body).await {
            Ok((text, call)) => {
                spent.add(&call);
                spent.cached = Some(None);
                return (Some(text), spent);
            }
            Err((miss, call)) => {
                state.metrics().summary_failure();
                tracing::info!(
                    miss = miss.as_str(),
                    "summary from the cached request unusable: the summarizer call instead"
                );
                spent.add(&call);
                spent.cached = Some(Some(miss));
            }
        }
    }
    let (narrative, cost) = summarize_part(state, input, part, params, spent).await;
    (narrative, cost)
}

/// Today's summary calls: the transcript of `part`, in chunks; `spent`
/// what was spent before them.
async fn summarize_part<S: Context>(
    state: &Arc<S>,
    input: &Input,
    part: &[Value],
    params: &Params,
    spent: SummaryCost,
) -> (Option<String>, SummaryCost) {
    let lines = summary::render_transcript(part, TRANSCRIPT_ITEM_BYTES);
    let chunks = {
        let counter = state.tokens().clone();
        let budget = params.summary_chunk_tokens;
        tokio::task::spawn_blocking(move || chunk_lines(&lines, budget, |s| counter.count_text(s)))
            .await
            .unwrap_or_default()
    };
    let cap = state.config().compaction.max_summary_calls;
    let run = chunks_within_cap(chunks.len(), cap.saturating_sub(spent.calls));
    let mut cost = SummaryCost {
        chunks_skipped: chunks.len() - run,
        ..spent
    };
    if run == 0 {
        return (None, cost);
    }
    let newest = (chunks.len() - run + 1).max(1);
    let mut narrative: Option<String> = None;
    for chunk in chunks[..1].iter().chain(&chunks[newest..]) {
        let mut messages = summary::summarizer_messages(narrative.as_deref(), chunk);
        // The answer with the most sections written; a partial one is kept
        // (the assembled summary fills the missing sections from the facts).
        let mut got: Option<(usize, String)> = None;
        for _attempt in 0..2 {
            if cost.calls >= cap {
                break;
            }
            cost.calls += 1;
            match call_summarizer(state, input, &messages, params).await {
                Ok((text, call)) => {
                    cost.add(&call);
                    match summary::validate(&text) {
                        Ok(()) => {
                            got = Some((summary::NARRATIVE_SECTIONS.len(), text));
                            break;
                        }
                        Err(missing) => {
                            state.metrics().summary_failure();
                            tracing::warn!(?missing, "summary lacks mandatory sections");
                            let written = summary::usable(&text);
                            if written > 0 && got.as_ref().is_none_or(|(n, _)| written >= *n) {
                                got = Some((written, text));
                            }
                            messages =
                                summary::retry_messages(narrative.as_deref(), chunk, &missing);
                        }
                    }
                }
                Err(e) => {
                    state.metrics().summary_failure();
                    tracing::warn!(error = %e, "summary call failed")
                }
            }
        }
        match got {
            Some((_, t)) => narrative = Some(t),
            None => return (None, cost),
        }
    }
    (narrative, cost)
}

/// How many of `chunks` to summarize under a cap of `cap` calls: one call
/// each, with a quarter of the cap kept for retries.
pub(super) fn chunks_within_cap(chunks: usize, cap: u32) -> usize {
    let cap = cap as usize;
    chunks.min(cap - cap / 4)
}

/// Groups transcript lines into chunks of at most `budget` tokens (a single
/// longer line is its own chunk).
pub fn chunk_lines(lines: &[String], budget: u64, count: impl Fn(&str) -> u64) -> Vec<String> {
    let mut chunks = Vec::new();
    let mut cur = String::new();
    let mut used = 0;
    for line in lines {
        let t = count(line);
        if !cur.is_empty() && used + t > budget {
            chunks.push(std::mem::take(&mut cur));
            used = 0;
        }
        cur.push_str(line);
        cur.push('\n');
        used += t;
    }
    if !cur.is_empty() {
        chunks.push(cur);
    }
    chunks
}

/// Bytes of one item's text shown to the summarizer (head and tail kept).
const TRANSCRIPT_ITEM_BYTES: usize = 2_000;

/// Bytes of a summarizer's error answer kept in the log line.
pub(super) const MAX_LOGGED_ERROR: usize = 300;

/// Why a summarizer call gave no text. Every kind is tried again once by
/// `summarize` (a refusal may be a passing overload, an empty answer a
/// sampling accident); past that the summary falls back to the facts.
#[derive(Debug, thiserror::Error)]
pub enum SummarizerError {
    /// The call could not be made or its answer read (its URL, the
    /// connection, a timeout): the upstream client's error, its reqwest
    /// cause its source.
    #[error(transparent)]
    Upstream(#[from] crate::upstream::Error),
    /// The request could not be encoded.
    #[error("summary request: {0}")]
    Encode(#[source] serde_json::Error),
    /// The summarizer refused: its status and answer, redacted and cut.
    #[error("summarizer answered {status}: {shown}")]
    Refused {
        /// The answer's status.
        status: http::StatusCode,
        /// The start of its body, credentials redacted.
        shown: String,
    },
    /// The answer is not JSON.
    #[error("summarizer answer is not JSON: {0}")]
    Decode(#[source] serde_json::Error),
    /// The answer holds no message text.
    #[error("summarizer answer has no message content")]
    NoContent,
}

/// One summarizer call: the answer's text and the call's tokens (as the
/// upstream reports them, else estimated).
pub(super) async fn call_summarizer<S: Context>(
    state: &Arc<S>,
    input: &Input,
    messages: &[Value],
    params: &Params,
) -> Result<(String, CallTokens), SummarizerError> {
    let cfg = &state.config().compaction;
    let model = if cfg.summarizer_model.is_empty() {
        input.who.model.as_str()
    } else {
        cfg.summarizer_model.as_str()
    };
    let mut body = match input.who.api {
        // Anthropic Messages: the system prompt is a top-level field.
        Api::Messages => json!({
            "model": model,
            "max_tokens": params.summary_output_tokens,
            "system": messages.iter().find(|m| m["role"] == "system").map(|m| m["content"].clone()),
            "messages": messages.iter().filter(|m| m["role"] != "system").collect::<Vec<_>>(),
            "stream": false,
        }),
        // Gemini: the system prompt is `systemInstruction`, the model in the path.
        Api::Gemini => gemini_summary_body(messages, params.summary_output_tokens),
        _ => json!({"model": model, "messages": messages, "stream": false}),
    };
    if !matches!(input.who.api, Api::Messages | Api::Gemini) {
        // Reasoning-model families reject `max_tokens`.
        let lower = model.to_ascii_lowercase();
        let key = if lower.starts_with('o')
            && lower.chars().nth(1).is_some_and(|c| c.is_ascii_digit())
            || lower.starts_with("gpt-5")
        {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        body[key] = json!(params.summary_output_tokens);
    }
    let path = summary_path(input.who.api, model);
    let v = post_summary(state, input, &path, &body, None).await?;
    let text = answer_text(input.who.api, &v).ok_or(SummarizerError::NoContent)?;
    let usage = input.who.api.usage(&v);
    let mut cache = SummaryCache::default();
    if let Some(u) = &usage {
        cache.add(u);
    }
    let reported = match usage {
        Some(u) if matches!(input.who.api, Api::Messages | Api::Gemini) => {
            (Some(u.total()), Some(u.output_tokens))
        }
        _ => (
            v.pointer("/usage/total_tokens").and_then(Value::as_u64),
            v.pointer("/usage/completion_tokens")
                .and_then(Value::as_u64),
        ),
    };
    let (tokens, output) = match reported {
        (Some(t), Some(out)) => (t, out.min(t)),
        (total, _) => {
            let counter = state.tokens().clone();
            let all: String = messages
                .iter()
                .filter_map(|m| m.get("content").and_then(Value::as_str))
                .chain([text.as_str()])
                .collect();
            let answer = text.clone();
            let (all, answer) = tokio::task::spawn_blocking(move || {
                (counter.count_text(&all), counter.count_text(&answer))
            })
            .await
            .unwrap_or((0, 0));
            let tokens = total.unwrap_or(all);
            (tokens, answer.min(tokens))
        }
    };
    Ok((
        text,
        CallTokens {
            tokens,
            output,
            cache,
        },
    ))
}

/// A summary call's body on Gemini: the system messages as
/// `systemInstruction`, the others as `contents`, the answer bounded.
fn gemini_summary_body(messages: &[Value], max_output: u64) -> Value {
    let text = |m: &Value| crate::compaction::items::value_text(&m["content"]);
    let system: Vec<String> = messages
        .iter()
        .filter(|m| m["role"] == "system")
        .map(text)
        .collect();
    let contents: Vec<Value> = messages
        .iter()
        .filter(|m| m["role"] != "system")
        .map(|m| crate::wire::gemini::as_content(m.clone()))
        .collect();
    let mut body = json!({
        "contents": contents,
        "generationConfig": {"maxOutputTokens": max_output},
    });
    if !system.is_empty() {
        body["systemInstruction"] = json!({"parts": [{"text": system.join("\n\n")}]});
    }
    body
}

/// The path below the summarizer's base a summary call of `api` for
/// `model` goes to (Gemini names the model in it).
fn summary_path(api: Api, model: &str) -> String {
    match api {
        Api::Gemini => crate::wire::gemini::model_path(model, "generateContent"),
        _ => api.summary_endpoint().to_string(),
    }
}

/// The text of a summary call's answer `v` in `api`'s shape.
fn answer_text(api: Api, v: &Value) -> Option<String> {
    match api {
        Api::Messages => crate::wire::messages::answer_text(v),
        Api::Gemini => crate::wire::gemini::answer_text(v),
        _ => v
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .map(String::from),
    }
}

/// Sends a summary call's `body` with the client's credentials (and
/// `provider` headers, when it repeats a request of the client's); its
/// answer as JSON, or why there is none.
async fn post_summary<S: Context>(
    state: &Arc<S>,
    input: &Input,
    path: &str,
    body: &Value,
    provider: Option<&HeaderMap>,
) -> Result<Value, SummarizerError> {
    let mut headers = input.who.auth.clone();
    if let Some(p) = provider {
        for (name, v) in p {
            headers.append(name.clone(), v.clone());
        }
    }
    if input.who.api == Api::Messages {
        // The API refuses a request without a version.
        headers
            .entry("anthropic-version")
            .or_insert(http::HeaderValue::from_static(ANTHROPIC_VERSION));
        state.summarizer().key_as_x_api_key(&mut headers);
    }
    if input.who.api == Api::Gemini {
        let name = crate::wire::gemini::KEY_HEADER;
        state.summarizer().key_as(&mut headers, name);
    }
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    headers.insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
    let url = state.summarizer().url(path, None)?;
    let bytes = bytes::Bytes::from(serde_json::to_vec(body).map_err(SummarizerError::Encode)?);
    let resp = state
        .summarizer()
        .send_bytes(http::Method::POST, &url, headers, bytes)
        .await?;
    let status = resp.status();
    let answer = state.summarizer().read_body(resp).await?;
    if !status.is_success() {
        // Redacted whole, then cut: a cut first could leave part of a key.
        let text = String::from_utf8_lossy(&answer);
        let text = state.summarizer().redact(&text, &input.who.auth);
        let shown = &text[..crate::compaction::items::floor_boundary(&text, MAX_LOGGED_ERROR)];
        return Err(SummarizerError::Refused {
            status,
            shown: shown.to_string(),
        });
    }
    serde_json::from_slice(&answer).map_err(SummarizerError::Decode)
}

/// Tokens the cached call's appended instruction may take (its prompt is
/// about 500).
pub(super) const INSTRUCTION_TOKENS: u64 = 800;

/// Why a summary call that repeats the request the upstream last saw was
/// not made, or gave nothing usable: today's call writes the summary then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachedMiss {
    /// The answer was a tool call.
    ToolCall,
    /// The answer lacked the summary's sections, or any text.
    Unusable,
    /// The call failed (refused, unreadable).
    Failed,
}

impl CachedMiss {
    /// Name used in reasons and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            CachedMiss::ToolCall => "tool_call",
            CachedMiss::Unusable => "unusable",
            CachedMiss::Failed => "failed",
        }
    }
}

/// The request a summary call that reads its history from the cache sends:
/// the one the upstream last saw ([`super::input::Sent`], the view as its items),
/// with one user message appended carrying the summarizer's instructions,
/// (with `continuing`, asking for what follows the last summary only),
/// not streamed, its answer bounded by the summary's budget (and the room
/// thinking takes, which must stay under it). `None` where it cannot share
/// the conversation's cache or cannot answer in text: another summarizer
/// model, a tool choice that forces a call, or no request seen.
pub(super) fn cached_body<S: Context>(
    state: &Arc<S>,
    input: &Input,
    params: &Params,
    continuing: bool,
) -> Option<Value> {
    let sent = input.request.sent.as_ref()?;
    let cfg = &state.config().compaction;
    if input.serving.observe
        || !matches!(input.who.api, Api::Chat | Api::Messages)
        || (!cfg.summarizer_model.is_empty() && cfg.summarizer_model != input.who.model)
    {
        return None;
    }
    let forced = match sent.body().get("tool_choice") {
        Some(Value::String(s)) => s == "required" || s == "any",
        Some(Value::Object(o)) => o
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t != "auto" && t != "none"),
        _ => false,
    };
    if forced {
        return None;
    }
    let mut body = sent.body().clone();
    let object = body.as_object_mut()?;
    let instruction = summary::cached_instruction(continuing);
    let mut items = input.request.view.values().to_vec();
    items.push(match input.who.api {
        Api::Messages => {
            json!({"role": "user", "content": [{"type": "text", "text": instruction}]})
        }
        _ => json!({"role": "user", "content": instruction}),
    });
    object.insert("messages".into(), Value::Array(items));
    object.insert("stream".into(), json!(false));
    object.remove("stream_options");
    let thinking = object
        .get("thinking")
        .and_then(|t| t.get("budget_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let answer = params.summary_output_tokens + thinking;
    let key = match input.who.api {
        Api::Messages => "max_tokens",
        _ if object.contains_key("max_completion_tokens") => "max_completion_tokens",
        _ if object.contains_key("max_tokens") => "max_tokens",
        _ => return Some(body),
    };
    object.insert(key.into(), json!(answer));
    Some(body)
}

/// The summary call that sends `body` ([`cached_body`]): the answer's text
/// and the call's tokens; why not, when its answer is a tool call, no
/// text, or the call failed.
pub(super) async fn call_cached<S: Context>(
    state: &Arc<S>,
    input: &Input,
    body: &Value,
) -> Result<(String, CallTokens), (CachedMiss, CallTokens)> {
    let provider = input.request.sent.as_ref().map(|s| &s.headers);
    let path = summary_path(input.who.api, &input.who.model);
    let v = match post_summary(state, input, &path, body, provider).await {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "summary call from the cached request failed");
            return Err((CachedMiss::Failed, CallTokens::default()));
        }
    };
    let call = CallTokens::reported(input.who.api.usage(&v));
    let called = match input.who.api {
        Api::Messages => v
            .get("content")
            .and_then(Value::as_array)
            .is_some_and(|b| b.iter().any(|b| b["type"] == "tool_use")),
        _ => v
            .pointer("/choices/0/message/tool_calls")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty()),
    };
    if called {
        return Err((CachedMiss::ToolCall, call));
    }
    match answer_text(input.who.api, &v) {
        Some(t) if summary::validate(&t).is_ok() => Ok((t, call)),
        _ => Err((CachedMiss::Unusable, call)),
    }
}

/// The `anthropic-version` a summary call through Anthropic Messages sends.
pub(super) const ANTHROPIC_VERSION: &str = "2023-06-01";

/// The provider headers of a request that decide what its body means: a
/// summary call that repeats the body sends them too.
pub fn provider_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in ["anthropic-version", "anthropic-beta"] {
        for v in headers.get_all(name) {
            out.append(http::HeaderName::from_static(name), v.clone());
        }
    }
    out
}

/// The credential headers of a request (kept in memory for the summarizer).
pub fn auth_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in crate::redact::CREDENTIAL_HEADERS {
        if let Some(v) = headers.get(name) {
            let mut v = v.clone();
            v.set_sensitive(true);
            if let Ok(n) = http::HeaderName::from_bytes(name.as_bytes()) {
                out.insert(n, v);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_call_cap_bounds_the_chunks_summarized() {
        assert_eq!(chunks_within_cap(3, 8), 3);
        assert_eq!(chunks_within_cap(76, 8), 6);
        assert_eq!(chunks_within_cap(5, 1), 1);
        assert_eq!(chunks_within_cap(5, 0), 0);
        assert_eq!(chunks_within_cap(0, 8), 0);
    }

    #[test]
    fn chunks_respect_the_budget() {
        let lines: Vec<String> = ["aaaa", "bb", "cccccc", "d"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let chunks = chunk_lines(&lines, 6, |s| s.len() as u64);
        assert_eq!(chunks, vec!["aaaa\nbb\n", "cccccc\n", "d\n"]);
        assert!(chunk_lines(&[], 5, |s| s.len() as u64).is_empty());
    }
}
