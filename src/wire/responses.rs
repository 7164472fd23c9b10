//! Responses API: `instructions` + `input` as items, `output` items, stream events.

use serde_json::{json, Map, Value};

use super::Usage;

/// `instructions` (as a leading pseudo-item, so two conversations with
/// different instructions never share a prefix) followed by the `input`
/// items, moved out of the body (an empty list is left); a string `input`
/// is one user message.
pub fn take_items(body: &mut Value) -> Vec<Value> {
    let mut items: Vec<Value> = instructions_item(body).into_iter().collect();
    match body.get_mut("input") {
        Some(input @ Value::String(_)) => {
            let text = std::mem::replace(input, Value::Array(Vec::new()));
            items.push(json!({"role": "user", "content": text}));
        }
        Some(Value::Array(list)) => items.append(list),
        _ => {}
    }
    items
}

/// The pseudo-item standing for the body's `instructions`, if it has any.
pub fn instructions_item(body: &Value) -> Option<Value> {
    let instr = body.get("instructions").filter(|v| !v.is_null())?;
    Some(json!({"type": "instructions", "content": instr}))
}

/// Whether an item is the pseudo-item standing for `instructions`.
pub fn is_instructions_item(item: &Value) -> bool {
    item.get("type").and_then(Value::as_str) == Some("instructions")
}

/// `input` must be a string or a list of objects; `instructions` a string.
pub fn validate(obj: &Map<String, Value>) -> Result<(), String> {
    match obj.get("input") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(Value::Array(list)) => {
            if let Some(i) = list.iter().position(|m| !m.is_object()) {
                return Err(format!("`input[{i}]` must be an object"));
            }
        }
        Some(_) => return Err("`input` must be a string or an array".into()),
    }
    match obj.get("instructions") {
        None | Some(Value::Null) | Some(Value::String(_)) => Ok(()),
        Some(_) => Err("`instructions` must be a string".into()),
    }
}

/// The `output` items of a complete answer.
pub fn response_items(body: &Value) -> Vec<Value> {
    body.get("output")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// Collects output items, usage and the final status from a Responses stream.
#[derive(Debug, Default)]
pub struct ResponsesCollector {
    /// Items announced done one by one (kept for streams cut short).
    done_items: Vec<Value>,
    /// The final `response` object (`response.completed`/`failed`/`incomplete`).
    pub final_response: Option<Value>,
    /// Usage of the final response.
    pub usage: Option<Usage>,
    /// The response id, from the first event that carries it.
    pub id: Option<String>,
    /// An error reported inside the stream (`response.failed` or `error`).
    pub error: Option<Value>,
}

impl ResponsesCollector {
    /// Feeds one event: its `event:` name (may be empty) and `data`.
    pub fn push(&mut self, event: &str, data: &str) {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(event)
            .to_string();
        if let Some(r) = v.get("response") {
            if self.id.is_none() {
                self.id = r.get("id").and_then(Value::as_str).map(String::from);
            }
        }
        match kind.as_str() {
            "response.output_item.done" => {
                if let Some(item) = v.get("item") {
                    self.done_items.push(item.clone());
                }
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                if let Some(r) = v.get("response") {
                    self.usage = r.get("usage").and_then(Usage::from_value);
                    if kind == "response.failed" {
                        self.error = r.get("error").cloned().or(Some(Value::Null));
                    }
                    self.final_response = Some(r.clone());
                }
            }
            "error" => self.error = Some(v.get("error").cloned().unwrap_or(v.clone())),
            _ => {}
        }
    }

    /// The output items: the final response's, else those seen done so far.
    pub fn items(&self) -> Vec<Value> {
        match &self.final_response {
            Some(r)
                if r.get("output")
                    .and_then(Value::as_array)
                    .is_some_and(|o| !o.is_empty()) =>
            {
                response_items(r)
            }
            _ => self.done_items.clone(),
        }
    }

    /// A terminal event was seen.
    pub fn finished(&self) -> bool {
        self.final_response.is_some()
    }
}

/// True for the event names that end a Responses stream.
pub fn is_terminal_event(kind: &str) -> bool {
    matches!(
        kind,
        "response.completed" | "response.incomplete" | "response.failed"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_include_instructions_and_string_input() {
        let b = json!({"instructions": "be brief", "input": "hi"});
        let items = take_items(&mut b.clone());
        assert_eq!(items.len(), 2);
        assert_eq!(items[1]["content"], "hi");
        assert!(validate(json!({"input": 3}).as_object().unwrap()).is_err());
        assert!(validate(json!({"input": [1]}).as_object().unwrap()).is_err());
    }

    #[test]
    fn collects_completed_response() {
        let mut c = ResponsesCollector::default();
        c.push(
            "response.created",
            r#"{"type":"response.created","response":{"id":"resp_1","output":[]}}"#,
        );
        c.push(
            "",
            r#"{"type":"response.output_item.done","item":{"type":"message","id":"m1"}}"#,
        );
        assert!(!c.finished());
        assert_eq!(c.items().len(), 1);
        c.push("response.completed", r#"{"type":"response.completed","response":{"id":"resp_1","output":[{"type":"message","id":"m1"}],"usage":{"input_tokens":7,"output_tokens":2}}}"#);
        assert!(c.finished());
        assert_eq!(c.id.as_deref(), Some("resp_1"));
        assert_eq!(c.usage.unwrap().total(), 9);
    }
}
