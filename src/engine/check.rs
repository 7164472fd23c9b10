//! The hard-limit check before a request goes upstream.

use std::sync::Arc;
use std::time::Duration;

use super::context::Context;
use super::count::{count_tools, estimate_view};
use super::jobs::wait_foreign;
use crate::compaction::policy::hard_limit;
use crate::wire::items::{ItemList, Tools};
use crate::wire::{chain_hashes, ItemHash};

/// Whether a request fits under the hard limit (window minus max output).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// It does (or is small enough that it surely does).
    Fits,
    /// It did not, and it waited for the compaction under way.
    Waited,
    /// It does not and nothing is under way: about this many tokens.
    Over(u64),
}

/// A request to check against the hard limit.
pub struct FitCheck<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Conversation.
    pub conversation: &'a str,
    /// Model (for its limits).
    pub model: &'a str,
    /// The items as they would go upstream.
    pub view: Arc<ItemList>,
    /// Their hashes, when already computed.
    pub hashes: Option<Arc<Vec<ItemHash>>>,
    /// The request's tool definitions.
    pub tools: Option<Tools>,
    /// Size of the request body, when it is what goes upstream.
    pub bytes: Option<usize>,
}

/// Checks a request against the hard limit; waits (bounded) for the
/// conversation's compaction under way when it is over. `bytes`, when
/// known, is the size of the request body: a token is at least one byte, so
/// a body no larger than the limit needs no tokenizer. `tools` are the
/// request's tool definitions, which count too. The estimate is scaled by
/// what the upstream reported for this conversation before.
pub async fn check_fit<S: Context>(state: &Arc<S>, req: FitCheck<'_>) -> Fit {
    let FitCheck {
        tenant,
        conversation,
        model,
        view,
        hashes,
        tools,
        bytes,
    } = req;
    let limits = state.model_limits(model);
    let hard = hard_limit(&limits);
    if bytes.is_some_and(|b| b as u64 <= hard) {
        return Fit::Fits;
    }
    let calibration = state.compactions().calibration(tenant, conversation);
    // A long conversation's next request: most items were counted before,
    // the new ones are few. Their bytes bound their tokens; the tokenizer
    // is needed only when that bound does not settle it.
    if let Some(h) = &hashes {
        let bound = state.tokens().bound(&view, h, tools.as_ref());
        if (bound as f64 * calibration).ceil() as u64 <= hard {
            return Fit::Fits;
        }
    }
    // What the upstream reported for this conversation's last exchange,
    // plus what the request adds to it: when that fits, the estimate of the
    // whole (which may count what the upstream prices otherwise) does not
    // get to compact it.
    if let Some(tokens) = reported_plus_added(
        state,
        tenant,
        conversation,
        &view,
        &hashes,
        &tools,
        calibration,
    )
    .await
    {
        if tokens <= hard {
            return Fit::Fits;
        }
    }
    let tools_tokens = count_tools(state, tools).await;
    // What the provider reads: from its newest compaction item on.
    let (view, hashes) = match crate::compaction::boundary::newest_in(&view) {
        Some(b) if b > 0 => (
            Arc::new(view.with_prefix_replaced(b, &[])),
            hashes
                .filter(|h| h.len() == view.len())
                .map(|h| Arc::new(h[b..].to_vec())),
        ),
        _ => (view, hashes),
    };
    let estimate = estimate_view(state, view, hashes).await + tools_tokens;
    let tokens = (estimate as f64 * calibration).ceil() as u64;
    if tokens <= hard {
        return Fit::Fits;
    }
    let wait = Duration::from_secs(state.config().compaction.wait_secs);
    let Some(mut rx) = state.compactions().job(tenant, conversation) else {
        if wait_foreign(state, tenant, conversation, wait).await {
            return Fit::Waited;
        }
        return Fit::Over(tokens);
    };
    tracing::info!(
        conversation,
        tokens,
        "request over the hard limit waits for the compaction under way"
    );
    let _ = tokio::time::timeout(wait, rx.wait_for(|done| *done)).await;
    Fit::Waited
}

/// The conversation's last reported prompt plus the estimate of the items
/// `view` adds to it (scaled by `calibration`), when `view` extends the
/// items of that prompt with the same tools: `None` otherwise (another
/// conversation's view, one a compaction rewrote since, other tools).
async fn reported_plus_added<S: Context>(
    state: &Arc<S>,
    tenant: &str,
    conversation: &str,
    view: &Arc<ItemList>,
    hashes: &Option<Arc<Vec<ItemHash>>>,
    tools: &Option<Tools>,
    calibration: f64,
) -> Option<u64> {
    let reported = state.compactions().last_reported(tenant, conversation)?;
    if reported.tools != tools.as_ref().map(|t| t.hash) {
        return None;
    }
    let hashes = match hashes {
        Some(h) if h.len() == view.len() => h.clone(),
        _ => Arc::new(view.hashes()),
    };
    let from = chain_hashes(&hashes)
        .iter()
        .rposition(|c| *c == reported.chain)?
        + 1;
    let (view, st) = (view.clone(), state.clone());
    let added: u64 = tokio::task::spawn_blocking(move || {
        (from..view.len())
            .map(|i| st.tokens().count_item_with(&hashes[i], || view.item(i)))
            .sum()
    })
    .await
    .ok()?;
    Some(reported.input_tokens + (added as f64 * calibration).ceil() as u64)
}
