//! What a conversation's preview reads of its items: the user's own words,
//! not the tags harnesses wrap around them.

use serde_json::Value;

/// An answer a request carries: an assistant message or one of its calls.
pub(super) fn is_answer(item: &Value) -> bool {
    item.get("role").and_then(Value::as_str) == Some("assistant")
        || item
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t.ends_with("_call") || t == "reasoning")
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
