//! A client's own provider compaction: whether a request asks the provider
//! to compact (so the proxy's threshold trigger stays off for it), and
//! where the newest provider compaction item or block of a history lies —
//! the conversation's boundary.
//!
//! The provider no longer reads what came before the boundary (Anthropic
//! drops every block before a `compaction` block; OpenAI's `compaction`
//! item carries the state of everything before it). So the proxy counts
//! only from the boundary on, and never cuts, rewrites or summarizes at or
//! before it: the boundary and everything before it go upstream exactly as
//! the client sent them. The item's opaque content is never read.

use serde_json::Value;

use super::remote::parse_token;
use crate::wire::items::ItemList;
use crate::wire::Api;

/// The prefix of Anthropic's compaction edits (`compact_20260112`): every
/// other edit (`clear_thinking_*`, `clear_tool_uses_*`) trims the context
/// without summarizing it, and leaves compaction to the proxy.
const COMPACT_EDIT_PREFIX: &str = "compact_";

/// Whether a request body (its parameters: `context_management`, the
/// on-demand `compaction`) asks the provider to compact.
pub fn asks_provider_compaction(api: Api, body: &Value) -> bool {
    let kind = |v: &Value| v.get("type").and_then(Value::as_str).map(str::to_owned);
    match api {
        // `context_management: [{"type": "compaction", "compact_threshold": N}]`.
        Api::Responses => body
            .get("context_management")
            .and_then(Value::as_array)
            .is_some_and(|l| l.iter().any(|e| kind(e).as_deref() == Some("compaction"))),
        // `context_management.edits: [{"type": "compact_20260112", …}]`, or
        // the on-demand `compaction: {"type": "summarize"}`.
        Api::Messages => {
            let edits = body
                .pointer("/context_management/edits")
                .and_then(Value::as_array)
                .is_some_and(|l| {
                    l.iter()
                        .any(|e| kind(e).is_some_and(|k| k.starts_with(COMPACT_EDIT_PREFIX)))
                });
            edits || body.get("compaction").is_some_and(Value::is_object)
        }
        Api::Chat | Api::Gemini => false,
    }
}

/// Whether an item is the provider's compaction: a Responses `compaction`
/// item whose `encrypted_content` is not a token of the proxy's own, or an
/// Anthropic assistant message holding a `compaction` block.
pub fn is_provider_item(item: &Value) -> bool {
    match item.get("type").and_then(Value::as_str) {
        Some("compaction") => item
            .get("encrypted_content")
            .and_then(Value::as_str)
            .is_none_or(|t| parse_token(t).is_none()),
        _ => {
            item.get("role").and_then(Value::as_str) == Some("assistant")
                && item
                    .get("content")
                    .and_then(Value::as_array)
                    .is_some_and(|b| b.iter().any(is_compaction_block))
        }
    }
}

/// A Messages `compaction` content block.
pub fn is_compaction_block(block: &Value) -> bool {
    block.get("type").and_then(Value::as_str) == Some("compaction")
}

/// Index of the newest provider compaction item of `items`.
pub fn newest(items: &[Value]) -> Option<usize> {
    items.iter().rposition(is_provider_item)
}

/// The index just past the newest provider compaction item (0 without
/// one): nothing before it is rewritten.
pub fn floor(items: &[Value]) -> usize {
    newest(items).map_or(0, |i| i + 1)
}

/// [`floor`], moved on to the first safe cut (`safe`: the history's safe
/// cuts, `0..=len`): past the outputs of the calls the item's message holds
/// (an Anthropic block opens the answer that makes them), so a kept call
/// never loses its output to a summary.
pub fn safe_floor(items: &[Value], safe: &[bool]) -> usize {
    let f = floor(items);
    if f == 0 {
        return 0;
    }
    (f..=items.len())
        .find(|&i| safe.get(i).copied().unwrap_or(true))
        .unwrap_or(items.len())
}

/// [`newest`] for a list that may still be the client's bytes: a list none
/// of whose items names `"compaction"` is not parsed.
pub fn newest_in(list: &ItemList) -> Option<usize> {
    if list.is_empty() || !list.may_contain("\"compaction\"") {
        return None;
    }
    (0..list.len())
        .rev()
        .find(|&i| is_provider_item(&list.item(i)))
}

/// `tokens` with the items before the boundary counted as nothing: the
/// provider does not see them, so neither the fit check nor a compaction's
/// figures count them.
pub fn count_from_boundary(items: &[Value], tokens: &mut [u64]) {
    if let Some(b) = newest(items) {
        tokens[..b].iter_mut().for_each(|t| *t = 0);
    }
}

/// Tokens of `items` the provider reads: from the newest provider
/// compaction item on.
pub fn seen_tokens(items: &[Value], count: &dyn Fn(&Value) -> u64) -> u64 {
    let from = newest(items).unwrap_or(0);
    items[from..].iter().map(count).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_compaction_requests_defer_to_the_provider() {
        let r = |cm: Value| json!({"model": "m", "context_management": cm});
        assert!(asks_provider_compaction(
            Api::Responses,
            &r(json!([{"type": "compaction", "compact_threshold": 1000}]))
        ));
        assert!(!asks_provider_compaction(Api::Responses, &r(json!([]))));
        assert!(!asks_provider_compaction(
            Api::Responses,
            &json!({"model": "m"})
        ));
        let m = |edits: Value| json!({"model": "m", "context_management": {"edits": edits}});
        assert!(asks_provider_compaction(
            Api::Messages,
            &m(
                json!([{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50000}}])
            )
        ));
        // What Claude Code sends on every turn trims, it does not compact.
        assert!(!asks_provider_compaction(
            Api::Messages,
            &m(json!([{"type": "clear_thinking_20251015", "keep": "all"},
                      {"type": "clear_tool_uses_20250919"}]))
        ));
        assert!(asks_provider_compaction(
            Api::Messages,
            &json!({"model": "m", "compaction": {"type": "summarize"}})
        ));
        assert!(!asks_provider_compaction(
            Api::Chat,
            &r(json!([{"type": "compaction"}]))
        ));
    }

    #[test]
    fn the_newest_provider_item_is_the_boundary() {
        let ours = json!({"type": "compaction", "encrypted_content": "compactor.v1.f.cmp_1"});
        let theirs =
            json!({"type": "compaction", "id": "cmp_x", "encrypted_content": "gAAAAB-opaque"});
        let block = json!({"role": "assistant", "content": [
            {"type": "compaction", "content": "summary"}, {"type": "text", "text": "ok"}]});
        let user = json!({"role": "user", "content": "hi"});
        assert!(!is_provider_item(&ours));
        // Content the proxy cannot read is the provider's, forwarded as is.
        assert!(is_provider_item(
            &json!({"type": "compaction", "encrypted_content": 7})
        ));
        assert!(is_provider_item(&json!({"type": "compaction"})));
        assert!(is_provider_item(&theirs));
        assert!(is_provider_item(&block));
        assert!(!is_provider_item(&user));
        let items = vec![
            user.clone(),
            theirs.clone(),
            user.clone(),
            block.clone(),
            user.clone(),
            ours,
        ];
        assert_eq!(newest(&items), Some(3));
        assert_eq!(floor(&items), 4);
        // A block opening a tool call: the floor is past its result.
        let calls = vec![
            user.clone(),
            json!({"role": "assistant", "content": [{"type": "compaction", "content": "s"},
                {"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]}),
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}),
            user.clone(),
        ];
        assert_eq!(floor(&calls), 2);
        assert_eq!(safe_floor(&calls, &[true, true, false, true, true]), 3);
        assert_eq!(safe_floor(&items[..1], &[true, true]), 0);
        assert_eq!(floor(&items[..1]), 0);
        let list = ItemList::from(items.clone());
        assert_eq!(newest_in(&list), Some(3));
        let mut tokens = vec![5; items.len()];
        count_from_boundary(&items, &mut tokens);
        assert_eq!(tokens, vec![0, 0, 0, 5, 5, 5]);
    }
}
