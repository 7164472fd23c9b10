//! The request read and parsed: what the read hands to identify, which
//! moves it whole into the exchange (`server::exchange`), where every later
//! phase reads it. Not a phase: it calls none.

use std::sync::Arc;

use http::HeaderMap;
use serde_json::Value;

use super::control::Control;
use crate::config::Mode;
use crate::engine;
use crate::store::{bounded_text, ClientIds, MAX_CLIENT_CHARS};
use crate::upstream::Payload;
use crate::wire::items::{ItemList, Tools};
use crate::wire::{self, Api, ItemHash};

/// A request read and parsed: the one representation of it that the later
/// phases share, never changed once read (what changes is the exchange's).
pub(super) struct ReadRequest {
    /// Who sent it.
    client: Client,
    /// What it asks of the model.
    parsed: Parsed,
    /// The client's bytes, and whether they can go upstream as they came.
    sent: AsSent,
    /// The mode it is served in, and whether the client asked for it to be
    /// compacted now.
    control: Control,
    /// The `previous_response_id` the client gave.
    previous: Option<String>,
    /// The input ended with Codex's in-band `compaction_trigger`.
    trigger: bool,
}

/// Who sent a request, and what its headers (and body) call it.
pub(super) struct Client {
    /// Tenant hash.
    tenant: String,
    /// The client's credential headers, kept in memory for summary calls.
    auth: HeaderMap,
    /// The provider headers that decide what its body means, repeated by a
    /// summary call that reads the request from the prompt cache.
    provider_headers: HeaderMap,
    /// The client, from its `user-agent`.
    user_agent: Option<String>,
    /// The ids the client sent for its conversation, as sent.
    ids: ClientIds,
    /// The explicit key the conversation goes by, if any.
    explicit_key: Option<String>,
    /// Codex marks the request as its own compaction request.
    own_compaction: bool,
}

/// What a request asks of the model: its body split into its parts.
pub(super) struct Parsed {
    /// Which API.
    api: Api,
    /// The model asked for.
    model: String,
    /// The client asked for a stream.
    streamed: bool,
    /// The body without its items and tools: model, sampling parameters.
    /// Stream usage the proxy asks for is added only to the bytes that go
    /// upstream.
    body: Value,
    /// The items, expanded where the proxy stands for them (the client's
    /// bytes until something must look inside).
    items: Arc<ItemList>,
    /// The tool definitions, if any (`body` holds `null` in their place).
    tools: Option<Tools>,
}

/// The client's bytes, as far as they can go upstream as they came.
pub(super) struct AsSent {
    /// The bytes that go upstream while no compaction applies: the
    /// client's, or theirs with the stream-usage member spliced in. `None`
    /// when the body must be rebuilt from its parts (an expanded history,
    /// a usage request that cannot be spliced in).
    original: Option<Payload>,
    /// The proxy asks for stream usage the client did not ask for.
    strip_usage: bool,
    /// The key of the body's bytes without items, when they are the
    /// client's own (see [`crate::wire::items::ItemCaches::cached_hash`]).
    body_key: Option<ItemHash>,
    /// The body's length as received.
    raw_len: usize,
}

impl Client {
    /// The sender of a request to `tenant`, from its `headers` and the
    /// `body` as read.
    pub(super) fn of(tenant: String, headers: &HeaderMap, body: &Value) -> Self {
        Self {
            tenant,
            auth: engine::auth_headers(headers),
            provider_headers: engine::provider_headers(headers),
            user_agent: header_text(headers, http::header::USER_AGENT.as_str())
                .map(|ua| bounded_text(ua, MAX_CLIENT_CHARS)),
            ids: wire::client_ids(headers, body),
            explicit_key: wire::explicit_conversation_key(headers, body),
            own_compaction: super::control::is_client_compaction(headers),
        }
    }
}

impl Parsed {
    /// A body of `api` asking for `model`, `streamed` or not, split into
    /// its parameters, `items` and `tools`.
    pub(super) fn new(
        api: Api,
        model: String,
        streamed: bool,
        body: Value,
        items: ItemList,
        tools: Option<Tools>,
    ) -> Self {
        Self {
            api,
            model,
            streamed,
            body,
            items: Arc::new(items),
            tools,
        }
    }
}

impl AsSent {
    /// What can go upstream of a body of `raw_len` bytes (see the fields).
    pub(super) fn new(
        original: Option<Payload>,
        strip_usage: bool,
        body_key: Option<ItemHash>,
        raw_len: usize,
    ) -> Self {
        Self {
            original,
            strip_usage,
            body_key,
            raw_len,
        }
    }
}

impl ReadRequest {
    /// The request of `client`, asking `parsed`, sent as `sent`, served
    /// under `control`, continuing `previous`, and ending with Codex's
    /// `trigger` or not.
    pub(super) fn new(
        client: Client,
        parsed: Parsed,
        sent: AsSent,
        control: Control,
        previous: Option<String>,
        trigger: bool,
    ) -> Self {
        Self {
            client,
            parsed,
            sent,
            control,
            previous,
            trigger,
        }
    }

    /// Which API.
    pub(super) fn api(&self) -> Api {
        self.parsed.api
    }

    /// Tenant hash.
    pub(super) fn tenant(&self) -> &str {
        &self.client.tenant
    }

    /// The model asked for.
    pub(super) fn model(&self) -> &str {
        &self.parsed.model
    }

    /// Whether the client asked for a stream.
    pub(super) fn streamed(&self) -> bool {
        self.parsed.streamed
    }

    /// The body without its items and tools.
    pub(super) fn body(&self) -> &Value {
        &self.parsed.body
    }

    /// The items, as the client sent them (expanded where the proxy stands
    /// for them).
    pub(super) fn items(&self) -> &Arc<ItemList> {
        &self.parsed.items
    }

    /// The tool definitions, if any.
    pub(super) fn tools(&self) -> Option<&Tools> {
        self.parsed.tools.as_ref()
    }

    /// The client's credential headers (for summary calls, and to redact).
    pub(super) fn auth(&self) -> &HeaderMap {
        &self.client.auth
    }

    /// The provider headers that decide what its body means
    /// (`anthropic-version`, `anthropic-beta`).
    pub(super) fn provider_headers(&self) -> &HeaderMap {
        &self.client.provider_headers
    }

    /// The client, from its `user-agent`.
    pub(super) fn user_agent(&self) -> Option<&str> {
        self.client.user_agent.as_deref()
    }

    /// The ids the client sent for its conversation, as sent.
    pub(super) fn client_ids(&self) -> &ClientIds {
        &self.client.ids
    }

    /// The explicit key the conversation goes by, if any.
    pub(super) fn explicit_key(&self) -> Option<&str> {
        self.client.explicit_key.as_deref()
    }

    /// Whether the client's headers mark it as its own compaction request
    /// (Codex's `request_kind: compaction`).
    pub(super) fn marked_client_compaction(&self) -> bool {
        self.client.own_compaction
    }

    /// The bytes that go upstream while no compaction applies, when they
    /// need not be rebuilt.
    pub(super) fn original(&self) -> Option<&Payload> {
        self.sent.original.as_ref()
    }

    /// Whether the proxy asks for stream usage the client did not ask for.
    pub(super) fn strip_usage(&self) -> bool {
        self.sent.strip_usage
    }

    /// The key of the body's bytes without items, when they are the
    /// client's own.
    pub(super) fn body_key(&self) -> Option<ItemHash> {
        self.sent.body_key
    }

    /// The body's length as received.
    pub(super) fn raw_len(&self) -> usize {
        self.sent.raw_len
    }

    /// The mode it is served in.
    pub(super) fn mode(&self) -> Mode {
        self.control.mode
    }

    /// Serves it in observe mode: its conversation is held out of
    /// compaction.
    pub(super) fn hold_out(&mut self) {
        self.control.mode = Mode::Observe;
        self.control.compact_now = false;
    }

    /// Whether the client asked for it to be compacted now.
    pub(super) fn asks_compaction_now(&self) -> bool {
        self.control.compact_now
    }

    /// The `previous_response_id` the client gave.
    pub(super) fn previous(&self) -> Option<&str> {
        self.previous.as_deref()
    }

    /// Whether the input ended with Codex's in-band `compaction_trigger`.
    pub(super) fn trigger(&self) -> bool {
        self.trigger
    }
}

/// A header's text, if present, text and not blank.
fn header_text<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}
