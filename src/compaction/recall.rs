//! Recall of what the cheap rungs elided: the `compactor_recall` tool the
//! proxy adds to a compacted request, the calls of it in an answer, and the
//! answers to them.
//!
//! Where the tool goes is decided once for a conversation's life: after the
//! client's own tools (and `compactor_compact`), on every request a
//! compaction applies to, from the conversation's first compacted request
//! on, with the same bytes ([`definition`]), whether or not what the
//! compaction holds has an archived original left to recall. Tool
//! definitions come first in both providers' prompt-cache keys (Anthropic:
//! tools, system, messages; OpenAI: the prefix as sent), so a tool that came
//! with a prune and went with a later summary would make the request after
//! each change read nothing from the cache, the unchanged tools and system
//! included. It is not offered before the first compaction: that would hold
//! every answer of a conversation that never compacts to look for calls,
//! and change bytes the client sent for nothing, while the first compaction
//! rewrites the cached prefix from its first replaced item anyway.
//!
//! A reference is answered from the request's own items: the originals the
//! client sent, which the compaction replaced on the way upstream. So a
//! reference is only ever answered with a tenant's own bytes, and one that
//! names no item of the request (another tenant's, a made-up one) gets a
//! tool error the model can read, never a failed request.

use serde_json::{json, Value};

use super::items::{floor_boundary, is_tool_output, output_field, value_text};
use super::ladder::archive_ref;
use crate::wire::format::may_add_tool;
use crate::wire::{Api, ItemHash};

/// The tool's name.
pub const TOOL: &str = "compactor_recall";

/// Largest answer to one call, bytes; a longer original is answered with
/// its head and tail (two thirds, one third) around a marker.
pub const MAX_RECALL_BYTES: usize = 16 * 1024;

/// What the stub says of the archive: the text the ladder's markers carry.
pub const ARCHIVED: &str = "original archived as item:";

const DESCRIPTION: &str = "Returns the original of a tool output that compactor shortened \
     in this conversation. Pass `ref`: the item:… reference its marker shows.";

/// The tool's definition in `api`'s shape: the same bytes in every request.
pub fn definition(api: Api) -> Value {
    let parameters = json!({
        "type": "object",
        "properties": {"ref": {"type": "string", "description": "item:<16 hex digits>"}},
        "required": ["ref"],
        "additionalProperties": false,
    });
    api.format().tool(TOOL, DESCRIPTION, parameters)
}

/// Whether the recall tool may be added to a compacted request: it has
/// tools of its own, none of them named [`TOOL`] (a client's own tool of
/// that name is the client's, and its calls go to the client), and does
/// not forbid calling them; it asks for one choice (a recall in another
/// choice could not be answered without answering them all); and it
/// continues no upstream-stored response (a continuation would have to name
/// the recall round).
pub fn may_offer(body: &Value, tools: Option<&Value>) -> bool {
    may_add_tool(body, tools, TOOL)
}

/// Most recall calls of one answer that are looked up; the others are
/// answered with a short tool error.
pub const MAX_CALLS_PER_ROUND: usize = 8;

/// Most characters of a reference echoed back in a tool error.
const MAX_ECHOED_REF: usize = 40;

/// Below this many bytes of room a recall is refused rather than answered
/// with a fragment too short to help.
pub const MIN_ANSWER_BYTES: usize = 256;

/// The answers to one round's `calls`, as (call id, text): each distinct
/// reference looked up once, at most [`MAX_CALLS_PER_ROUND`] of them, the
/// round's answers together within `room` bytes (shared evenly, each at
/// most [`MAX_RECALL_BYTES`]). A repeated reference gets a pointer to the
/// first answer; a call past the cap, or when there is no room, a tool
/// error the model can read.
pub fn answers(
    calls: &[Call],
    originals: &[Value],
    hashes: &[ItemHash],
    room: usize,
) -> Vec<(String, String)> {
    let mut distinct: Vec<&str> = Vec::new();
    for c in calls {
        if !distinct.contains(&c.reference.as_str()) && distinct.len() < MAX_CALLS_PER_ROUND {
            distinct.push(&c.reference);
        }
    }
    let each = (room / distinct.len().max(1)).min(MAX_RECALL_BYTES);
    let mut first: Vec<(&str, &str)> = Vec::new();
    calls
        .iter()
        .map(|c| {
            let text = if let Some((_, id)) = first.iter().find(|(r, _)| *r == c.reference) {
                format!("same original as the {TOOL} call {id} of this answer")
            } else if !distinct.contains(&c.reference.as_str()) {
                format!(
                    "error: at most {MAX_CALLS_PER_ROUND} different references are recalled per answer; ask again for this one"
                )
            } else if each < MIN_ANSWER_BYTES {
                format!(
                    "error: the context window has no room left to recall {}; continue with what the marker says",
                    echoed(&c.reference)
                )
            } else {
                first.push((&c.reference, &c.id));
                answer(&c.reference, originals, hashes, each)
            };
            (c.id.clone(), text)
        })
        .collect()
}

/// A client-chosen reference as a tool error quotes it: at most
/// [`MAX_ECHOED_REF`] characters.
fn echoed(reference: &str) -> String {
    let cut: String = reference.chars().take(MAX_ECHOED_REF).collect();
    if cut.len() < reference.len() {
        format!("{cut:?}…")
    } else {
        format!("{cut:?}")
    }
}

/// The text of a tool output (every `tool_result` of an Anthropic message,
/// every `functionResponse` of a Gemini content).
fn output_text(item: &Value) -> String {
    if crate::wire::messages::is_tool_result_message(item)
        || crate::wire::gemini::is_function_response(item)
    {
        return super::items::text_of(item);
    }
    item.get(output_field(item))
        .map(value_text)
        .unwrap_or_default()
}

/// The client's tool definitions with the recall tool added at the end.
pub fn with_tool(api: Api, tools: &Value) -> Value {
    let mut list = tools.as_array().cloned().unwrap_or_default();
    list.push(definition(api));
    Value::Array(list)
}

/// A call of the recall tool.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The call's id (Chat `id`, Responses `call_id`).
    pub id: String,
    /// The reference asked for (empty when the arguments name none).
    pub reference: String,
}

/// What an answer asks of the proxy.
#[derive(Debug, Clone, PartialEq)]
pub enum Round {
    /// No recall call: the answer goes to the client.
    Final,
    /// Only recall calls: the proxy answers them and continues.
    Recall(Vec<Call>),
    /// Recall calls beside the client's own tool calls: the request is sent
    /// again without the recall tool (the client never sees a call it
    /// cannot answer, nor loses one of its own).
    Mixed,
    /// Calls of `compactor_compact` (with recall calls, maybe) and none of
    /// the client's: the proxy answers them all and continues.
    Compact(Vec<Call>, Vec<super::agent_tool::Call>),
}

/// What a complete answer asks of the proxy.
pub fn round(api: Api, answer: &Value) -> Round {
    round_of(api, answer, true, false)
}

/// What a complete answer asks of the proxy, given which of its tools the
/// request was offered: a call of a tool the proxy did not offer is the
/// client's (its own tool of that name).
pub fn round_of(api: Api, answer: &Value, recall: bool, compact: bool) -> Round {
    let calls = api.format().tool_calls(answer);
    let compacts: Vec<super::agent_tool::Call> = calls
        .iter()
        .filter(|c| compact && c.name == super::agent_tool::TOOL)
        .map(|c| super::agent_tool::call(&c.id, &c.arguments))
        .collect();
    let recalls: Vec<Call> = calls
        .iter()
        .filter(|c| recall && c.name == TOOL)
        .map(|c| Call {
            id: c.id.clone(),
            reference: serde_json::from_str::<Value>(&c.arguments)
                .ok()
                .and_then(|a| a.get("ref").and_then(Value::as_str).map(String::from))
                .unwrap_or_default(),
        })
        .collect();
    if !compacts.is_empty() {
        return if recalls.len() + compacts.len() == calls.len() {
            Round::Compact(recalls, compacts)
        } else {
            Round::Mixed
        };
    }
    match (recalls.is_empty(), recalls.len() == calls.len()) {
        (true, _) => Round::Final,
        (false, true) => Round::Recall(recalls),
        (false, false) => Round::Mixed,
    }
}

/// Longest arguments of a recall call kept as the model wrote them in the
/// continued request; longer ones (a made-up reference of any length) are
/// cut, so a round cannot grow the request by what the model invents.
const MAX_KEPT_ARGUMENTS: usize = 200;

/// `arguments` of a recall call as the continued request repeats them.
fn kept_arguments(arguments: &mut Value) {
    let long = arguments
        .as_str()
        .is_some_and(|a| a.len() > MAX_KEPT_ARGUMENTS);
    if long {
        let cut: String = arguments
            .as_str()
            .unwrap_or_default()
            .chars()
            .take(MAX_KEPT_ARGUMENTS / 2)
            .collect();
        *arguments = Value::from(json!({ "ref": format!("{cut}…") }).to_string());
    }
}

/// The items to append to the request to continue after a recall round:
/// the answer's own output (recall calls' long arguments cut), then one
/// tool result per call.
pub fn continuation(api: Api, answer: &Value, results: &[(String, String)]) -> Vec<Value> {
    api.format()
        .continuation(answer, results, &mut |name, arguments| {
            if name == TOOL {
                kept_arguments(arguments);
            }
        })
}

/// The answer to a call of `reference`: the original tool output among
/// the request's own `originals` (with their hashes), at most `max` bytes
/// (and never more than [`MAX_RECALL_BYTES`]); a tool error when it names
/// none of them.
pub fn answer(reference: &str, originals: &[Value], hashes: &[ItemHash], max: usize) -> String {
    let found = originals
        .iter()
        .zip(hashes)
        .find(|(item, h)| is_tool_output(item) && archive_ref(h) == reference)
        .map(|(item, _)| output_text(item));
    match found {
        Some(text) => bounded(&text, max.min(MAX_RECALL_BYTES)),
        None => format!(
            "error: {TOOL} knows no archived output {} in this conversation; \
             use a reference exactly as a compactor marker shows it",
            echoed(reference)
        ),
    }
}

/// Room for the marker [`bounded`] puts between head and tail.
const CUT_MARKER_BYTES: usize = 80;

/// `text` cut to about `max` bytes: head and tail around a marker.
fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let keep = max.saturating_sub(CUT_MARKER_BYTES);
    let head = floor_boundary(text, keep * 2 / 3);
    let tail = super::items::ceil_boundary(text, text.len() - keep / 3);
    format!(
        "{}\n[compactor: {} bytes of the original left out here]\n{}",
        &text[..head],
        tail - head,
        &text[tail..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::item_hash;

    fn tool_output(text: &str) -> Value {
        json!({"role": "tool", "tool_call_id": "c1", "content": text})
    }

    #[test]
    fn answers_from_the_requests_own_items_bounded() {
        let log = format!("error[E0308]: mismatched types\n{}", "x".repeat(40_000));
        let items = vec![json!({"role": "user", "content": "hi"}), tool_output(&log)];
        let hashes: Vec<ItemHash> = items.iter().map(item_hash).collect();
        let reference = archive_ref(&hashes[1]);
        let got = answer(&reference, &items, &hashes, MAX_RECALL_BYTES);
        assert!(got.starts_with("error[E0308]") && got.len() <= MAX_RECALL_BYTES + 100);
        assert!(got.contains("bytes of the original left out"));
        let short = vec![tool_output("exit 1")];
        let h: Vec<ItemHash> = short.iter().map(item_hash).collect();
        assert_eq!(
            answer(&archive_ref(&h[0]), &short, &h, MAX_RECALL_BYTES),
            "exit 1"
        );
        // A user message's hash is no archived output; an unknown reference
        // is a tool error.
        assert!(
            answer(&archive_ref(&hashes[0]), &items, &hashes, MAX_RECALL_BYTES)
                .starts_with("error:")
        );
        assert!(
            answer("item:0000000000000000", &items, &hashes, MAX_RECALL_BYTES)
                .starts_with("error:")
        );
        // A made-up reference is not echoed back whole.
        let huge = "x".repeat(1 << 20);
        assert!(answer(&huge, &items, &hashes, MAX_RECALL_BYTES).len() < 300);
        // A smaller bound is kept.
        assert!(answer(&reference, &items, &hashes, 2_000).len() <= 2_000);
    }

    #[test]
    fn rounds_tell_recall_from_the_clients_calls() {
        let call = |id: &str, name: &str| {
            json!({"id": id, "type": "function",
                   "function": {"name": name, "arguments": "{\"ref\":\"item:0123456789abcdef\"}"}})
        };
        let chat = |calls: Vec<Value>| json!({"choices": [{"message": {"role": "assistant", "tool_calls": calls}}]});
        assert_eq!(
            round(
                Api::Chat,
                &json!({"choices": [{"message": {"content": "hi"}}]})
            ),
            Round::Final
        );
        assert_eq!(
            round(Api::Chat, &chat(vec![call("a", TOOL)])),
            Round::Recall(vec![Call {
                id: "a".into(),
                reference: "item:0123456789abcdef".into()
            }])
        );
        assert_eq!(
            round(Api::Chat, &chat(vec![call("a", TOOL), call("b", "shell")])),
            Round::Mixed
        );
        assert_eq!(
            round(Api::Chat, &chat(vec![call("b", "shell")])),
            Round::Final
        );
        let resp = json!({"output": [{"type": "function_call", "call_id": "r", "name": TOOL, "arguments": "{}"}]});
        assert_eq!(
            round(Api::Responses, &resp),
            Round::Recall(vec![Call {
                id: "r".into(),
                reference: String::new()
            }])
        );
        let cont = continuation(Api::Responses, &resp, &[("r".into(), "text".into())]);
        assert_eq!(
            cont[1],
            json!({"type": "function_call_output", "call_id": "r", "output": "text"})
        );
        let cont = continuation(
            Api::Chat,
            &chat(vec![call("a", TOOL)]),
            &[("a".into(), "t".into())],
        );
        assert_eq!(
            (cont[0]["role"].as_str(), cont[1]["tool_call_id"].as_str()),
            (Some("assistant"), Some("a"))
        );
    }

    #[test]
    fn offered_only_to_requests_with_tools() {
        let tools = json!([{"type": "function", "function": {"name": "shell"}}]);
        let body = json!({"model": "m"});
        assert!(may_offer(&body, Some(&tools)));
        assert!(!may_offer(&body, None));
        assert!(!may_offer(&body, Some(&json!([]))));
        assert!(!may_offer(&json!({"tool_choice": "none"}), Some(&tools)));
        assert!(!may_offer(
            &json!({"previous_response_id": "resp_1"}),
            Some(&tools)
        ));
        let own = json!([{"type": "function", "function": {"name": TOOL}}]);
        assert!(!may_offer(&body, Some(&own)));
        let once = with_tool(Api::Chat, &tools);
        assert_eq!(once.as_array().unwrap().len(), 2);
        assert_eq!(
            serde_json::to_vec(&once).unwrap(),
            serde_json::to_vec(&with_tool(Api::Chat, &tools)).unwrap(),
            "the same bytes every time"
        );
    }
}
