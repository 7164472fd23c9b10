//! Compaction the model asks for: the `compactor_compact` tool the proxy
//! offers beside the client's own tools (when `compaction.agent_tool` is
//! on), the calls of it in an answer, the answers the proxy gives them, and
//! the section the model's notes become in the summary.
//!
//! A call schedules; it never compacts the request that made it. The proxy
//! answers the call itself, the model carries on within the same request,
//! and the compaction is computed in the background and applied at the
//! conversation's next turn boundary (a new user message), so a tool loop
//! is never cut short by the model's own request. One call per turn is
//! honoured; another in the same turn is told it is already scheduled.

use serde_json::{json, Value};

use super::items::floor_boundary;
use crate::wire::format::may_add_tool;
#[cfg(test)]
use crate::wire::format::tool_name;
use crate::wire::Api;

/// The tool's name.
pub const TOOL: &str = "compactor_compact";

/// Longest `reason` kept in the compaction's reason, bytes.
pub const MAX_REASON_BYTES: usize = 200;

/// Longest `keep` notes carried into the summary, bytes: the notes go in
/// verbatim, so a model that writes pages cannot grow the summary by them.
pub const MAX_KEEP_BYTES: usize = 4 * 1024;

/// Heading of the summary section that holds the model's notes.
pub const KEEP_HEADING: &str = "## NOTES THE AGENT ASKED TO KEEP";

const DESCRIPTION: &str = "Asks compactor to compact this conversation's history at the next \
     turn boundary (after the current task step, when the user speaks next): older items are \
     replaced by a structured summary, freeing context. Call it when the context is filling up \
     with material no longer needed. Pass `reason`; pass `keep` with your own notes of what must \
     survive (they are kept verbatim in the summary). The call returns at once; carry on.";

/// The answer to the call that schedules the compaction.
pub const SCHEDULED: &str =
    "scheduled: the conversation will be compacted at the next turn boundary";

/// The answer to any further call in the same turn.
pub const ALREADY_SCHEDULED: &str =
    "already scheduled for this turn: the conversation will be compacted at the next turn boundary; no second compaction is scheduled";

/// The tool's definition in `api`'s shape: the same bytes in every request.
pub fn definition(api: Api) -> Value {
    let parameters = json!({
        "type": "object",
        "properties": {
            "reason": {"type": "string", "description": "why the history should be compacted now"},
            "keep": {"type": "string", "description": "your notes of what matters and must survive the compaction"},
        },
        "required": ["reason"],
        "additionalProperties": false,
    });
    api.format().tool(TOOL, DESCRIPTION, parameters)
}

/// Whether the tool may be added to a request: it has tools of its own,
/// none of them named [`TOOL`] (the client's own tool of that name wins,
/// and its calls go to the client), does not forbid calling them, asks for
/// one choice (a call in another choice could not be answered), and
/// continues no upstream-stored response (a continuation would have to
/// name the hidden round).
pub fn offers(body: &Value, tools: Option<&Value>) -> bool {
    may_add_tool(body, tools, TOOL)
}

/// The client's tool definitions with the proxy's [`added`] at the end.
pub fn with_tools(api: Api, tools: &Value, compact: bool, recall: Option<Value>) -> Value {
    let mut list = tools.as_array().cloned().unwrap_or_default();
    list.extend(added(api, compact, recall));
    Value::Array(list)
}

/// The tools the proxy adds after the client's, in their order:
/// `compactor_compact` first (offered on every request of the
/// conversation, so its place never moves), then `recall` when offered.
pub fn added(api: Api, compact: bool, recall: Option<Value>) -> Vec<Value> {
    compact
        .then(|| definition(api))
        .into_iter()
        .chain(recall)
        .collect()
}

/// A call of the tool, its arguments read.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Call {
    /// The call's id (Chat `id`, Responses `call_id`, Messages `id`).
    pub id: String,
    /// Why, as the model said it (bounded by [`MAX_REASON_BYTES`]).
    pub reason: String,
    /// The model's notes of what to keep (bounded by [`MAX_KEEP_BYTES`]).
    pub keep: Option<String>,
}

/// `s` cut at a char boundary to at most `max` bytes.
fn bounded(s: &str, max: usize) -> String {
    s[..floor_boundary(s, max)].to_string()
}

/// A call read from its id and arguments (a JSON object as text, or
/// already parsed): what cannot be read is left empty, never refused — the
/// model is answered either way.
pub fn call(id: &str, arguments: &str) -> Call {
    let args: Value = serde_json::from_str(arguments).unwrap_or(Value::Null);
    let text = |k: &str| args.get(k).and_then(Value::as_str).map(str::trim);
    Call {
        id: id.to_string(),
        reason: bounded(text("reason").unwrap_or_default(), MAX_REASON_BYTES),
        keep: text("keep")
            .filter(|k| !k.is_empty())
            .map(|k| bounded(k, MAX_KEEP_BYTES)),
    }
}

/// The answers to one answer's calls: the first schedules (when
/// `scheduled_before` is false), every other is told it is already
/// scheduled for this turn.
pub fn answers(calls: &[Call], scheduled_before: bool) -> Vec<(String, String)> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let text = if i == 0 && !scheduled_before {
                SCHEDULED
            } else {
                ALREADY_SCHEDULED
            };
            (c.id.clone(), text.to_string())
        })
        .collect()
}

/// The notes of the calls that schedule, joined (each bounded; together
/// within [`MAX_KEEP_BYTES`]).
pub fn notes(calls: &[Call]) -> Option<String> {
    let joined = calls
        .iter()
        .filter_map(|c| c.keep.as_deref())
        .collect::<Vec<_>>()
        .join("\n\n");
    (!joined.is_empty()).then(|| bounded(&joined, MAX_KEEP_BYTES))
}

/// The summary section holding the model's notes, verbatim.
pub fn keep_section(notes: &str) -> String {
    format!(
        "{KEEP_HEADING}\nWritten by the model when it asked for this compaction, verbatim:\n{}",
        bounded(notes, MAX_KEEP_BYTES)
    )
}

/// The reason a scheduled compaction is stored with.
pub fn reason(calls: &[Call]) -> String {
    match calls
        .iter()
        .map(|c| c.reason.as_str())
        .find(|r| !r.is_empty())
    {
        Some(r) => format!("agent: {r}"),
        None => "agent: the model called compactor_compact".to_string(),
    }
}

/// The prefix chain that names the turn a request belongs to: the chain
/// hash through its latest real user message (a request of the same tool
/// loop has the same), or through its first item when it has none.
pub fn turn_of(items: &[Value], chains: &[crate::wire::ItemHash]) -> Option<crate::wire::ItemHash> {
    let at = super::items::latest_user(items).unwrap_or(0);
    chains.get(at).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn definitions_are_byte_stable_in_each_shape() {
        for api in [Api::Chat, Api::Responses, Api::Messages, Api::Gemini] {
            let a = serde_json::to_vec(&definition(api)).unwrap();
            let b = serde_json::to_vec(&definition(api)).unwrap();
            assert_eq!(a, b);
            assert_eq!(tool_name(&definition(api)), Some(TOOL));
        }
        assert!(definition(Api::Messages)["input_schema"].is_object());
        assert!(definition(Api::Chat)["function"]["parameters"].is_object());
    }

    #[test]
    fn offered_only_beside_the_clients_own_tools_and_never_over_its_own_of_that_name() {
        let tools = json!([{"type": "function", "function": {"name": "shell"}}]);
        let body = json!({"model": "m"});
        assert!(offers(&body, Some(&tools)));
        assert!(!offers(&body, None));
        assert!(!offers(&body, Some(&json!([]))));
        assert!(!offers(&json!({"n": 2}), Some(&tools)));
        assert!(!offers(&json!({"tool_choice": "none"}), Some(&tools)));
        assert!(!offers(&json!({"previous_response_id": "r"}), Some(&tools)));
        let own = json!([{"name": TOOL, "input_schema": {}}]);
        assert!(!offers(&body, Some(&own)));
        let listed = with_tools(Api::Chat, &tools, true, None);
        assert_eq!(listed.as_array().unwrap().len(), 2);
        assert_eq!(tool_name(&listed[1]), Some(TOOL));
    }

    #[test]
    fn arguments_are_read_bounded_and_the_second_call_is_told_so() {
        let c = call(
            "c1",
            &json!({"reason": "full", "keep": "the port is 8123"}).to_string(),
        );
        assert_eq!(
            (c.reason.as_str(), c.keep.as_deref()),
            ("full", Some("the port is 8123"))
        );
        let long = call(
            "c2",
            &json!({"keep": "é".repeat(MAX_KEEP_BYTES)}).to_string(),
        );
        assert!(long.keep.unwrap().len() <= MAX_KEEP_BYTES);
        let garbled = call("c3", "not json");
        assert_eq!(
            garbled,
            Call {
                id: "c3".into(),
                ..Call::default()
            }
        );
        let got = answers(&[c.clone(), garbled.clone()], false);
        assert_eq!(got[0].1, SCHEDULED);
        assert_eq!(got[1].1, ALREADY_SCHEDULED);
        assert_eq!(answers(&[c], true)[0].1, ALREADY_SCHEDULED);
        assert_eq!(
            reason(&[garbled]),
            "agent: the model called compactor_compact"
        );
    }
}
