//! What the compaction layer needs to know about an item, for both wire
//! formats: is it leading system text, a real user message, a tool call or a
//! tool output, and which call ids pair them.
//!
//! Chat items carry a `role`; Responses items a `type` (messages may carry
//! only a `role`). The helpers look at both, so one pure layer serves both APIs.

use serde_json::Value;

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
    role(item) == "user" && matches!(kind(item), "" | "message") && !is_summary(item)
}

/// A summary message the proxy wrote.
pub fn is_summary(item: &Value) -> bool {
    role(item) == "user" && text_of(item).starts_with(SUMMARY_MARKER)
}

/// The call ids an item opens (assistant `tool_calls`, or a Responses
/// `*_call` item with a `call_id`).
pub fn call_ids(item: &Value) -> Vec<&str> {
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

/// The call id an item answers (a chat `tool` message, or a Responses
/// `*_call_output` item).
pub fn output_id(item: &Value) -> Option<&str> {
    if role(item) == "tool" {
        return item.get("tool_call_id").and_then(Value::as_str);
    }
    if kind(item).ends_with("_call_output") {
        return item.get("call_id").and_then(Value::as_str);
    }
    None
}

/// Whether an item is a tool output.
pub fn is_tool_output(item: &Value) -> bool {
    crate::wire::class::is_tool_output(role(item), kind(item))
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
    items.iter().rposition(is_user_message)
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
