//! Tool calls in the four wire formats (Chat Completions `tool_calls`, Responses
//! `*_call` items, hosted tools that carry their own outcome, Messages `tool_use`,
//! Gemini `functionCall`) and their
//! one-line rendering for the tool-call log.

use serde_json::Value;

use super::edits::patch_files;
use super::errors::Outcome;
use super::limits::{MAX_ERROR_LINE, MAX_LOG_CALL};
use super::text::{clip, first_line, kind, parse_args, str_field, value_or_json};

pub(super) struct Call {
    pub(super) id: String,
    pub(super) name: String,
    pub(super) args: Value,
    /// Outcome carried by the call item itself (hosted tools, `mcp_call`).
    pub(super) inline: Option<Outcome>,
}

/// The tool calls an item makes, in the three wire formats.
pub(super) fn calls_of(item: &Value) -> Vec<Call> {
    // A Gemini `model` content: its `functionCall` parts, `args` an object,
    // paired by id or else by name (`wire::gemini`).
    if crate::wire::gemini::is_content(item) {
        let keys = crate::wire::gemini::call_ids(item);
        return crate::wire::gemini::function_calls(item)
            .zip(keys)
            .map(|(c, key)| Call {
                id: key.to_string(),
                name: str_field(c, &["name"]).unwrap_or("tool").to_string(),
                args: c.get("args").cloned().unwrap_or(Value::Null),
                inline: None,
            })
            .collect();
    }
    // An Anthropic assistant message: its `tool_use` blocks, `input` an object.
    if let Some(blocks) = item.get("content").and_then(Value::as_array) {
        let uses: Vec<Call> = blocks
            .iter()
            .filter(|b| kind(b) == "tool_use")
            .map(|b| Call {
                id: str_field(b, &["id"]).unwrap_or("").to_string(),
                name: str_field(b, &["name"]).unwrap_or("tool").to_string(),
                args: b.get("input").cloned().unwrap_or(Value::Null),
                inline: None,
            })
            .collect();
        if !uses.is_empty() {
            return uses;
        }
    }
    if let Some(calls) = item.get("tool_calls").and_then(Value::as_array) {
        return calls
            .iter()
            .map(|c| {
                let f = c.get("function").unwrap_or(c);
                Call {
                    id: str_field(c, &["id"]).unwrap_or("").to_string(),
                    name: str_field(f, &["name"]).unwrap_or("tool").to_string(),
                    args: parse_args(f.get("arguments")),
                    inline: None,
                }
            })
            .collect();
    }
    let k = kind(item);
    if !k.ends_with("_call") {
        return Vec::new();
    }
    let id = str_field(item, &["call_id"]).unwrap_or("").to_string();
    let call = match k {
        "function_call" => Call {
            id,
            name: str_field(item, &["name"]).unwrap_or("function").to_string(),
            args: parse_args(item.get("arguments")),
            inline: None,
        },
        "custom_tool_call" => Call {
            id,
            name: str_field(item, &["name"])
                .unwrap_or("custom_tool")
                .to_string(),
            args: item.get("input").cloned().unwrap_or(Value::Null),
            inline: None,
        },
        "local_shell_call" => Call {
            id,
            name: "local_shell".to_string(),
            args: item.get("action").cloned().unwrap_or(Value::Null),
            inline: None,
        },
        _ => {
            // Hosted tools (web_search_call, mcp_call, …): the item is its own record.
            let error = item
                .get("error")
                .filter(|e| !e.is_null())
                .map(value_or_json);
            let failed = error.is_some() || str_field(item, &["status"]) == Some("failed");
            let args = item
                .get("action")
                .cloned()
                .unwrap_or_else(|| parse_args(item.get("arguments")));
            Call {
                id,
                name: str_field(item, &["name"]).unwrap_or(k).to_string(),
                args,
                inline: Some(Outcome {
                    failed,
                    pruned: false,
                    errors: error
                        .map(|e| vec![clip(e.trim(), MAX_ERROR_LINE)])
                        .unwrap_or_default(),
                    exit: None,
                    status: None,
                }),
            }
        }
    };
    vec![call]
}

/// Keys whose values are file contents: shown as a size in the tool log.
const BULKY_KEYS: [&str; 12] = [
    "content",
    "contents",
    "file_text",
    "new_string",
    "old_string",
    "newString",
    "oldString",
    "new_str",
    "old_str",
    "edits",
    "patch",
    "input",
];

/// Short rendering of a call's arguments for the tool log.
pub(super) fn short_args(call: &Call) -> String {
    let patches = patch_files(&call.args);
    if !patches.is_empty() {
        let ops: Vec<String> = patches
            .iter()
            .map(|p| format!("{} {}", p.op, p.path))
            .collect();
        return format!("patch: {}", ops.join(", "));
    }
    let s = match &call.args {
        Value::Null => String::new(),
        Value::String(s) => first_line(s, 80),
        Value::Object(o) => o
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) if BULKY_KEYS.contains(&k.as_str()) && s.len() > 40 => {
                        format!("<{} bytes>", s.len())
                    }
                    Value::String(s) => first_line(s, 80),
                    Value::Array(a) if a.iter().all(Value::is_string) => first_line(
                        &a.iter()
                            .filter_map(Value::as_str)
                            .collect::<Vec<_>>()
                            .join(" "),
                        80,
                    ),
                    other => clip(&other.to_string(), 60),
                };
                format!("{k}={v}")
            })
            .collect::<Vec<_>>()
            .join(", "),
        other => clip(&other.to_string(), 80),
    };
    clip(&s, MAX_LOG_CALL)
}
