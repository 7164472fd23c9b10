//! What a compaction starts from: the request as it would go upstream,
//! what is asked of the result, and what the upstream last saw.

use std::sync::{Arc, OnceLock};

use http::HeaderMap;
use serde_json::Value;

use crate::compaction::policy::Stated;
use crate::compaction::{agent_tool, recall, Compaction};
use crate::wire::items::{ItemList, Tools};
use crate::wire::{Api, ItemHash};

/// What a compaction starts from, grouped by subject: whose conversation
/// it is, the request as it would go upstream, what is asked of the
/// compaction, and how the conversation is served.
#[derive(Clone)]
pub struct Input {
    /// Whose conversation it is, and how its upstream is called.
    pub who: Who,
    /// The request as it would go upstream.
    pub request: Request,
    /// What is asked of the compaction.
    pub ask: Ask,
    /// How the conversation is served.
    pub serving: Serving,
}

/// Whose conversation a compaction is of, and how its upstream is called.
#[derive(Clone)]
pub struct Who {
    /// The conversation's wire format (the summary call uses it too).
    pub api: Api,
    /// Tenant.
    pub tenant: String,
    /// Conversation.
    pub conversation: String,
    /// The conversation's model.
    pub model: String,
    /// The client's credential headers, for the summarizer call (memory only).
    pub auth: HeaderMap,
}

/// The request a compaction starts from, as it would go upstream.
#[derive(Clone)]
pub struct Request {
    /// The request's items after any compaction already applied.
    pub view: Arc<ItemList>,
    /// Chain hashes of the original (client-sent) items.
    pub chains: Arc<Vec<ItemHash>>,
    /// The compaction already applied, if any.
    pub base: Option<Arc<Compaction>>,
    /// The request's tool definitions (they count against the window).
    pub tools: Option<Tools>,
    /// The request's top-level `system` (Anthropic Messages), which the
    /// provider's compaction call sends as the conversation does.
    pub system: Option<Value>,
    /// The request as the upstream last saw it, for a summary call that
    /// reads its history from the upstream's prompt cache.
    pub sent: Option<Arc<Sent>>,
    /// When the request arrived, on the process's monotonic clock (a
    /// wall clock set back would make a compaction stored before it look
    /// stored after it: see `engine::jobs`).
    pub requested: std::time::Instant,
}

/// What is asked of a compaction.
#[derive(Clone)]
pub struct Ask {
    /// Why.
    pub reason: String,
    /// What the result must achieve.
    pub goal: Goal,
    /// Compact the whole history, keeping no verbatim tail (explicit
    /// compaction requests: `/v1/responses/compact`, `compaction_trigger`).
    pub whole: bool,
    /// The model's own notes of what to keep (its `compactor_compact`
    /// call): the compaction is a summary, and they are a section of it.
    pub keep: Option<String>,
    /// The result is a background compaction (threshold, agent), counted at
    /// its first application: a threshold one's on the next request that
    /// extends it, the model's at the conversation's next turn boundary
    /// unless a request over the hard limit needs it sooner.
    pub soft: bool,
}

/// How the conversation a compaction is of is served.
#[derive(Clone, Copy)]
pub struct Serving {
    /// Observe mode: the result is recorded as what the proxy would have
    /// done, never applied. [`Request::view`] is then the client's items
    /// and [`Request::base`] the would-be compaction before, which is
    /// applied here first.
    pub observe: bool,
    /// The request asks the provider to compact
    /// ([`crate::compaction::boundary::asks_provider_compaction`]): the
    /// threshold trigger leaves the conversation to it.
    pub provider_compaction: bool,
    /// The threshold starts no compaction after this exchange: one already
    /// waits for the turn boundary, or the mode is manual.
    pub no_trigger: bool,
}

/// What the upstream last saw of a conversation's request, but its items
/// (the [`Request::view`]): a summary call that repeats it, with one user
/// message appended, reads everything before that message from the
/// upstream's prompt cache (see `engine::summarizer`).
///
/// Every exchange makes one, and few are read (a compaction's summary
/// call, an idle watch): the body as sent is put together on its first
/// read ([`Sent::body`]), so an exchange that no compaction follows never
/// parses its tools, nor lists the proxy's among them.
pub struct Sent {
    api: Api,
    /// The body without its items and tools.
    params: Value,
    /// The client's tools, as it sent them.
    tools: Option<Tools>,
    /// Whether `compactor_compact` and `compactor_recall` went with them.
    offered: (bool, bool),
    /// The request's provider headers that decide what its body means
    /// (`anthropic-version`, `anthropic-beta`); the credentials are
    /// [`Who::auth`].
    pub headers: HeaderMap,
    body: OnceLock<Value>,
}

impl Sent {
    /// What went upstream of an `api` request: `params` (its body without
    /// items and tools), the client's `tools`, whether the proxy's
    /// `compactor_compact` and `compactor_recall` were `offered` after
    /// them, and its provider `headers`.
    pub fn new(
        api: Api,
        params: Value,
        tools: Option<Tools>,
        offered: (bool, bool),
        headers: HeaderMap,
    ) -> Sent {
        Sent {
            api,
            params,
            tools,
            offered,
            headers,
            body: OnceLock::new(),
        }
    }

    /// The body without its items: the model, `system`, `tool_choice`,
    /// thinking, sampling parameters, and `tools` as sent (the proxy's own
    /// among them).
    pub fn body(&self) -> &Value {
        self.body.get_or_init(|| {
            let mut body = self.params.clone();
            if let Some(object) = body.as_object_mut() {
                match self.tools.as_ref().map(Tools::value) {
                    Some(tools) => {
                        let (agent, offered_recall) = self.offered;
                        let recall = offered_recall.then(|| recall::definition(self.api));
                        let listed = agent_tool::with_tools(self.api, tools, agent, recall);
                        object.insert("tools".into(), listed);
                    }
                    None => {
                        object.remove("tools");
                    }
                }
            }
            body
        })
    }
}

impl std::fmt::Debug for Sent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sent")
            .field("api", &self.api)
            .field("params", &self.params)
            .field("tools", &self.tools.as_ref().map(|t| t.hash))
            .field("offered", &self.offered)
            .finish_non_exhaustive()
    }
}

/// What a compaction must achieve; it escalates past the ladder until it
/// does, or declines before any summarizer call when nothing could.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Goal {
    /// Shrink the request by [`FIT_MARGIN`](crate::compaction::policy::FIT_MARGIN) at least (background, manual).
    #[default]
    Shrink,
    /// Fit the model's hard limit, window less max output (the pre-send
    /// check, explicit compaction requests).
    HardLimit,
    /// The upstream refused the request as too long.
    Overflow {
        /// What its answer stated.
        stated: Stated,
        /// The request's own max output, if it set one.
        max_output: Option<u64>,
    },
}

/// The label of a goal in logs and metrics.
pub(super) fn goal_kind(goal: Goal) -> &'static str {
    match goal {
        Goal::Shrink => "shrink",
        Goal::HardLimit => "hard_limit",
        Goal::Overflow { .. } => "overflow",
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::wire::items::{split_body, ItemCaches};

    /// The body a summary call repeats: the parameters, then the client's
    /// tools with the proxy's offered after them, put together when first
    /// read and the same on every read.
    #[test]
    fn the_body_as_sent_lists_the_proxys_tools_after_the_clients() {
        let raw = bytes::Bytes::from_static(
            br#"{"model":"m","tools":[{"type":"function","function":{"name":"read"}}],"messages":[{"role":"user","content":"hi"}]}"#,
        );
        let split = split_body(&raw, "messages").expect("splits");
        let caches = ItemCaches::default();
        let (span, key) = split.tools.expect("tools");
        let tools = Tools::raw(raw.clone(), span, key, &caches);
        let names = |body: &Value| -> Vec<String> {
            body["tools"]
                .as_array()
                .expect("tools")
                .iter()
                .map(|t| {
                    let name = t.pointer("/function/name").or_else(|| t.get("name"));
                    name.and_then(Value::as_str).unwrap_or_default().to_string()
                })
                .collect()
        };
        let sent = Sent::new(
            Api::Chat,
            split.body.clone(),
            Some(tools.clone()),
            (true, true),
            HeaderMap::new(),
        );
        assert_eq!(names(sent.body()), ["read", agent_tool::TOOL, recall::TOOL]);
        assert_eq!(sent.body()["model"], "m");
        assert!(std::ptr::eq(sent.body(), sent.body()));
        let plain = Sent::new(
            Api::Chat,
            split.body.clone(),
            Some(tools),
            (false, false),
            HeaderMap::new(),
        );
        assert_eq!(names(plain.body()), ["read"]);
        let none = Sent::new(Api::Chat, split.body, None, (true, true), HeaderMap::new());
        assert!(none.body().get("tools").is_none());
    }
}
