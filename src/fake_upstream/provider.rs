//! The fake upstream's own compaction, as each provider documents it, for
//! clients that ask the provider to compact:
//!
//! - **Responses** (`context_management: [{"type": "compaction",
//!   "compact_threshold": N}]`): when the input from its newest `compaction`
//!   item on is over `N` tokens, the answer's output starts with a
//!   `compaction` item whose `encrypted_content` the fake minted (JSON and
//!   SSE). Any later request carrying a `compaction` item that is not one it
//!   minted, as it minted it, is refused (400 `invalid_encrypted_content`,
//!   as OpenAI refuses an item it can no longer decrypt; also every item
//!   minted before [`State::expire`]), and only what follows the newest one
//!   is counted (what came before is carried by it).
//! - **Messages** (`context_management.edits: [{"type": "compact_20260112",
//!   "trigger": {"type": "input_tokens", "value": N}}]`, beta
//!   `compact-2026-01-12` required): over `N`, the answer's content starts
//!   with a `compaction` block summarizing the conversation, and its usage
//!   reports the compaction and the message apart (`iterations`). On every
//!   request, everything before the newest `compaction` block is dropped
//!   before the fake's own checks ([`super::anthropic::check`]) and counts;
//!   the block itself is read as the summary it carries.
//!
//! The real thresholds are large (Anthropic's trigger is at least 50,000
//! tokens); the fake's minimum is a setting ([`Settings::min_threshold`]) so
//! that small-window tests see the behaviour the real APIs only show at
//! scale. Tokens are the fake's usual bytes / 4.

use std::collections::HashSet;

use serde_json::{json, Value};

use super::anthropic::{self, Answer};
use super::reply::{Received, Reply};

/// The beta Anthropic's threshold compaction needs.
pub const COMPACT_BETA: &str = "compact-2026-01-12";

/// How the fake's provider compaction behaves.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// The smallest threshold a request may set (`compact_threshold`,
    /// `trigger.value`); a smaller one is refused as the APIs refuse theirs.
    pub min_threshold: u64,
    /// The Responses window: a prompt (from the newest compaction item on)
    /// over it is refused with OpenAI's `context_length_exceeded`.
    pub responses_window: Option<u64>,
}

/// What the fake remembers of its compactions.
#[derive(Debug, Default)]
pub struct State {
    /// On once a test turns it on.
    pub settings: Option<Settings>,
    /// Every `compaction` item minted, serialized as it was sent.
    minted: HashSet<String>,
    /// Compactions made (items minted and blocks written).
    pub compactions: usize,
}

fn refuse_openai(message: String, code: &str) -> Reply {
    Reply::json(
        400,
        json!({"error": {"message": message, "type": "invalid_request_error", "param": "input", "code": code}}),
    )
}

fn refuse_anthropic(message: String) -> Reply {
    Reply::json(
        400,
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}}),
    )
}

fn is_compaction_item(v: &Value) -> bool {
    v.get("type").and_then(Value::as_str) == Some("compaction")
}

fn tokens_of(v: &Value) -> u64 {
    (v.to_string().len() as u64 / 4).max(1)
}

/// The Responses `compact_threshold` a body asks for, if it asks.
fn responses_threshold(body: &Value) -> Option<u64> {
    body.get("context_management")?
        .as_array()?
        .iter()
        .find(|e| is_compaction_item(e))
        .map(|e| {
            e.get("compact_threshold")
                .and_then(Value::as_u64)
                .unwrap_or(u64::MAX)
        })
}

/// The input a Responses request's model reads: from its newest
/// `compaction` item on, with its instructions.
fn responses_seen(body: &Value) -> Value {
    let input = body
        .get("input")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let from = input.iter().rposition(is_compaction_item).unwrap_or(0);
    json!({"instructions": body.get("instructions"), "input": input[from..]})
}

/// The Anthropic `compact_*` edit's trigger, if the body has one.
fn messages_trigger(body: &Value) -> Option<u64> {
    body.pointer("/context_management/edits")?
        .as_array()?
        .iter()
        .find(|e| {
            e.get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.starts_with("compact_"))
        })
        .map(|e| {
            e.pointer("/trigger/value")
                .and_then(Value::as_u64)
                .unwrap_or(150_000)
        })
}

fn has_beta(headers: &http::HeaderMap, beta: &str) -> bool {
    headers
        .get_all("anthropic-beta")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|b| b.trim() == beta))
}

/// A Messages body as the API reads it: everything before the newest
/// `compaction` block dropped, the block read as the summary it carries (a
/// user turn, for the fake's checks), the blocks after it kept as the
/// assistant's.
pub fn messages_seen(body: &Value) -> Value {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let at = msgs.iter().enumerate().rev().find_map(|(i, m)| {
        m.get("content")
            .and_then(Value::as_array)
            .and_then(|b| b.iter().rposition(is_compaction_item))
            .map(|j| (i, j))
    });
    let Some((i, j)) = at else {
        return body.clone();
    };
    let blocks = msgs[i]["content"].as_array().cloned().unwrap_or_default();
    let summary = blocks[j]
        .get("content")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let mut seen = vec![json!({"role": "user", "content": [{"type": "text", "text": summary}]})];
    if blocks.len() > j + 1 {
        seen.push(json!({"role": "assistant", "content": blocks[j + 1..]}));
    }
    seen.extend(msgs[i + 1..].iter().cloned());
    let mut out = body.clone();
    out["messages"] = Value::Array(seen);
    out
}

impl State {
    /// Whether it is on.
    pub fn on(&self) -> bool {
        self.settings.is_some()
    }

    /// Forgets every `compaction` item minted so far, as a provider whose
    /// key rotated or whose items expired: a later request carrying one is
    /// refused (400 `invalid_encrypted_content`). How many it forgot.
    pub fn expire(&mut self) -> usize {
        let n = self.minted.len();
        self.minted.clear();
        n
    }

    /// The refusal of a request the provider would refuse, if any (only
    /// while on): a `compaction` item it did not mint, a threshold under
    /// the minimum, a missing beta, a prompt over the window; for
    /// Messages, the fake's usual checks on what the API reads.
    pub fn refusal(&self, rec: &Received, messages_window: Option<u64>) -> Option<Reply> {
        let settings = self.settings?;
        let body = rec.json();
        if rec.path.ends_with("/responses") {
            let input = body.get("input").and_then(Value::as_array);
            for item in input
                .into_iter()
                .flatten()
                .filter(|i| is_compaction_item(i))
            {
                if !self.minted.contains(&item.to_string()) {
                    let id = item.get("id").and_then(Value::as_str).unwrap_or("");
                    // As OpenAI answers it: no `param`.
                    let mut refusal = json!({"error": {
                        "message": format!("The encrypted content for item {id} could not be verified. Reason: Encrypted content could not be decrypted or parsed."),
                        "type": "invalid_request_error", "param": null,
                        "code": "invalid_encrypted_content"}});
                    if id.is_empty() {
                        refusal["error"]["message"] =
                            json!("The encrypted content could not be verified.");
                    }
                    return Some(Reply::json(400, refusal));
                }
            }
            if let Some(t) = responses_threshold(&body) {
                if t < settings.min_threshold {
                    return Some(refuse_openai(
                        format!(
                            "context_management[0].compact_threshold: must be at least {}",
                            settings.min_threshold
                        ),
                        "invalid_value",
                    ));
                }
            }
            let tokens = tokens_of(&responses_seen(&body));
            if let Some(w) = settings.responses_window.filter(|&w| tokens > w) {
                return Some(refuse_openai(
                    format!("This model's maximum context length is {w} tokens. However, your messages resulted in {tokens} tokens."),
                    "context_length_exceeded",
                ));
            }
            return None;
        }
        if !rec.path.ends_with("/messages") {
            return None;
        }
        if let Some(t) = messages_trigger(&body) {
            if !has_beta(&rec.headers, COMPACT_BETA) {
                return Some(refuse_anthropic(format!(
                    "context_management.edits.0: compaction requires the beta header `{COMPACT_BETA}`"
                )));
            }
            if t < settings.min_threshold {
                return Some(refuse_anthropic(format!(
                    "context_management.edits.0.trigger.value: must be at least {}",
                    settings.min_threshold
                )));
            }
        }
        anthropic::check(&messages_seen(&body), &rec.headers, messages_window)
    }

    /// A Responses answer, with the compaction the request's threshold
    /// calls for: a minted `compaction` item first in its output, usage
    /// counting what the model read after it. `reply` as made otherwise.
    pub fn responses_reply(&mut self, rec: &Received, reply: Reply) -> Reply {
        if !self.on() || !rec.path.ends_with("/responses") {
            return reply;
        }
        let body = rec.json();
        let seen = responses_seen(&body);
        let tokens = tokens_of(&seen);
        let item = match responses_threshold(&body) {
            Some(t) if tokens > t => Some(self.mint(&seen)),
            _ => None,
        };
        // What the model then reads: the item and the newest user turn.
        let input = seen["input"].as_array().cloned().unwrap_or_default();
        let prompt = match &item {
            Some(item) => {
                let from = input
                    .iter()
                    .rposition(|i| i.get("role").and_then(Value::as_str) == Some("user"))
                    .unwrap_or(0);
                tokens_of(item) + tokens_of(&json!(input[from..]))
            }
            None => tokens,
        };
        with_output_first(reply, item, prompt)
    }

    fn mint(&mut self, seen: &Value) -> Value {
        self.compactions += 1;
        let digest = blake3::hash(seen.to_string().as_bytes()).to_hex();
        let item = json!({
            "type": "compaction",
            "id": format!("cmp_fake{}", self.compactions),
            "encrypted_content": format!("gAAAAB{}{}", digest, "-opaque".repeat(8)),
        });
        self.minted.insert(item.to_string());
        item
    }

    /// A Messages answer to what the API reads of the request (see
    /// [`messages_seen`]), opened by a `compaction` block when the trigger
    /// is passed, usage with its iterations. `None` when off.
    pub fn messages_reply(
        &mut self,
        rec: &Received,
        answer: &Answer,
        cached: u64,
    ) -> Option<Reply> {
        self.settings?;
        let body = rec.json();
        let seen = messages_seen(&body);
        let tokens = anthropic::prompt_tokens(&seen);
        let trigger = messages_trigger(&body).filter(|&t| tokens > t);
        let Some(_) = trigger else {
            let len = seen.to_string().len();
            return Some(anthropic::reply(&seen, len, answer, cached));
        };
        self.compactions += 1;
        let block = json!({"type": "compaction", "content": summary_of(&seen)});
        // The answer is written from the compacted context: the summary.
        let mut compacted = seen.clone();
        compacted["messages"] =
            json!([{"role": "user", "content": [{"type": "text", "text": block["content"]}]}]);
        let len = compacted.to_string().len();
        let mut with_block = answer.clone();
        with_block.content.insert(0, block.clone());
        let reply = anthropic::reply(&compacted, len, &with_block, 0);
        let compaction_usage = json!({"type": "compaction", "input_tokens": tokens,
            "output_tokens": tokens_of(&block), "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0});
        Some(with_iterations(reply, compaction_usage))
    }
}

/// The fake's summary of a conversation: each user turn's text, shortened.
fn summary_of(body: &Value) -> String {
    let turns: Vec<String> = body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .map(|m| {
            let text = crate::compaction::items::text_of(m);
            text.chars().take(160).collect::<String>()
        })
        .filter(|t| !t.is_empty())
        .collect();
    format!(
        "Summary of the conversation so far:\n- {}",
        turns.join("\n- ")
    )
}

/// `reply` (a Responses answer, JSON or SSE) with `item` first in its
/// output and `prompt` as its input tokens.
fn with_output_first(reply: Reply, item: Option<Value>, prompt: u64) -> Reply {
    match reply {
        full @ Reply::Full { .. } => {
            super::cache::edit_json(full, |v| edit_response(v, item.as_ref(), prompt))
        }
        Reply::Sse {
            chunks,
            gap,
            reset_after,
        } => {
            let mut events = Vec::new();
            for chunk in chunks {
                let text = String::from_utf8_lossy(&chunk).into_owned();
                let Some(data) = text
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .and_then(|d| serde_json::from_str::<Value>(d).ok())
                else {
                    events.push(text);
                    continue;
                };
                let mut data = data;
                let kind = data["type"].as_str().unwrap_or("").to_string();
                if item.is_some() {
                    if let Some(i) = data.get("output_index").and_then(Value::as_u64) {
                        data["output_index"] = json!(i + 1);
                    }
                }
                if let Some(resp) = data.get_mut("response") {
                    edit_response(resp, item.as_ref(), prompt);
                }
                let first_item = kind == "response.in_progress";
                events.push(format!("event: {kind}\ndata: {data}\n\n"));
                if let (true, Some(item)) = (first_item, &item) {
                    for k in ["response.output_item.added", "response.output_item.done"] {
                        let d = json!({"type": k, "output_index": 0, "item": item});
                        events.push(format!("event: {k}\ndata: {d}\n\n"));
                    }
                }
            }
            // Numbered again: the inserted events took their places.
            let events = events
                .into_iter()
                .enumerate()
                .map(|(n, e)| renumber(e, n))
                .collect();
            match Reply::sse(events) {
                Reply::Sse { chunks, .. } => Reply::Sse {
                    chunks,
                    gap,
                    reset_after,
                },
                other => other,
            }
        }
        other => other,
    }
}

fn renumber(event: String, n: usize) -> String {
    let Some((head, data)) = event.split_once("data: ") else {
        return event;
    };
    match serde_json::from_str::<Value>(data.trim_end()) {
        Ok(mut v) if v.get("sequence_number").is_some() => {
            v["sequence_number"] = json!(n);
            format!("{head}data: {v}\n\n")
        }
        _ => event,
    }
}

fn edit_response(v: &mut Value, item: Option<&Value>, prompt: u64) {
    if let (Some(item), Some(Value::Array(out))) = (item, v.get_mut("output")) {
        out.insert(0, item.clone());
    }
    if let Some(u) = v.get_mut("usage").and_then(Value::as_object_mut) {
        let output = u.get("output_tokens").and_then(Value::as_u64).unwrap_or(0);
        u.insert("input_tokens".into(), json!(prompt));
        u.insert("total_tokens".into(), json!(prompt + output));
    }
}

/// A Messages answer whose usage reports the compaction iteration and the
/// message iteration apart, the top level being the message's.
fn with_iterations(reply: Reply, compaction: Value) -> Reply {
    let add = |u: &mut Value| {
        let mut message = u.clone();
        message["type"] = json!("message");
        u["iterations"] = json!([compaction, message]);
    };
    match reply {
        full @ Reply::Full { .. } => super::cache::edit_json(full, |v| {
            if let Some(u) = v.get_mut("usage") {
                add(u);
            }
        }),
        Reply::Sse {
            chunks,
            gap,
            reset_after,
        } => {
            // The cumulative usage of `message_delta` carries them.
            let start_usage = chunks.iter().find_map(|c| {
                let t = String::from_utf8_lossy(c);
                let d = t.lines().find_map(|l| l.strip_prefix("data: "))?;
                let v: Value = serde_json::from_str(d).ok()?;
                v.pointer("/message/usage").cloned()
            });
            let chunks = chunks
                .into_iter()
                .map(|c| {
                    let t = String::from_utf8_lossy(&c).into_owned();
                    if !t.starts_with("event: message_delta") {
                        return c;
                    }
                    let Some((head, d)) = t.split_once("data: ") else {
                        return c;
                    };
                    let Ok(mut v) = serde_json::from_str::<Value>(d.trim_end()) else {
                        return c;
                    };
                    let mut u = start_usage.clone().unwrap_or(json!({}));
                    if let Some(out) = v.pointer("/usage/output_tokens") {
                        u["output_tokens"] = out.clone();
                    }
                    add(&mut u);
                    v["usage"] = u;
                    bytes::Bytes::from(format!("{head}data: {v}\n\n"))
                })
                .collect();
            Reply::Sse {
                chunks,
                gap,
                reset_after,
            }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(path: &str, body: Value, beta: Option<&str>) -> Received {
        let mut headers = http::HeaderMap::new();
        if let Some(b) = beta {
            headers.insert("anthropic-beta", b.parse().unwrap());
        }
        Received {
            method: http::Method::POST,
            path: path.into(),
            query: None,
            headers,
            body: bytes::Bytes::from(body.to_string()),
        }
    }

    fn on() -> State {
        State {
            settings: Some(Settings {
                min_threshold: 10,
                responses_window: Some(4000),
            }),
            ..State::default()
        }
    }

    fn json_of(r: &Reply) -> Value {
        match r {
            Reply::Full { body, .. } => serde_json::from_slice(body).unwrap(),
            _ => Value::Null,
        }
    }

    #[test]
    fn responses_items_are_minted_and_accepted_back_only_as_minted() {
        let mut st = on();
        let long = "x".repeat(800);
        let body = json!({"model": "m", "context_management": [{"type": "compaction", "compact_threshold": 120}],
                          "input": [{"role": "user", "content": long}]});
        let r = rec("/v1/responses", body.clone(), None);
        assert!(st.refusal(&r, None).is_none());
        let out = json_of(&st.responses_reply(&r, Reply::responses("ok", 1, 2)));
        let item = out["output"][0].clone();
        assert_eq!(item["type"], "compaction");
        assert_eq!(out["output"][1]["type"], "message");
        assert_eq!(st.compactions, 1);
        // Sent back as minted: accepted, and counted from it on.
        let mut next = body.clone();
        next["input"] =
            json!([{"role": "user", "content": long}, item, {"role": "user", "content": "more"}]);
        let r2 = rec("/v1/responses", next.clone(), None);
        assert!(st.refusal(&r2, None).is_none());
        let out2 = json_of(&st.responses_reply(&r2, Reply::responses("ok", 1, 2)));
        assert_eq!(
            out2["output"][0]["type"], "message",
            "under the threshold now"
        );
        // Altered by one byte: refused.
        let mut bad = item.clone();
        bad["encrypted_content"] =
            json!(format!("{}x", item["encrypted_content"].as_str().unwrap()));
        next["input"][1] = bad;
        let refused = st.refusal(&rec("/v1/responses", next, None), None);
        assert!(json_of(&refused.unwrap())["error"]["code"] == "invalid_encrypted_content");
    }

    #[test]
    fn messages_compaction_needs_its_beta_and_drops_what_precedes_the_block() {
        let mut st = on();
        let body = json!({"model": "m", "max_tokens": 10,
            "context_management": {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 20}}]},
            "messages": [{"role": "user", "content": "a long enough first turn to pass the trigger"}]});
        let refused = st.refusal(&rec("/v1/messages", body.clone(), None), None);
        assert!(json_of(&refused.unwrap())["error"]["message"]
            .as_str()
            .unwrap()
            .contains(COMPACT_BETA));
        let r = rec("/v1/messages", body.clone(), Some(COMPACT_BETA));
        assert!(st.refusal(&r, None).is_none());
        let answer = json_of(&st.messages_reply(&r, &Answer::text("ok"), 0).unwrap());
        assert_eq!(answer["content"][0]["type"], "compaction");
        assert_eq!(answer["content"][1]["text"], "ok");
        let it = &answer["usage"]["iterations"];
        assert_eq!(it[0]["type"], "compaction");
        assert_eq!(it[1]["type"], "message");
        assert_eq!(it[1]["input_tokens"], answer["usage"]["input_tokens"]);
        // Later: an orphan tool result before the block does not matter.
        let mut next = body.clone();
        next["messages"] = json!([
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "gone", "content": "x"}]},
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": "next"}]);
        assert!(st
            .refusal(&rec("/v1/messages", next, Some(COMPACT_BETA)), None)
            .is_none());
    }
}
