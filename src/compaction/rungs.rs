//! The replacements of the rungs a compaction computes without a call:
//! the cheap rungs ([`cheap_rungs`]) and the summary's place among the
//! items kept ([`summary_replacement`]).

use serde_json::Value;

use super::computed::Rung;
use super::params::Params;
use super::prepare::Prepared;
use super::{boundary, cut, items, ladder};
use crate::wire::ItemHash;

/// Rungs 1 and 2 on `view[..cut]`: the first whose result fits the target,
/// as (rung, replacement, tokens after).
pub fn cheap_rungs(
    view: &[Value],
    hashes: &[ItemHash],
    p: &Prepared,
    params: &Params,
    count: &dyn Fn(&Value) -> u64,
) -> Option<(Rung, Vec<Value>, u64)> {
    // The leading items (and a provider compaction item with what precedes
    // it) are kept as they are; only what follows them is rewritten.
    let kept = &view[..p.lead];
    let part = &view[p.lead..p.cut];
    let hashes = &hashes[p.lead..p.cut];
    let whole =
        |rewritten: &[Value]| -> Vec<Value> { kept.iter().chain(rewritten).cloned().collect() };
    let kept_tokens = boundary::seen_tokens(kept, count);
    let (truncated, n1) = ladder::truncate_outputs(part, hashes, params.truncate);
    let after1: u64 = kept_tokens + truncated.iter().map(count).sum::<u64>() + p.tail;
    if n1 > 0 && after1 <= params.target_tokens {
        return Some((Rung::Truncate, whole(&truncated), after1));
    }
    let (pruned, n2) = ladder::prune_outputs(&truncated, hashes);
    let after2: u64 = kept_tokens + pruned.iter().map(count).sum::<u64>() + p.tail;
    if n1 + n2 > 0 && after2 <= params.target_tokens {
        return Some((Rung::Prune, whole(&pruned), after2));
    }
    None
}

/// Rung 3's replacement: leading items, the summary message, and, in their
/// order, the system messages and the recent user messages of the compacted
/// part (the latest user message always, when it is there; see
/// [`cut::kept_verbatim`]). Returns (replacement, tokens after, messages
/// kept verbatim after the summary).
pub fn summary_replacement(
    view: &[Value],
    tokens: &[u64],
    p: &Prepared,
    params: &Params,
    summary_text: String,
    count: &dyn Fn(&Value) -> u64,
) -> (Vec<Value>, u64, usize) {
    let part = &view[p.lead..p.cut];
    let part_tokens = &tokens[p.lead..p.cut];
    // The latest user message of the whole view must reach the model verbatim.
    let newest_is_here = items::latest_user(view).is_some_and(|i| i >= p.lead && i < p.cut);
    let recent = cut::kept_verbatim(part, part_tokens, params.recent_user_budget, newest_is_here);
    let media: Vec<String> = part
        .iter()
        .enumerate()
        .filter(|(i, _)| !recent.contains(i))
        .flat_map(|(_, item)| items::media_markers(item))
        .collect();
    let mut replacement: Vec<Value> = view[..p.lead].to_vec();
    replacement.push(items::user_message(with_media_note(summary_text, &media)));
    replacement.extend(recent.iter().map(|&i| part[i].clone()));
    let after = boundary::seen_tokens(&replacement, count) + p.tail;
    (replacement, after, recent.len())
}

/// Most media markers a summary lists; past them, how many more.
const MAX_MEDIA_MARKERS: usize = 16;

/// `summary` with a line for each image, document or audio block of the
/// items it replaced: the model learns what it was shown is gone, and can
/// ask for it again.
fn with_media_note(mut summary: String, markers: &[String]) -> String {
    if markers.is_empty() {
        return summary;
    }
    summary.push_str(
        "\n\n## MEDIA NOT KEPT\nRecorded by the proxy: what the replaced messages showed, which \
         this summary cannot carry (ask for it again if it is still needed)",
    );
    for m in markers.iter().take(MAX_MEDIA_MARKERS) {
        summary.push_str("\n- ");
        summary.push_str(m);
    }
    if markers.len() > MAX_MEDIA_MARKERS {
        summary.push_str(&format!(
            "\n- and {} more",
            markers.len() - MAX_MEDIA_MARKERS
        ));
    }
    summary
}
