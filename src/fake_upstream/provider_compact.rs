//! The fake upstream's own compaction, for the summary rung delegated to
//! the provider, as the two APIs document it:
//!
//! - `POST /v1/responses/compact` answers a compacted window: the user
//!   messages of its `input`, then a `compaction` item whose
//!   `encrypted_content` is an opaque token the fake minted. Its
//!   `/v1/responses` accepts that item back only byte-identical.
//! - `/v1/messages` with `compaction: {"type": "summarize"}` (under the
//!   beta `compact-2026-09-04`) answers one `compaction` block, `stop_reason`
//!   `"compaction"`. It refuses the request with `context_management`
//!   beside it, a history ending in a tool call it does not answer, or no
//!   beta; a later request carrying the block without the beta, or a block
//!   it did not mint, is refused too.
//!
//! A minted item or block stands for what it compacted: the Messages
//! endpoint judges a request (first role, pairing, thinking signatures) as
//! if the block were the messages it replaced, so a thinking block kept
//! after it stays valid as long as what precedes it is what it was signed
//! against. The tokens minted are kept in a registry of this process
//! (tokens are unique, so fakes of parallel tests share it harmlessly).
//!
//! [`Behaviour`] makes the compaction fail (a status, a hang, an answer
//! that is no compaction) or keep nothing (no user message, a summary that
//! says nothing), for the fallback and continuity tests.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use serde_json::{json, Value};

use super::reply::{Received, Reply};
use crate::compaction::provider::COMPACT_BETA;
use crate::wire::messages;

/// How the fake's compaction answers.
#[derive(Debug, Clone, Default)]
pub enum Behaviour {
    /// As documented.
    #[default]
    Compact,
    /// A valid compaction that keeps nothing: no user message, a summary
    /// that says nothing.
    KeepNothing,
    /// This status, with this JSON body.
    Fail(u16, Value),
    /// No answer for this long, then the usual one.
    Hang(Duration),
    /// A 200 whose body is no compaction.
    Junk,
}

/// What a minted token stands for.
struct Minted {
    /// The item or block as the fake answered it, serialized.
    exact: String,
    /// The items or messages it replaced.
    stands_for: Vec<Value>,
}

fn registry() -> std::sync::MutexGuard<'static, HashMap<String, Minted>> {
    static MINTED: OnceLock<Mutex<HashMap<String, Minted>>> = OnceLock::new();
    MINTED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn mint(prefix: &str, stands_for: &[Value]) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let digest = blake3::hash(format!("{n}:{}", Value::from(stands_for.to_vec())).as_bytes());
    format!("{prefix}{}", &digest.to_hex()[..32])
}

/// An item's bytes as sent (compact JSON, members in their order): what
/// "byte-identical" compares.
fn serialized(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

fn refuse(status: u16, message: &str) -> Reply {
    Reply::json(
        status,
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}}),
    )
}

fn kind(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("")
}

/// Whether a Messages request asks for on-demand compaction.
pub fn is_on_demand(body: &Value) -> bool {
    body.pointer("/compaction/type").and_then(Value::as_str) == Some("summarize")
}

fn has_beta(headers: &http::HeaderMap) -> bool {
    headers
        .get_all("anthropic-beta")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|b| b.trim() == COMPACT_BETA))
}

/// The fake's answer when it is its compaction's to give: a compaction
/// request (either API), or a Responses request whose compaction item it
/// refuses. `None`: the request is answered as usual.
pub fn answer(behaviour: &Behaviour, rec: &Received) -> Option<Reply> {
    if rec.path.ends_with("/responses/compact") {
        return Some(with_behaviour(behaviour, || {
            responses_compact(behaviour, &rec.json())
        }));
    }
    if rec.path.ends_with("/responses") {
        return responses_refusal(&rec.json());
    }
    if rec.path.ends_with("/messages") {
        let body = rec.json();
        if is_on_demand(&body) {
            return Some(with_behaviour(behaviour, || on_demand(behaviour, &body)));
        }
    }
    None
}

fn with_behaviour(behaviour: &Behaviour, usual: impl FnOnce() -> Reply) -> Reply {
    match behaviour {
        Behaviour::Fail(status, body) => Reply::json(*status, body.clone()),
        Behaviour::Hang(d) => Reply::Delay(*d, Box::new(usual())),
        Behaviour::Junk => Reply::json(200, json!({"object": "list", "data": []})),
        Behaviour::Compact | Behaviour::KeepNothing => usual(),
    }
}

fn responses_compact(behaviour: &Behaviour, body: &Value) -> Reply {
    let input = match body.get("input") {
        Some(Value::Array(items)) => items.clone(),
        Some(Value::String(s)) => vec![json!({"type": "message", "role": "user", "content": s})],
        _ => return refuse(400, "input: expected a list of items"),
    };
    let keep_users = !matches!(behaviour, Behaviour::KeepNothing);
    let mut output: Vec<Value> = input
        .iter()
        .filter(|i| keep_users && i.get("role").and_then(Value::as_str) == Some("user"))
        .filter(|i| matches!(kind(i), "" | "message"))
        .cloned()
        .collect();
    let stands_for = if keep_users {
        input.clone()
    } else {
        Vec::new()
    };
    let token = mint("enc_", &stands_for);
    let item = json!({"type": "compaction", "id": format!("cmp_{}", &token[4..16]), "encrypted_content": token});
    registry().insert(
        token.clone(),
        Minted {
            exact: serialized(&item),
            stands_for,
        },
    );
    output.push(item);
    let input_tokens = (body.to_string().len() as u64 / 4).max(1);
    Reply::json(
        200,
        json!({"id": format!("resp_{}", &token[4..16]), "object": "response.compaction",
               "created_at": 1, "output": output,
               "usage": {"input_tokens": input_tokens, "output_tokens": 40,
                         "total_tokens": input_tokens + 40}}),
    )
}

/// A Responses request's compaction items, each accepted only as minted.
fn responses_refusal(body: &Value) -> Option<Reply> {
    let items = body.get("input")?.as_array()?;
    let registry = registry();
    for (i, item) in items.iter().enumerate() {
        if kind(item) != "compaction" {
            continue;
        }
        let token = item
            .get("encrypted_content")
            .and_then(Value::as_str)
            .unwrap_or("");
        match registry.get(token) {
            Some(m) if serialized(item) == m.exact => {}
            _ => {
                return Some(Reply::json(
                    400,
                    json!({"error": {"message": format!("input[{i}]: the compaction item is invalid or was altered"),
                                     "type": "invalid_request_error", "param": format!("input[{i}]"),
                                     "code": "invalid_encrypted_content"}}),
                ))
            }
        }
    }
    None
}

fn on_demand(behaviour: &Behaviour, body: &Value) -> Reply {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let summary = match behaviour {
        Behaviour::KeepNothing => "The conversation went on.".to_string(),
        _ => {
            let first = msgs
                .first()
                .map(crate::compaction::items::text_of)
                .unwrap_or_default();
            let first: String = first.chars().take(200).collect();
            format!("Summary of {} messages. It began: {first}", msgs.len())
        }
    };
    let token = mint("sig_cmp_", &msgs);
    let block = json!({"type": "compaction", "content": summary, "signature": token});
    let stands_for = expanded_messages(&msgs);
    registry().insert(
        token.clone(),
        Minted {
            exact: serialized(&block),
            stands_for,
        },
    );
    let input_tokens = (body.to_string().len() as u64 / 4).max(1);
    Reply::json(
        200,
        json!({"id": format!("msg_{}", &token[8..20]), "type": "message", "role": "assistant",
               "model": body.get("model").cloned().unwrap_or(json!("fake")),
               "content": [block], "stop_reason": "compaction", "stop_sequence": null,
               "usage": {"input_tokens": input_tokens, "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": 0, "output_tokens": 40}}),
    )
}

/// The refusal of a Messages request the compaction rules forbid, if any:
/// on-demand compaction beside `context_management`, without its beta, or
/// over a history ending in an unanswered tool call; a compaction block the
/// fake did not mint or that was altered; a block without the beta.
pub fn messages_refusal(body: &Value, headers: &http::HeaderMap) -> Option<Reply> {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    if is_on_demand(body) {
        if body.get("context_management").is_some() {
            return Some(refuse(
                400,
                "compaction: cannot be used together with context_management",
            ));
        }
        if !has_beta(headers) {
            return Some(refuse(
                400,
                &format!("compaction: requires the anthropic-beta header {COMPACT_BETA}"),
            ));
        }
        if msgs
            .last()
            .is_some_and(|m| !messages::tool_use_ids(m).is_empty())
        {
            return Some(refuse(
                400,
                "compaction: the conversation cannot end with a tool_use block awaiting its tool_result",
            ));
        }
    }
    let registry = registry();
    for (i, m) in msgs.iter().enumerate() {
        for (j, b) in messages::blocks(m).iter().enumerate() {
            if kind(b) != "compaction" {
                continue;
            }
            if !has_beta(headers) {
                return Some(refuse(
                    400,
                    &format!("messages.{i}.content.{j}: compaction blocks require the anthropic-beta header {COMPACT_BETA}"),
                ));
            }
            let token = b.get("signature").and_then(Value::as_str).unwrap_or("");
            match registry.get(token) {
                Some(minted) if serialized(b) == minted.exact => {}
                _ => {
                    return Some(refuse(
                        400,
                        &format!(
                            "messages.{i}.content.{j}: Invalid `signature` in `compaction` block"
                        ),
                    ))
                }
            }
        }
    }
    None
}

/// `msgs` with every message holding a minted compaction block replaced by
/// the messages it stands for (those hold none: they were expanded when
/// it was minted).
fn expanded_messages(msgs: &[Value]) -> Vec<Value> {
    let has_block = |m: &Value| messages::blocks(m).iter().any(|b| kind(b) == "compaction");
    if !msgs.iter().any(has_block) {
        return msgs.to_vec();
    }
    let registry = registry();
    let mut out = Vec::with_capacity(msgs.len());
    for m in msgs {
        let token = messages::blocks(m)
            .iter()
            .find(|b| kind(b) == "compaction")
            .and_then(|b| b.get("signature"))
            .and_then(Value::as_str);
        match token.and_then(|t| registry.get(t)) {
            Some(minted) => out.extend(minted.stands_for.iter().cloned()),
            None => out.push(m.clone()),
        }
    }
    out
}

/// A Messages request body as the fake judges it: its compaction blocks
/// replaced by what they stand for.
pub fn expanded(body: &Value) -> Value {
    expanded_at(body, 0).0
}

/// [`expanded`], and where the message at `i` of `body` is in it.
pub fn expanded_at(body: &Value, i: usize) -> (Value, usize) {
    let Some(msgs) = body.get("messages").and_then(Value::as_array) else {
        return (body.clone(), i);
    };
    let before = expanded_messages(&msgs[..i.min(msgs.len())]).len();
    let all = expanded_messages(msgs);
    if all.len() == msgs.len() && before == i.min(msgs.len()) {
        return (body.clone(), i);
    }
    let mut out = body.clone();
    out["messages"] = Value::Array(all);
    (out, before)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beta() -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(
            "anthropic-beta",
            http::HeaderValue::from_static(COMPACT_BETA),
        );
        h
    }

    fn reply_json(r: Reply) -> (u16, Value) {
        match r {
            Reply::Full { status, body, .. } => (status, serde_json::from_slice(&body).unwrap()),
            other => panic!("not a full reply: {other:?}"),
        }
    }

    #[test]
    fn an_on_demand_block_stands_for_what_it_compacted_and_only_as_minted() {
        let msgs = vec![
            json!({"role": "user", "content": "task"}),
            json!({"role": "assistant", "content": "done"}),
        ];
        let body = json!({"model": "m", "messages": msgs, "compaction": {"type": "summarize"}});
        assert!(messages_refusal(&body, &beta()).is_none());
        let (status, answer) = reply_json(on_demand(&Behaviour::Compact, &body));
        assert_eq!(status, 200);
        assert_eq!(answer["stop_reason"], "compaction");
        let block = answer["content"][0].clone();
        let later = json!({"messages": [
            {"role": "assistant", "content": [block.clone()]},
            {"role": "user", "content": "next"}]});
        assert!(messages_refusal(&later, &beta()).is_none());
        assert!(
            messages_refusal(&later, &http::HeaderMap::new()).is_some(),
            "no beta"
        );
        let (e, at) = expanded_at(&later, 1);
        assert_eq!(at, 2);
        assert_eq!(e["messages"][0], msgs[0]);
        let mut altered = block.clone();
        altered["content"] = json!("edited");
        let bad = json!({"messages": [{"role": "assistant", "content": [altered]}]});
        assert!(messages_refusal(&bad, &beta()).is_some());
    }

    #[test]
    fn on_demand_compaction_refuses_what_the_api_refuses() {
        let call = json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]});
        let open = json!({"messages": [{"role": "user", "content": "a"}, call], "compaction": {"type": "summarize"}});
        assert!(messages_refusal(&open, &beta()).is_some());
        let both = json!({"messages": [{"role": "user", "content": "a"}], "compaction": {"type": "summarize"},
                          "context_management": {"edits": []}});
        assert!(messages_refusal(&both, &beta()).is_some());
        let bare = json!({"messages": [{"role": "user", "content": "a"}], "compaction": {"type": "summarize"}});
        assert!(messages_refusal(&bare, &http::HeaderMap::new()).is_some());
    }

    #[test]
    fn a_responses_compaction_item_is_accepted_only_byte_identical() {
        let body = json!({"model": "m", "input": [
            {"type": "message", "role": "user", "content": "task"},
            {"type": "message", "role": "assistant", "content": "ok"}]});
        let (_, answer) = reply_json(responses_compact(&Behaviour::Compact, &body));
        let output = answer["output"].as_array().unwrap().clone();
        assert_eq!(output.len(), 2, "the user message, then the item");
        let later = json!({"input": output});
        assert!(responses_refusal(&later).is_none());
        let mut item = output[1].clone();
        item["encrypted_content"] =
            json!(format!("{}x", item["encrypted_content"].as_str().unwrap()));
        assert!(responses_refusal(&json!({"input": [item]})).is_some());
        let (_, nothing) = reply_json(responses_compact(&Behaviour::KeepNothing, &body));
        assert_eq!(
            nothing["output"].as_array().unwrap().len(),
            1,
            "only the item"
        );
    }
}
