//! The summary rung delegated to the provider, the pure half: what a
//! provider's compaction answer must hold to be used, what part of the
//! history may be sent for it, and where its output and the proxy's own
//! facts go in the replacement.
//!
//! - Responses (`POST /responses/compact`): the answer's `output` is a
//!   compacted window (the user messages it kept, then an opaque
//!   `compaction` item); it goes in as it came, in the summary's place,
//!   with no selection of recent user messages on top.
//! - Messages (on-demand compaction, `compaction: {"type": "summarize"}`):
//!   the answer is one `compaction` block; the message holding it goes
//!   first, before everything kept.
//!
//! The facts the proxy extracts itself go as a text part appended to the
//! newest user message of the compacted request, not in a message of their
//! own before the kept turns: the kept turns then keep the very prefix the
//! provider's compaction stands for, and a thinking block in them stays
//! bound to what it was signed against. The replacement therefore runs up
//! to and including that message.

use serde_json::{json, Value};

use super::items;
use crate::wire::{messages, Api};

/// The beta of Messages on-demand compaction: the compaction request and
/// every later request carrying its block send it.
pub const COMPACT_BETA: &str = "compact-2026-09-04";

/// What a reason of a compaction summarized by the provider ends with.
pub const PROVIDER_REASON: &str = "summary by the provider";

/// Why a provider's answer is no compaction the proxy can use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a compaction: {0}")]
pub struct Invalid(pub &'static str);

fn kind(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("")
}

/// A Responses `compaction` item: its opaque content a string.
pub fn is_compaction_item(item: &Value) -> bool {
    kind(item) == "compaction"
        && item
            .get("encrypted_content")
            .is_some_and(|c| c.as_str().is_some_and(|s| !s.is_empty()))
}

/// A Messages `compaction` block.
pub fn is_compaction_block(block: &Value) -> bool {
    kind(block) == "compaction"
}

/// Whether a Messages request's items carry a `compaction` block (the
/// request then needs [`COMPACT_BETA`]).
pub fn carries_block(items: &[Value]) -> bool {
    items
        .iter()
        .any(|m| messages::blocks(m).iter().any(is_compaction_block))
}

/// Adds [`COMPACT_BETA`] to the headers' `anthropic-beta` list (once).
pub fn add_beta(headers: &mut http::HeaderMap) {
    messages::add_beta(headers, COMPACT_BETA);
}

/// Whether a replacement made of a Messages window keeps thinking blocks
/// in its kept turns: each stays valid only if all before it is what it was
/// signed against (an earlier compaction, or a tool the proxy added, may
/// have changed that), so the request lets the API drop a block that no
/// longer matches rather than refuse it.
pub fn keeps_thinking(replacement: &[Value]) -> bool {
    carries_block(replacement) && replacement.iter().any(messages::has_thinking)
}

/// The compacted window of a `/responses/compact` answer: its `output`, as
/// it came. It must hold a `compaction` item, and nothing but that and
/// messages.
pub fn responses_window(answer: &Value) -> Result<Vec<Value>, Invalid> {
    let output = answer
        .get("output")
        .and_then(Value::as_array)
        .ok_or(Invalid("no output list"))?;
    if !output.iter().any(is_compaction_item) {
        return Err(Invalid("no compaction item in the output"));
    }
    let other = output
        .iter()
        .any(|i| !(is_compaction_item(i) || kind(i) == "message" || kind(i).is_empty()));
    if other {
        return Err(Invalid(
            "an output item that is neither a message nor a compaction",
        ));
    }
    Ok(output.clone())
}

/// The message a Messages on-demand compaction answer stands for: one
/// assistant message holding its one `compaction` block, as it came.
pub fn messages_window(answer: &Value) -> Result<Vec<Value>, Invalid> {
    if answer.get("stop_reason").and_then(Value::as_str) != Some("compaction") {
        return Err(Invalid("stop_reason is not \"compaction\""));
    }
    let content = answer
        .get("content")
        .and_then(Value::as_array)
        .ok_or(Invalid("no content list"))?;
    match content.as_slice() {
        [block] if is_compaction_block(block) => {
            Ok(vec![json!({"role": "assistant", "content": [block]})])
        }
        _ => Err(Invalid("the content is not one compaction block")),
    }
}

/// How much of `part` a Messages on-demand compaction may be asked for:
/// the API refuses a history ending in a tool call not yet answered, so
/// the part stops before the last assistant message whose calls it does
/// not answer.
pub fn closed_len(part: &[Value]) -> usize {
    let mut end = part.len();
    while end > 0 {
        let open = part[..end].iter().enumerate().any(|(i, m)| {
            let ids = messages::tool_use_ids(m);
            !ids.is_empty()
                && !part[i + 1..end].iter().any(|r| {
                    messages::tool_results(r)
                        .filter_map(|b| b.get("tool_use_id").and_then(Value::as_str))
                        .any(|id| ids.contains(&id))
                })
        });
        if !open {
            break;
        }
        end -= 1;
    }
    end
}

/// The newest user message of a request's items, in the sense the facts
/// need: on Messages every user-role message (a tool result too: it is the
/// request's last one, after every signed block); elsewhere a real user
/// message.
fn newest_user(api: Api, items: &[Value]) -> Option<usize> {
    match api {
        Api::Messages => items
            .iter()
            .rposition(|m| m.get("role").and_then(Value::as_str) == Some("user")),
        _ => items::latest_user(items),
    }
}

/// `message` with `text` appended as its last content part.
pub fn with_text_part(api: Api, message: &Value, text: &str) -> Value {
    let part_type = match api {
        Api::Messages => "text",
        _ => "input_text",
    };
    let part = json!({"type": part_type, "text": text});
    let mut out = message.clone();
    let parts = match message.get("content") {
        Some(Value::String(s)) => vec![json!({"type": part_type, "text": s}), part],
        Some(Value::Array(list)) => {
            let mut list = list.clone();
            list.push(part);
            list
        }
        _ => vec![part],
    };
    out["content"] = Value::Array(parts);
    out
}

/// A user message of its own holding `text`.
fn facts_message(api: Api, text: &str) -> Value {
    match api {
        Api::Messages => json!({"role": "user", "content": [{"type": "text", "text": text}]}),
        _ => json!({"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": text}]}),
    }
}

/// A replacement made of a provider's compacted window.
#[derive(Debug, Clone, PartialEq)]
pub struct Placed {
    /// What is sent in place of `view[..view_end]`.
    pub replacement: Vec<Value>,
    /// How much of the view it replaces.
    pub view_end: usize,
    /// Items of the view it carries verbatim (leading ones and kept turns).
    pub kept: usize,
}

/// What [`place`] starts from.
pub struct Window<'a> {
    /// The wire format.
    pub api: Api,
    /// The request's items as they would go upstream.
    pub view: &'a [Value],
    /// Leading system items, kept verbatim first.
    pub lead: usize,
    /// `view[lead..sent]` is what the provider compacted.
    pub sent: usize,
    /// Where the compacted part ended before [`closed_len`] shortened it:
    /// `view[sent..cut]` is kept verbatim after the window.
    pub cut: usize,
    /// The tail (`view[cut..]`) when its tool outputs were truncated: it
    /// then belongs to the replacement whole.
    pub truncated_tail: Option<Vec<Value>>,
    /// The provider's window ([`responses_window`], [`messages_window`]).
    pub window: Vec<Value>,
    /// The proxy's facts, as the text the local summary would carry.
    pub facts: &'a str,
}

/// The replacement: the leading items, the provider's window as it came,
/// the kept turns verbatim up to the newest user message, and that
/// message with the facts appended. With no user message after the window,
/// the facts go to the newest user message the window itself kept (a
/// Responses window keeps the user's messages), or, when it kept none, in a
/// user message of their own right after it.
pub fn place(w: Window<'_>) -> Placed {
    let Window {
        api,
        view,
        lead,
        sent,
        cut,
        truncated_tail,
        window,
        facts,
    } = w;
    let mut replacement: Vec<Value> = view[..lead].to_vec();
    replacement.extend(window);
    let window_end = replacement.len();
    let tail: Vec<Value> = match &truncated_tail {
        Some(t) => view[sent..cut]
            .iter()
            .cloned()
            .chain(t.iter().cloned())
            .collect(),
        None => view[sent..].to_vec(),
    };
    // With the tail truncated, all of it is the replacement's.
    let upto = match (&truncated_tail, newest_user(api, &tail)) {
        (Some(_), _) => tail.len(),
        (None, Some(k)) => k + 1,
        (None, None) => cut - sent,
    };
    let newest = newest_user(api, &tail[..upto]);
    replacement.extend(tail[..upto].iter().cloned());
    match newest {
        Some(k) => {
            let at = window_end + k;
            replacement[at] = with_text_part(api, &replacement[at], facts);
        }
        None => {
            let in_window = (api != Api::Messages)
                .then(|| newest_user(api, &replacement[lead..window_end]))
                .flatten();
            match in_window {
                Some(k) => {
                    let at = lead + k;
                    replacement[at] = with_text_part(api, &replacement[at], facts);
                }
                None => replacement.insert(window_end, facts_message(api, facts)),
            }
        }
    }
    Placed {
        kept: lead + upto,
        view_end: sent + upto,
        replacement,
    }
}

/// Whether a stored compaction's replacement came from the provider (its
/// reason says so).
pub fn by_provider(reason: &str) -> bool {
    reason.ends_with(PROVIDER_REASON)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(t: &str) -> Value {
        json!({"role": "user", "content": t})
    }
    fn said(t: &str) -> Value {
        json!({"role": "assistant", "content": [{"type": "thinking", "thinking": t, "signature": "s"}, {"type": "text", "text": t}]})
    }

    #[test]
    fn a_messages_window_goes_first_and_the_facts_into_the_newest_user_message() {
        let view = vec![
            user("task"),
            said("a"),
            user("more"),
            said("b"),
            user("newest"),
        ];
        let window = messages_window(&json!({"stop_reason": "compaction",
            "content": [{"type": "compaction", "content": "summary", "signature": "x"}]}))
        .unwrap();
        let placed = place(Window {
            api: Api::Messages,
            view: &view,
            lead: 0,
            sent: 2,
            cut: 2,
            truncated_tail: None,
            window: window.clone(),
            facts: "FACTS",
        });
        assert_eq!(placed.view_end, 5, "up to the newest user message");
        assert_eq!(
            placed.replacement[0], window[0],
            "the block first, as it came"
        );
        assert_eq!(
            placed.replacement[1..3],
            view[2..4],
            "kept turns verbatim, thinking too"
        );
        assert_eq!(
            placed.replacement[3]["content"],
            json!([{"type": "text", "text": "newest"}, {"type": "text", "text": "FACTS"}])
        );
        assert_eq!(placed.kept, 3);
    }

    #[test]
    fn a_responses_window_keeps_its_user_messages_and_takes_the_facts_when_nothing_follows() {
        let view = vec![
            json!({"type": "message", "role": "developer", "content": "rules"}),
            json!({"type": "message", "role": "user", "content": "task"}),
            json!({"type": "function_call", "call_id": "c", "name": "sh", "arguments": "{}"}),
            json!({"type": "function_call_output", "call_id": "c", "output": "ok"}),
        ];
        let answer = json!({"output": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "task"}]},
            {"type": "compaction", "id": "cmp_1", "encrypted_content": "opaque"}]});
        let window = responses_window(&answer).unwrap();
        let placed = place(Window {
            api: Api::Responses,
            view: &view,
            lead: 1,
            sent: 4,
            cut: 4,
            truncated_tail: None,
            window,
            facts: "FACTS",
        });
        assert_eq!(placed.view_end, 4);
        assert_eq!(placed.replacement[0], view[0]);
        assert_eq!(
            placed.replacement[1]["content"][1],
            json!({"type": "input_text", "text": "FACTS"})
        );
        assert_eq!(
            placed.replacement[2], answer["output"][1],
            "the item untouched"
        );
        assert_eq!(placed.replacement.len(), 3, "no recent user messages added");
    }

    #[test]
    fn answers_that_are_no_compaction_are_refused() {
        assert!(responses_window(&json!({"output": []})).is_err());
        assert!(responses_window(
            &json!({"output": [{"type": "compaction", "encrypted_content": ""}]})
        )
        .is_err());
        assert!(responses_window(&json!({"choices": []})).is_err());
        assert!(
            responses_window(&json!({"output": [{"type": "reasoning"}, {"type": "compaction", "encrypted_content": "x"}]}))
                .is_err()
        );
        assert!(messages_window(
            &json!({"stop_reason": "end_turn", "content": [{"type": "text", "text": "hi"}]})
        )
        .is_err());
        assert!(messages_window(&json!({"stop_reason": "compaction", "content": []})).is_err());
    }

    #[test]
    fn the_part_sent_stops_before_an_open_tool_call() {
        let call = json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]});
        let result = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]});
        let part = vec![user("a"), call.clone(), result.clone()];
        assert_eq!(closed_len(&part), 3);
        let open = vec![user("a"), call.clone()];
        assert_eq!(closed_len(&open), 1);
    }

    #[test]
    fn with_no_user_message_left_the_facts_get_their_own() {
        let view = vec![user("a"), said("b"), user("c")];
        let window =
            vec![json!({"role": "assistant", "content": [{"type": "compaction", "content": "s"}]})];
        let placed = place(Window {
            api: Api::Messages,
            view: &view,
            lead: 0,
            sent: 3,
            cut: 3,
            truncated_tail: None,
            window,
            facts: "FACTS",
        });
        assert_eq!(placed.replacement.len(), 2);
        assert_eq!(placed.replacement[1]["role"], "user");
        assert_eq!(placed.view_end, 3);
    }
}
