//! The cheap rungs of the ladder, no model call: truncate oversized tool
//! outputs (head and tail kept, a marker naming the elided size and the
//! archived original), then prune old tool outputs to a one-line stub. The
//! tool calls themselves are kept, so pairing is untouched.
//!
//! Marker and stub carry a digest of what they replace, so the facts an
//! agent needs survive the cut: the exit status, the exact error lines not
//! otherwise kept, and the paths the output names
//! ([`super::summary::output_digest`]).

use serde_json::Value;

use super::items::{ceil_boundary, floor_boundary, is_tool_output, output_field, value_text};
use super::summary::output_digest;
use crate::tokens::media::omitted_marker;
use crate::wire::hash::hex;
use crate::wire::{gemini, messages, ItemHash};

/// Limits of rung 1.
#[derive(Debug, Clone, Copy)]
pub struct TruncateLimits {
    /// Outputs longer than this many bytes are truncated.
    pub max_bytes: usize,
    /// Bytes kept from the start.
    pub keep_head: usize,
    /// Bytes kept from the end.
    pub keep_tail: usize,
}

/// How a marker tells the model to read the original: the proxy offers
/// the tool only to requests that have tools of their own, so the marker
/// says when.
const RECALL_HINT: &str =
    "; when the compactor_recall tool is offered, call it with this ref to read it";

/// The reference under which the original is kept in the store's items.
pub fn archive_ref(hash: &ItemHash) -> String {
    format!("item:{}", &hex(hash)[..16])
}

/// Rung 1: truncates each tool output over `max_bytes`. Returns the new
/// items and how many were truncated.
pub fn truncate_outputs(
    part: &[Value],
    hashes: &[ItemHash],
    limits: TruncateLimits,
) -> (Vec<Value>, usize) {
    rewrite_outputs(part, hashes, |text, hash| {
        if text.len() <= limits.max_bytes {
            return None;
        }
        let head = floor_boundary(text, limits.keep_head);
        let tail = ceil_boundary(text, text.len().saturating_sub(limits.keep_tail).max(head));
        let elided = tail - head;
        let kept = format!("{}\n{}", &text[..head], &text[tail..]);
        let marker = format!(
            "\n[compactor: {elided} bytes of tool output elided; original archived as {}{RECALL_HINT}]\n{}",
            archive_ref(hash),
            digest_lines(text, &kept)
        );
        Some(format!("{}{marker}{}", &text[..head], &text[tail..]))
    })
}

/// Rung 2: replaces every tool output with a one-line stub naming its size
/// and the archived original, followed by the output's digest.
pub fn prune_outputs(part: &[Value], hashes: &[ItemHash]) -> (Vec<Value>, usize) {
    rewrite_outputs(part, hashes, |text, hash| {
        if text.starts_with("[compactor: tool output pruned") {
            return None;
        }
        Some(
            format!(
                "[compactor: tool output pruned ({} bytes); original archived as {}{RECALL_HINT}]\n{}",
                text.len(),
                archive_ref(hash),
                digest_lines(text, "")
            )
            .trim_end()
            .to_string(),
        )
    })
}

/// The digest of `text` as lines, each ending in a newline (empty when
/// there is nothing to say).
fn digest_lines(text: &str, kept: &str) -> String {
    output_digest(text, kept)
        .into_iter()
        .map(|l| l + "\n")
        .collect()
}

/// Replaces the payload of each tool output for which `new_text` (given its
/// text and the item's hash) returns one; everything else is copied as is.
/// Returns the items and how many changed.
fn rewrite_outputs(
    part: &[Value],
    hashes: &[ItemHash],
    mut new_text: impl FnMut(&str, &ItemHash) -> Option<String>,
) -> (Vec<Value>, usize) {
    let mut changed = 0;
    let out = part
        .iter()
        .zip(hashes)
        .map(|(item, hash)| {
            if !is_tool_output(item) {
                return item.clone();
            }
            if messages::is_tool_result_message(item) {
                return rewrite_results(item, hash, &mut new_text, &mut changed);
            }
            if gemini::is_function_response(item) {
                let mut new = item.clone();
                if gemini::rewrite_responses(&mut new, |t| new_text(t, hash)) > 0 {
                    changed += 1;
                }
                return new;
            }
            let field = output_field(item);
            let text = item.get(field).map(value_text).unwrap_or_default();
            match new_text(&text, hash) {
                Some(t) => {
                    let mut new = item.clone();
                    new[field] = Value::String(with_omitted(t, item.get(field)));
                    changed += 1;
                    new
                }
                None => item.clone(),
            }
        })
        .collect();
    (out, changed)
}

/// [`rewrite_outputs`] for an Anthropic user message: each `tool_result`
/// block's `content` (its `is_error` and id kept), under the message's
/// archive reference.
fn rewrite_results(
    item: &Value,
    hash: &ItemHash,
    new_text: &mut impl FnMut(&str, &ItemHash) -> Option<String>,
    changed: &mut usize,
) -> Value {
    let mut new = item.clone();
    let mut any = false;
    if let Some(Value::Array(blocks)) = new.get_mut("content") {
        for b in blocks.iter_mut() {
            if b.get("type").and_then(Value::as_str) != Some("tool_result") {
                continue;
            }
            if let Some(t) = new_text(&messages::tool_result_text(b), hash) {
                b["content"] = Value::String(with_omitted(t, b.get("content")));
                any = true;
            }
        }
    }
    if any {
        *changed += 1;
    }
    new
}

/// `text`, the new content of an output whose `old` content held images,
/// documents or audio, followed by a marker for each: what the model was
/// shown and is no longer is said, never dropped in silence.
fn with_omitted(text: String, old: Option<&Value>) -> String {
    let Some(Value::Array(parts)) = old else {
        return text;
    };
    let markers: Vec<String> = parts.iter().filter_map(omitted_marker).collect();
    if markers.is_empty() {
        return text;
    }
    format!("{}\n{}", text.trim_end(), markers.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::item_hash;
    use serde_json::json;

    #[test]
    fn truncation_keeps_head_tail_and_names_the_archive() {
        let big = format!("HEAD{}TAIL", "é".repeat(5000));
        let items = vec![
            json!({"role": "tool", "tool_call_id": "a", "content": big}),
            json!({"type": "function_call_output", "call_id": "b", "output": "short"}),
        ];
        let hashes: Vec<_> = items.iter().map(item_hash).collect();
        let (out, n) = truncate_outputs(
            &items,
            &hashes,
            TruncateLimits {
                max_bytes: 100,
                keep_head: 10,
                keep_tail: 10,
            },
        );
        assert_eq!(n, 1);
        let t = out[0]["content"].as_str().unwrap();
        assert!(t.starts_with("HEAD") && t.ends_with("TAIL"), "{t}");
        assert!(t.contains(&archive_ref(&hashes[0])) && t.contains("bytes of tool output elided"));
        assert_eq!(out[0]["tool_call_id"], "a");
        assert_eq!(out[1], items[1]);
    }

    #[test]
    fn anthropic_results_are_rewritten_block_by_block() {
        let items = vec![
            json!({"role": "assistant", "content": [
                {"type": "tool_use", "id": "a", "name": "Bash", "input": {"command": "make"}},
                {"type": "tool_use", "id": "b", "name": "Read", "input": {"file_path": "x"}}]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "a", "is_error": true, "content": "y".repeat(300)},
                {"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "z".repeat(200)}]},
                {"type": "text", "text": "keep me"}]}),
        ];
        let hashes: Vec<_> = items.iter().map(item_hash).collect();
        let (out, n) = prune_outputs(&items, &hashes);
        assert_eq!(n, 1);
        assert_eq!(out[0], items[0]);
        let blocks = out[1]["content"].as_array().unwrap();
        assert!(blocks[0]["content"].as_str().unwrap().contains("300 bytes"));
        assert_eq!(blocks[0]["is_error"], true);
        assert_eq!(blocks[0]["tool_use_id"], "a");
        assert!(blocks[1]["content"].as_str().unwrap().contains("200 bytes"));
        assert_eq!(blocks[2], json!({"type": "text", "text": "keep me"}));
    }

    #[test]
    fn pruning_stubs_every_output_once() {
        let items = vec![
            json!({"type": "function_call", "call_id": "b", "name": "sh"}),
            json!({"type": "function_call_output", "call_id": "b", "output": "x".repeat(300)}),
        ];
        let hashes: Vec<_> = items.iter().map(item_hash).collect();
        let (out, n) = prune_outputs(&items, &hashes);
        assert_eq!(n, 1);
        assert_eq!(out[0], items[0]);
        assert!(out[1]["output"].as_str().unwrap().contains("300 bytes"));
        let (again, n2) = prune_outputs(&out, &hashes);
        assert_eq!((again, n2), (out, 0));
    }

    /// A pruned failing output keeps its exit status, its exact error line
    /// and the paths it names; a truncated one keeps the error lines of the
    /// part it elides.
    #[test]
    fn stubs_keep_a_digest_of_errors_and_paths() {
        let err =
            "thread 'iso' panicked at crates/ledger/src/csv.rs:88:14: expected `Z`, got `+01:00`";
        let log = format!(
            "{}test iso::roundtrip ... FAILED\n{err}\n{}test result: FAILED. 1 failed\nProcess exited with code 101\n",
            "test a::b ... ok\n".repeat(400),
            "test c::d ... ok\n".repeat(400)
        );
        let items = vec![
            json!({"type": "function_call", "call_id": "t", "name": "shell", "arguments": "{}"}),
            json!({"type": "function_call_output", "call_id": "t", "output": log}),
        ];
        let hashes: Vec<_> = items.iter().map(item_hash).collect();
        let (pruned, _) = prune_outputs(&items, &hashes);
        let stub = pruned[1]["output"].as_str().unwrap();
        assert!(
            stub.starts_with("[compactor: tool output pruned ("),
            "{stub}"
        );
        assert!(stub.contains("\nExit code: 101\n"), "{stub}");
        assert!(stub.contains(&format!("\n{err}\n")), "{stub}");
        assert!(
            stub.ends_with("Paths named: crates/ledger/src/csv.rs"),
            "{stub}"
        );
        assert!(
            stub.len() < 400 + RECALL_HINT.len(),
            "a digest, not the output: {stub}"
        );
        let (truncated, n) = truncate_outputs(
            &items,
            &hashes,
            TruncateLimits {
                max_bytes: 1000,
                keep_head: 300,
                keep_tail: 200,
            },
        );
        assert_eq!(n, 1);
        let t = truncated[1]["output"].as_str().unwrap();
        assert!(
            t.contains(&format!(
                "original archived as {}{RECALL_HINT}]\n{err}\n",
                archive_ref(&hashes[1])
            )),
            "{t}"
        );
        assert!(
            !t.contains("Exit code: 101"),
            "the kept tail states it: {t}"
        );
        // An output with nothing to report keeps the bare stub.
        let quiet =
            vec![json!({"type": "function_call_output", "call_id": "q", "output": "all good"})];
        let (out, _) = prune_outputs(&quiet, &[item_hash(&quiet[0])]);
        assert!(!out[0]["output"].as_str().unwrap().contains('\n'));
    }

    #[test]
    fn a_pruned_output_says_which_images_it_held() {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        png.extend(1568u32.to_be_bytes());
        png.extend(1000u32.to_be_bytes());
        let png = crate::tokens::media::encode_base64(&png);
        let items = vec![
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "Screenshot taken."},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
            ]}]}),
            json!({"type": "function_call_output", "call_id": "c", "output": [
                {"type": "input_text", "text": "page 1"},
                {"type": "input_image", "image_url": "https://example.com/shot.png"},
            ]}),
            json!({"role": "tool", "tool_call_id": "a", "content": "plain text, no image"}),
        ];
        let hashes: Vec<_> = items.iter().map(item_hash).collect();
        let (out, n) = prune_outputs(&items, &hashes);
        assert_eq!(n, 3);
        let anthropic = out[0]["content"][0]["content"].as_str().unwrap();
        assert!(
            anthropic.starts_with("[compactor: tool output pruned"),
            "{anthropic}"
        );
        assert!(
            anthropic.ends_with("\n[image omitted by compactor: 1568×1000 PNG, ~1600 tokens]"),
            "{anthropic}"
        );
        assert!(!anthropic.contains(&png));
        let openai = out[1]["output"].as_str().unwrap();
        assert!(
            openai.ends_with("\n[image omitted by compactor: ~1445 tokens]"),
            "{openai}"
        );
        let plain = out[2]["content"].as_str().unwrap();
        assert!(!plain.contains("omitted by compactor"), "{plain}");
    }
}
