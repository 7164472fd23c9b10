//! The fake upstream's Anthropic Messages endpoint: answers as the API
//! does (JSON or the SSE event sequence, usage with the cached part apart)
//! and refuses what the API refuses, as documented, so that a test sees a
//! request the proxy rewrote judged by the same rules:
//!
//! - the first message must be the user's;
//! - every `tool_use` must have its `tool_result` first in the very next
//!   user message, and no `tool_result` may answer a call that is not in the
//!   message before;
//! - at most four `cache_control` breakpoints;
//! - a thinking block's signature binds it to everything before it (system,
//!   tools, earlier messages and blocks; `cache_control` aside): a block
//!   whose prefix changed is refused ("Invalid `signature` in `thinking`
//!   block") unless the request asks for mismatched blocks to be dropped
//!   (`thinking.block_binding.prefix_mismatch_behavior: "drop_block"` with
//!   its beta);
//! - with thinking on, the last assistant message of an open tool loop must
//!   start with a thinking block;
//! - a window, when one is set: "prompt is too long: N tokens > W maximum",
//!   or, when the prompt fits but not with `max_tokens`, "input length and
//!   `max_tokens` exceed context limit: N + M > W".
//!
//! Tokens are counted as the other endpoints of the fake count them: bytes
//! of the request body / 4. The real API's thresholds are far larger; these
//! rules are what it documents, not a recording of it.

use serde_json::{json, Map, Value};

use super::reply::Reply;
pub use super::reply::{Answer, SIGN_HERE};
use crate::wire::messages::{self, BLOCK_BINDING_BETA};

/// The refusal of a request the API would refuse, if any.
pub fn check(body: &Value, headers: &http::HeaderMap, window: Option<u64>) -> Option<Reply> {
    let refuse = |message: String| {
        Some(Reply::json(
            400,
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}}),
        ))
    };
    if let Some(refusal) = super::provider_compact::messages_refusal(body, headers) {
        return Some(refusal);
    }
    // A compaction block is judged as the messages it stands for.
    let expanded = super::provider_compact::expanded(body);
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let judged = expanded
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let role = |m: &Value| {
        m.get("role")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let conversational: Vec<&Value> = judged.iter().filter(|m| role(m) != "system").collect();
    if conversational.first().is_some_and(|m| role(m) != "user") {
        return refuse("messages: the first message must use the \"user\" role".into());
    }
    for (i, m) in conversational.iter().enumerate() {
        let uses = messages::tool_use_ids(m);
        let next = conversational.get(i + 1);
        if !uses.is_empty() {
            let Some(next) = next else { continue };
            let leading: Vec<&str> = messages::blocks(next)
                .iter()
                .take_while(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
                .filter_map(|b| b.get("tool_use_id").and_then(Value::as_str))
                .collect();
            if let Some(missing) = uses.iter().find(|id| !leading.contains(id)) {
                return refuse(format!(
                    "messages.{}: `tool_use` ids were found without `tool_result` blocks immediately after: {missing}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
                    i + 1
                ));
            }
        }
        if role(m) == "user" {
            let before = i
                .checked_sub(1)
                .map(|p| messages::tool_use_ids(conversational[p]))
                .unwrap_or_default();
            for r in messages::tool_results(m) {
                let id = r.get("tool_use_id").and_then(Value::as_str).unwrap_or("");
                if !before.contains(&id) {
                    return refuse(format!(
                        "messages.{i}.content: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
                    ));
                }
            }
        }
    }
    let breakpoints = body.get("system").map_or(0, messages::breakpoints)
        + body.get("tools").map_or(0, messages::breakpoints)
        + msgs.iter().map(messages::breakpoints).sum::<usize>();
    if breakpoints > messages::MAX_CACHE_BREAKPOINTS {
        return refuse(format!(
            "A maximum of 4 blocks with cache_control may be provided. Found {breakpoints}."
        ));
    }
    let thinking_on = messages::thinking_on(body);
    if thinking_on {
        let drop = body
            .pointer("/thinking/block_binding/prefix_mismatch_behavior")
            .and_then(Value::as_str)
            == Some("drop_block")
            && headers
                .get_all("anthropic-beta")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| v.split(',').any(|b| b.trim() == BLOCK_BINDING_BETA));
        for (i, m) in msgs.iter().enumerate() {
            for (j, b) in messages::blocks(m).iter().enumerate() {
                if b.get("type").and_then(Value::as_str) != Some("thinking") {
                    continue;
                }
                let sig = b.get("signature").and_then(Value::as_str).unwrap_or("");
                if sig != signature(body, i, j) && !drop {
                    return refuse(format!(
                        "messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
                    ));
                }
            }
        }
        let open_loop = msgs.last().is_some_and(messages::is_tool_result_message);
        let last_assistant = msgs.iter().rev().find(|m| role(m) == "assistant");
        if let (true, Some(a)) = (open_loop, last_assistant) {
            if !messages::blocks(a)
                .first()
                .is_some_and(messages::is_thinking)
            {
                return refuse("messages: when `thinking` is enabled, a final `assistant` message must start with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). Expected `thinking` or `redacted_thinking`, but found `tool_use`.".into());
            }
        }
    }
    let window = window?;
    let tokens = prompt_tokens(body);
    if tokens > window {
        return refuse(format!(
            "prompt is too long: {tokens} tokens > {window} maximum"
        ));
    }
    let max = body.get("max_tokens").and_then(Value::as_u64).unwrap_or(0);
    if max <= window && tokens + max > window {
        return refuse(format!(
            "input length and `max_tokens` exceed context limit: {tokens} + {max} > {window}, decrease input length or `max_tokens` and try again"
        ));
    }
    None
}

/// The prompt's size as the fake counts it: its JSON's bytes / 4 (of the
/// compact serialisation, which is how clients and the proxy send it).
pub fn prompt_tokens(body: &Value) -> u64 {
    (body.to_string().len() as u64 / 4).max(1)
}

/// The signature of a thinking block at `messages[i].content[j]`: a hash
/// of everything before it, `cache_control` left out.
pub fn signature(body: &Value, i: usize, j: usize) -> String {
    // Bound to what a compaction block before it stands for.
    let (body, i) = &super::provider_compact::expanded_at(body, i);
    let (body, i) = (body, *i);
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut before: Vec<Value> = msgs.into_iter().take(i + 1).collect();
    if let Some(last) = before.last_mut() {
        let blocks: Vec<Value> = messages::blocks(last).iter().take(j).cloned().collect();
        last["content"] = Value::Array(blocks);
    }
    let mut prefix = json!({
        "system": body.get("system"),
        "tools": body.get("tools"),
        "messages": before,
    });
    strip_cache_control(&mut prefix);
    let digest = blake3::hash(prefix.to_string().as_bytes());
    format!("sig-{}", &digest.to_hex()[..24])
}

/// Removes every `cache_control` member, at any depth: what a signature
/// binds leaves the breakpoints out.
pub fn strip_cache_control(v: &mut Value) {
    match v {
        Value::Object(o) => {
            o.remove("cache_control");
            o.values_mut().for_each(strip_cache_control);
        }
        Value::Array(l) => l.iter_mut().for_each(strip_cache_control),
        _ => {}
    }
}

/// The answer to `body` (`raw_len` bytes as received): its blocks (a
/// placeholder signature signed for this request), usage counting the
/// prompt as [`prompt_tokens`] does, as JSON or as the SSE events of a
/// stream.
pub fn reply(body: &Value, raw_len: usize, answer: &Answer, cached: u64) -> Reply {
    let prompt = (raw_len as u64 / 4).max(1);
    let cached = cached.min(prompt);
    let usage = json!({
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": answer.output_tokens,
    });
    reply_with_usage(body, answer, usage)
}

/// [`reply`] with a given `usage` object (a simulated cache's, see
/// [`super::cache`]).
pub fn reply_with_usage(body: &Value, answer: &Answer, usage: Value) -> Reply {
    let signs = answer
        .content
        .iter()
        .any(|b| b.get("signature").and_then(Value::as_str) == Some(SIGN_HERE));
    let content: Vec<Value> = if signs {
        // The answer's thinking is bound to the request it answers: its
        // messages, then the answer's own blocks before it.
        let n = body
            .get("messages")
            .and_then(Value::as_array)
            .map_or(0, Vec::len);
        let mut answered = body.clone();
        if let Some(Value::Array(list)) = answered.get_mut("messages") {
            list.push(json!({"role": "assistant", "content": answer.content}));
        }
        answer
            .content
            .iter()
            .enumerate()
            .map(|(j, b)| {
                let mut b = b.clone();
                if b.get("signature").and_then(Value::as_str) == Some(SIGN_HERE) {
                    b["signature"] = Value::String(signature(&answered, n, j));
                }
                b
            })
            .collect()
    } else {
        answer.content.clone()
    };
    let id = format!("msg_{}", super::bodies::next_response_id());
    let model = body.get("model").cloned().unwrap_or(json!("fake"));
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        return Reply::json(
            200,
            json!({"id": id, "type": "message", "role": "assistant", "model": model,
                   "content": content, "stop_reason": answer.stop_reason,
                   "stop_sequence": null, "usage": usage}),
        );
    }
    let mut events = Vec::new();
    let mut push = |name: &str, data: Value| {
        events.push(format!("event: {name}\ndata: {data}\n\n"));
    };
    let mut start_usage = usage.clone();
    start_usage["output_tokens"] = json!(1);
    push(
        "message_start",
        json!({"type": "message_start", "message": {"id": id, "type": "message",
               "role": "assistant", "model": model, "content": [], "stop_reason": null,
               "stop_sequence": null, "usage": start_usage}}),
    );
    for (i, b) in content.iter().enumerate() {
        let (start, delta) = stream_block(b);
        push(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": start}),
        );
        for d in delta {
            push(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i, "delta": d}),
            );
        }
        push(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        );
    }
    push(
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": answer.stop_reason,
               "stop_sequence": null}, "usage": {"output_tokens": answer.output_tokens}}),
    );
    push("message_stop", json!({"type": "message_stop"}));
    Reply::sse(events)
}

/// A block as `content_block_start` opens it, and the deltas that fill it.
fn stream_block(b: &Value) -> (Value, Vec<Value>) {
    let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
    let text = |k: &str| b.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    match kind {
        "text" => (
            json!({"type": "text", "text": ""}),
            vec![json!({"type": "text_delta", "text": text("text")})],
        ),
        "thinking" => (
            json!({"type": "thinking", "thinking": "", "signature": ""}),
            vec![
                json!({"type": "thinking_delta", "thinking": text("thinking")}),
                json!({"type": "signature_delta", "signature": text("signature")}),
            ],
        ),
        "tool_use" => {
            let mut start = b.clone();
            start["input"] = json!({});
            let input = b.get("input").cloned().unwrap_or(json!({})).to_string();
            (
                start,
                vec![json!({"type": "input_json_delta", "partial_json": input})],
            )
        }
        _ => (b.clone(), Vec::new()),
    }
}

/// Whether a Messages request is a summary call the proxy makes (its
/// `system` carries the summarizer marker, or its last message does: a
/// summary call repeating the conversation's request with the instruction
/// appended).
pub fn is_summarizer_request(body: &Value) -> bool {
    let text = |v: Option<&Value>| match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    };
    let last = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .and_then(|m| m.get("content"));
    [text(body.get("system")), text(last)]
        .iter()
        .any(|t| t.contains(crate::compaction::summary::SUMMARIZER_MARKER))
}

/// The body of a summary call as the chat-shaped messages the fake's
/// narrative reads.
pub fn as_chat(body: &Value) -> Value {
    let mut msgs = vec![
        json!({"role": "system", "content": body.get("system").cloned().unwrap_or(Value::Null)}),
    ];
    msgs.extend(
        body.get("messages")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default(),
    );
    let mut out = Map::new();
    out.insert("messages".into(), Value::Array(msgs));
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(msgs: Value) -> Value {
        json!({"model": "m", "max_tokens": 100, "thinking": {"type": "adaptive"}, "messages": msgs})
    }

    #[test]
    fn the_documented_refusals() {
        let h = http::HeaderMap::new();
        let refused = |b: &Value| match check(b, &h, None) {
            Some(Reply::Full { body, .. }) => String::from_utf8_lossy(&body).into_owned(),
            _ => String::new(),
        };
        assert!(
            refused(&body(json!([{"role": "assistant", "content": "x"}])))
                .contains("first message")
        );
        let unpaired = body(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "bad"},
                {"type": "tool_use", "id": "a", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "text", "text": "hm"}]},
        ]));
        assert!(refused(&unpaired).contains("without `tool_result`"));
        let orphan = body(json!([
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "z", "content": "x"}]},
        ]));
        assert!(refused(&orphan).contains("unexpected `tool_use_id`"));
        let mut signed = body(json!([{"role": "user", "content": "go"}]));
        let raw = signed.to_string().len();
        let r = reply(
            &signed,
            raw,
            &Answer::tool_use("a", "Bash", json!({})).thinking("hm"),
            0,
        );
        let Reply::Full { body: answer, .. } = r else {
            panic!()
        };
        let answer: Value = serde_json::from_slice(&answer).unwrap();
        signed["messages"]
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "assistant", "content": answer["content"]}));
        signed["messages"].as_array_mut().unwrap().push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "ok"}]}));
        assert!(check(&signed, &h, None).is_none(), "{}", refused(&signed));
        let mut edited = signed.clone();
        edited["messages"][0]["content"] = json!("went");
        assert!(refused(&edited).contains("Invalid `signature`"));
        edited["thinking"]["block_binding"] = json!({"prefix_mismatch_behavior": "drop_block"});
        let mut beta = http::HeaderMap::new();
        beta.insert("anthropic-beta", BLOCK_BINDING_BETA.parse().unwrap());
        assert!(check(&edited, &beta, None).is_none());
        let mut stripped = signed.clone();
        stripped["messages"][1]["content"]
            .as_array_mut()
            .unwrap()
            .remove(0);
        assert!(refused(&stripped).contains("must start with a thinking block"));
        let tokens = prompt_tokens(&signed);
        assert!(refused_with_window(&signed, tokens - 1).contains("prompt is too long"));
        assert!(refused_with_window(&signed, tokens + 50).contains("exceed context limit"));
    }

    fn refused_with_window(b: &Value, w: u64) -> String {
        match check(b, &http::HeaderMap::new(), Some(w)) {
            Some(Reply::Full { body, .. }) => String::from_utf8_lossy(&body).into_owned(),
            _ => String::new(),
        }
    }
}
