//! Where a compaction starts: the cut in the request as it would go
//! upstream and the figures around it ([`Prepared`]).

use serde_json::Value;

use super::computed::Compaction;
use super::params::Params;
use super::{boundary, cut, items, rewrite};

/// The cut and figures a compaction starts from.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Cut in the view.
    pub cut: usize,
    /// Cut in the original items (what the compaction covers).
    pub covered_len: usize,
    /// Leading system items.
    pub lead: usize,
    /// Tokens of the whole view.
    pub before: u64,
    /// Tokens of the view's tail (from the cut on).
    pub tail: u64,
}

/// Chooses the cut for `view` (the request as it would go upstream, after
/// `base` if one applied). `None` when there is nothing safe to compact.
pub fn prepare(
    view: &[Value],
    tokens: &[u64],
    base: Option<&Compaction>,
    params: &Params,
) -> Option<Prepared> {
    // A cut inside the base's replacement could not be mapped back to the
    // client's items: the previous summary is compacted with what follows.
    let min_cut = base.map(|b| b.replacement.len()).unwrap_or(0);
    let cut = cut::choose_cut(view, tokens, params.tail_budget)?.max(min_cut);
    finish_prepare(view, tokens, base, cut, false)
}

/// Like [`prepare`], but compacts everything after the leading items that
/// can be compacted safely: an explicit compaction request
/// (`/v1/responses/compact`, `compaction_trigger`) keeps no verbatim tail.
pub fn prepare_whole(
    view: &[Value],
    tokens: &[u64],
    base: Option<&Compaction>,
) -> Option<Prepared> {
    let min_cut = base.map(|b| b.replacement.len()).unwrap_or(0);
    finish_prepare(view, tokens, base, min_cut, true)
}

fn finish_prepare(
    view: &[Value],
    tokens: &[u64],
    base: Option<&Compaction>,
    from: usize,
    whole: bool,
) -> Option<Prepared> {
    let safe = cut::safe_cuts(view);
    // Everything up to the provider's newest compaction item goes as sent.
    let lead = items::leading_system(view).max(boundary::safe_floor(view, &safe));
    let ok = |i: &usize| safe[*i] && *i > lead;
    let cut = if whole {
        (from..=view.len()).rev().find(ok)?
    } else {
        // Moving the cut forward past the replacement must land on a safe cut too.
        (from..view.len()).find(ok)?
    };
    let covered_len = rewrite::view_to_original(cut, base)?;
    Some(Prepared {
        cut,
        covered_len,
        lead,
        before: tokens.iter().sum(),
        tail: tokens[cut..].iter().sum(),
    })
}
