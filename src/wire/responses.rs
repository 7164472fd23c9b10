//! Responses API: `instructions` + `input` as items, `output` items, stream events.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use super::format::{text_of, First, Format, Start, ToolCall};
use super::usage::Usage;
use crate::error::InvalidField;

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
pub fn validate(obj: &Map<String, Value>) -> Result<(), InvalidField> {
    match obj.get("input") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(Value::Array(list)) => {
            if let Some(i) = list.iter().position(|m| !m.is_object()) {
                return Err(InvalidField::wrong_type(format!("input[{i}]"), "an object"));
            }
        }
        Some(_) => return Err(InvalidField::wrong_type("input", "a string or an array")),
    }
    match obj.get("instructions") {
        None | Some(Value::Null) | Some(Value::String(_)) => Ok(()),
        Some(_) => Err(InvalidField::wrong_type("instructions", "a string")),
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
    /// The `output` of the final `response` object
    /// (`response.completed`/`failed`/`incomplete`), once one came; the
    /// rest of that object (which echoes the instructions and tools) is
    /// not kept.
    final_output: Option<Vec<Value>>,
    /// Usage of the final response.
    pub usage: Option<Usage>,
    /// The response id, from the first event that carries it.
    pub id: Option<String>,
    /// An error reported inside the stream (`response.failed` or `error`).
    pub error: Option<Value>,
    /// Past what is collected of an answer: no more items are kept (those
    /// done before stand for the output), the usage and the end still are.
    pub capped: bool,
}

impl ResponsesCollector {
    /// Feeds one event: its `event:` name (may be empty) and `data`.
    pub fn push(&mut self, event: &str, data: &str) {
        // Deltas, nearly all of a stream's events (one per token or so),
        // repeat what the `done` events carry whole: an event named as one
        // is not read at all.
        if event.ends_with(".delta") {
            return;
        }
        // The other events may carry a whole response object (with the
        // instructions and tools echoed): the event is read with its members
        // left as raw JSON, and only what is kept becomes a tree. An event
        // of another shape is read as a tree.
        let Ok(view) = serde_json::from_str::<EventView>(data) else {
            if let Ok(v) = serde_json::from_str::<Value>(data) {
                self.push_value(event, &v);
            }
            return;
        };
        let kind = view.kind.as_deref().unwrap_or(event);
        let tree = |raw: &RawValue| serde_json::from_str::<Value>(raw.get()).unwrap_or_default();
        if let (Some(r), None) = (view.response, &self.id) {
            self.id = serde_json::from_str::<IdView>(r.get())
                .ok()
                .and_then(|r| r.id)
                .map(Cow::into_owned);
        }
        match kind {
            "response.output_item.done" => {
                if let Some(item) = view.item.filter(|_| !self.capped) {
                    self.done_items.push(tree(item));
                }
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                if let Some(r) = view.response {
                    match serde_json::from_str::<FinalView>(r.get()) {
                        Ok(f) => {
                            let output = f
                                .output
                                .filter(|_| !self.capped)
                                .map(tree)
                                .unwrap_or_default();
                            let usage = f.usage.map(tree).unwrap_or_default();
                            let error = f.error.map(tree);
                            self.finish(kind, output, &usage, error);
                        }
                        // Not an object (`null`, say), or an odd one (a
                        // repeated member): read as a tree.
                        Err(_) => self.finish_with(kind, &tree(r)),
                    }
                }
            }
            "error" => {
                self.error = Some(match view.error {
                    Some(e) => tree(e),
                    None => serde_json::from_str(data).unwrap_or_default(),
                })
            }
            _ => {}
        }
    }

    /// [`ResponsesCollector::push`] for an event parsed as a tree.
    fn push_value(&mut self, event: &str, v: &Value) {
        let kind = v.get("type").and_then(Value::as_str).unwrap_or(event);
        if let Some(r) = v.get("response") {
            if self.id.is_none() {
                self.id = r.get("id").and_then(Value::as_str).map(String::from);
            }
        }
        match kind {
            "response.output_item.done" => {
                if let Some(item) = v.get("item").filter(|_| !self.capped) {
                    self.done_items.push(item.clone());
                }
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                if let Some(r) = v.get("response") {
                    self.finish_with(kind, r);
                }
            }
            "error" => self.error = Some(v.get("error").cloned().unwrap_or(v.clone())),
            _ => {}
        }
    }

    /// A terminal event whose response object was read as a tree.
    fn finish_with(&mut self, kind: &str, response: &Value) {
        let field = |k: &str| response.get(k).cloned();
        let output = if self.capped {
            Value::Null
        } else {
            field("output").unwrap_or_default()
        };
        self.finish(
            kind,
            output,
            &field("usage").unwrap_or_default(),
            field("error"),
        );
    }

    /// A terminal event, with what its response object held.
    fn finish(&mut self, kind: &str, output: Value, usage: &Value, error: Option<Value>) {
        self.usage = Usage::from_value(usage);
        if kind == "response.failed" {
            self.error = error.or(Some(Value::Null));
        }
        self.final_output = Some(match output {
            Value::Array(items) => items,
            _ => Vec::new(),
        });
    }

    /// The output items: the final response's, else those seen done so far.
    pub fn items(&self) -> Vec<Value> {
        match &self.final_output {
            Some(items) if !items.is_empty() => items.clone(),
            _ => self.done_items.clone(),
        }
    }

    /// A terminal event was seen.
    pub fn finished(&self) -> bool {
        self.final_output.is_some()
    }
}

/// What [`ResponsesCollector`] reads of an event before it knows what it
/// keeps. A member that is present, even `null`, is `Some`.
#[derive(Deserialize)]
struct EventView<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "present")]
    response: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    item: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    error: Option<&'a RawValue>,
}

/// What the collector keeps of a final response object, the rest skipped.
#[derive(Deserialize)]
struct FinalView<'a> {
    #[serde(default, borrow)]
    output: Option<&'a RawValue>,
    #[serde(default, borrow)]
    usage: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    error: Option<&'a RawValue>,
}

/// A response object's id, the rest skipped.
#[derive(Deserialize)]
struct IdView<'a> {
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
}

/// A member's raw JSON, `null` included.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// The `type` of an event (see [`event_type`]).
#[derive(Deserialize)]
struct TypeView<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
}

/// An event's `type` member, if it is a JSON object with a string there;
/// nothing else of it is built.
pub fn event_type(data: &str) -> Option<String> {
    match serde_json::from_str::<TypeView>(data) {
        Ok(v) => v.kind.map(Cow::into_owned),
        // Another shape (a repeated member, say): as a tree.
        Err(_) => serde_json::from_str::<Value>(data)
            .ok()?
            .get("type")?
            .as_str()
            .map(String::from),
    }
}

/// True for the event names that end a Responses stream.
pub fn is_terminal_event(kind: &str) -> bool {
    matches!(
        kind,
        "response.completed" | "response.incomplete" | "response.failed"
    )
}

/// The Responses API's answers to what the phases ask ([`Format`]).
pub struct Responses;

/// Event types that come before a Responses stream commits to an answer.
const PRELUDE_EVENTS: &[&str] = &[
    "response.created",
    "response.in_progress",
    "response.queued",
];

impl Format for Responses {
    fn tool(&self, name: &str, description: &str, parameters: Value) -> Value {
        json!({"type": "function", "name": name,
            "description": description, "parameters": parameters})
    }

    fn stream_start(&self, name: &str, data: &str) -> Start {
        let kind = event_type(data).unwrap_or_else(|| name.to_string());
        if PRELUDE_EVENTS.contains(&kind.as_str()) {
            Start::Prelude
        } else if kind == "response.failed" || kind == "error" {
            Start::Failed
        } else {
            Start::Committed
        }
    }

    fn starts_reasoning(&self, name: &str, data: &str) -> bool {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return false;
        };
        let kind = event_type(data).unwrap_or_else(|| name.to_string());
        kind == "response.output_item.added"
            && v.pointer("/item/type").and_then(Value::as_str) == Some("reasoning")
    }

    fn first_output(&self, name: &str, data: &str) -> Option<First> {
        let v: Value = serde_json::from_str(data).ok()?;
        match event_type(data)
            .unwrap_or_else(|| name.to_string())
            .as_str()
        {
            "response.output_text.delta" => Some(First::Text),
            "response.output_item.added" => match v.pointer("/item/type").and_then(Value::as_str) {
                Some("function_call") => Some(First::ToolCall),
                Some("message") => Some(First::Text),
                _ => None,
            },
            _ => None,
        }
    }

    fn answer_of(&self, items: Vec<Value>) -> Value {
        json!({ "output": items })
    }

    fn tool_calls(&self, answer: &Value) -> Vec<ToolCall> {
        answer
            .get("output")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|i| i.get("type").and_then(Value::as_str) == Some("function_call"))
            .map(|c| ToolCall {
                id: text_of(c, "call_id"),
                name: text_of(c, "name"),
                arguments: text_of(c, "arguments"),
            })
            .collect()
    }

    fn continuation(
        &self,
        answer: &Value,
        results: &[(String, String)],
        arguments: &mut dyn FnMut(&str, &mut Value),
    ) -> Vec<Value> {
        let mut out: Vec<Value> = answer
            .get("output")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for item in &mut out {
            let Some(name) = item.get("name").and_then(Value::as_str).map(String::from) else {
                continue;
            };
            if let Some(args) = item.get_mut("arguments") {
                arguments(&name, args);
            }
        }
        out.extend(results.iter().map(
            |(id, text)| json!({"type": "function_call_output", "call_id": id, "output": text}),
        ));
        out
    }

    fn expands_items(&self) -> bool {
        true
    }
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

    /// The raw read and the tree read of events collect the same.
    #[test]
    fn events_read_alike_either_way() {
        let streams: &[&[(&str, &str)]] = &[
            &[
                (
                    "response.created",
                    r#"{"type":"response.created","response":{"id":"resp_1","instructions":"x","tools":[{"a":1}],"output":[]}}"#,
                ),
                (
                    "",
                    r#"{"type":"response.output_text.delta","delta":"Hel\u006co","item_id":"m1"}"#,
                ),
                (
                    "",
                    r#"{"type":"response.output_item.done","item":{"type":"message","id":"m1","content":[{"type":"output_text","text":"Hello"}]}}"#,
                ),
                ("", r#"{"type":"response.output_item.done","item":null}"#),
                (
                    "response.completed",
                    r#"{"type":"response.completed","response":{"id":"resp_1","output":[{"type":"message","id":"m1"}],"usage":{"input_tokens":7,"output_tokens":2}}}"#,
                ),
            ],
            &[
                (
                    "response.created",
                    r#"{"type":"response.created","response":{"id":5}}"#,
                ),
                (
                    "response.in_progress",
                    r#"{"type":7,"response":{"id":"resp_2"}}"#,
                ),
                (
                    "response.failed",
                    r#"{"type":"response.failed","response":{"id":"resp_2","error":{"code":"context_length_exceeded"}}}"#,
                ),
            ],
            &[
                (
                    "error",
                    r#"{"type":"error","code":"rate_limit","message":"slow down"}"#,
                ),
                ("", "[DONE]"),
            ],
            &[
                ("error", r#"{"type":"error","error":null}"#),
                (
                    "response.completed",
                    r#"{"type":"response.completed","response":null}"#,
                ),
            ],
            &[
                // The output given twice (the last counts), instructions
                // and tools echoed, usage of another shape.
                (
                    "response.completed",
                    r#"{"type":"response.completed","response":{"output":[{"id":"a"}],"instructions":"x","tools":[{"b":[1]}],"output":[{"id":"b"}],"usage":{"input_tokens":"many"}}}"#,
                ),
            ],
            &[(
                "response.incomplete",
                r#"{"type":"response.incomplete","response":{"output":{"id":"c"},"error":null,"usage":null}}"#,
            )],
        ];
        let mut collected = Vec::new();
        for events in streams {
            let mut raw = ResponsesCollector::default();
            let mut tree = ResponsesCollector::default();
            for (name, data) in events.iter() {
                raw.push(name, data);
                if let Ok(v) = serde_json::from_str::<Value>(data) {
                    tree.push_value(name, &v);
                }
            }
            assert_eq!(raw.done_items, tree.done_items);
            assert_eq!(raw.final_output, tree.final_output);
            assert_eq!(raw.usage, tree.usage);
            assert_eq!(raw.id, tree.id);
            assert_eq!(raw.error, tree.error);
            assert_eq!(raw.items(), tree.items());
            collected.push(raw);
        }
        assert_eq!(collected[0].id.as_deref(), Some("resp_1"));
        assert_eq!(collected[0].usage.map(|u| u.total()), Some(9));
        assert_eq!(collected[0].done_items.len(), 2);
        assert_eq!(collected[1].id.as_deref(), Some("resp_2"));
        assert_eq!(
            collected[1].error,
            Some(json!({"code": "context_length_exceeded"}))
        );
        assert_eq!(collected[2].error.as_ref().unwrap()["code"], "rate_limit");
        assert!(collected[3].finished());
        assert_eq!(collected[3].error, Some(Value::Null));
        assert_eq!(collected[4].items(), vec![json!({"id": "b"})]);
        assert_eq!(collected[4].usage, None);
        assert!(collected[5].finished() && collected[5].items().is_empty());
        assert_eq!(
            event_type(r#"{"type":"response.created","response":{}}"#).as_deref(),
            Some("response.created")
        );
        assert_eq!(event_type(r#"{"type":3}"#), None);
        assert_eq!(event_type("[DONE]"), None);
    }

    #[test]
    fn events_named_as_deltas_are_not_read() {
        let mut c = ResponsesCollector::default();
        let completed = r#"{"type":"response.completed","response":{"id":"r","output":[],"usage":{"input_tokens":1,"output_tokens":1}}}"#;
        // The name decides: whatever a delta's data says is not looked at.
        c.push("response.output_text.delta", completed);
        c.push("response.function_call_arguments.delta", completed);
        assert!(!c.finished());
        assert_eq!(c.id, None);
        // Unnamed, the same data is read.
        c.push("", completed);
        assert!(c.finished());
        assert_eq!(c.id.as_deref(), Some("r"));
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
