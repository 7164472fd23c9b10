//! What the compaction layer needs to know about an item, for the four wire
//! formats: is it leading system text, a real user message, a tool call or a
//! tool output, and which call ids pair them.
//!
//! Chat items carry a `role`; Responses items a `type` (messages may carry
//! only a `role`); an Anthropic message a `role` and content blocks, where a
//! `tool_use` block is a call and a user message holding `tool_result`
//! blocks answers them (several at once); a Gemini content a `role` and
//! parts, `functionCall` and `functionResponse` among them. The helpers look
//! at all of these, so one pure layer serves the four APIs.

use serde_json::Value;

use crate::wire::{gemini, messages};

/// Marker that opens every summary message the proxy writes.
pub const SUMMARY_MARKER: &str = "[compactor summary";

fn role(item: &Value) -> &str {
    item.get("role").and_then(Value::as_str).unwrap_or("")
}

fn kind(item: &Value) -> &str {
    item.get("type").and_then(Value::as_str).unwrap_or("")
}

/// System or developer text (including the Responses `instructions` pseudo-item).
pub fn is_system(item: &Value) -> bool {
    crate::wire::class::is_system(role(item), kind(item))
}

/// A message from the user (not a tool output, not a summary the proxy wrote).
pub fn is_user_message(item: &Value) -> bool {
    role(item) == "user"
        && matches!(kind(item), "" | "message")
        && !messages::is_tool_result_message(item)
        && !gemini::is_function_response(item)
        && !is_summary(item)
}

/// A summary message the proxy wrote.
pub fn is_summary(item: &Value) -> bool {
    role(item) == "user" && text_of(item).starts_with(SUMMARY_MARKER)
}

/// The call ids an item opens (assistant `tool_calls`, a Responses
/// `*_call` item with a `call_id`, the `tool_use` blocks of an Anthropic
/// assistant message).
pub fn call_ids(item: &Value) -> Vec<&str> {
    if gemini::is_content(item) {
        return gemini::call_ids(item);
    }
    if item.get("content").is_some_and(Value::is_array) {
        let uses = messages::tool_use_ids(item);
        if !uses.is_empty() {
            return uses;
        }
    }
    if let Some(calls) = item.get("tool_calls").and_then(Value::as_array) {
        return calls
            .iter()
            .filter_map(|c| c.get("id").and_then(Value::as_str))
            .collect();
    }
    if kind(item).ends_with("_call") {
        if let Some(id) = item.get("call_id").and_then(Value::as_str) {
            return vec![id];
        }
    }
    Vec::new()
}

/// The call ids an item answers: a chat `tool` message's or a Responses
/// `*_call_output` item's one, the `tool_result` blocks of an Anthropic
/// user message.
pub fn output_ids(item: &Value) -> Vec<&str> {
    if gemini::is_content(item) {
        return gemini::output_ids(item);
    }
    if role(item) == "user" {
        return messages::tool_results(item)
            .filter_map(|b| b.get("tool_use_id").and_then(Value::as_str))
            .collect();
    }
    output_id(item).into_iter().collect()
}

/// The outputs an item carries, each as (call id, text, failed as the
/// harness said it): one for a chat `tool` message or a Responses output
/// item, one per `tool_result` block of an Anthropic user message
/// (`is_error` marks a failure).
pub fn outputs(item: &Value) -> Vec<(&str, String, bool)> {
    if gemini::is_content(item) {
        return gemini::outputs(item);
    }
    if role(item) == "user" && messages::is_tool_result_message(item) {
        return messages::tool_results(item)
            .map(|b| {
                let id = b.get("tool_use_id").and_then(Value::as_str).unwrap_or("");
                let failed = b.get("is_error").and_then(Value::as_bool) == Some(true);
                (id, messages::tool_result_text(b), failed)
            })
            .collect();
    }
    match output_id(item) {
        Some(id) if is_tool_output(item) => vec![(id, text_of(item), false)],
        None if is_tool_output(item) => vec![("", text_of(item), false)],
        _ => Vec::new(),
    }
}

/// The call id an item answers (a chat `tool` message, or a Responses
/// `*_call_output` item); see [`output_ids`] for Anthropic messages.
pub fn output_id(item: &Value) -> Option<&str> {
    if role(item) == "tool" {
        return item.get("tool_call_id").and_then(Value::as_str);
    }
    if kind(item).ends_with("_call_output") {
        return item.get("call_id").and_then(Value::as_str);
    }
    None
}

/// Whether an item is a tool output (for Anthropic, a user message that
/// answers tool calls).
pub fn is_tool_output(item: &Value) -> bool {
    crate::wire::class::is_tool_output(role(item), kind(item))
        || messages::is_tool_result_message(item)
        || gemini::is_function_response(item)
}

/// The field holding a tool output's payload.
pub fn output_field(item: &Value) -> &'static str {
    if role(item) == "tool" {
        "content"
    } else {
        "output"
    }
}

/// The text of a message or tool output: a string, or the text parts of a list.
pub fn text_of(item: &Value) -> String {
    if gemini::is_content(item) {
        return gemini::text_of(item);
    }
    if messages::is_tool_result_message(item) {
        // Each result's text, then the message's own text blocks.
        let blocks = messages::blocks(item);
        return blocks
            .iter()
            .map(|b| match b.get("type").and_then(Value::as_str) {
                Some("tool_result") => messages::tool_result_text(b),
                _ => b
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
            })
            .filter(|t| !t.is_empty())
            .collect::<Vec<_>>()
            .join("\n");
    }
    let field = if is_tool_output(item) {
        output_field(item)
    } else {
        "content"
    };
    match item.get(field) {
        Some(v) => value_text(v),
        None => String::new(),
    }
}

/// Text of a content value: a string, or the `text` of each part.
pub fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str).or_else(|| p.as_str()))
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Object(o) => o
            .get("text")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// Number of leading system/developer items.
pub fn leading_system(items: &[Value]) -> usize {
    items.iter().take_while(|i| is_system(i)).count()
}

/// Index of the latest real user message.
pub fn latest_user(items: &[Value]) -> Option<usize> {
    items
        .iter()
        .rposition(|i| is_user_message(i) && !is_facts_message(i))
}

/// Opens the message in which an audit restores the facts a cheap rung
/// left out (see [`super::summary::audit_and_repair`]).
pub const FACTS_MESSAGE: &str = "<compactor_facts>";

/// A message of facts the proxy restored: the user's words are elsewhere.
pub fn is_facts_message(item: &Value) -> bool {
    role(item) == "user" && text_of(item).starts_with(FACTS_MESSAGE)
}

/// The largest char boundary of `s` at or below `i`.
pub(crate) fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The smallest char boundary of `s` at or above `i`.
pub(crate) fn ceil_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// A user message carrying `text`, in the given API's shape.
pub fn user_message(text: String) -> Value {
    serde_json::json!({"role": "user", "content": text})
}

/// Markers for the images, documents and audio `item` holds, in order,
/// each with where it was (`a user message`, `a tool output`…): what a
/// summary says of the media of the items it replaces (see
/// [`crate::tokens::media::omitted_marker`]). Content arrays of every API
/// are read, and the ones inside an Anthropic `tool_result`.
pub fn media_markers(item: &Value) -> Vec<String> {
    fn walk(blocks: &[Value], place: &str, out: &mut Vec<String>) {
        for b in blocks {
            if let Some(marker) = crate::tokens::media::omitted_marker(b) {
                out.push(format!("{marker} (in {place})"));
            } else if let Some(inner) = b.get("content").and_then(Value::as_array) {
                walk(inner, "a tool output", out);
            }
        }
    }
    let place = if is_tool_output(item) {
        "a tool output"
    } else {
        match role(item) {
            "user" => "a user message",
            "assistant" | "model" => "an assistant message",
            _ => "a message",
        }
    };
    let mut out = Vec::new();
    for key in ["content", "output", "parts"] {
        if let Some(blocks) = item.get(key).and_then(Value::as_array) {
            walk(blocks, place, &mut out);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn media_markers_say_what_each_item_held_and_where() {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        png.extend(800u32.to_be_bytes());
        png.extend(600u32.to_be_bytes());
        let png = crate::tokens::media::encode_base64(&png);
        let user = json!({"role": "user", "content": [
            {"type": "text", "text": "what is wrong here?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
        ]});
        let tool = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        ]}]});
        let chat = json!({"role": "user", "content": "no media at all"});
        assert_eq!(
            media_markers(&user),
            ["[image omitted by compactor: 800×600 PNG, ~640 tokens] (in a user message)"]
        );
        let in_tool = media_markers(&tool);
        assert_eq!(in_tool.len(), 1, "{in_tool:?}");
        assert!(in_tool[0].ends_with("(in a tool output)"), "{in_tool:?}");
        assert!(media_markers(&chat).is_empty());
    }

    #[test]
    fn both_wire_formats_pair_by_id() {
        let chat_call = json!({"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]});
        assert_eq!(call_ids(&chat_call), vec!["a", "b"]);
        assert_eq!(
            output_id(&json!({"role": "tool", "tool_call_id": "a"})),
            Some("a")
        );
        let fc = json!({"type": "function_call", "call_id": "c", "name": "sh"});
        assert_eq!(call_ids(&fc), vec!["c"]);
        assert_eq!(
            output_id(&json!({"type": "function_call_output", "call_id": "c"})),
            Some("c")
        );
        assert_eq!(
            output_id(&json!({"type": "custom_tool_call_output", "call_id": "d"})),
            Some("d")
        );
        assert!(call_ids(&json!({"type": "web_search_call", "id": "w"})).is_empty());
    }

    #[test]
    fn user_messages_exclude_summaries_and_outputs() {
        assert!(is_user_message(&json!({"role": "user", "content": "hi"})));
        assert!(is_user_message(
            &json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})
        ));
        assert!(!is_user_message(&user_message(format!(
            "{SUMMARY_MARKER}] ..."
        ))));
        assert!(!is_user_message(&json!({"role": "tool", "content": "x"})));
        assert_eq!(
            text_of(
                &json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]})
            ),
            "a\nb"
        );
    }
}
