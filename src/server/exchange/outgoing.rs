//! What goes upstream of an exchange: the body (the client's bytes, them
//! with the compaction spliced in, or the body rebuilt around the view),
//! the headers of an attempt, and the hashes of what is sent.

use std::borrow::Cow;
use std::sync::Arc;

use serde_json::Value;

use super::pending::PendingExchange;
use crate::compaction::{agent_tool, recall, Compaction};
use crate::error::ProxyError;
use crate::upstream::Payload;
use crate::wire::items::Tools;
use crate::wire::{messages, Api, ItemHash};

impl PendingExchange {
    /// The headers of an attempt: `headers`, with the beta a request that
    /// lets the API drop a thinking block needs.
    pub fn upstream_headers<'a>(&self, headers: &'a http::HeaderMap) -> Cow<'a, http::HeaderMap> {
        let up = &self.upstream;
        // A provider's compaction block in the view: every request carrying
        // it needs the beta it was made under.
        let compact_beta = self.request.api() == Api::Messages
            && up
                .compaction
                .as_ref()
                .is_some_and(|c| crate::compaction::provider::carries_block(&c.replacement));
        if !up.drop_block && !compact_beta {
            return Cow::Borrowed(headers);
        }
        let mut out = headers.clone();
        if up.drop_block {
            messages::add_binding_beta(&mut out);
        }
        if compact_beta {
            crate::compaction::provider::add_beta(&mut out);
        }
        Cow::Owned(out)
    }

    /// The body to send upstream: the client's bytes while they can go as
    /// they came, else the body rebuilt around the items of the view.
    pub fn upstream_bytes(&self) -> Result<Payload, ProxyError> {
        if let (None, Some(original), false, false) = (
            &self.upstream.compaction,
            self.request.original(),
            self.upstream.drop_block,
            self.offered.agent_tool,
        ) {
            return Ok(original.clone());
        }
        if let Some(spliced) = self.spliced_bytes() {
            return Ok(spliced);
        }
        let bound;
        let body = if self.upstream.drop_block {
            let mut b = self.request.body().clone();
            messages::with_block_binding(&mut b);
            bound = b;
            &bound
        } else {
            self.request.body()
        };
        if !self.offered.recall && !self.offered.agent_tool && self.upstream.extra.is_empty() {
            return self
                .request
                .api()
                .rebuild_body(body, &self.upstream.view.values(), self.request.tools())
                .map(Payload::from)
                .map_err(ProxyError::internal);
        }
        let mut items = self.upstream.view.values().to_vec();
        items.extend(self.upstream.extra.iter().cloned());
        let with_recall = (self.offered.recall || self.offered.agent_tool).then(|| {
            let tools = self
                .request
                .tools()
                .map(Tools::value)
                .unwrap_or(&Value::Null);
            let recall = self
                .offered
                .recall
                .then(|| recall::definition(self.request.api()));
            let listed =
                agent_tool::with_tools(self.request.api(), tools, self.offered.agent_tool, recall);
            let mut body = serde_json::json!({ "tools": listed });
            Tools::take(&mut body)
        });
        let tools = with_recall
            .as_ref()
            .map_or(self.request.tools(), Option::as_ref);
        self.request
            .api()
            .rebuild_body(body, &items, tools)
            .map(Payload::from)
            .map_err(ProxyError::internal)
    }

    /// The request as the client's bytes with the compaction's JSON in
    /// place of the items it covers and the proxy's tools (recall, the
    /// agent's compaction tool) after the client's, nothing parsed or
    /// serialised but those: where the view is exactly the replacement
    /// followed by the client's items past it, and nothing else changes (no
    /// recall rounds, no thinking block to drop). Else `None`: the body is
    /// rebuilt.
    fn spliced_bytes(&self) -> Option<Payload> {
        let up = &self.upstream;
        let api = self.request.api();
        if api.format().edits_view() || up.drop_block || !up.extra.is_empty() {
            return None;
        }
        let items = self.request.items();
        let body = items.body_bytes();
        let mut edits = Vec::with_capacity(2);
        if up.compaction.is_some() {
            let c = self.plain_compaction()?;
            let (cut, follow) = items.covered_span(c.covered_len)?;
            edits.push((cut, c.replacement_json(api, follow)));
        }
        let added = agent_tool::added(
            api,
            self.offered.agent_tool,
            self.offered.recall.then(|| recall::definition(api)),
        );
        if !added.is_empty() {
            edits.push(self.request.tools()?.appended(body, &added)?);
        }
        self.request.original()?.with_cuts_replaced(body, edits)
    }

    /// The compaction applied, when the view is its replacement followed
    /// by the client's items past it, unchanged: in every API but
    /// Anthropic Messages, whose view [`PendingExchange::apply`] edits.
    fn plain_compaction(&self) -> Option<&Compaction> {
        self.upstream
            .compaction
            .as_deref()
            .filter(|_| !self.request.api().format().edits_view())
    }

    /// The hashes of the view's items when they are known without hashing
    /// anything: the request's own, or those of a plain compaction's
    /// replacement (made once per compaction) followed by the request's
    /// past what it covers.
    pub(super) fn view_hashes(&self) -> Option<Arc<Vec<ItemHash>>> {
        if Arc::ptr_eq(&self.upstream.view, self.request.items()) {
            return Some(self.digest.hashes.clone());
        }
        let c = self.plain_compaction()?;
        let tail = self.digest.hashes.get(c.covered_len..)?;
        let mut all = Vec::with_capacity(c.replacement.len() + tail.len());
        all.extend_from_slice(c.replacement_hashes());
        all.extend_from_slice(tail);
        Some(Arc::new(all))
    }
}
