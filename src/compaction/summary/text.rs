//! Small string and JSON helpers shared by the summary modules: clipping
//! with a marker, head-and-tail cuts, code fences that survive backticks,
//! field lookups and tool-name words.

use serde_json::Value;

use crate::compaction::items::{ceil_boundary, floor_boundary, value_text};

/// `s` cut to at most `max` bytes (ending in `…` when cut).
pub(super) fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let end = floor_boundary(s, max.saturating_sub(3));
    format!("{}…", &s[..end])
}

/// `s` cut to at most `max` bytes keeping its head and tail, with a marker
/// naming the elided size in the middle.
pub(super) fn head_tail(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let keep = max.saturating_sub(48);
    let head = floor_boundary(s, keep / 2);
    let tail = ceil_boundary(s, s.len() - (keep - keep / 2)).max(head);
    format!(
        "{}\n[… {} bytes elided …]\n{}",
        &s[..head],
        tail - head,
        &s[tail..]
    )
}

/// The first line of `s`, clipped.
pub(super) fn first_line(s: &str, max: usize) -> String {
    let t = s.trim();
    let line = t.lines().next().unwrap_or("");
    if line.len() < t.len() {
        clip(&format!("{line}…"), max)
    } else {
        clip(line, max)
    }
}

pub(super) fn role(item: &Value) -> &str {
    item.get("role").and_then(Value::as_str).unwrap_or("")
}

pub(super) fn kind(item: &Value) -> &str {
    item.get("type").and_then(Value::as_str).unwrap_or("")
}

pub(super) fn str_field<'a>(v: &'a Value, keys: &[&str]) -> Option<&'a str> {
    keys.iter().find_map(|k| v.get(*k).and_then(Value::as_str))
}

/// Arguments as JSON when they parse, else the raw string.
pub(super) fn parse_args(v: Option<&Value>) -> Value {
    match v {
        Some(Value::String(s)) => {
            serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
        }
        Some(v) => v.clone(),
        None => Value::Null,
    }
}

/// Every string inside `v` (a few levels deep).
pub(super) fn string_leaves<'a>(v: &'a Value, depth: usize, out: &mut Vec<&'a str>) {
    match v {
        Value::String(s) => out.push(s),
        Value::Array(a) if depth > 0 => a.iter().for_each(|x| string_leaves(x, depth - 1, out)),
        Value::Object(o) if depth > 0 => o.values().for_each(|x| string_leaves(x, depth - 1, out)),
        _ => {}
    }
}

/// A code fence longer than any backtick run in `content`.
fn fence_for(content: &str) -> String {
    let mut longest = 0;
    let mut run = 0;
    for c in content.chars() {
        if c == '`' {
            run += 1;
            longest = longest.max(run);
        } else {
            run = 0;
        }
    }
    "`".repeat((longest + 1).max(3))
}

pub(super) fn fenced(content: &str, lang: &str) -> String {
    let fence = fence_for(content);
    let nl = if content.ends_with('\n') { "" } else { "\n" };
    format!("{fence}{lang}\n{content}{nl}{fence}")
}

/// Lowercased name split into words (`read_file`, `readFile`, `Read`).
pub(super) fn name_words(name: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut prev_lower = false;
    for c in name.chars() {
        if !c.is_alphanumeric() {
            if !cur.is_empty() {
                words.push(std::mem::take(&mut cur));
            }
            prev_lower = false;
            continue;
        }
        if c.is_uppercase() && prev_lower && !cur.is_empty() {
            words.push(std::mem::take(&mut cur));
        }
        prev_lower = c.is_lowercase() || c.is_ascii_digit();
        cur.extend(c.to_lowercase());
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    words
}

pub(super) fn name_has(name: &str, words: &[&str]) -> bool {
    name_words(name).iter().any(|w| words.contains(&w.as_str()))
}

/// A value as text: a string as is, anything else as its text leaves, or
/// as JSON when it has none.
pub(super) fn value_or_json(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => {
            let t = value_text(other);
            if t.is_empty() {
                other.to_string()
            } else {
                t
            }
        }
    }
}
