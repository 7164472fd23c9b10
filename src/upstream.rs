//! The upstream client: one pooled reqwest client (keep-alive, HTTP/1.1 and
//! HTTP/2 by ALPN, rustls), URL mapping, header hygiene and credentials.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::config::{UpstreamConfig, UpstreamWebSocket};
use crate::error::{ProxyError, UpstreamFailure};
use crate::wire::Api;

mod opened;
mod payload;
mod websocket;
pub use payload::Payload;
pub use websocket::{Broke, Socket};

/// Why the upstream client got no usable answer. The message is the one a
/// client gets (`ProxyError` shows it as it is), so it names the innermost
/// cause of a reqwest error but never its URL, which could carry a key in
/// a query string (see [`describe`]); the reqwest error itself stays the
/// source, for the log and for telling failures apart.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The URL would leave the upstream's base path. A refusal, not a
    /// failure: there is no cause to keep, and the text says which base.
    #[error("path refused: it leads outside the upstream's base path {base}/")]
    OutsideBase {
        /// The base path, without its trailing slash.
        base: String,
    },
    /// No connection could be made.
    #[error("upstream unreachable: {}", describe(.0))]
    Connect(#[source] reqwest::Error),
    /// The request failed on its connection (written in part, reset,
    /// closed before an answer).
    #[error("upstream unreachable: {}", describe(.0))]
    Request(#[source] reqwest::Error),
    /// The answer's body broke off or could not be decoded.
    #[error("upstream unreachable: {}", describe(.0))]
    Body(#[source] reqwest::Error),
    /// The answer is longer than the proxy reads whole.
    #[error("upstream unreachable: the answer is over the {limit} bytes the proxy reads whole")]
    TooLarge {
        /// [`MAX_ANSWER_BYTES`], or the limit the caller set.
        limit: usize,
    },
    /// No answer, or no next piece of one, within the bound: reqwest's
    /// error when it timed out itself, none when the proxy's own clock ran
    /// out.
    #[error("upstream timed out after {secs} s")]
    Timeout {
        /// The bound, in seconds.
        secs: u64,
        /// reqwest's timeout error, if it was reqwest that gave up.
        #[source]
        source: Option<reqwest::Error>,
    },
    /// The upstream answered, but its answers break the exchange the proxy
    /// holds it to (a model that keeps calling a tool it was not given).
    /// Text, because the answers themselves are the cause and they are
    /// not the client's to read here.
    #[error("upstream unreachable: {0}")]
    Misbehaved(String),
    /// The upstream's WebSocket failed before the answer began.
    #[error("upstream unreachable: {0}")]
    Socket(#[source] websocket::Broke),
}

impl Error {
    /// A reqwest failure that is not a timeout the caller bounds: which
    /// step failed, as [`describe`] names it.
    pub fn broke(e: reqwest::Error) -> Error {
        if e.is_connect() {
            Error::Connect(e)
        } else if e.is_body() || e.is_decode() {
            Error::Body(e)
        } else {
            Error::Request(e)
        }
    }

    /// The proxy's own bound of `after` ran out (the upstream stayed
    /// silent, or stopped taking the request's body).
    pub fn silent(after: Duration) -> Error {
        Error::Timeout {
            secs: after.as_secs(),
            source: None,
        }
    }

    /// Whether the upstream did not answer in time (504, not 502).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }
}

impl From<Error> for ProxyError {
    /// A path the upstream client refuses is the client's mistake (400);
    /// every other failure is the upstream's (502, 504).
    fn from(e: Error) -> Self {
        match e {
            Error::OutsideBase { .. } => ProxyError::InvalidPath(e.to_string()),
            e => {
                let timed_out = e.is_timeout();
                ProxyError::Upstream(UpstreamFailure::new(e, timed_out))
            }
        }
    }
}

/// A secret that never prints.
#[derive(Clone)]
pub struct Secret(String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MASKED")
    }
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1),
/// plus the ones the proxy recomputes.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The header each request the proxy sends upstream carries, naming the
/// proxy instance that sent it (after the names of any proxies it went
/// through before): a request that arrives carrying this instance's own name
/// has come back to it, as when `upstream.base_url` is the proxy itself.
pub const HOP_HEADER: &str = "x-compactor-hop";

/// URLs kept derived beside the endpoints' (each derivation parses the
/// URL again).
const DERIVED_URLS: usize = 16;

/// The configured upstream.
pub struct Upstream {
    client: reqwest::Client,
    /// The client of WebSocket handshakes (HTTP/1.1 only: an upgrade has
    /// no HTTP/2 form here); none with `upstream.websocket = "off"`.
    ws_client: Option<reqwest::Client>,
    /// The upstream refused a WebSocket once: every request goes over
    /// HTTP from then on.
    ws_refused: std::sync::atomic::AtomicBool,
    base: String,
    /// `base`, parsed once: each request's URL is derived from it.
    base_url: reqwest::Url,
    /// The URLs of the parsed endpoints, derived once: building a URL
    /// parses it again, which costs as much as a small request's parse.
    endpoints: Vec<(&'static str, reqwest::Url)>,
    /// The URLs derived lately for other paths (a Gemini path names its
    /// model), newest last, with the path and query each is for.
    derived: std::sync::Mutex<VecDeque<(String, Option<String>, reqwest::Url)>>,
    api_key: Option<Secret>,
    /// This instance's name in [`HOP_HEADER`], random per process.
    hop: String,
    /// How long to wait for response headers.
    pub response_timeout: Duration,
    /// How long a response body may stay silent.
    pub idle_timeout: Duration,
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstream")
            .field("base", &self.base)
            .field("api_key", &self.api_key)
            .finish()
    }
}

impl Upstream {
    /// Builds the client. Reads the server-side key from the environment
    /// variable the config names, if any.
    pub fn new(cfg: &UpstreamConfig) -> anyhow::Result<Self> {
        let builder = || {
            reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(cfg.connect_timeout_secs))
                .pool_idle_timeout(Duration::from_secs(90))
                .tcp_nodelay(true)
                // Redirects are the client's business, as with a direct connection.
                .redirect(reqwest::redirect::Policy::none())
        };
        let client = builder()
            .pool_max_idle_per_host(256)
            .connector_layer(opened::NoteOpened)
            .build()?;
        let ws_client = match cfg.websocket {
            UpstreamWebSocket::Auto => Some(builder().http1_only().build()?),
            UpstreamWebSocket::Off => None,
        };
        let api_key = cfg.api_key()?.map(Secret);
        let mut name = [0u8; 8];
        getrandom::fill(&mut name).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        let hop: String = name.iter().map(|b| format!("{b:02x}")).collect();
        let base = cfg.base_url.trim_end_matches('/').to_string();
        let base_url = reqwest::Url::parse(&base)
            .map_err(|e| anyhow::anyhow!("upstream.base_url `{base}` is not a URL: {e}"))?;
        let mut upstream = Self {
            client,
            ws_client,
            ws_refused: Default::default(),
            base,
            base_url,
            endpoints: Vec::new(),
            derived: Default::default(),
            api_key,
            hop,
            response_timeout: Duration::from_secs(cfg.response_timeout_secs),
            idle_timeout: Duration::from_secs(cfg.idle_timeout_secs),
        };
        for api in [Api::Chat, Api::Responses, Api::Messages] {
            let url = upstream.derive_url(api.endpoint(), None)?;
            upstream.endpoints.push((api.endpoint(), url));
        }
        Ok(upstream)
    }

    /// The upstream URL for a client path below `/v1` (e.g. `/models`);
    /// refused unless it stays below the base URL's path.
    pub fn url(&self, below_v1: &str, query: Option<&str>) -> Result<reqwest::Url, Error> {
        let known = self.endpoints.iter().find(|(p, _)| *p == below_v1);
        if let (Some((_, url)), None) = (known, query) {
            return Ok(url.clone());
        }
        let mut derived = self.derived.lock().unwrap_or_else(|p| p.into_inner());
        let same = |(p, q, _): &&(String, Option<String>, reqwest::Url)| {
            p == below_v1 && q.as_deref() == query
        };
        if let Some((_, _, url)) = derived.iter().find(same) {
            return Ok(url.clone());
        }
        let url = self.derive_url(below_v1, query)?;
        if derived.len() == DERIVED_URLS {
            derived.pop_front();
        }
        derived.push_back((below_v1.to_string(), query.map(String::from), url.clone()));
        Ok(url)
    }

    fn derive_url(&self, below_v1: &str, query: Option<&str>) -> Result<reqwest::Url, Error> {
        let mut url = self.base_url.clone();
        let base = self.base_url.path().trim_end_matches('/');
        url.set_path(&format!("{base}{below_v1}"));
        url.set_query(query);
        // The URL parser resolves dot segments (`..`, `%2e%2e`) and reads a
        // backslash as a slash: whatever the client's path says, the URL
        // sent must still be below the base path, or the client's key (or
        // the server's) would reach whatever else the upstream host serves.
        let under = url
            .path()
            .strip_prefix(base)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
        if !under {
            return Err(Error::OutsideBase {
                base: base.to_string(),
            });
        }
        Ok(url)
    }

    /// Whether `incoming` already went through this proxy ([`HOP_HEADER`]).
    pub fn looped(&self, incoming: &HeaderMap) -> bool {
        incoming
            .get_all(HOP_HEADER)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|name| name.trim() == self.hop)
    }

    /// The one place requests upstream are built: each carries this
    /// instance's name in [`HOP_HEADER`], after those it came with.
    fn request(
        &self,
        method: http::Method,
        url: &reqwest::Url,
        headers: HeaderMap,
    ) -> reqwest::RequestBuilder {
        self.request_on(&self.client, method, url, headers)
    }

    fn request_on(
        &self,
        client: &reqwest::Client,
        method: http::Method,
        url: &reqwest::Url,
        mut headers: HeaderMap,
    ) -> reqwest::RequestBuilder {
        let names: Vec<&str> = headers
            .get_all(HOP_HEADER)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .chain([self.hop.as_str()])
            .collect();
        if let Ok(v) = HeaderValue::from_str(&names.join(", ")) {
            headers.insert(HOP_HEADER, v);
        }
        client.request(method, url.clone()).headers(headers)
    }

    /// Reads a whole (small) answer body: 502 if the upstream breaks off or
    /// sends more than [`MAX_ANSWER_BYTES`], 504 if it stays silent longer
    /// than `idle_timeout`.
    pub async fn read_body(&self, resp: reqwest::Response) -> Result<bytes::Bytes, Error> {
        match tokio::time::timeout(self.idle_timeout, read_capped(resp, MAX_ANSWER_BYTES)).await {
            Ok(result) => result,
            Err(_) => Err(Error::silent(self.idle_timeout)),
        }
    }

    /// Text bound for records or logs without credentials: the client's
    /// (in `credentials`), the server-side key, anything shaped like one
    /// (see [`crate::redact`]).
    pub fn redact<'a>(&self, text: &'a str, credentials: &HeaderMap) -> std::borrow::Cow<'a, str> {
        let own = self.api_key.as_ref().map(|Secret(k)| k.as_str());
        crate::redact::redact(text, credentials, own)
    }

    /// An upstream error body relayed to a client, without the server-side
    /// key: the client never had it, and an upstream that refuses it may
    /// quote it. (The client's own key, quoted back, is its own.)
    pub fn hide_own_key(&self, body: bytes::Bytes) -> bytes::Bytes {
        match (&self.api_key, std::str::from_utf8(&body)) {
            (Some(Secret(key)), Ok(text)) if text.contains(key.as_str()) => {
                let out = crate::redact::redact(text, &HeaderMap::new(), Some(key));
                bytes::Bytes::from(out.into_owned())
            }
            _ => body,
        }
    }

    /// The base URL, for the banner.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Request headers to send upstream: the client's, minus hop-by-hop and
    /// proxy-internal ones, with the server-side key swapped in if configured.
    /// `identity` asks the upstream not to compress (the proxy reads the body).
    pub fn request_headers(&self, incoming: &HeaderMap, identity: bool) -> HeaderMap {
        let mut out = strip_hop_by_hop(incoming);
        out.remove(header::HOST);
        out.remove(header::CONTENT_LENGTH);
        // Every `x-compactor-*` header is the proxy's business (the
        // conversation, the request's controls, the admin token): none goes
        // upstream but the hop header, which a proxy in front of this one
        // set and which is how a request that comes back is recognised.
        let ours: Vec<_> = out
            .keys()
            .filter(|k| k.as_str().starts_with("x-compactor-") && k.as_str() != HOP_HEADER)
            .cloned()
            .collect();
        for k in ours {
            out.remove(k);
        }
        if identity {
            out.insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
        }
        if let Some(Secret(key)) = &self.api_key {
            // Every credential header the proxy accepts from a client.
            out.remove("api-key");
            out.remove("x-api-key");
            out.remove("x-goog-api-key");
            if let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}")) {
                let mut v = v;
                v.set_sensitive(true);
                out.insert(header::AUTHORIZATION, v);
            }
        }
        out
    }

    /// [`Upstream::request_headers`] for a parsed endpoint: on Anthropic
    /// Messages a server-side key goes in `x-api-key`, on Gemini in
    /// `x-goog-api-key`, where those APIs read it.
    pub fn request_headers_for(&self, api: Api, incoming: &HeaderMap, identity: bool) -> HeaderMap {
        let mut out = self.request_headers(incoming, identity);
        match api {
            Api::Messages => self.key_as_x_api_key(&mut out),
            Api::Gemini => self.key_as(&mut out, crate::wire::gemini::KEY_HEADER),
            _ => {}
        }
        out
    }

    /// Moves the server-side key, if one is configured, from
    /// `Authorization` to the API's own key header `name`.
    pub fn key_as(&self, headers: &mut HeaderMap, name: &'static str) {
        if let Some(Secret(key)) = &self.api_key {
            headers.remove(header::AUTHORIZATION);
            if let Ok(mut v) = HeaderValue::from_str(key) {
                v.set_sensitive(true);
                headers.insert(name, v);
            }
        }
    }

    /// Moves the server-side key, if one is configured, from
    /// `Authorization` to `x-api-key` (Anthropic's header).
    pub fn key_as_x_api_key(&self, headers: &mut HeaderMap) {
        self.key_as(headers, "x-api-key");
    }

    /// Sends a request whose body streams from the client; maps connection
    /// failures to 502, and gives up with `give_up`'s error once it
    /// resolves: only the caller knows when the upload ended, and so when
    /// the upstream's time to answer begins.
    pub async fn send(
        &self,
        method: http::Method,
        url: &reqwest::Url,
        headers: HeaderMap,
        body: reqwest::Body,
        give_up: impl Future<Output = Error>,
    ) -> Result<reqwest::Response, Error> {
        let send = self.request(method, url, headers).body(body).send();
        tokio::select! {
            sent = send => self.map(Ok(sent)),
            e = give_up => Err(e),
        }
    }

    /// Sends a request whose body is in memory, and once more if it failed
    /// on a pooled connection the upstream had closed while it was idle
    /// (llama-server closes after every stream although it announces
    /// keep-alive): see `stale_connection`.
    pub async fn send_bytes(
        &self,
        method: http::Method,
        url: &reqwest::Url,
        headers: HeaderMap,
        body: impl Into<Payload>,
    ) -> Result<reqwest::Response, Error> {
        let body = body.into();
        self.send_again_if_stale(|| {
            self.request(method.clone(), url, headers.clone())
                .body(body.body())
        })
        .await
    }

    /// [`Upstream::send_bytes`] for a request without a body (a `GET` of
    /// `/v1/models`, say): no body is sent, nor a length for one.
    pub async fn send_bodyless(
        &self,
        method: http::Method,
        url: &reqwest::Url,
        headers: HeaderMap,
    ) -> Result<reqwest::Response, Error> {
        self.send_again_if_stale(|| self.request(method.clone(), url, headers.clone()))
            .await
    }

    /// Sends a request whose body is in memory once, telling a closed
    /// pooled connection from other failures: the caller decides whether
    /// to send it again ([`SendFailure::retry_allowed`]).
    pub async fn send_once(
        &self,
        method: http::Method,
        url: &reqwest::Url,
        headers: HeaderMap,
        body: &Payload,
    ) -> Result<reqwest::Response, SendFailure> {
        self.attempt(self.request(method, url, headers).body(body.body()))
            .await
    }

    /// [`Upstream::send_once`] for a Responses request that came over the
    /// client's WebSocket `socket`: over the upstream's own WebSocket when
    /// it takes one (opened at the socket's first response, kept between
    /// responses), else over HTTP. An upgrade refused is remembered for
    /// the process, unless the refusal was of the moment (a key refused, a
    /// rate limit, a server error). A socket that was kept and closed before the answer
    /// began is replaced once, as a closed pooled connection is.
    pub async fn send_over(
        &self,
        socket: &std::sync::Arc<Socket>,
        url: &reqwest::Url,
        headers: HeaderMap,
        body: &Payload,
    ) -> Result<reqwest::Response, SendFailure> {
        use std::sync::atomic::Ordering;
        let event = match &self.ws_client {
            Some(_) if !self.ws_refused.load(Ordering::Relaxed) => {
                websocket::create_event(&body.to_bytes())
            }
            _ => None,
        };
        let (Some(ws_client), Some(event)) = (&self.ws_client, event) else {
            return self.send_once(http::Method::POST, url, headers, body).await;
        };
        let failed = |e| Err::<reqwest::Response, _>(SendFailure::Failed(e));
        for _ in 0..2 {
            let (conn, kept) = match socket.take() {
                Some(conn) => (conn, true),
                None => {
                    let mut handshake = headers.clone();
                    let key = websocket::handshake(&mut handshake, socket);
                    let req = self.request_on(ws_client, http::Method::GET, url, handshake);
                    let resp = self.execute(req).await.map_err(SendFailure::Failed)?;
                    if !websocket::accepted(&resp, &key) {
                        let status = resp.status().as_u16();
                        // A key refused, a limit or a failure of the moment
                        // says nothing of whether the upstream takes a
                        // WebSocket: this request alone goes over HTTP.
                        if websocket::refusal_of_the_moment(resp.status()) {
                            tracing::debug!(
                                status,
                                "the upstream's WebSocket was refused for now: over HTTP"
                            );
                        } else if !self.ws_refused.swap(true, Ordering::Relaxed) {
                            tracing::info!(
                                status,
                                "the upstream takes no WebSocket on /v1/responses: \
                                 responses asked over one go to it over HTTP with SSE"
                            );
                        }
                        return self.send_once(http::Method::POST, url, headers, body).await;
                    }
                    let conn = websocket::open(resp, MAX_ANSWER_BYTES).await;
                    let conn = conn.map_err(|e| SendFailure::Failed(Error::broke(e)))?;
                    (conn, false)
                }
            };
            match websocket::exchange(socket.clone(), conn, event.clone(), self.response_timeout)
                .await
            {
                Ok(resp) => return Ok(resp),
                Err(websocket::Broke::Closed) if kept => {
                    tracing::debug!("the upstream's kept WebSocket was closed; opening another");
                }
                Err(websocket::Broke::Silent) => {
                    return failed(Error::silent(self.response_timeout))
                }
                Err(e) => return failed(Error::Socket(e)),
            }
        }
        failed(Error::Socket(websocket::Broke::Closed))
    }

    async fn send_again_if_stale(
        &self,
        build: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, Error> {
        match self.attempt(build()).await {
            Err(failed) if failed.retry_allowed() => {
                tracing::debug!(error = %failed, "retrying once");
                self.execute(build()).await
            }
            other => other.map_err(SendFailure::into_error),
        }
    }

    /// One send, watched for whether it opened a new connection.
    async fn attempt(
        &self,
        req: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, SendFailure> {
        let (sent, opened) =
            opened::watched(tokio::time::timeout(self.response_timeout, req.send())).await;
        self.classify(sent, opened)
    }

    /// What a send came to, telling a closed pooled connection (which may
    /// be sent again, see `stale_connection`) from other failures.
    fn classify(
        &self,
        sent: Result<reqwest::Result<reqwest::Response>, tokio::time::error::Elapsed>,
        opened: bool,
    ) -> Result<reqwest::Response, SendFailure> {
        match sent {
            Ok(Err(e)) if stale_connection(&e, opened) => Err(SendFailure::Stale(e)),
            other => self.map(other).map_err(SendFailure::Failed),
        }
    }

    async fn execute(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response, Error> {
        self.map(tokio::time::timeout(self.response_timeout, req.send()).await)
    }

    fn map(
        &self,
        sent: Result<reqwest::Result<reqwest::Response>, tokio::time::error::Elapsed>,
    ) -> Result<reqwest::Response, Error> {
        match sent {
            Err(_) => Err(Error::silent(self.response_timeout)),
            Ok(Err(e)) if e.is_timeout() => Err(Error::Timeout {
                secs: self.response_timeout.as_secs(),
                source: Some(e),
            }),
            Ok(Err(e)) => Err(Error::broke(e)),
            Ok(Ok(resp)) => Ok(resp),
        }
    }
}

/// A send that failed, and whether it may be sent again. `E` is the error
/// of any other failure: the client's ([`Error`]), or, once the caller has
/// read the start of the answer too, the one it answers with.
#[derive(Debug, thiserror::Error)]
pub enum SendFailure<E = Error> {
    /// A pooled connection the upstream had closed before the request
    /// reached it: sending again on a new connection is allowed.
    #[error("pooled upstream connection was closed: {}", describe(.0))]
    Stale(#[source] reqwest::Error),
    /// Any other failure.
    #[error(transparent)]
    Failed(E),
}

impl<E> SendFailure<E> {
    /// Whether the request may be sent again.
    pub fn retry_allowed(&self) -> bool {
        matches!(self, SendFailure::Stale(_))
    }
}

impl SendFailure {
    /// The failure when no retry is made: a closed connection is the
    /// upstream unreachable.
    pub fn into_error(self) -> Error {
        match self {
            SendFailure::Stale(e) => Error::broke(e),
            SendFailure::Failed(e) => e,
        }
    }
}

impl<E: From<Error>> SendFailure<E> {
    /// The error the client gets when no retry is made.
    pub fn into_proxy_error(self) -> E {
        match self {
            SendFailure::Stale(e) => Error::broke(e).into(),
            SendFailure::Failed(e) => e,
        }
    }
}

impl From<SendFailure> for SendFailure<ProxyError> {
    fn from(f: SendFailure) -> Self {
        match f {
            SendFailure::Stale(e) => SendFailure::Stale(e),
            SendFailure::Failed(e) => SendFailure::Failed(e.into()),
        }
    }
}

/// Whether a send that failed on a connection closed under it, before any
/// response byte, is made once more: when the request was never written,
/// or when it went out on a pooled connection (`opened`: the send made a
/// connection of its own), where the likely cause is the upstream closing
/// the connection while it sat idle. As browsers do, a request on a
/// connection that had answered before is sent again; one on a fresh
/// connection is not: an upstream that reads a request and drops the
/// connection may have taken it, and the client gets the 502 it would get
/// without the proxy.
fn stale_connection(e: &reqwest::Error, opened: bool) -> bool {
    if e.is_connect() || e.is_timeout() {
        return false;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            if h.is_canceled() {
                return true;
            }
            if h.is_incomplete_message() {
                return !opened;
            }
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionAborted
            ) {
                return !opened;
            }
        }
        source = s.source();
    }
    false
}

/// Most bytes of an answer the proxy reads whole (JSON and error answers,
/// which it parses for usage and output). A larger one is refused (502)
/// rather than held in memory: no chat or Responses answer comes near it.
pub const MAX_ANSWER_BYTES: usize = 64 << 20;

/// The whole body, or an error once it is over `limit` bytes. A body that
/// arrives in one chunk is not copied.
async fn read_capped(mut resp: reqwest::Response, limit: usize) -> Result<bytes::Bytes, Error> {
    let too_large = || Error::TooLarge { limit };
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let broke = Error::broke;
    let Some(first) = resp.chunk().await.map_err(broke)? else {
        return Ok(bytes::Bytes::new());
    };
    let mut next = resp.chunk().await.map_err(broke)?;
    if next.is_none() && first.len() <= limit {
        return Ok(first);
    }
    let mut all = bytes::BytesMut::from(&first[..]);
    loop {
        if all.len() > limit {
            return Err(too_large());
        }
        let Some(chunk) = next else {
            return Ok(all.freeze());
        };
        all.extend_from_slice(&chunk);
        next = resp.chunk().await.map_err(broke)?;
    }
}

/// Describes a reqwest error without its URL's path or query (either could
/// carry a key) — the kind, the server it was sent to (scheme, host and
/// port only), and the innermost cause.
pub fn describe(e: &reqwest::Error) -> String {
    let mut source: &dyn std::error::Error = e;
    while let Some(s) = source.source() {
        source = s;
    }
    let server = e
        .url()
        .map(|u| u.origin())
        .filter(|o| o.is_tuple())
        .map(|o| format!(" to {}", o.ascii_serialization()))
        .unwrap_or_default();
    let kind = if e.is_connect() {
        "connection"
    } else if e.is_body() || e.is_decode() {
        "response body"
    } else {
        "request"
    };
    format!("{kind}{server} failed: {source}")
}

/// Copies headers without hop-by-hop ones (including those the `Connection`
/// header names).
pub fn strip_hop_by_hop(incoming: &HeaderMap) -> HeaderMap {
    let named: Vec<HeaderName> = incoming
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    let mut out = HeaderMap::with_capacity(incoming.len());
    for (name, value) in incoming {
        if HOP_BY_HOP.contains(&name.as_str()) || named.contains(name) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_join_the_base_path_and_keep_the_query() {
        let at = |base: &str| {
            Upstream::new(&UpstreamConfig {
                base_url: base.into(),
                ..Default::default()
            })
            .unwrap()
        };
        let u = at("http://127.0.0.1:9/v1/");
        assert_eq!(
            u.url("/chat/completions", Some("a=1&b=%20"))
                .unwrap()
                .as_str(),
            "http://127.0.0.1:9/v1/chat/completions?a=1&b=%20"
        );
        // The endpoints' URLs, kept from the start, and those kept once
        // derived, are those derived; a path refused is refused again.
        let model = "/models/gemini-2.5-flash:streamGenerateContent";
        for _ in 0..2 {
            for query in [None, Some("alt=sse")] {
                assert_eq!(
                    u.url(model, query).unwrap(),
                    u.derive_url(model, query).unwrap()
                );
            }
            assert!(u.url("/../admin", None).is_err());
        }
        for path in ["/chat/completions", "/responses"] {
            assert_eq!(
                u.url(path, None).unwrap(),
                u.derive_url(path, None).unwrap()
            );
            assert_eq!(
                u.url(path, None).unwrap().as_str(),
                format!("http://127.0.0.1:9/v1{path}")
            );
        }
        assert_eq!(
            at("http://127.0.0.1:9")
                .url("/models", None)
                .unwrap()
                .as_str(),
            "http://127.0.0.1:9/models"
        );
        assert!(Upstream::new(&UpstreamConfig {
            base_url: "not a url".into(),
            ..Default::default()
        })
        .is_err());
    }

    #[test]
    fn no_url_leaves_the_base_path() {
        let u = Upstream::new(&UpstreamConfig {
            base_url: "http://127.0.0.1:9/api/v1".into(),
            ..Default::default()
        })
        .unwrap();
        for below in [
            "/../internal/admin",
            "/%2e%2e/internal/admin",
            "/%2E%2e/%2e%2E/etc/passwd",
            "/..\\..\\etc/passwd",
            "/a/../../../x",
            "/.%2e/x",
            "evil",
        ] {
            let refused = u.url(below, None);
            assert!(
                matches!(refused, Err(Error::OutsideBase { .. })),
                "{below}: {refused:?}"
            );
        }
        // Dot segments that stay below it resolve there.
        assert_eq!(
            u.url("/a/../models", Some("x=1")).unwrap().as_str(),
            "http://127.0.0.1:9/api/v1/models?x=1"
        );
        assert_eq!(
            u.url("/files/file-abc/content", None).unwrap().as_str(),
            "http://127.0.0.1:9/api/v1/files/file-abc/content"
        );
    }

    #[test]
    fn hop_by_hop_and_named_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert("connection", "keep-alive, x-trace".parse().unwrap());
        h.insert("x-trace", "1".parse().unwrap());
        h.insert("te", "trailers".parse().unwrap());
        h.insert("authorization", "Bearer k".parse().unwrap());
        let out = strip_hop_by_hop(&h);
        assert!(out.get("x-trace").is_none() && out.get("te").is_none());
        assert_eq!(out.get("authorization").unwrap(), "Bearer k");
    }

    #[test]
    fn secret_never_prints() {
        assert_eq!(format!("{:?}", Secret("sk-live".into())), "MASKED");
    }

    async fn within<F: std::future::Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .expect("timed out")
    }

    /// A connection refused keeps its cause: the client-facing error's
    /// source is the reqwest error itself, and its message, unchanged,
    /// names the innermost cause without the URL.
    #[tokio::test]
    async fn a_refused_connection_keeps_its_reqwest_error_as_source() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let u = Upstream::new(&UpstreamConfig {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            ..Default::default()
        })
        .unwrap();
        let url = u.url("/models", None).unwrap();
        let failed = within(u.send_bodyless(http::Method::GET, &url, HeaderMap::new()))
            .await
            .unwrap_err();
        assert!(matches!(failed, Error::Connect(_)), "{failed:?}");
        let e = ProxyError::from(failed);
        assert_eq!(e.status(), http::StatusCode::BAD_GATEWAY);
        assert_eq!(e.body()["error"]["code"], "upstream_unreachable");
        let message = e.to_string();
        assert!(
            message.starts_with(&format!(
                "upstream unreachable: connection to http://127.0.0.1:{port} failed: "
            )),
            "{message}"
        );
        assert!(!message.contains("/v1/models"), "the URL: {message}");
        let source = std::error::Error::source(&e).expect("a source");
        let reqwest = source
            .downcast_ref::<reqwest::Error>()
            .expect("the reqwest error");
        assert!(reqwest.is_connect(), "{reqwest:?}");
        // The whole chain reaches the operating system's refusal.
        let mut innermost: &dyn std::error::Error = reqwest;
        while let Some(s) = innermost.source() {
            innermost = s;
        }
        assert!(message.ends_with(&innermost.to_string()), "{message}");
    }

    /// The proxy's own clock running out is a 504 with no cause; reqwest's
    /// is kept; a path refused is the client's 400.
    #[test]
    fn timeouts_and_refusals_map_to_their_statuses() {
        let silent = ProxyError::from(Error::silent(Duration::from_secs(7)));
        assert_eq!(silent.status(), http::StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(silent.to_string(), "upstream timed out after 7 s");
        assert_eq!(silent.body()["error"]["code"], "upstream_timeout");
        assert!(std::error::Error::source(&silent).is_none());
        let refused = ProxyError::from(Error::OutsideBase {
            base: "/api/v1".into(),
        });
        assert_eq!(refused.status(), http::StatusCode::BAD_REQUEST);
        assert_eq!(refused.body()["error"]["code"], "invalid_path");
        assert_eq!(
            refused.to_string(),
            "path refused: it leads outside the upstream's base path /api/v1/"
        );
    }

    #[tokio::test]
    async fn an_answer_read_whole_is_capped() {
        use crate::fake_upstream::{FakeUpstream, Reply};
        let fake = within(FakeUpstream::start()).await.unwrap();
        let client = reqwest::Client::new();
        let url = fake.url() + "/x";
        let chunks = |n: usize| -> Vec<String> { (0..n).map(|i| format!("{i:0>50}")).collect() };
        let answer = |reply: Reply| {
            fake.push(reply);
            within(client.post(&url).body("{}").send())
        };

        // Declared length over the limit: refused before reading.
        let resp = answer(Reply::json(
            200,
            serde_json::json!({"text": "x".repeat(1000)}),
        ))
        .await
        .unwrap();
        let err = ProxyError::from(within(read_capped(resp, 100)).await.unwrap_err());
        assert_eq!(err.status(), http::StatusCode::BAD_GATEWAY);
        assert!(err.to_string().contains("100 bytes"), "{err}");

        // Chunked, five chunks of 50 bytes: whole under the limit, in order…
        let resp = answer(Reply::sse(chunks(5))).await.unwrap();
        let all = within(read_capped(resp, 300)).await.unwrap();
        assert_eq!(all, chunks(5).concat().as_bytes());
        // …refused over it.
        let resp = answer(Reply::sse(chunks(5))).await.unwrap();
        assert!(within(read_capped(resp, 200)).await.is_err());

        // One chunk, at the limit exactly.
        let resp = answer(Reply::sse(chunks(1))).await.unwrap();
        let one = within(read_capped(resp, 50)).await.unwrap();
        assert_eq!(one, chunks(1)[0].as_bytes());
    }
}
