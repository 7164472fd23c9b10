//! A provider compaction item the provider no longer accepts: recognising
//! its refusal, and rebuilding from the record what the item stood for.
//!
//! OpenAI's encrypted `compaction` items can stop being readable (a key
//! rotated, an item expired or was minted for another account): the
//! Responses API then refuses every request carrying one with a 400 whose
//! `error.code` is `invalid_encrypted_content` ("The encrypted content …
//! could not be verified."). A client sending its history back as it holds
//! it would be refused for good. The item stood for the input of the
//! exchange whose answer carried it, and the record keeps that input: the
//! proxy puts it back in the item's place (expanding an older provider item
//! in it the same way), compacts the result locally, and sends again.
//!
//! Anthropic's `compaction` block carries its summary as plain text, which
//! the API reads back as it is; no refusal of a block is documented, so
//! Messages requests are never rebuilt.

use serde_json::Value;

use super::boundary;
use super::computed::{Compaction, Rung};
use crate::wire::{Api, ItemHash};

/// The head of the reason of a compaction computed over a rebuilt history.
pub const REBUILD_REASON: &str = "rebuild";

/// The `error.code` OpenAI answers an encrypted item it cannot read with.
pub const INVALID_ENCRYPTED_CONTENT: &str = "invalid_encrypted_content";

/// How deep provider items inside recorded histories are expanded: each
/// level is an older compaction of the same conversation.
const MAX_DEPTH: usize = 32;

/// Whether an error answer (`status`, `body`) to a request of `api` is the
/// provider refusing encrypted content it can no longer read.
pub fn refuses_encrypted_item(api: Api, status: u16, body: &[u8]) -> bool {
    if api != Api::Responses || status != 400 {
        return false;
    }
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let Some(error) = v.get("error") else {
        return false;
    };
    if error.get("code").and_then(Value::as_str) == Some(INVALID_ENCRYPTED_CONTENT) {
        return true;
    }
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_ascii_lowercase();
    message.contains("encrypted content")
        && (message.contains("could not be verified") || message.contains("could not be decrypted"))
}

/// Whether the data of a Responses stream's failure event (`response.failed`,
/// its error under `response.error`; `error`, its fields at the top level
/// or under `error`), seen before any output, is that same refusal.
pub fn stream_refuses_encrypted_item(data: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(data) else {
        return false;
    };
    let error = v
        .pointer("/response/error")
        .filter(|e| e.is_object())
        .or_else(|| v.get("error").filter(|e| e.is_object()))
        .unwrap_or(&v);
    let Ok(body) = serde_json::to_vec(&serde_json::json!({ "error": error })) else {
        return false;
    };
    refuses_encrypted_item(Api::Responses, 400, &body)
}

/// What replaces the client's items up to its newest provider compaction
/// item: `(covered_len, history)`, the items it covers (the item and all
/// before it) and the history the item stood for, with no provider item
/// left in it. `history_of(item)` gives the recorded input of the exchange
/// whose answer carried `item` (`None`: not recorded). `None` when `items`
/// holds no provider item, or some item on the way is not in the record.
pub fn rebuild(
    items: &[Value],
    history_of: &mut dyn FnMut(&Value) -> Option<Vec<Value>>,
) -> Option<(usize, Vec<Value>)> {
    let k = boundary::newest(items)?;
    let history = expand(history_of(&items[k])?, history_of, 1)?;
    Some((k + 1, history))
}

/// The history a rebuild found, as the compaction a request's view starts
/// from: it replaces the client's first `covered_len` items (through the
/// refused item, chain hash `covered_chain`) with `history`. Applied for
/// the one request, never stored: the local compaction computed over it
/// extends it, as one extends a stored compaction.
pub fn standing_for(
    tenant: &str,
    conversation: &str,
    covered_len: usize,
    covered_chain: ItemHash,
    history: Vec<Value>,
) -> Compaction {
    Compaction {
        items_kept: history.len(),
        ..Compaction::made_now(
            tenant,
            conversation,
            (covered_len, covered_chain),
            history,
            // What the record holds, put back as it was: nothing shortened.
            Rung::Truncate,
            format!("{REBUILD_REASON}: what the provider's compaction item stood for"),
        )
    }
}

/// `items` with its newest provider item replaced by what it stood for
/// (and what precedes it dropped: that history holds it), recursively.
fn expand(
    items: Vec<Value>,
    history_of: &mut dyn FnMut(&Value) -> Option<Vec<Value>>,
    depth: usize,
) -> Option<Vec<Value>> {
    let Some(k) = boundary::newest(&items) else {
        return Some(items);
    };
    if depth >= MAX_DEPTH {
        return None;
    }
    let mut out = expand(history_of(&items[k])?, history_of, depth + 1)?;
    out.extend(items.into_iter().skip(k + 1));
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn user(t: &str) -> Value {
        json!({"type": "message", "role": "user", "content": t})
    }

    fn item(n: u32) -> Value {
        json!({"type": "compaction", "id": format!("cmp_{n}"), "encrypted_content": format!("gAAAAB{n}")})
    }

    #[test]
    fn the_documented_refusal_is_recognised() {
        let real =
            br#"{"error": {"message": "The encrypted content gAAA...DQ== could not be verified.",
            "type": "invalid_request_error", "param": null, "code": "invalid_encrypted_content"}}"#;
        assert!(refuses_encrypted_item(Api::Responses, 400, real));
        let no_code = br#"{"error": {"message": "The encrypted content for item cmp_1 could not be verified. Reason: Encrypted content could not be decrypted or parsed.", "type": "invalid_request_error"}}"#;
        assert!(refuses_encrypted_item(Api::Responses, 400, no_code));
        // Other refusals, other statuses, other APIs: not this one.
        let other = br#"{"error": {"message": "Invalid value", "code": "invalid_value"}}"#;
        assert!(!refuses_encrypted_item(Api::Responses, 400, other));
        assert!(!refuses_encrypted_item(Api::Responses, 500, real));
        assert!(!refuses_encrypted_item(Api::Messages, 400, real));
        assert!(!refuses_encrypted_item(Api::Responses, 400, b"not json"));
        // The same refusal as a stream's failure event.
        let failed = br#"{"type": "response.failed", "sequence_number": 2, "response": {"status": "failed",
            "error": {"code": "invalid_encrypted_content", "message": "The encrypted content could not be verified."}}}"#;
        assert!(stream_refuses_encrypted_item(failed));
        let event = br#"{"type": "error", "code": "invalid_encrypted_content", "message": "x", "param": null}"#;
        assert!(stream_refuses_encrypted_item(event));
        let too_long = br#"{"type": "response.failed", "response": {"error": {"code": "context_length_exceeded", "message": "too long"}}}"#;
        assert!(!stream_refuses_encrypted_item(too_long));
    }

    #[test]
    fn an_item_is_replaced_by_what_it_stood_for_older_ones_too() {
        // Exchange 1 answered with item 1 over [u1, a1]; exchange 2, sent
        // [u1, a1, item1, u2] (or only [item1, u2]), answered with item 2.
        let first = vec![user("u1"), user("a1")];
        let second = vec![item(1), user("u2")];
        let mut history_of = |i: &Value| match i["id"].as_str() {
            Some("cmp_1") => Some(first.clone()),
            Some("cmp_2") => Some(second.clone()),
            _ => None,
        };
        let items = vec![user("dropped"), item(2), user("a2"), user("u3")];
        let (covered, history) = rebuild(&items, &mut history_of).unwrap();
        assert_eq!(covered, 2);
        assert_eq!(history, vec![user("u1"), user("a1"), user("u2")]);
        // An item the record does not hold: nothing to rebuild from.
        assert!(rebuild(&[item(3), user("u")], &mut history_of).is_none());
        let mut partial = |i: &Value| (i["id"] == "cmp_2").then(|| second.clone());
        assert!(rebuild(&items, &mut partial).is_none());
        // Without a provider item there is nothing to rebuild.
        assert!(rebuild(&[user("u")], &mut history_of).is_none());
        // A record that loops is given up, not followed for ever.
        let mut looping = |_: &Value| Some(vec![item(9)]);
        assert!(rebuild(&[item(9)], &mut looping).is_none());
    }
}
