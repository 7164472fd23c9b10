//! The token counts a compaction and the hard-limit check start from
//! (tokenizer work, off the async threads).

use std::sync::Arc;

use super::context::Context;
use super::error::CompactError;
use crate::wire::items::{ItemList, Tools};
use crate::wire::ItemHash;

/// Tokens of each item (tokenizer work, off the async threads).
pub(super) async fn count_items<S: Context>(
    state: &Arc<S>,
    items: Arc<ItemList>,
    known: Option<Arc<Vec<ItemHash>>>,
) -> Result<(Vec<ItemHash>, Vec<u64>), CompactError> {
    let st = state.clone();
    tokio::task::spawn_blocking(move || {
        let hashes: Vec<ItemHash> = match known {
            Some(h) if h.len() == items.len() => h.to_vec(),
            _ => items.hashes(),
        };
        let tokens = (0..items.len())
            .map(|i| st.tokens().count_item_with(&hashes[i], || items.item(i)))
            .collect();
        (hashes, tokens)
    })
    .await
    .map_err(CompactError::Internal)
}

/// Estimated tokens of a request view (`hashes`: its item hashes, when
/// already computed).
pub async fn estimate_view<S: Context>(
    state: &Arc<S>,
    view: Arc<ItemList>,
    hashes: Option<Arc<Vec<ItemHash>>>,
) -> u64 {
    count_items(state, view, hashes)
        .await
        .map(|(_, t)| t.iter().sum())
        .unwrap_or(0)
}

/// Tokens of a request's tool definitions (tokenizer work, off the async
/// threads).
pub(super) async fn count_tools<S: Context>(state: &Arc<S>, tools: Option<Tools>) -> u64 {
    let Some(t) = tools else {
        return 0;
    };
    let counter = state.tokens().clone();
    tokio::task::spawn_blocking(move || counter.count_item(&t.hash, t.value()))
        .await
        .unwrap_or(0)
}
