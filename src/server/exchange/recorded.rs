//! The record of an exchange: made when the exchange ends, committed by
//! the record phase ([`crate::server::record`]) the driver opened it with.

use std::sync::Arc;

use serde_json::Value;

use super::outcome::Outcome;
use super::pending::PendingExchange;
use crate::app::AppState;
use crate::compaction::{items, Compaction};
use crate::error::ProxyError;
use crate::store::{ExchangeRecord, ExchangeSavings, LeftOut, RecordedWindow};
use crate::wire::items::Tools;
use crate::wire::{chain_extend, item_hash, ItemHash};

/// Most characters of an upstream error body kept in a record.
const MAX_ERROR_CHARS: usize = 4096;

/// What a record keeps of an error: redacted of the client's credentials
/// (`auth`) and the proxy's own, and cut short.
fn error_text(state: &AppState, error: &str, auth: &http::HeaderMap) -> String {
    let mut s = state.upstream.redact(error, auth).into_owned();
    if s.len() > MAX_ERROR_CHARS {
        s.truncate(items::floor_boundary(&s, MAX_ERROR_CHARS));
        s.push('…');
    }
    s
}
/// The stored form of a request's parameters: its body with the tools put
/// back (everything but the items).
fn params_json(body: &Value, tools: Option<&Tools>) -> String {
    let mut params = body.clone();
    Tools::restore(tools, &mut params);
    params.to_string()
}
/// The record: made when the exchange ends, committed by [`crate::server::record`].
impl PendingExchange {
    /// Records an exchange that failed before an answer could be relayed
    /// and returns the error for the client.
    pub async fn fail(
        self,
        state: &Arc<AppState>,
        err: ProxyError,
        ttfb_ms: Option<f64>,
    ) -> ProxyError {
        let outcome = Outcome {
            status: err.status().as_u16(),
            error: Some(err.to_string()),
            ttfb_ms,
            ..Outcome::default()
        };
        self.finish(state, outcome).await;
        err
    }

    /// Builds the record: claims item bodies not yet stored, computes chains.
    pub fn to_record(&self, state: &AppState, outcome: Outcome) -> ExchangeRecord {
        let mut new_items = Vec::new();
        // As of before the claims of recent requests were looked up: a
        // forget since sends what they and the claims here found stored.
        let claimed_at = self.digest.forgets;
        // A store other processes write keeps the bodies the record leaves
        // out until it commits: a deletion elsewhere may take them first.
        let shared = state.store.is_shared();
        // The items of the prefix an earlier exchange stands for were
        // claimed when that exchange was recorded, and so were those a
        // recorded recent request had too.
        let len = self.digest.hashes.len();
        let suffix_from = self
            .conversation
            .ident
            .prefix
            .map(|p| p.len)
            .unwrap_or(0)
            .min(len);
        let known = self.digest.claims.known();
        let before = suffix_from..known.start.clamp(suffix_from, len);
        let after = known.end.clamp(suffix_from, len)..len;
        let list = self.request.items();
        let body = |at: usize| (self.digest.hashes[at], list.json(at));
        // Which of the items were claimed now (kept track of when shared).
        let mut fresh = vec![false; if shared { len } else { 0 }];
        for range in [before, after] {
            for j in state.store.claim_items(&self.digest.hashes[range.clone()]) {
                if let Some(f) = fresh.get_mut(range.start + j) {
                    *f = true;
                }
                new_items.push(body(range.start + j));
            }
        }
        self.digest.claims.all_claimed();
        // The body holds everything but the items: model, tools, sampling.
        let params_hash = self.digest.params;
        let params_fresh = state.store.claim_item(&params_hash);
        if params_fresh {
            new_items.push((
                params_hash,
                params_json(self.request.body(), self.request.tools()),
            ));
        }
        let response_hashes: Vec<ItemHash> = outcome.response_items.iter().map(item_hash).collect();
        let mut responses_left_out = Vec::new();
        for (h, item) in response_hashes.iter().zip(&outcome.response_items) {
            if state.store.claim_item(h) {
                new_items.push((*h, item.to_string()));
            } else if shared {
                responses_left_out.push((*h, item.clone()));
            }
        }
        // What a shared store's record leaves out, made only if sent.
        let stored_items = if shared {
            let list = list.clone();
            let left_out: Vec<(usize, ItemHash)> = (suffix_from..len)
                .filter(|&at| !fresh[at])
                .map(|at| (at, self.digest.hashes[at]))
                .collect();
            let params = (!params_fresh)
                .then(|| (self.request.body().clone(), self.request.tools().cloned()));
            // It keeps the request's items alive until the commit.
            LeftOut::new(self.request.raw_len(), move || {
                let mut bodies: Vec<(ItemHash, String)> =
                    left_out.iter().map(|&(at, h)| (h, list.json(at))).collect();
                if let Some((body, tools)) = &params {
                    bodies.push((params_hash, params_json(body, tools.as_ref())));
                }
                bodies.extend(responses_left_out.iter().map(|(h, v)| (*h, v.to_string())));
                bodies
            })
        } else {
            LeftOut::default()
        };
        let complete = !outcome.partial && (200..300).contains(&outcome.status);
        ExchangeRecord {
            id: self.conversation.id,
            conversation: self.conversation().to_string(),
            new_conversation: self.conversation.ident.is_new,
            chained_by_id: self.request.previous().is_some(),
            branched_from: self.conversation.ident.branched_from.clone(),
            explicit_key: self.request.explicit_key().map(String::from),
            tenant: self.request.tenant().to_string(),
            api: self.request.api(),
            model: self.request.model().to_string(),
            prefix: self.conversation.ident.prefix,
            suffix_items: self.digest.hashes[suffix_from.min(self.digest.hashes.len())..].to_vec(),
            request_len: self.digest.hashes.len(),
            params: params_hash,
            response_items: response_hashes.clone(),
            new_items,
            stored_items,
            claimed_at,
            journaled: false,
            response_id: outcome.response_id,
            usage: outcome.usage,
            status: outcome.status,
            streamed: self.request.streamed(),
            partial: outcome.partial,
            error: outcome
                .error
                .map(|e| error_text(state, &e, self.request.auth())),
            started_ms: self.timing.started_ms,
            latency_ms: self.timing.started.elapsed().as_secs_f64() * 1000.0,
            ttfb_ms: outcome.ttfb_ms,
            chain_request: (!self.digest.hashes.is_empty()).then_some(self.digest.chain_request),
            // Only a complete answer can be continued by the next request.
            chain_full: (complete && !response_hashes.is_empty())
                .then(|| chain_extend(self.digest.chain_request, &response_hashes)),
            chain_echoed: complete
                .then(|| self.chain_echoed(&outcome.response_items, &response_hashes))
                .flatten(),
            compaction: self.upstream.compaction.as_ref().map(|c| c.id.clone()),
            window: {
                let (limits, source) = state.model_window(self.request.model());
                Some(RecordedWindow {
                    tokens: limits.context_window,
                    source,
                })
            },
            client_ids: self.request.client_ids().clone(),
            client: self.request.user_agent().map(String::from),
            preview: self
                .conversation
                .ident
                .is_new
                .then(|| self.preview(state))
                .flatten(),
            savings: self.savings(state),
        }
    }

    /// The chain over the request and the answer as its client sends it
    /// back, when that differs from the answer ([`Api::echoed`]).
    ///
    /// [`Api::echoed`]: crate::wire::Api::echoed
    fn chain_echoed(&self, items: &[Value], hashes: &[ItemHash]) -> Option<ItemHash> {
        let api = self.request.api();
        let echoed: Vec<Option<Value>> = items.iter().map(|i| api.echoed(i)).collect();
        if echoed.iter().all(Option::is_none) {
            return None;
        }
        let hashes: Vec<ItemHash> = echoed
            .iter()
            .zip(hashes)
            .map(|(e, h)| e.as_ref().map_or(*h, item_hash))
            .collect();
        Some(chain_extend(self.digest.chain_request, &hashes))
    }

    /// What the compaction applied saved, or the would-be one would have,
    /// in the upstream's tokens (the estimate scaled by what it reported
    /// for this conversation).
    fn savings(&self, state: &AppState) -> ExchangeSavings {
        let calibration = state
            .compactions
            .calibration(self.request.tenant(), self.conversation());
        let upstream = |c: &Arc<Compaction>| (c.saved() as f64 * calibration) as u64;
        ExchangeSavings {
            mode: self.request.mode(),
            tokens_saved: self.upstream.compaction.as_ref().map(upstream).unwrap_or(0),
            tokens_saved_potential: self.upstream.observed.as_ref().map(upstream).unwrap_or(0),
            observed_compaction: self.upstream.observed.as_ref().map(|c| c.id.clone()),
            recall_rounds: self.offered.spent.rounds,
            recall_input_tokens: self.offered.spent.input_tokens,
            recall_output_tokens: self.offered.spent.output_tokens,
        }
    }

    /// Records the exchange through the record phase the driver opened it
    /// with ([`Recorder`]), waiting for the commit. False when the answer
    /// must not reach the client: a store shared by replicas could not
    /// commit it (released, it would be an answer no replica knows of).
    pub async fn finish(&self, state: &Arc<AppState>, outcome: Outcome) -> bool {
        (self.recorder.finish)(state, self, outcome).await
    }

    /// Records without waiting (the client is gone; nothing can wait).
    pub fn finish_detached(&self, state: &Arc<AppState>, outcome: Outcome) {
        (self.recorder.detached)(state, self, outcome)
    }
}
