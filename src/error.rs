//! The proxy's request-path error type and its one mapping to an
//! OpenAI-style JSON error (`{"error":{"message","type","code"}}`).
//!
//! Upstream answers (4xx/5xx) are not errors here: they are relayed verbatim.
//! These are the failures the proxy itself must explain. Messages never carry
//! request headers, so credentials cannot leak through them.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};

/// Body type of every response the proxy produces.
pub type ProxyBody = UnsyncBoxBody<Bytes, BodyError>;

/// Error type a response body may fail with (ends the connection uncleanly).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// A source error of any kind, kept for the log and `source()`.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body that is JSON but not the shape its endpoint needs: which
/// field, and what is wrong with it, as OpenAI reports it (`param`, `code`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidField {
    /// The field at fault, as OpenAI names it (`messages[3]`); `None` for
    /// the body as a whole.
    pub param: Option<String>,
    /// `missing_required_parameter` or `invalid_type`.
    pub code: &'static str,
    /// What is wrong, naming the field.
    pub message: String,
}

impl InvalidField {
    /// A required field is absent.
    pub fn missing(param: &str) -> Self {
        InvalidField {
            param: Some(param.to_string()),
            code: "missing_required_parameter",
            message: format!("missing required field `{param}`"),
        }
    }

    /// A field has the wrong type: `expected` says what it must be ("an
    /// array").
    pub fn wrong_type(param: impl Into<String>, expected: &str) -> Self {
        let param = param.into();
        InvalidField {
            message: format!("`{param}` must be {expected}"),
            param: Some(param),
            code: "invalid_type",
        }
    }

    /// A required query parameter is absent or unreadable: `message` says
    /// what it must be.
    pub fn missing_query(param: &str, message: &str) -> Self {
        InvalidField {
            param: Some(param.to_string()),
            code: "missing_required_parameter",
            message: message.to_string(),
        }
    }

    /// The body is JSON but not an object.
    pub fn not_an_object() -> Self {
        InvalidField {
            param: None,
            code: "invalid_type",
            message: "request body must be a JSON object".into(),
        }
    }
}

/// A failure the proxy answers itself, tagged with where it came from.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The client's body is not JSON.
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    /// The client's body is JSON, but not the shape the endpoint needs.
    #[error(transparent)]
    InvalidRequest(#[from] InvalidField),
    /// The client's body could not be read to its end (the connection
    /// failed under it).
    #[error("could not read request body: {0}")]
    BodyUnreadable(#[source] BoxError),
    /// A compaction the client asked for (`/v1/responses/compact`, Codex's
    /// `compaction_trigger`) could not be made from its history: the
    /// compaction's own error, which says why.
    #[error("nothing to compact: {0}")]
    NothingToCompact(#[source] BoxError),
    /// The client's body exceeds `server.max_body_bytes`.
    #[error("request body exceeds the limit of {limit} bytes")]
    PayloadTooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// The path is not one the proxy serves.
    #[error("unknown endpoint: {method} {path}")]
    NotFound {
        /// Request method.
        method: String,
        /// Request path (no query string).
        path: String,
    },
    /// A path the proxy will not forward: it could leave the upstream's base
    /// path, or it spells a parsed endpoint another way. Text: a refusal
    /// has no cause, only a reason.
    #[error("{0}")]
    InvalidPath(String),
    /// The request came back to the proxy that sent it: the upstream is the
    /// proxy itself.
    #[error("request loop: this request already went through this proxy, so upstream.base_url points back at it")]
    LoopDetected,
    /// The client stopped sending its request body.
    #[error("the client sent nothing of its request body for {0} s")]
    RequestTimeout(u64),
    /// The upstream could not be reached, broke the connection, or did not
    /// answer in time: the upstream client's error, its message and its
    /// source. (A path it refuses is an [`ProxyError::InvalidPath`].)
    #[error(transparent)]
    Upstream(UpstreamFailure),
    /// A bug or resource failure inside the proxy (the cause is logged,
    /// not shown).
    #[error("internal error")]
    Internal(#[source] BoxError),
    /// The admin page or API refused the caller (see `admin::authorize`).
    #[error("{message}")]
    Forbidden {
        /// Which rule refused it.
        code: &'static str,
        /// What the caller can do about it.
        message: &'static str,
    },
    /// An endpoint that accepts other methods only.
    #[error("this admin endpoint accepts {allow} only")]
    MethodNotAllowed {
        /// The `Allow` header's value.
        allow: &'static str,
    },
    /// No recorded conversation has this id or id prefix. Text: the
    /// answer to a lookup, not a failure with a cause.
    #[error("{0}")]
    ConversationNotFound(String),
    /// The id prefix names several recorded conversations (text, as
    /// [`ProxyError::ConversationNotFound`]: it lists them).
    #[error("{0}")]
    ConversationAmbiguous(String),
    /// The store could not be read (the cause is logged, not shown).
    #[error("the store could not be read")]
    StoreUnavailable(#[source] BoxError),
    /// The store cannot take records now (its database is unreachable):
    /// the request is refused before it goes upstream, so that no answer
    /// goes out unrecorded (the cause is logged, not shown).
    #[error("the proxy's database is unreachable; try again shortly")]
    StoreDown(#[source] BoxError),
    /// `/readyz`: a check failed. The answer is the readiness report
    /// (`{"status":"not_ready","checks":{…}}`) whatever the endpoint's
    /// error shape: each failed check's finding is an [`Unready`]'s.
    #[error("not ready")]
    NotReady {
        /// Each check's finding, by name.
        checks: serde_json::Value,
    },
}

/// Why a readiness check (`/readyz`) failed. Its message is the finding
/// the probe reports, for operators: store errors and the upstream
/// client's carry no credentials (the upstream's never its URL).
#[derive(Debug, thiserror::Error)]
pub enum Unready {
    /// The store refused or failed (a stalled database, a writer gone):
    /// its own error.
    #[error("{0}")]
    Store(#[source] BoxError),
    /// The database file does not open for writing.
    #[error("the database is not writable: {0}")]
    NotWritable(#[source] std::io::Error),
    /// The store's writer, or its database, did not answer within the
    /// check's bound.
    #[error("{0} did not answer in time")]
    StoreSilent(&'static str),
    /// The upstream answered its probe with a server error.
    #[error("the upstream answered {0}")]
    UpstreamStatus(StatusCode),
    /// The probe could not be sent, or its answer not read: the error a
    /// request would get.
    #[error(transparent)]
    Request(ProxyError),
    /// The probe had no answer within its bound, in seconds.
    #[error("the upstream did not answer within {0} s")]
    UpstreamSilent(u64),
}

impl Unready {
    /// The `code` of its finding, as a request's error would say it.
    fn code(&self) -> &'static str {
        match self {
            Unready::Store(_) | Unready::NotWritable(_) | Unready::StoreSilent(_) => {
                "store_unavailable"
            }
            Unready::Request(e) => e.code(),
            Unready::UpstreamSilent(_) => "upstream_timeout",
            Unready::UpstreamStatus(_) => "upstream_unreachable",
        }
    }

    /// What `/readyz` says of the failed check:
    /// `{"ok": false, "error", "code"}`.
    pub fn finding(&self) -> serde_json::Value {
        serde_json::json!({"ok": false, "error": self.to_string(), "code": self.code()})
    }
}

/// The upstream client's error (`upstream::Error`, which converts to a
/// [`ProxyError`] where the two meet) as the request path holds it: its
/// message is the client's, its source the cause it keeps (the reqwest
/// error), and whether it timed out decides 504 over 502. Boxed, because
/// the upstream client sits above this module and this module cannot name
/// its type; `get_ref` and a downcast reach it.
#[derive(Debug)]
pub struct UpstreamFailure {
    error: BoxError,
    timed_out: bool,
}

impl UpstreamFailure {
    /// `error`, which `timed_out` or not.
    pub fn new(error: impl Into<BoxError>, timed_out: bool) -> Self {
        UpstreamFailure {
            error: error.into(),
            timed_out,
        }
    }

    /// Whether the upstream did not answer in time (504).
    pub fn is_timeout(&self) -> bool {
        self.timed_out
    }

    /// The upstream client's error itself.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.error
    }
}

impl std::fmt::Display for UpstreamFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for UpstreamFailure {
    /// The upstream client's error's own source: this wrapper adds nothing
    /// to the chain.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

impl ProxyError {
    /// A failure inside the proxy, its cause kept for the log.
    pub fn internal(cause: impl Into<BoxError>) -> Self {
        ProxyError::Internal(cause.into())
    }

    /// The store could not be read, its cause kept for the log.
    pub fn store_unavailable(cause: impl Into<BoxError>) -> Self {
        ProxyError::StoreUnavailable(cause.into())
    }

    /// The store cannot take records now, its cause kept for the log.
    pub fn store_down(cause: impl Into<BoxError>) -> Self {
        ProxyError::StoreDown(cause.into())
    }
}

/// An error and its sources, one after the other (`a: b: c`), each said
/// once: a message that already ends with its source's is not repeated.
/// For logs and operators' findings, never a client's answer.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

impl ProxyError {
    /// HTTP status the client sees.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::InvalidJson(_)
            | ProxyError::InvalidRequest(_)
            | ProxyError::BodyUnreadable(_)
            | ProxyError::InvalidPath(_)
            | ProxyError::NothingToCompact(_)
            | ProxyError::ConversationAmbiguous(_) => StatusCode::BAD_REQUEST,
            ProxyError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::ConversationNotFound(_) => StatusCode::NOT_FOUND,
            ProxyError::StoreUnavailable(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ProxyError::StoreDown(_) | ProxyError::NotReady { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::LoopDetected => StatusCode::LOOP_DETECTED,
            ProxyError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::NotFound { .. } => StatusCode::NOT_FOUND,
            ProxyError::Upstream(e) if e.is_timeout() => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Upstream(_) => StatusCode::BAD_GATEWAY,
            ProxyError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type` field.
    fn kind(&self) -> &'static str {
        match self {
            ProxyError::InvalidJson(_)
            | ProxyError::InvalidRequest(_)
            | ProxyError::BodyUnreadable(_)
            | ProxyError::InvalidPath(_)
            | ProxyError::NothingToCompact(_)
            | ProxyError::PayloadTooLarge { .. }
            | ProxyError::RequestTimeout(_)
            | ProxyError::NotFound { .. }
            | ProxyError::MethodNotAllowed { .. }
            | ProxyError::ConversationNotFound(_)
            | ProxyError::ConversationAmbiguous(_) => "invalid_request_error",
            ProxyError::Forbidden { .. } => "permission_error",
            ProxyError::Upstream(_) => "upstream_error",
            ProxyError::Internal(_)
            | ProxyError::LoopDetected
            | ProxyError::StoreUnavailable(_)
            | ProxyError::StoreDown(_)
            | ProxyError::NotReady { .. } => "server_error",
        }
    }

    /// OpenAI's `code` field.
    fn code(&self) -> &'static str {
        match self {
            ProxyError::InvalidJson(_) => "invalid_json",
            ProxyError::InvalidRequest(field) => field.code,
            ProxyError::BodyUnreadable(_) => "invalid_request",
            ProxyError::InvalidPath(_) => "invalid_path",
            ProxyError::NothingToCompact(_) => "nothing_to_compact",
            ProxyError::LoopDetected => "loop_detected",
            ProxyError::PayloadTooLarge { .. } => "request_too_large",
            ProxyError::RequestTimeout(_) => "request_timeout",
            ProxyError::NotFound { .. } => "unknown_url",
            ProxyError::Upstream(e) if e.is_timeout() => "upstream_timeout",
            ProxyError::Upstream(_) => "upstream_unreachable",
            ProxyError::Internal(_) => "internal_error",
            ProxyError::Forbidden { code, .. } => code,
            ProxyError::MethodNotAllowed { .. } => "method_not_allowed",
            ProxyError::ConversationNotFound(_) => "conversation_not_found",
            ProxyError::ConversationAmbiguous(_) => "conversation_id_ambiguous",
            ProxyError::StoreUnavailable(_) | ProxyError::StoreDown(_) => "store_unavailable",
            ProxyError::NotReady { .. } => "not_ready",
        }
    }

    /// OpenAI's `param` field: the request field at fault, where one is.
    fn param(&self) -> Option<&str> {
        match self {
            ProxyError::InvalidRequest(field) => field.param.as_deref(),
            _ => None,
        }
    }

    /// The JSON body the client receives.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": self.kind(),
                "param": self.param(),
                "code": self.code(),
            }
        })
    }

    /// The JSON body in the shape of an endpoint's own errors: OpenAI's, or
    /// Anthropic's `{"type":"error","error":{"type","message"}}` on
    /// `/v1/messages`.
    pub fn body_as(&self, shape: ErrorShape) -> serde_json::Value {
        if let ProxyError::NotReady { checks } = self {
            return serde_json::json!({"status": "not_ready", "checks": checks});
        }
        match shape {
            ErrorShape::OpenAi => self.body(),
            ErrorShape::Anthropic => serde_json::json!({
                "type": "error",
                "error": {
                    "type": anthropic_type(self.status()),
                    "message": self.to_string(),
                }
            }),
            ErrorShape::Google => serde_json::json!({
                "error": {
                    "code": self.status().as_u16(),
                    "message": self.to_string(),
                    "status": google_status(self.status()),
                }
            }),
        }
    }

    /// Logs at the right level and renders the response. Client mistakes are
    /// not logged as errors; internal details are logged, never shown.
    pub fn into_response(self) -> Response<ProxyBody> {
        self.into_response_as(ErrorShape::OpenAi)
    }

    /// [`ProxyError::into_response`] in the shape of an endpoint's errors.
    pub fn into_response_as(self, shape: ErrorShape) -> Response<ProxyBody> {
        match &self {
            ProxyError::Internal(cause) => {
                tracing::error!(detail = %chain(cause.as_ref()), "internal error")
            }
            ProxyError::Upstream(_) => tracing::warn!(error = %self, "upstream failure"),
            ProxyError::LoopDetected => tracing::error!(error = %self, "request loop"),
            ProxyError::StoreUnavailable(cause) => {
                tracing::error!(detail = %chain(cause.as_ref()), "store read failed")
            }
            ProxyError::StoreDown(cause) => {
                tracing::error!(detail = %chain(cause.as_ref()), "store unreachable")
            }
            ProxyError::NotReady { checks } => tracing::info!(%checks, "not ready"),
            _ => tracing::debug!(error = %self, "rejected request"),
        }
        let mut resp = json_response(self.status(), &self.body_as(shape));
        if let ProxyError::MethodNotAllowed { allow } = self {
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        // Refused before anything went upstream: worth trying again soon.
        if let ProxyError::StoreDown(_) = self {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Which family of error bodies an endpoint's clients read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error":{"message","type","code"}}`.
    OpenAi,
    /// `{"type":"error","error":{"type","message"}}`.
    Anthropic,
    /// Google's `{"error":{"code","message","status"}}` (Gemini).
    Google,
}

/// Google's error `status` for a status the proxy answers with.
fn google_status(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        408 | 504 => "DEADLINE_EXCEEDED",
        429 => "RESOURCE_EXHAUSTED",
        503 => "UNAVAILABLE",
        400..=499 => "INVALID_ARGUMENT",
        _ => "INTERNAL",
    }
}

/// Anthropic's error `type` for a status the proxy answers with.
fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// A complete JSON response.
pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<ProxyBody> {
    let bytes = Bytes::from(serde_json::to_vec(value).unwrap_or_default());
    let mut resp = Response::new(full(bytes));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// A body made of one buffer.
pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shape error names its field in `param` and is not `invalid_json`;
    /// a refused compaction says why once.
    #[test]
    fn shape_errors_name_their_field_and_their_own_code() {
        let e = ProxyError::from(InvalidField::wrong_type("messages[2]", "an object"));
        let b = e.body();
        assert_eq!(b["error"]["code"], "invalid_type");
        assert_eq!(b["error"]["param"], "messages[2]");
        assert_eq!(b["error"]["message"], "`messages[2]` must be an object");
        let e = ProxyError::from(InvalidField::missing("messages"));
        assert_eq!(e.body()["error"]["code"], "missing_required_parameter");
        let syntax = serde_json::from_slice::<serde_json::Value>(b"{").unwrap_err();
        let b = ProxyError::InvalidJson(syntax).body();
        assert_eq!(b["error"]["code"], "invalid_json");
        assert!(b["error"]["param"].is_null());
        let e = crate::engine::CompactError::NothingToCompact.into_refusal();
        assert_eq!(e.to_string(), "nothing to compact: no safe cut point");
        assert_eq!(e.body()["error"]["code"], "nothing_to_compact");
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn error_shape_is_openai_style() {
        let e = ProxyError::PayloadTooLarge { limit: 10 };
        assert_eq!(e.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let b = e.body();
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["code"], "request_too_large");
        assert!(b["error"]["message"].as_str().unwrap().contains("10 bytes"));
    }

    /// A store failure keeps its cause as the source, shows none of it,
    /// and the log's chain says each cause once.
    #[test]
    fn store_failures_keep_their_cause_out_of_sight() {
        let io = std::io::Error::other("disk I/O error at /secret/path");
        let e = ProxyError::store_down(crate::store::StoreError::Io(io));
        let source = std::error::Error::source(&e).expect("a source");
        assert!(source.downcast_ref::<crate::store::StoreError>().is_some());
        assert!(!e.body().to_string().contains("/secret/path"));
        assert_eq!(
            chain(&e),
            "the proxy's database is unreachable; try again shortly: store io: disk I/O error at /secret/path"
        );
    }

    /// `/readyz`'s 503 comes from the same mapping, in the readiness
    /// report's shape, each failed check with its code.
    #[test]
    fn not_ready_is_the_readiness_report() {
        let store =
            Unready::NotWritable(std::io::Error::from(std::io::ErrorKind::PermissionDenied));
        let upstream = Unready::Request(
            crate::upstream::Error::silent(std::time::Duration::from_secs(2)).into(),
        );
        let checks = serde_json::json!({"store": store.finding(), "upstream": upstream.finding()});
        let resp = ProxyError::NotReady { checks }.into_response_as(ErrorShape::Anthropic);
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        let e = ProxyError::NotReady {
            checks: serde_json::json!({"store": store.finding(), "upstream": upstream.finding()}),
        };
        let b = e.body_as(ErrorShape::OpenAi);
        assert_eq!(b["status"], "not_ready");
        assert_eq!(b["checks"]["store"]["ok"], false);
        assert_eq!(b["checks"]["store"]["code"], "store_unavailable");
        assert!(b["checks"]["store"]["error"]
            .as_str()
            .is_some_and(|m| m.starts_with("the database is not writable: ")));
        assert_eq!(b["checks"]["upstream"]["code"], "upstream_timeout");
        assert_eq!(
            b["checks"]["upstream"]["error"],
            "upstream timed out after 2 s"
        );
    }

    /// The admin API's refusals go through the same mapping: their status,
    /// type and code, and the `Allow` header of a wrong method.
    #[test]
    fn admin_refusals_map_in_the_same_place() {
        let resp = ProxyError::MethodNotAllowed { allow: "GET" }.into_response();
        assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(resp.headers()[header::ALLOW], "GET");
        let cases = [
            (
                ProxyError::Forbidden {
                    code: "admin_token_invalid",
                    message: "the admin token is not valid",
                },
                StatusCode::FORBIDDEN,
                "permission_error",
                "admin_token_invalid",
            ),
            (
                ProxyError::ConversationAmbiguous("prefix ab".into()),
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "conversation_id_ambiguous",
            ),
            (
                ProxyError::store_unavailable("disk I/O error at /secret/path"),
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "store_unavailable",
            ),
        ];
        for (e, status, kind, code) in cases {
            assert_eq!(e.status(), status);
            let b = e.body();
            assert_eq!(b["error"]["type"], kind);
            assert_eq!(b["error"]["code"], code);
            assert!(!b.to_string().contains("/secret/path"), "{b}");
        }
    }
}
