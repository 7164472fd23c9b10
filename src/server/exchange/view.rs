//! What goes upstream, as the phases change it: a compaction applied, the
//! proxy's tools offered and taken away, the client's own items back, and
//! what a summary call repeats of the request.

use std::sync::Arc;

use super::pending::PendingExchange;
use crate::compaction::{agent_tool, recall, Compaction};
use crate::config::Mode;
use crate::engine::{self, Input};
use crate::wire::items::Tools;

impl PendingExchange {
    /// Applies a compaction: the view becomes its replacement followed by
    /// the rest of the client's items.
    pub fn apply(&mut self, c: Arc<Compaction>) {
        let view = self
            .request
            .items()
            .with_prefix_shared(c.covered_len, c.clone());
        let up = &mut self.upstream;
        up.drop_block = up.hidden_thinking;
        let request = &self.request;
        let format = request.api().format();
        up.view = Arc::new(if format.edits_view() {
            let mut values = view.into_values();
            let tools = request.tools().map(Tools::value);
            up.drop_block |=
                format.finish_view(&mut values, c.replacement.len(), request.body(), tools)
                    || crate::compaction::provider::keeps_thinking(&c.replacement);
            values.into()
        } else {
            view
        });
        up.compaction = Some(c);
        self.offer_recall();
    }

    /// Offers `compactor_recall` to every compacted request (whatever
    /// compacted it: a stored compaction, a hard-limit, manual or requested
    /// one, an overflow's) that may have it (see [`recall::may_offer`]),
    /// whether or not its replacement carries archived originals: the tool
    /// definitions come first in the providers' prompt caches, so a tool
    /// that came and went with what a compaction holds would make the
    /// requests after it read nothing from the cache (see [`recall`]).
    pub(super) fn offer_recall(&mut self) {
        if self.upstream.compaction.is_none() {
            return;
        }
        let offered = &mut self.offered;
        if offered.recall_withdrawn || offered.recall_rounds == 0 {
            return;
        }
        offered.recall =
            recall::may_offer(self.request.body(), self.request.tools().map(Tools::value));
        offered.recall_offered |= offered.recall;
    }

    /// Offers `compactor_compact` when `on` (`compaction.agent_tool` for
    /// the request's tenant and model), the mode lets the proxy rewrite the
    /// request, it is not the client's own compaction request, and the
    /// request may have it (see [`agent_tool::offers`]).
    pub fn offer_agent_tool(&mut self, on: bool) {
        let request = &self.request;
        let offered = &mut self.offered;
        offered.agent_tool = on
            && request.mode().rewrites()
            && !self.conversation.client_compaction
            && agent_tool::offers(request.body(), request.tools().map(Tools::value));
        offered.agent_offered |= offered.agent_tool;
    }

    /// Takes the recall tool away for the rest of the request; with
    /// `forget`, the rounds' calls and answers too.
    pub fn withdraw_recall(&mut self, forget: bool) {
        self.offered.recall = false;
        self.offered.recall_withdrawn = true;
        if forget {
            self.upstream.extra.clear();
        }
    }

    /// Takes `compactor_compact` away for the rest of the request (its
    /// calls are still looked for, and never relayed).
    pub fn withdraw_agent_tool(&mut self) {
        self.offered.agent_tool = false;
    }

    /// Goes back to the client's own items. On Anthropic Messages with
    /// thinking on, the client's history may hold thinking the API signed
    /// against an earlier compacted request, which it would refuse as sent:
    /// the request lets the API drop such blocks.
    pub fn unapply(&mut self) {
        let request = &self.request;
        let up = &mut self.upstream;
        up.view = request.items().clone();
        up.compaction = None;
        up.drop_block = request.api().format().signs_thinking(request.body());
        self.offered.recall = false;
        up.extra.clear();
    }

    /// What a compaction of this request starts from (in observe mode,
    /// the client's items and the would-be compaction before).
    pub fn input(&self, reason: String, whole: bool) -> Input {
        let request = &self.request;
        let mode = request.mode();
        let observe = mode == Mode::Observe;
        Input {
            who: engine::Who {
                api: request.api(),
                tenant: request.tenant().to_string(),
                conversation: self.conversation().to_string(),
                model: request.model().to_string(),
                auth: request.auth().clone(),
            },
            request: engine::Request {
                view: self.upstream.view.clone(),
                chains: self.digest.chains.clone(),
                base: if observe {
                    self.upstream.observed.clone()
                } else {
                    self.upstream.compaction.clone()
                },
                tools: request.tools().cloned(),
                system: request.api().format().system(request.body()),
                sent: self.as_sent(),
                requested: self.timing.started,
            },
            ask: engine::Ask {
                reason,
                goal: engine::Goal::Shrink,
                whole,
                keep: None,
                soft: false,
            },
            serving: engine::Serving {
                observe,
                provider_compaction: crate::compaction::boundary::asks_provider_compaction(
                    request.api(),
                    request.body(),
                ),
                no_trigger: self.conversation.deferred || mode == Mode::Manual,
            },
        }
    }

    /// What the upstream last saw of the request but its items (the view):
    /// its body with the tools as they went, the proxy's among them (see
    /// [`engine::Sent`]). Chat Completions and Messages: a summary call
    /// repeats it so its history is a cache read.
    pub(super) fn as_sent(&self) -> Option<Arc<engine::Sent>> {
        let request = &self.request;
        let api = request.api();
        if !api.summary_repeats_request() || !request.mode().rewrites() {
            return None;
        }
        let mut body = request.body().clone();
        if self.upstream.drop_block {
            crate::wire::messages::with_block_binding(&mut body);
        }
        Some(Arc::new(engine::Sent::new(
            api,
            body,
            request.tools().cloned(),
            (self.offered.agent_tool, self.offered.recall),
            // With the betas the attempt added (a provider's compaction
            // block, a thinking block the API may drop): the repeated body
            // means what it meant upstream only under them.
            self.upstream_headers(request.provider_headers())
                .into_owned(),
        )))
    }
}
