//! Which API a request belongs to ([`Api`]), and what each asks of its
//! wire format: where its items, model, usage and output live, how its
//! body is checked and rebuilt.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::usage::Usage;
use super::{chat, format, gemini, items, messages, responses};
use crate::error::InvalidField;

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
        match (self, gemini::route_below(client_path)) {
            (Api::Gemini, Some(below)) => below.to_string().into(),
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
