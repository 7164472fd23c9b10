//! Wire formats: an *item* view over the four APIs, what the phases ask of each ([`mod@format`]), content hashes, usage.
//!
//! Owns the knowledge of where the history lives in a request body
//! (`messages` for Chat Completions and Anthropic Messages, `instructions` +
//! `input` for Responses, `contents` for Gemini) and where usage and output live in an answer. Works on `serde_json::Value`
//! so nothing the proxy does not understand is ever dropped.

pub mod chat;
pub mod class;
pub mod format;
pub mod gemini;
pub mod hash;
pub mod items;
pub mod messages;
mod messages_stream;
pub mod own_calls;
pub mod responses;
pub mod splice;
pub mod sse;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::InvalidField;

pub use hash::{chain_extend, chain_hashes, item_hash, ItemHash};

/// Which of the parsed APIs a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/messages` (Anthropic Messages)
    Messages,
    /// `POST /v1beta/models/{model}:generateContent` (Gemini)
    Gemini,
}

impl Api {
    /// This API's answers to what the phases ask of its wire format.
    pub fn format(self) -> &'static dyn format::Format {
        match self {
            Api::Chat => &chat::Chat,
            Api::Responses => &responses::Responses,
            Api::Messages => &messages::Messages,
            Api::Gemini => &gemini::Gemini,
        }
    }

    /// The endpoint path below the API prefix, as recorded.
    pub fn endpoint(self) -> &'static str {
        match self {
            Api::Chat => "/chat/completions",
            Api::Responses => "/responses",
            Api::Messages => "/messages",
            Api::Gemini => "/generateContent",
        }
    }

    /// The path below the upstream's base a request to `client_path` goes
    /// to: the endpoint, or for Gemini the client's path below its version
    /// prefix (it names the model).
    pub fn upstream_path(self, client_path: &str) -> std::borrow::Cow<'static, str> {
        match (self, gemini::route(client_path)) {
            (Api::Gemini, Some(route)) => route.below.into(),
            _ => self.endpoint().into(),
        }
    }

    /// The model a request asks for and whether it streams: the body's
    /// `model` and `stream`, or for Gemini the path's model and method
    /// (`:streamGenerateContent` with `alt=sse`; without it the answer is
    /// one JSON array, read whole).
    pub fn model_and_stream(self, body: &Value, uri: &http::Uri) -> (String, bool) {
        if self == Api::Gemini {
            return match gemini::route(uri.path()) {
                Some(r) => {
                    let sse = r.method == gemini::Method::Stream && gemini::asks_sse(uri.query());
                    (r.model, sse)
                }
                None => (String::new(), false),
            };
        }
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let streamed = body.get("stream").and_then(Value::as_bool) == Some(true);
        (model.to_string(), streamed)
    }

    /// The endpoint a summary call for a conversation of this API goes to:
    /// Chat Completions for both OpenAI APIs (every compatible server has
    /// it), Messages for Anthropic's, `generateContent` for Gemini's (below
    /// `/models/{model}`, see [`gemini::model_path`]).
    pub fn summary_endpoint(self) -> &'static str {
        match self {
            Api::Messages | Api::Gemini => self.endpoint(),
            _ => "/chat/completions",
        }
    }

    /// Whether a summary call for a conversation of this API goes to the
    /// API's own endpoint, so it may repeat the request as sent (its
    /// history then a cache read).
    pub fn summary_repeats_request(self) -> bool {
        self != Api::Gemini && self.summary_endpoint() == self.endpoint()
    }

    /// The shape of the errors this endpoint's clients read.
    pub fn error_shape(self) -> crate::error::ErrorShape {
        match self {
            Api::Messages => crate::error::ErrorShape::Anthropic,
            Api::Gemini => crate::error::ErrorShape::Google,
            _ => crate::error::ErrorShape::OpenAi,
        }
    }

    /// The name used in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Responses => "responses",
            Api::Messages => "messages",
            Api::Gemini => "gemini",
        }
    }

    /// The request field that holds the items (`input` for Responses also
    /// has `instructions` before it).
    pub fn items_key(self) -> &'static str {
        match self {
            Api::Chat | Api::Messages => "messages",
            Api::Responses => "input",
            Api::Gemini => "contents",
        }
    }

    /// The items of a body [`items::split_body`] parsed: the byte ranges it
    /// found (after the `instructions` pseudo-item), or, when the item field
    /// was no array, the items moved out of `body` as [`Api::take_items`]
    /// does.
    pub fn item_list(
        self,
        body: &mut Value,
        raw: bytes::Bytes,
        spans: Option<Vec<std::ops::Range<usize>>>,
    ) -> items::ItemList {
        match spans {
            Some(spans) => {
                let head = match self {
                    Api::Chat | Api::Messages | Api::Gemini => Vec::new(),
                    Api::Responses => responses::instructions_item(body).into_iter().collect(),
                };
                items::ItemList::raw(head, raw, spans)
            }
            None => self.take_items(body).into(),
        }
    }

    /// The history of a request as an ordered list of items (a copy; the
    /// request path moves them out with [`Api::take_items`] instead).
    pub fn request_items(self, body: &Value) -> Vec<Value> {
        self.take_items(&mut body.clone())
    }

    /// Moves the history out of a request body (leaving an empty list in
    /// its place, so putting items back keeps the body's key order): the
    /// items of the history, in order, without copying them.
    pub fn take_items(self, body: &mut Value) -> Vec<Value> {
        match self {
            Api::Chat | Api::Messages | Api::Gemini => match body.get_mut(self.items_key()) {
                Some(Value::Array(a)) => std::mem::take(a),
                _ => Vec::new(),
            },
            Api::Responses => responses::take_items(body),
        }
    }

    /// Puts `items` in a request body as its history, the inverse of
    /// [`Api::take_items`]: `messages` for chat; `input` for Responses
    /// (where `instructions` stays the body's own field and a leading
    /// instructions pseudo-item is dropped).
    pub fn set_items(self, body: &mut Value, items: &[Value]) {
        match self {
            Api::Chat | Api::Messages | Api::Gemini => {
                body[self.items_key()] = Value::Array(items.to_vec())
            }
            Api::Responses => {
                let skip = usize::from(items.first().is_some_and(responses::is_instructions_item));
                body["input"] = Value::Array(items[skip..].to_vec());
            }
        }
    }

    /// The one place a request body is rebuilt from its parts: `body` (the
    /// parameters without items and tools) with `items` as its history and
    /// `tools` put back; a Chat stream asks for usage (see
    /// [`chat::ensure_stream_usage`]). The client's body is left as it is.
    pub fn rebuild_body(
        self,
        body: &Value,
        items: &[Value],
        tools: Option<&items::Tools>,
    ) -> serde_json::Result<bytes::Bytes> {
        let mut full = body.clone();
        if self == Api::Chat {
            chat::ensure_stream_usage(&mut full);
        }
        self.set_items(&mut full, items);
        items::Tools::restore(tools, &mut full);
        serde_json::to_vec(&full).map(bytes::Bytes::from)
    }

    /// Checks that the body has the shape this endpoint needs, naming the
    /// offending field otherwise.
    pub fn validate(self, body: &Value) -> Result<(), InvalidField> {
        let obj = body.as_object().ok_or_else(InvalidField::not_an_object)?;
        if let Some(m) = obj.get("model") {
            if !m.is_string() {
                return Err(InvalidField::wrong_type("model", "a string"));
            }
        }
        if let Some(s) = obj.get("stream") {
            if !s.is_boolean() && !s.is_null() {
                return Err(InvalidField::wrong_type("stream", "a boolean"));
            }
        }
        match self {
            Api::Chat => chat::validate(obj),
            Api::Responses => responses::validate(obj),
            Api::Messages => messages::validate(obj),
            Api::Gemini => gemini::validate(obj),
        }
    }

    /// Usage figures of a complete (non-streamed) answer body.
    pub fn usage(self, body: &Value) -> Option<Usage> {
        if self == Api::Gemini {
            return gemini::usage(body);
        }
        let usage = body.get("usage")?;
        match self {
            Api::Messages => messages::usage_of(usage),
            _ => Usage::from_value(usage),
        }
    }

    /// Output items of a complete (non-streamed) answer body.
    pub fn response_items(self, body: &Value) -> Vec<Value> {
        match self {
            Api::Chat => chat::response_items(body),
            Api::Responses => responses::response_items(body),
            Api::Messages => messages::response_items(body),
            Api::Gemini => gemini::response_items(body),
        }
    }

    /// An answer's output item as its client is likely to send it back,
    /// when that differs from the item: `None` if the same.
    pub fn echoed(self, item: &Value) -> Option<Value> {
        match self {
            Api::Chat => chat::echoed(item),
            Api::Responses | Api::Messages | Api::Gemini => None,
        }
    }
}

/// Token usage as the upstream reported it, normalised across both APIs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt / input tokens.
    pub input_tokens: u64,
    /// Completion / output tokens.
    pub output_tokens: u64,
    /// Prompt tokens served from the upstream's cache, when reported.
    pub cached_tokens: Option<u64>,
    /// Prompt tokens written to the upstream's cache, when reported
    /// (Anthropic `cache_creation_input_tokens`; an OpenAI-compatible
    /// `cache_write_tokens` or `cache_creation_tokens` in the details).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    /// Of `cache_write_tokens`, those written for an hour (Anthropic
    /// `cache_creation.ephemeral_1h_input_tokens`); the rest were written
    /// for five minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_1h_tokens: Option<u64>,
}

impl Usage {
    /// Reads either API's usage object (`prompt_tokens`/`completion_tokens`
    /// or `input_tokens`/`output_tokens`). `null` or no figures: `None`.
    pub fn from_value(v: &Value) -> Option<Usage> {
        let obj = v.as_object()?;
        let get = |k: &str| obj.get(k).and_then(Value::as_u64);
        let input = get("prompt_tokens").or_else(|| get("input_tokens"))?;
        let output = get("completion_tokens")
            .or_else(|| get("output_tokens"))
            .unwrap_or(0);
        let details = obj
            .get("prompt_tokens_details")
            .or_else(|| obj.get("input_tokens_details"));
        let detail = |k: &str| details.and_then(|d| d.get(k)).and_then(Value::as_u64);
        let cached = detail("cached_tokens");
        let written = ["cache_write_tokens", "cache_creation_tokens"]
            .into_iter()
            .find_map(detail);
        Some(Usage {
            input_tokens: input,
            output_tokens: output,
            cached_tokens: cached,
            cache_write_tokens: written,
            cache_write_1h_tokens: None,
        })
    }

    /// Input plus output: what the conversation occupies after this exchange.
    pub fn total(&self) -> u64 {
        self.input_tokens + self.output_tokens
    }
}

/// What a client's credential header holds, if any: the first of
/// [`crate::redact::CREDENTIAL_HEADERS`] it sent (`Authorization`,
/// `api-key`, `x-api-key`).
pub fn credential(headers: &http::HeaderMap) -> Option<&[u8]> {
    crate::redact::CREDENTIAL_HEADERS
        .iter()
        .find_map(|name| headers.get(*name))
        .map(|v| v.as_bytes())
}

/// The ids a client sent for its conversation, each as sent (cut to
/// `MAX_CLIENT_ID_CHARS`): what people call the conversation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientIds {
    /// Our `x-compactor-conversation` header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A `session-id` / `session_id` header (Codex sends one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The body's `prompt_cache_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<String>,
}

impl ClientIds {
    /// The distinct ids, in the order [`ClientIds`] lists them.
    pub fn distinct(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for id in [&self.header, &self.session, &self.cache_key]
            .into_iter()
            .flatten()
        {
            if !out.contains(&id.as_str()) {
                out.push(id);
            }
        }
        out
    }
}

/// Most characters kept of each client-sent id.
pub const MAX_CLIENT_ID_CHARS: usize = 200;

/// The ids a client sent for its conversation: our header, a session
/// header (Codex's `session-id`), the body's `prompt_cache_key`; each cut to
/// [`MAX_CLIENT_ID_CHARS`].
pub fn client_ids(headers: &http::HeaderMap, body: &Value) -> ClientIds {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    let bounded = |s: &str| Some(bounded_text(s, MAX_CLIENT_ID_CHARS));
    ClientIds {
        header: text("x-compactor-conversation").and_then(bounded),
        session: SESSION_HEADERS
            .into_iter()
            .find_map(text)
            .map(String::from)
            .or_else(|| messages::metadata_session(body))
            .as_deref()
            .and_then(bounded),
        cache_key: body
            .get("prompt_cache_key")
            .and_then(Value::as_str)
            .filter(|k| !k.trim().is_empty())
            .and_then(bounded),
    }
}

/// `s` cut to at most `max` characters (with an ellipsis when cut).
pub fn bounded_text(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        None => s.to_string(),
        Some((at, _)) => {
            let mut out = s[..at].to_string();
            out.push('…');
            out
        }
    }
}

/// The headers that carry a client's session id: Codex's `session-id`
/// (or `session_id`), Claude Code's `x-claude-code-session-id`.
pub const SESSION_HEADERS: [&str; 3] = ["session-id", "session_id", "x-claude-code-session-id"];

/// An explicit conversation key the client sent, in order of preference:
/// our own header, a session header ([`SESSION_HEADERS`]),
/// `prompt_cache_key`, then `metadata.session_id`/`metadata.conversation_id`
/// or the session in Claude Code's `metadata.user_id`. Every session id
/// shares one namespace, so a client that sends it in two places is one
/// conversation. A key longer than [`MAX_KEY_BYTES`] stands as a hash of
/// itself in a namespace of its own (`…#blake3:`), so that any length a
/// client sends names one conversation and fits every store's index.
pub fn explicit_conversation_key(headers: &http::HeaderMap, body: &Value) -> Option<String> {
    let key = client_conversation_key(headers, body)?;
    if key.len() <= MAX_KEY_BYTES {
        return Some(key);
    }
    let (ns, _) = key.split_once(':').unwrap_or(("key", ""));
    let digest = blake3::hash(key.as_bytes());
    Some(format!("{ns}#blake3:{}", digest.to_hex()))
}

/// The longest explicit conversation key kept as the client sent it
/// (PostgreSQL's B-tree index takes about 2,700 bytes a row).
pub const MAX_KEY_BYTES: usize = 512;

fn client_conversation_key(headers: &http::HeaderMap, body: &Value) -> Option<String> {
    let header = |name: &str| {
        headers
            .get(name)
            // Any UTF-8 id: `to_str` takes visible ASCII only.
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
            .filter(|v| !v.is_empty())
    };
    if let Some(v) = header("x-compactor-conversation") {
        return Some(format!("x-compactor-conversation:{v}"));
    }
    for name in SESSION_HEADERS {
        if let Some(v) = header(name) {
            // `session_id` keeps the key it always had.
            let ns = if name == "session_id" {
                name
            } else {
                "session-id"
            };
            return Some(format!("{ns}:{v}"));
        }
    }
    if let Some(k) = body.get("prompt_cache_key").and_then(Value::as_str) {
        // Codex sends the same value as its `session-id` header; keep one namespace.
        return Some(format!("session-id:{k}"));
    }
    let meta = body.get("metadata")?;
    for key in ["session_id", "conversation_id"] {
        if let Some(v) = meta.get(key).and_then(Value::as_str) {
            return Some(format!("session-id:{v}"));
        }
    }
    messages::metadata_session(body).map(|v| format!("session-id:{v}"))
}

/// A JSON object's members in order, values left as raw JSON: read
/// without building a tree, so the bytes of each member can be kept as sent.
pub struct RawMembers<'a>(pub Vec<(String, &'a serde_json::value::RawValue)>);

impl<'de> serde::Deserialize<'de> for RawMembers<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Members;
        impl<'de> serde::de::Visitor<'de> for Members {
            type Value = RawMembers<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    out.push(entry);
                }
                Ok(RawMembers(out))
            }
        }
        d.deserialize_map(Members)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_of_both_apis() {
        let chat = json!({"prompt_tokens": 32, "completion_tokens": 8, "total_tokens": 40,
                          "prompt_tokens_details": {"cached_tokens": 4}});
        assert_eq!(
            Usage::from_value(&chat),
            Some(Usage {
                input_tokens: 32,
                output_tokens: 8,
                cached_tokens: Some(4),
                ..Usage::default()
            })
        );
        // A cache write, where an OpenAI-compatible upstream reports one.
        let written = json!({"prompt_tokens": 3000, "completion_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 1024, "cache_write_tokens": 1900}});
        let u = Usage::from_value(&written).unwrap();
        assert_eq!(
            (u.cached_tokens, u.cache_write_tokens),
            (Some(1024), Some(1900))
        );
        let resp = json!({"input_tokens": 10, "output_tokens": 3, "total_tokens": 13});
        assert_eq!(Usage::from_value(&resp).unwrap().total(), 13);
        assert_eq!(Usage::from_value(&Value::Null), None);
    }

    #[test]
    fn a_long_explicit_key_is_one_bounded_key() {
        let long = "k".repeat(12_000);
        let body = json!({"prompt_cache_key": long});
        let key = explicit_conversation_key(&http::HeaderMap::new(), &body).unwrap();
        assert!(key.len() <= MAX_KEY_BYTES, "{}", key.len());
        assert!(key.starts_with("session-id#blake3:"), "{key}");
        assert_eq!(
            explicit_conversation_key(&http::HeaderMap::new(), &body),
            Some(key.clone()),
            "the same key every time"
        );
        let other = json!({"prompt_cache_key": format!("{long}x")});
        assert_ne!(
            explicit_conversation_key(&http::HeaderMap::new(), &other),
            Some(key)
        );
        let short = json!({"prompt_cache_key": "abc"});
        assert_eq!(
            explicit_conversation_key(&http::HeaderMap::new(), &short).as_deref(),
            Some("session-id:abc")
        );
    }

    #[test]
    fn explicit_keys_share_a_namespace() {
        let mut h = http::HeaderMap::new();
        h.insert("session-id", "abc".parse().unwrap());
        let body = json!({"prompt_cache_key": "abc"});
        assert_eq!(
            explicit_conversation_key(&h, &json!({})),
            explicit_conversation_key(&http::HeaderMap::new(), &body)
        );
    }
}
