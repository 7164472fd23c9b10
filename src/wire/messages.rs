//! Anthropic Messages: `messages[]` as items (the top-level `system` stays a
//! body field, like every other parameter), the answer's `content` as one
//! assistant message, stream events, usage with its cached parts, the
//! shapes a compacted request must keep.
//!
//! Blocks the proxy does not know are kept as they came: nothing here
//! rebuilds a message from fields it read.

use serde_json::{json, Map, Value};

use super::format::{text_of, First, Format, Start, ToolCall};
pub use super::messages_stream::{usage_of, MessagesCollector};
use crate::error::InvalidField;

/// The beta that lets the API drop a thinking block whose signature no
/// longer matches its (compacted) prefix, instead of refusing the request.
pub const BLOCK_BINDING_BETA: &str = "thinking-binding-controls-2026-08-01";

/// Most `cache_control` breakpoints the API takes in one request.
pub const MAX_CACHE_BREAKPOINTS: usize = 4;

/// `messages` must be a list of objects with a string `role` and a string
/// or list `content`; `system` a string or a list of blocks.
pub fn validate(obj: &Map<String, Value>) -> Result<(), InvalidField> {
    let msgs = match obj.get("messages") {
        None => return Err(InvalidField::missing("messages")),
        Some(Value::Array(msgs)) => msgs,
        Some(_) => return Err(InvalidField::wrong_type("messages", "an array")),
    };
    for (i, m) in msgs.iter().enumerate() {
        let Some(m) = m.as_object() else {
            return Err(InvalidField::wrong_type(
                format!("messages[{i}]"),
                "an object",
            ));
        };
        if !m.get("role").is_some_and(Value::is_string) {
            return Err(InvalidField::wrong_type(
                format!("messages[{i}].role"),
                "a string",
            ));
        }
        match m.get("content") {
            Some(Value::String(_)) | Some(Value::Array(_)) => {}
            _ => {
                return Err(InvalidField::wrong_type(
                    format!("messages[{i}].content"),
                    "a string or an array",
                ))
            }
        }
    }
    match obj.get("system") {
        None | Some(Value::Null) | Some(Value::String(_)) | Some(Value::Array(_)) => Ok(()),
        Some(_) => Err(InvalidField::wrong_type("system", "a string or an array")),
    }
}

/// The answer's `content` as one assistant message.
pub fn response_items(body: &Value) -> Vec<Value> {
    match body.get("content") {
        Some(content @ Value::Array(_)) => {
            vec![json!({"role": "assistant", "content": content})]
        }
        _ => Vec::new(),
    }
}

/// What Claude Code's own compaction request asks, in the text it appends
/// to the conversation's last user message.
const CLIENT_COMPACTION_ASK: &str = "create a detailed summary of the conversation so far";

/// Whether a request is a client's own compaction request: its last
/// message asks the model to summarize the conversation so far (Claude
/// Code's prompt after "prompt is too long", or its `/compact`).
pub fn is_client_compaction(last: &Value) -> bool {
    if last.get("role").and_then(Value::as_str) != Some("user") {
        return false;
    }
    let asks = |t: &str| t.contains(CLIENT_COMPACTION_ASK);
    match last.get("content") {
        Some(Value::String(t)) => asks(t),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter(|b| block_type(b) == "text")
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .any(asks),
        _ => false,
    }
}

/// The text of a complete answer: its `text` blocks, joined.
pub fn answer_text(body: &Value) -> Option<String> {
    let texts: Vec<&str> = body
        .get("content")?
        .as_array()?
        .iter()
        .filter(|b| block_type(b) == "text")
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect();
    (!texts.is_empty()).then(|| texts.join(""))
}

/// The blocks of a message's `content` (none for a string).
pub fn blocks(item: &Value) -> &[Value] {
    item.get("content")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

fn block_type(b: &Value) -> &str {
    b.get("type").and_then(Value::as_str).unwrap_or("")
}

/// A `thinking` or `redacted_thinking` block.
pub fn is_thinking(b: &Value) -> bool {
    matches!(block_type(b), "thinking" | "redacted_thinking")
}

/// Whether a message holds a thinking block.
pub fn has_thinking(item: &Value) -> bool {
    blocks(item).iter().any(is_thinking)
}

/// The ids of the client tool calls (`tool_use` blocks) of an assistant
/// message. Server tools (`server_tool_use`) are answered inside the same
/// message, so they open nothing a later message must close.
pub fn tool_use_ids(item: &Value) -> Vec<&str> {
    if item.get("role").and_then(Value::as_str) != Some("assistant") {
        return Vec::new();
    }
    blocks(item)
        .iter()
        .filter(|b| block_type(b) == "tool_use")
        .filter_map(|b| b.get("id").and_then(Value::as_str))
        .collect()
}

/// The `tool_result` blocks of a user message.
pub fn tool_results(item: &Value) -> impl Iterator<Item = &Value> {
    let user = item.get("role").and_then(Value::as_str) == Some("user");
    blocks(item)
        .iter()
        .filter(move |b| user && block_type(b) == "tool_result")
}

/// Whether a message answers tool calls (holds a `tool_result` block).
pub fn is_tool_result_message(item: &Value) -> bool {
    tool_results(item).next().is_some()
}

/// Text of a `tool_result`'s `content`: a string, or its text blocks.
pub fn tool_result_text(block: &Value) -> String {
    match block.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Removes the thinking blocks of an assistant message. `None` when
/// nothing else is left of it (the message then goes too).
pub fn without_thinking(item: &Value) -> Option<Value> {
    if !has_thinking(item) {
        return Some(item.clone());
    }
    let kept: Vec<Value> = blocks(item)
        .iter()
        .filter(|b| !is_thinking(b))
        .cloned()
        .collect();
    if kept.is_empty() {
        return None;
    }
    let mut out = item.clone();
    out["content"] = Value::Array(kept);
    Some(out)
}

/// A compaction's replacement made a valid start of a Messages request:
/// no thinking block (a signed block is bound to everything before it,
/// which the compaction changed; an assistant message of nothing else
/// goes), the first message the user's, the summary (`is_summary`) as a
/// text block, and one `cache_control` breakpoint, on the last block of the
/// last message sent as blocks, so the compacted prefix is cached (the
/// client's own breakpoints in the summarized part go with it).
pub fn finish_replacement(
    replacement: Vec<Value>,
    is_summary: impl Fn(&Value) -> bool,
) -> Vec<Value> {
    finish_replacement_after(replacement, 0, false, is_summary)
}

/// [`finish_replacement`] for a replacement whose first `keep` messages
/// end with a provider `compaction` block: they go exactly as the client
/// sent them (the API drops everything before the block and reads the
/// block as sent), and what follows them is finished as a replacement is.
/// The first message is then the client's, whatever its role.
///
/// `whole`: nothing of the client's request follows the replacement (its
/// tail was truncated into it). When it then ends inside an open tool loop,
/// the loop's last assistant message keeps its thinking, which the API
/// requires there; [`finish_view`] takes it off once the loop has moved on,
/// and lets the API drop it while it has not.
pub fn finish_replacement_after(
    replacement: Vec<Value>,
    keep: usize,
    whole: bool,
    is_summary: impl Fn(&Value) -> bool,
) -> Vec<Value> {
    let keep = keep.min(replacement.len());
    let loop_assistant = open_loop_assistant(&replacement).filter(|&i| whole && i >= keep);
    let mut out: Vec<Value> = replacement[keep..]
        .iter()
        .enumerate()
        .filter_map(|(i, m)| {
            if Some(keep + i) == loop_assistant {
                Some(m.clone())
            } else {
                without_thinking(m)
            }
        })
        .map(|mut m| {
            if is_summary(&m) {
                if let Some(Value::String(text)) = m.get("content") {
                    m["content"] = json!([{"type": "text", "text": text}]);
                }
            }
            remove_breakpoints(&mut m);
            m
        })
        .collect();
    // The first message but the system ones (which the API sets aside).
    let role = |m: &Value| {
        m.get("role")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let first = out.iter().position(|m| role(m) != "system");
    if keep == 0 && first.map(|i| role(&out[i])).as_deref() != Some("user") {
        out.insert(
            first.unwrap_or(out.len()),
            json!({"role": "user", "content": [{"type": "text", "text": "[compactor: the conversation so far follows]"}]}),
        );
    }
    // On the last message with blocks: a message sent as a string stays as
    // it was sent (the newest user message must reach the model verbatim).
    if let Some(m) = out.iter_mut().rev().find(|m| {
        m.get("content")
            .and_then(Value::as_array)
            .is_some_and(|b| !b.is_empty())
    }) {
        set_breakpoint(m);
    }
    let mut whole = replacement;
    whole.truncate(keep);
    whole.extend(out);
    whole
}

/// The view that goes upstream once a compaction applies
/// (`view[..replacement_len]` is its replacement), made valid: thinking
/// blocks of the tail were signed against the prefix the compaction
/// replaced, so they go — but for the last assistant message of an open
/// tool loop, which the API requires to start with its own block: that one
/// stays, in the tail or in a replacement that took the tail in (see
/// [`finish_replacement_after`]), and the request must let the API drop it
/// ([`with_block_binding`]); this returns whether it must. A replacement's
/// block whose loop has moved on goes like the tail's. Breakpoints past
/// [`MAX_CACHE_BREAKPOINTS`] (counting `outside`, the system's and tools')
/// are taken off the tail's oldest first, then the replacement's.
///
/// A provider's `compaction` block and the client's messages up to it go
/// as the client sent them: the API reads from the block on.
pub fn finish_view(view: &mut Vec<Value>, replacement_len: usize, outside: usize) -> bool {
    let floor = view
        .iter()
        .rposition(holds_compaction_block)
        .map_or(0, |i| i + 1);
    let mut replacement_len = replacement_len.min(view.len());
    // The open loop's own block may be in the replacement (a tail
    // truncated into it, see [`finish_replacement_after`]).
    let mut keep = open_loop_assistant(view).filter(|&i| i >= floor);
    // Such a block once its loop has moved on goes; the rest of the
    // replacement is as it was made (a provider's kept turns keep theirs).
    let moved_on = open_loop_assistant(&view[..replacement_len])
        .filter(|&r| r >= floor && Some(r) != keep && has_thinking(&view[r]));
    if let Some(r) = moved_on {
        match without_thinking(&view[r]) {
            Some(m) => view[r] = m,
            None => {
                view.remove(r);
                replacement_len -= 1;
                keep = keep.map(|k| k - 1);
            }
        }
    }
    let kept_thinking = keep.is_some_and(|k| has_thinking(&view[k]));
    let mut i = replacement_len.max(floor);
    while i < view.len() {
        if Some(i) != keep
            && view[i].get("role").and_then(Value::as_str) == Some("assistant")
            && has_thinking(&view[i])
        {
            match without_thinking(&view[i]) {
                Some(m) => view[i] = m,
                None => {
                    view.remove(i);
                    keep = keep.map(|k| if k > i { k - 1 } else { k });
                    continue;
                }
            }
        }
        i += 1;
    }
    let start = replacement_len.max(floor).min(view.len());
    // The client's own messages below the floor: past the replacement, or
    // the ones the replacement kept verbatim before the block.
    let clients = |i: usize| i < floor && (i >= replacement_len || floor <= replacement_len);
    let mut count = outside + view.iter().map(breakpoints).sum::<usize>();
    let order: Vec<usize> = (start..view.len())
        .chain(0..start)
        .filter(|&i| !clients(i))
        .collect();
    for i in order {
        while count > MAX_CACHE_BREAKPOINTS && breakpoints(&view[i]) > 0 {
            remove_first_breakpoint(&mut view[i]);
            count -= 1;
        }
    }
    kept_thinking
}

/// The last assistant message of an open tool loop: the messages end with
/// the user's `tool_result` blocks, which answer it.
fn open_loop_assistant(msgs: &[Value]) -> Option<usize> {
    if !msgs.last().is_some_and(is_tool_result_message) {
        return None;
    }
    msgs.iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
}

/// Whether a message holds a provider `compaction` block.
fn holds_compaction_block(m: &Value) -> bool {
    blocks(m)
        .iter()
        .any(|b| b.get("type").and_then(Value::as_str) == Some("compaction"))
}

/// Whether a request has thinking on (`thinking` set, and not `disabled`).
pub fn thinking_on(body: &Value) -> bool {
    body.get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t != "disabled")
}

/// Asks the API to drop a thinking block whose signature no longer matches
/// its prefix rather than refuse the request (only where thinking is on).
pub fn with_block_binding(body: &mut Value) {
    if !thinking_on(body) {
        return;
    }
    let Some(thinking) = body.get_mut("thinking").and_then(Value::as_object_mut) else {
        return;
    };
    thinking.insert(
        "block_binding".into(),
        json!({"prefix_mismatch_behavior": "drop_block"}),
    );
}

/// Adds [`BLOCK_BINDING_BETA`] to a request's `anthropic-beta` header.
pub fn add_binding_beta(headers: &mut http::HeaderMap) {
    add_beta(headers, BLOCK_BINDING_BETA);
}

/// `anthropic-beta` with [`BLOCK_BINDING_BETA`] added (once).
pub fn with_binding_beta(existing: Option<&str>) -> String {
    with_beta(existing, BLOCK_BINDING_BETA)
}

/// Adds `beta` to the headers' `anthropic-beta` list (once). A client may
/// send its betas on several header lines: every line is kept, joined into
/// the one list the proxy's beta is added to. Should a line not be visible
/// ASCII, the lines stay as they came and the beta goes on a line of its own.
pub fn add_beta(headers: &mut http::HeaderMap, beta: &str) {
    let lines: Option<Vec<&str>> = headers
        .get_all("anthropic-beta")
        .iter()
        .map(|v| v.to_str().ok().map(str::trim))
        .collect();
    let Some(lines) = lines else {
        let present = headers
            .get_all("anthropic-beta")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|l| l.split(',').any(|b| b.trim() == beta));
        if let (false, Ok(v)) = (present, http::HeaderValue::from_str(beta)) {
            headers.append("anthropic-beta", v);
        }
        return;
    };
    let joined = lines
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(",");
    if let Ok(v) = http::HeaderValue::from_str(&with_beta(Some(&joined), beta)) {
        headers.insert("anthropic-beta", v);
    }
}

/// An `anthropic-beta` list with `beta` added (once).
fn with_beta(existing: Option<&str>, beta: &str) -> String {
    match existing.map(str::trim).filter(|s| !s.is_empty()) {
        Some(list) if list.split(',').any(|b| b.trim() == beta) => list.to_string(),
        Some(list) => format!("{list},{beta}"),
        None => beta.to_string(),
    }
}

/// How many `cache_control` breakpoints a value holds (a message, the
/// `system` blocks, the tools).
pub fn breakpoints(v: &Value) -> usize {
    match v {
        Value::Array(list) => list.iter().map(breakpoints).sum(),
        Value::Object(o) => {
            let own = usize::from(o.get("cache_control").is_some_and(|c| !c.is_null()));
            own + o
                .get("content")
                .filter(|c| c.is_array())
                .map(breakpoints)
                .unwrap_or(0)
        }
        _ => 0,
    }
}

fn remove_breakpoints(m: &mut Value) {
    while breakpoints(m) > 0 {
        remove_first_breakpoint(m);
    }
}

fn remove_first_breakpoint(v: &mut Value) -> bool {
    match v {
        Value::Array(list) => list.iter_mut().any(remove_first_breakpoint),
        Value::Object(o) => {
            if o.get("cache_control").is_some_and(|c| !c.is_null()) {
                o.remove("cache_control");
                return true;
            }
            match o.get_mut("content") {
                Some(c @ Value::Array(_)) => remove_first_breakpoint(c),
                _ => false,
            }
        }
        _ => false,
    }
}

/// Puts a breakpoint on the last block of a message.
fn set_breakpoint(m: &mut Value) {
    if let Some(Value::Array(blocks)) = m.get_mut("content") {
        if let Some(Value::Object(b)) = blocks.last_mut() {
            b.insert("cache_control".into(), json!({"type": "ephemeral"}));
        }
    }
}

/// The session id Claude Code puts in `metadata.user_id`, a JSON string
/// (`{"device_id": …, "session_id": …}`).
pub fn metadata_session(body: &Value) -> Option<String> {
    let user = body.pointer("/metadata/user_id")?.as_str()?;
    if !user.trim_start().starts_with('{') {
        return None;
    }
    let v: Value = serde_json::from_str(user).ok()?;
    v.get("session_id")
        .and_then(Value::as_str)
        .filter(|s| !s.trim().is_empty())
        .map(String::from)
}

/// Anthropic Messages' answers to what the phases ask ([`Format`]).
pub struct Messages;

/// Event types that come before a Messages stream commits to an answer:
/// the message opens, then its first content block commits.
const PRELUDE_EVENTS: &[&str] = &["message_start", "ping"];

impl Format for Messages {
    fn tool(&self, name: &str, description: &str, parameters: Value) -> Value {
        json!({"name": name, "description": description, "input_schema": parameters})
    }

    fn stream_start(&self, name: &str, data: &str) -> Start {
        let kind = super::responses::event_type(data).unwrap_or_else(|| name.to_string());
        if PRELUDE_EVENTS.contains(&kind.as_str()) {
            Start::Prelude
        } else if kind == "error" {
            Start::Failed
        } else {
            Start::Committed
        }
    }

    /// Never: a thinking block is signed for the request that produced
    /// it, and one relayed from a recall round's answer would stand, in
    /// the client's history, before text another request produced, which
    /// the API may refuse once the client sends it back. Messages streams
    /// stay held.
    fn starts_reasoning(&self, _name: &str, _data: &str) -> bool {
        false
    }

    fn first_output(&self, _name: &str, data: &str) -> Option<First> {
        let v: Value = serde_json::from_str(data).ok()?;
        match v.get("type").and_then(Value::as_str)? {
            "content_block_start" => {
                match v.pointer("/content_block/type").and_then(Value::as_str) {
                    Some("tool_use") => Some(First::ToolCall),
                    Some("text") => Some(First::Text),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    fn answer_of(&self, items: Vec<Value>) -> Value {
        let content = items
            .first()
            .and_then(|m| m.get("content"))
            .cloned()
            .unwrap_or(Value::Null);
        json!({ "content": content })
    }

    fn tool_calls(&self, answer: &Value) -> Vec<ToolCall> {
        answer
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
            .map(|b| ToolCall {
                id: text_of(b, "id"),
                name: text_of(b, "name"),
                arguments: b.get("input").cloned().unwrap_or(Value::Null).to_string(),
            })
            .collect()
    }

    /// The answer's content as one assistant message, then the results as
    /// one user message; a call's `input` is no text, and is kept.
    fn continuation(
        &self,
        answer: &Value,
        results: &[(String, String)],
        _arguments: &mut dyn FnMut(&str, &mut Value),
    ) -> Vec<Value> {
        let content = answer.get("content").cloned().unwrap_or(json!([]));
        let results: Vec<Value> = results
            .iter()
            .map(|(id, text)| json!({"type": "tool_result", "tool_use_id": id, "content": text}))
            .collect();
        vec![
            json!({"role": "assistant", "content": content}),
            json!({"role": "user", "content": results}),
        ]
    }

    fn signs_thinking(&self, body: &Value) -> bool {
        thinking_on(body)
    }

    fn edits_view(&self) -> bool {
        true
    }

    /// The tail's old thinking and surplus cache breakpoints (see
    /// [`finish_view`]).
    fn finish_view(
        &self,
        view: &mut Vec<Value>,
        replaced: usize,
        body: &Value,
        tools: Option<&Value>,
    ) -> bool {
        let outside = tools.map_or(0, breakpoints) + body.get("system").map_or(0, breakpoints);
        finish_view(view, replaced, outside)
    }

    fn system(&self, body: &Value) -> Option<Value> {
        body.get("system").cloned()
    }

    fn is_client_compaction(&self, last: &Value) -> bool {
        is_client_compaction(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Usage;

    #[test]
    fn usage_counts_the_cached_parts_of_the_prompt() {
        let u = json!({"input_tokens": 12, "cache_read_input_tokens": 3000,
                       "cache_creation_input_tokens": 200, "output_tokens": 9,
                       "cache_creation": {"ephemeral_5m_input_tokens": 150,
                                          "ephemeral_1h_input_tokens": 50}});
        assert_eq!(
            usage_of(&u),
            Some(Usage {
                input_tokens: 3212,
                output_tokens: 9,
                cached_tokens: Some(3000),
                cache_write_tokens: Some(200),
                cache_write_1h_tokens: Some(50),
            })
        );
        assert_eq!(usage_of(&json!({"output_tokens": 3})), None);
    }

    /// An answer that compacted reports its iterations apart; the top
    /// level may sum the message iterations (a server tool's rounds), and
    /// the compaction's prompt was the history before it.
    /// A provider's compaction block past the compacted prefix keeps its
    /// message as the client sent it, thinking and breakpoints included.
    #[test]
    fn the_tail_leaves_a_provider_compaction_message_as_sent() {
        let bp = json!({"type": "ephemeral"});
        let provider = json!({"role": "assistant", "content": [
            {"type": "compaction", "content": "summary", "cache_control": bp},
            {"type": "thinking", "thinking": "t", "signature": "s1"},
            {"type": "text", "text": "ok", "cache_control": bp}]});
        let mut view = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "[compactor summary]", "cache_control": bp}]}),
            provider.clone(),
            json!({"role": "user", "content": [{"type": "text", "text": "go", "cache_control": bp}]}),
            json!({"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t2", "signature": "s2"},
                {"type": "text", "text": "done", "cache_control": bp}]}),
            json!({"role": "user", "content": "next"}),
        ];
        assert!(!finish_view(&mut view, 1, 1));
        assert_eq!(view[1], provider);
        assert!(
            !has_thinking(&view[3]),
            "thinking after the block goes as before"
        );
        assert_eq!(
            view.iter().map(breakpoints).sum::<usize>() + 1,
            MAX_CACHE_BREAKPOINTS
        );
    }

    #[test]
    fn usage_of_a_compacting_answer_is_its_last_message_iteration() {
        let u = json!({
            "input_tokens": 28000, "output_tokens": 1400,
            "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0,
            "iterations": [
                {"type": "message", "input_tokens": 5000, "output_tokens": 400,
                 "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
                {"type": "compaction", "input_tokens": 180000, "output_tokens": 3500,
                 "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
                {"type": "message", "input_tokens": 20000, "output_tokens": 1000,
                 "cache_read_input_tokens": 3000, "cache_creation_input_tokens": 0},
            ]
        });
        assert_eq!(
            usage_of(&u),
            Some(Usage {
                input_tokens: 23000,
                output_tokens: 1000,
                cached_tokens: Some(3000),
                cache_write_tokens: Some(0),
                cache_write_1h_tokens: None,
            })
        );
    }

    #[test]
    fn a_stream_is_collected_into_one_assistant_message_with_cumulative_usage() {
        let mut c = MessagesCollector::default();
        let events = [
            (
                "message_start",
                r#"{"type":"message_start","message":{"id":"msg_1","role":"assistant","content":[],"usage":{"input_tokens":10,"cache_read_input_tokens":90,"output_tokens":1}}}"#,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"let me "}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"see"}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"sig"}}"#,
            ),
            (
                "content_block_stop",
                r#"{"type":"content_block_stop","index":0}"#,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"Bash","input":{}}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"command\": \"ls"}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":" -la\"}"}}"#,
            ),
            (
                "content_block_stop",
                r#"{"type":"content_block_stop","index":1}"#,
            ),
            (
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":42}}"#,
            ),
            ("message_stop", r#"{"type":"message_stop"}"#),
        ];
        for (e, d) in events {
            c.push(e, d);
        }
        assert!(c.finished());
        assert_eq!(c.id.as_deref(), Some("msg_1"));
        assert_eq!(c.stop_reason.as_deref(), Some("tool_use"));
        assert_eq!(
            c.usage,
            Some(Usage {
                input_tokens: 100,
                output_tokens: 42,
                cached_tokens: Some(90),
                ..Usage::default()
            })
        );
        assert_eq!(
            c.items(),
            vec![json!({"role": "assistant", "content": [
                {"type": "thinking", "thinking": "let me see", "signature": "sig"},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls -la"}},
            ]})]
        );
    }

    #[test]
    fn tool_uses_and_results_pair_by_id() {
        let a = json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "t", "signature": "s"},
            {"type": "tool_use", "id": "a", "name": "Bash", "input": {}},
            {"type": "server_tool_use", "id": "srv", "name": "web_search", "input": {}},
            {"type": "tool_use", "id": "b", "name": "Read", "input": {}},
        ]});
        assert_eq!(tool_use_ids(&a), vec!["a", "b"]);
        let u = json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": "ok"},
            {"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "fine"}]},
            {"type": "text", "text": "and more"},
        ]});
        let ids: Vec<_> = tool_results(&u)
            .filter_map(|b| b.get("tool_use_id").and_then(Value::as_str))
            .collect();
        assert_eq!(ids, vec!["a", "b"]);
        assert!(is_tool_result_message(&u));
        assert!(!is_tool_result_message(&a));
        let stripped = without_thinking(&a).unwrap();
        assert_eq!(blocks(&stripped).len(), 3);
        assert!(without_thinking(
            &json!({"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]})
        )
        .is_none());
    }

    fn msg(role: &str, content: Value) -> Value {
        json!({"role": role, "content": content})
    }

    #[test]
    fn a_replacement_starts_with_the_user_loses_its_thinking_and_ends_on_one_breakpoint() {
        let summary = msg("user", json!("[compactor summary] facts"));
        let replacement = vec![
            summary,
            msg(
                "assistant",
                json!([{"type": "thinking", "thinking": "t", "signature": "s"}]),
            ),
            msg(
                "user",
                json!([{"type": "text", "text": "recent", "cache_control": {"type": "ephemeral"}}]),
            ),
        ];
        let out = finish_replacement(replacement, |m| {
            m["content"]
                .as_str()
                .is_some_and(|t| t.starts_with("[compactor summary"))
        });
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(out[0]["content"][0]["type"], "text");
        assert_eq!(out[0]["content"][0]["text"], "[compactor summary] facts");
        assert_eq!(breakpoints(&Value::Array(out.clone())), 1);
        assert_eq!(out[1]["content"][0]["cache_control"]["type"], "ephemeral");
        let odd = finish_replacement(vec![msg("assistant", json!("hi"))], |_| false);
        assert_eq!(odd[0]["role"], "user");
        assert_eq!(odd[1]["role"], "assistant");
    }

    #[test]
    fn the_tail_keeps_only_the_open_loops_thinking_and_at_most_four_breakpoints() {
        let think = |sig: &str| json!({"type": "thinking", "thinking": "t", "signature": sig});
        let bp = json!({"type": "ephemeral"});
        let mut view = vec![
            msg(
                "user",
                json!([{"type": "text", "text": "summary", "cache_control": bp}]),
            ),
            msg(
                "assistant",
                json!([think("a"), {"type": "text", "text": "done", "cache_control": bp}]),
            ),
            msg(
                "user",
                json!([{"type": "text", "text": "next", "cache_control": bp}]),
            ),
            msg(
                "assistant",
                json!([think("b"), {"type": "tool_use", "id": "x", "name": "Bash", "input": {}}]),
            ),
            msg(
                "user",
                json!([{"type": "tool_result", "tool_use_id": "x", "content": "ok", "cache_control": bp}]),
            ),
        ];
        let drop = finish_view(&mut view, 1, 2);
        assert!(drop, "the open loop's block stays and must be droppable");
        assert!(!has_thinking(&view[1]));
        assert_eq!(view[3]["content"][0]["signature"], "b");
        let total = 2 + view.iter().map(breakpoints).sum::<usize>();
        assert_eq!(total, MAX_CACHE_BREAKPOINTS);
        assert_eq!(breakpoints(&view[0]), 1, "the summary's breakpoint is kept");
        assert_eq!(breakpoints(&view[1]), 0, "the tail's oldest goes first");
        // At a turn boundary nothing of the old thinking is needed.
        let mut at_boundary = vec![
            msg("user", json!("summary")),
            msg(
                "assistant",
                json!([think("c"), {"type": "text", "text": "x"}]),
            ),
            msg("user", json!("go on")),
        ];
        assert!(!finish_view(&mut at_boundary, 1, 0));
        assert!(!has_thinking(&at_boundary[1]));
        let mut body = json!({"thinking": {"type": "adaptive"}});
        with_block_binding(&mut body);
        assert_eq!(
            body["thinking"]["block_binding"]["prefix_mismatch_behavior"],
            "drop_block"
        );
        let mut off = json!({"thinking": {"type": "disabled"}});
        with_block_binding(&mut off);
        assert!(off["thinking"].get("block_binding").is_none());
        assert_eq!(
            with_binding_beta(Some("a,b")),
            format!("a,b,{BLOCK_BINDING_BETA}")
        );
        assert_eq!(
            with_binding_beta(Some(BLOCK_BINDING_BETA)),
            BLOCK_BINDING_BETA
        );
    }

    /// Betas a client sent on several header lines all reach the upstream,
    /// with the proxy's added once.
    #[test]
    fn every_beta_line_is_kept_when_one_is_added() {
        let mut headers = http::HeaderMap::new();
        headers.append("anthropic-beta", "a, b".parse().unwrap());
        headers.append("anthropic-beta", "c".parse().unwrap());
        add_binding_beta(&mut headers);
        add_binding_beta(&mut headers);
        let lines: Vec<_> = headers.get_all("anthropic-beta").iter().collect();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0], format!("a, b,c,{BLOCK_BINDING_BETA}").as_str());
        let mut odd = http::HeaderMap::new();
        odd.append("anthropic-beta", "a".parse().unwrap());
        odd.append(
            "anthropic-beta",
            http::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        );
        add_binding_beta(&mut odd);
        add_binding_beta(&mut odd);
        let lines: Vec<_> = odd.get_all("anthropic-beta").iter().collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(lines[2], BLOCK_BINDING_BETA);
    }

    /// A tail truncated into the replacement inside an open tool loop: the
    /// loop's own block stays in the replacement, droppable; once the loop
    /// moves on, it goes like any other.
    #[test]
    fn a_replacement_that_took_the_open_loop_in_keeps_its_block_until_it_moves_on() {
        let think = |sig: &str| json!({"type": "thinking", "thinking": "t", "signature": sig});
        let replacement = vec![
            msg("user", json!("[compactor summary] facts")),
            msg(
                "assistant",
                json!([think("old"), {"type": "tool_use", "id": "a", "name": "Read", "input": {}}]),
            ),
            msg(
                "user",
                json!([{"type": "tool_result", "tool_use_id": "a", "content": "short"}]),
            ),
            msg(
                "assistant",
                json!([think("loop"), {"type": "tool_use", "id": "b", "name": "Read", "input": {}}]),
            ),
            msg(
                "user",
                json!([{"type": "tool_result", "tool_use_id": "b", "content": "[elided]"}]),
            ),
        ];
        let summary = |m: &Value| {
            m["content"]
                .as_str()
                .is_some_and(|t| t.starts_with("[compactor"))
        };
        let part = finish_replacement_after(replacement.clone(), 0, false, summary);
        assert!(!part.iter().any(has_thinking), "a tail follows: {part:?}");
        let whole = finish_replacement_after(replacement, 0, true, summary);
        assert!(!has_thinking(&whole[1]));
        assert_eq!(whole[3]["content"][0]["signature"], "loop");
        let n = whole.len();
        let mut view = whole.clone();
        assert!(
            finish_view(&mut view, n, 0),
            "the loop's block is droppable"
        );
        assert_eq!(view[3]["content"][0]["signature"], "loop");
        // The loop moves on: its block in the replacement goes.
        let mut later = whole;
        later.push(msg(
            "assistant",
            json!([think("next"), {"type": "tool_use", "id": "c", "name": "Read", "input": {}}]),
        ));
        later.push(msg(
            "user",
            json!([{"type": "tool_result", "tool_use_id": "c", "content": "ok"}]),
        ));
        assert!(finish_view(&mut later, n, 0));
        assert!(!has_thinking(&later[3]), "{:?}", later[3]);
        assert_eq!(later[5]["content"][0]["signature"], "next");
        later.push(msg(
            "assistant",
            json!([think("end"), {"type": "text", "text": "done"}]),
        ));
        later.push(msg("user", json!("thanks")));
        assert!(!finish_view(&mut later, n, 0));
        assert!(!later.iter().any(has_thinking));
    }

    #[test]
    fn claude_codes_session_rides_in_metadata_user_id() {
        let body = json!({"metadata": {"user_id": "{\"device_id\": \"d\", \"account_uuid\": \"\", \"session_id\": \"73bb\"}"}});
        assert_eq!(metadata_session(&body).as_deref(), Some("73bb"));
        assert_eq!(
            metadata_session(&json!({"metadata": {"user_id": "user-42"}})),
            None
        );
    }

    #[test]
    fn validation_names_the_field() {
        let obj = |v: Value| v.as_object().unwrap().clone();
        assert!(validate(&obj(json!({"messages": []}))).is_ok());
        let e = validate(&obj(json!({"messages": [{"role": "user", "content": 3}]}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = validate(&obj(json!({"messages": [], "system": 5}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("system"));
        assert!(validate(&obj(json!({"system": "x"}))).is_err());
    }
}
