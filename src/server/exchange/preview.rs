//! What a conversation's preview reads of its items: the user's own words,
//! not the tags harnesses wrap around them.

use super::pending::PendingExchange;
use crate::app::AppState;
use crate::compaction::items;
use crate::store::{bounded_text, MAX_PREVIEW_CHARS};

/// Items looked through for a conversation's first user message.
const PREVIEW_SCAN: usize = 32;

impl PendingExchange {
    /// The person's first message, redacted and cut short, to tell the
    /// conversation it opens from others. Context a client wraps in tags
    /// (Codex's `<environment_context>…`, Claude Code's
    /// `<system-reminder>…` blocks before or after the person's words) is
    /// not theirs; nor are the turns a client writes before the first
    /// request of a conversation reaches any model (aider's few-shot
    /// examples): when the request already holds answers, the person's
    /// message is the one after the last of them.
    pub(super) fn preview(&self, state: &AppState) -> Option<String> {
        let items = self.request.items();
        let n = items.len();
        let shown = |text: &str| {
            // Cut before redacting (a pasted file may be long), and again
            // after: a credential cut in two at the first cut is gone by
            // the second.
            let cut = bounded_text(text, 4 * MAX_PREVIEW_CHARS);
            bounded_text(
                &state.upstream.redact(&cut, self.request.auth()),
                MAX_PREVIEW_CHARS,
            )
        };
        // The user messages after the last answer, looked for in the tail.
        // What an item is is read from its role and type: only a user's
        // message is built (a tool's output or a system prompt is
        // kilobytes of text the preview never shows).
        let mut after_answers = Vec::new();
        for i in (n.saturating_sub(PREVIEW_SCAN)..n).rev() {
            let (role, kind) = items.role_and_type(i);
            if is_answer(&role, &kind) {
                after_answers.reverse();
                let own = after_answers.iter().find_map(|t: &String| own_text(t));
                if let Some(own) = own {
                    return Some(shown(own));
                }
                break;
            }
            if role != "user" {
                continue;
            }
            let item = items.item(i);
            if items::is_user_message(&item) {
                after_answers.push(items::text_of(&item));
            }
        }
        let mut first: Option<String> = None;
        for i in 0..n.min(PREVIEW_SCAN) {
            if items.role_and_type(i).0 != "user" {
                continue;
            }
            let item = items.item(i);
            if !items::is_user_message(&item) {
                continue;
            }
            let text = items::text_of(&item);
            if let Some(own) = own_text(&text) {
                return Some(shown(own));
            }
            if !text.trim().is_empty() {
                first.get_or_insert_with(|| shown(text.trim()));
            }
        }
        first
    }
}

/// An answer a request carries, by the item's role and type: an
/// assistant message (a Gemini `model` content) or one of its calls.
pub(super) fn is_answer(role: &str, kind: &str) -> bool {
    matches!(role, "assistant" | "model") || kind.ends_with("_call") || kind == "reasoning"
}

/// A message's text without the tagged context blocks a client puts before
/// or after the person's words (`<system-reminder>…</system-reminder>`);
/// none when nothing else is left.
pub(super) fn own_text(text: &str) -> Option<&str> {
    let mut rest = text.trim();
    loop {
        let before = rest;
        if let Some(after) = leading_block(rest) {
            rest = after.trim_start();
        }
        if let Some(before_it) = trailing_block(rest) {
            rest = before_it.trim_end();
        }
        if rest == before {
            break;
        }
    }
    (!rest.is_empty()).then_some(rest)
}

/// A name a client's context tag may have (`system-reminder`, `cwd`).
pub(super) fn is_tag_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// The text after a `<name …>…</name>` block it opens with.
pub(super) fn leading_block(text: &str) -> Option<&str> {
    let open = text.strip_prefix('<')?;
    let name_len = open
        .find(|c: char| c.is_whitespace() || c == '>' || c == '/')
        .unwrap_or(open.len());
    let name = &open[..name_len];
    if !is_tag_name(name) {
        return None;
    }
    let close = format!("</{name}>");
    let end = text.find(&close)? + close.len();
    Some(&text[end..])
}

/// The text before a `<name …>…</name>` block it ends with.
pub(super) fn trailing_block(text: &str) -> Option<&str> {
    let body = text.strip_suffix('>')?;
    let slash = body.rfind("</")?;
    let name = &body[slash + 2..];
    if !is_tag_name(name) {
        return None;
    }
    let open = format!("<{name}");
    let start = text[..slash]
        .rmatch_indices(&open)
        .map(|(i, _)| i)
        .find(|&i| {
            text[i + open.len()..]
                .chars()
                .next()
                .is_some_and(|c| c == '>' || c.is_whitespace())
        })?;
    Some(&text[..start])
}

#[cfg(test)]
mod tests {
    use super::own_text;

    #[test]
    fn own_text_drops_the_tagged_context_around_the_persons_words() {
        assert_eq!(
            own_text("<environment_context>\n<cwd>/w</cwd>\n</environment_context>"),
            None
        );
        assert_eq!(
            own_text("<system-reminder>\nctx\n</system-reminder>\nFix it\n<system-reminder a=\"1\">x</system-reminder>"),
            Some("Fix it")
        );
        assert_eq!(own_text("  plain words "), Some("plain words"));
        assert_eq!(own_text("<b>bold</b> words"), Some("words"));
        assert_eq!(own_text("a < b and c > d"), Some("a < b and c > d"));
        assert_eq!(own_text("<unclosed> words"), Some("<unclosed> words"));
        assert_eq!(own_text("   "), None);
    }
}
