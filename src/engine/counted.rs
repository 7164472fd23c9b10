//! Counting a request for its compaction: each item's hash and tokens,
//! the tool definitions', and the limit the result must meet.

use std::sync::Arc;

use serde_json::Value;

use super::context::Context;
use super::count::{count_items, count_tools};
use super::error::CompactError;
use super::input::{Goal, Input};
use super::learned::{MAX_CALIBRATION, MIN_CALIBRATION};
use crate::compaction::policy::{fit_limit, hard_limit, FIT_MARGIN};
use crate::compaction::{Compaction, Params};
use crate::config::ModelLimits;
use crate::tokens::TokenCounter;
use crate::wire::{item_hash, ItemHash};

/// What the counting found: the view as values, each item's hash and
/// tokens, and what the result may take.
pub(super) struct Counted {
    pub(super) limits: ModelLimits,
    pub(super) params: Params,
    pub(super) values: Arc<Vec<Value>>,
    pub(super) hashes: Vec<ItemHash>,
    /// Each item's tokens (none before a provider compaction item: the
    /// provider does not read them).
    pub(super) tokens: Vec<u64>,
    pub(super) tools_tokens: u64,
    /// The view's tokens.
    pub(super) before: u64,
    /// What the items may take (see [`items_limit`]).
    pub(super) limit: u64,
    /// What goes beside the items (the tool definitions, a Messages
    /// `system`): the target is the request's, so they count against it.
    pub(super) outside: u64,
    counter: Arc<TokenCounter>,
}

impl Counted {
    pub(super) fn view(&self) -> &[Value] {
        &self.values
    }

    pub(super) fn count(&self, v: &Value) -> u64 {
        self.counter.count_item(&item_hash(v), v)
    }

    pub(super) fn base<'a>(&self, input: &'a Input) -> Option<&'a Compaction> {
        input.request.base.as_deref()
    }
}

/// Counts the request: its items, its tools, and the limit they set.
pub(super) async fn count<S: Context>(
    state: &Arc<S>,
    input: &Input,
) -> Result<Counted, CompactError> {
    let limits = state.model_limits(&input.who.model);
    let params = Params::new(&state.config().compaction, &limits);
    let (hashes, mut tokens) = count_items(state, input.request.view.clone(), None).await?;
    let tools_tokens = count_tools(state, input.request.tools.clone()).await;
    let values = input.request.view.values();
    // The provider does not read what precedes its compaction item.
    crate::compaction::boundary::count_from_boundary(&values, &mut tokens);
    let before: u64 = tokens.iter().sum();
    let limit = items_limit(state, input, before, tools_tokens);
    let counter = state.tokens().clone();
    let system = input
        .request
        .system
        .as_ref()
        .map_or(0, |v| counter.count_item(&item_hash(v), v));
    Ok(Counted {
        limits,
        params,
        values,
        hashes,
        tokens,
        tools_tokens,
        before,
        limit,
        outside: tools_tokens + system,
        counter,
    })
}

/// The tokens the items of a compacted request may take, in the proxy's
/// estimate: the goal's limit in the upstream's tokens, scaled by what the
/// upstream reported for this conversation, less the tool definitions. An
/// overflow answer that states the refused size calibrates the scale first.
fn items_limit<S: Context>(state: &Arc<S>, input: &Input, before: u64, tools_tokens: u64) -> u64 {
    let limits = state.model_limits(&input.who.model);
    let (tenant, conversation) = (input.who.tenant.as_str(), input.who.conversation.as_str());
    let sent = before + tools_tokens;
    let upstream_limit = match input.ask.goal {
        Goal::Shrink => return (before as f64 * (1.0 - FIT_MARGIN)) as u64,
        Goal::HardLimit => hard_limit(&limits),
        Goal::Overflow { stated, max_output } => {
            // A figure far off the estimate is a canned or garbled message,
            // not this request's size.
            let ratio = stated.requested.unwrap_or(0) as f64 / sent.max(1) as f64;
            if let Some(requested) = stated.requested {
                if (MIN_CALIBRATION..=MAX_CALIBRATION).contains(&ratio) {
                    state
                        .compactions()
                        .calibrate(tenant, conversation, requested, sent);
                }
            }
            let calibration = state.compactions().calibration(tenant, conversation);
            let refused = (sent as f64 * calibration).ceil() as u64;
            fit_limit(stated, &limits, max_output, Some(refused))
        }
    };
    let calibration = state.compactions().calibration(tenant, conversation);
    ((upstream_limit as f64 / calibration) as u64).saturating_sub(tools_tokens)
}
