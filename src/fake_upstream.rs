//! A scriptable upstream (Chat Completions, Responses, Anthropic Messages, Gemini) on a real socket, for tests,
//! benchmarks and the offline demo.
//!
//! It records every request it receives and answers from a queue of
//! scripted [`Reply`]s; with the queue empty it answers like a small model
//! would: a short text, usage figures derived from the request size, SSE when
//! `stream` is set (with the usage chunk only when `include_usage` is).
//!
//! What its children share (the [`Reply`], the [`Received`] request) is a
//! child of its own, `reply`, which they name; this file runs the server.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::error::{BodyError, ProxyBody};

pub mod anthropic;
mod auto;
mod bodies;
pub mod cache;
pub mod gemini;
pub mod provider;
pub mod provider_compact;
mod reply;
mod websocket;

pub use auto::{auto_reply, is_summarizer_request};
pub use bodies::{
    chat_body, chat_stream_events, next_response_id, responses_body, responses_stream_events,
    usage_chat,
};
pub use reply::{Received, Reply, AUTO_TEXT};

#[derive(Default)]
struct Shared {
    received: Vec<Received>,
    script: VecDeque<Reply>,
    /// Requests answered (recorded or not).
    answered: usize,
    /// Keep nothing of what was received (long benchmarks).
    forget: bool,
    /// The answer to every summarizer request, instead of the automatic one.
    summary_reply: Option<String>,
    /// How long every summarizer request takes to be answered.
    summary_delay: Option<Duration>,
    /// Prompt caching, when simulated: the latest request bodies.
    cache: Option<VecDeque<Bytes>>,
    /// The window `/v1/messages` enforces, when set.
    messages_window: Option<u64>,
    /// The providers' prompt caches, simulated ([`cache`]), when on.
    sim: Option<cache::Sim>,
    /// The provider's own compaction, when a test turns it on.
    provider: provider::State,
    /// How the provider's own compaction answers.
    provider_compact: provider_compact::Behaviour,
    /// `GET /v1/responses` upgrades to a WebSocket (else refused, 404).
    websocket: bool,
    /// WebSocket upgrades taken, refused, and `response.create`s answered
    /// on them.
    ws_upgrades: usize,
    ws_refusals: usize,
    ws_requests: usize,
    /// The statuses the next upgrades are refused with, in order, before
    /// `websocket` decides again.
    ws_refuse_next: VecDeque<StatusCode>,
}

/// Request bodies a simulated prompt cache keeps.
const CACHED_BODIES: usize = 16;
/// A simulated prompt cache serves prompts of at least this many tokens...
const CACHE_MIN_TOKENS: u64 = 1024;
/// ...in blocks of this many (as OpenAI's automatic prompt caching does).
const CACHE_BLOCK_TOKENS: u64 = 128;

/// The cached tokens a prompt cache holding `earlier` bodies reports for
/// `body` (tokens counted as bytes / 4, like the automatic usage): the
/// longest byte prefix shared with one of them, in whole blocks.
fn cached_tokens(earlier: &VecDeque<Bytes>, body: &[u8]) -> u64 {
    let shared = earlier
        .iter()
        .map(|e| e.iter().zip(body).take_while(|(a, b)| a == b).count())
        .max()
        .unwrap_or(0) as u64
        / 4;
    if shared < CACHE_MIN_TOKENS {
        return 0;
    }
    shared / CACHE_BLOCK_TOKENS * CACHE_BLOCK_TOKENS
}

/// `reply` with `cached` as its usage's cached tokens, when it is a JSON
/// answer with usage (streamed answers are left as they are).
fn with_cached(reply: Reply, cached: u64) -> Reply {
    cache::edit_json(reply, |v| {
        if let Some(u) = v.get_mut("usage").and_then(Value::as_object_mut) {
            let key = if u.contains_key("prompt_tokens") {
                "prompt_tokens_details"
            } else {
                "input_tokens_details"
            };
            u.insert(key.into(), json!({"cached_tokens": cached}));
        }
    })
}

/// A running fake upstream.
#[derive(Clone)]
pub struct FakeUpstream {
    addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
}

impl FakeUpstream {
    /// Starts on an ephemeral loopback port.
    pub async fn start() -> std::io::Result<FakeUpstream> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Mutex::new(Shared::default()));
        let fake = FakeUpstream { addr, shared };
        let server = fake.clone();
        tokio::spawn(async move {
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let me = server.clone();
                let svc = service_fn(move |req| {
                    let me = me.clone();
                    async move { Ok::<_, Infallible>(me.answer(req).await) }
                });
                let conn = builder
                    .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                    .into_owned();
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
        });
        Ok(fake)
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL including `/v1`.
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Queues a reply for the next request.
    pub fn push(&self, reply: Reply) {
        self.lock().script.push_back(reply);
    }

    /// Drops every queued reply not taken (a refused request left its own).
    pub fn clear_script(&self) {
        self.lock().script.clear();
    }

    /// Answers every summarizer request with `text` (not taken from the
    /// script); `None` restores the automatic narrative.
    pub fn set_summary_reply(&self, text: Option<String>) {
        self.lock().summary_reply = text;
    }

    /// Delays every answer to a summarizer request by `d` (a slow model).
    pub fn set_summary_delay(&self, d: Option<Duration>) {
        self.lock().summary_delay = d;
    }

    /// From now on, the automatic JSON answers report the cached tokens of
    /// a simulated prompt cache (see `cached_tokens`); summarizer
    /// requests neither read nor fill it.
    pub fn simulate_prompt_cache(&self) {
        self.lock().cache = Some(VecDeque::new());
    }

    /// From now on, answers report the usage of each provider's documented
    /// prompt cache, simulated on a clock of its own ([`cache`]), and every
    /// answered request is billed in a ledger ([`FakeUpstream::take_bill`]);
    /// summarizer requests take no scripted reply. Not combined with the
    /// provider's own compaction ([`FakeUpstream::set_provider_compaction`]):
    /// with both on, model answers are the cache's, and the compaction
    /// endpoints (`/v1/responses/compact`) are answered but not billed.
    pub fn simulate_cache(&self, settings: cache::Settings) {
        self.lock().sim = Some(cache::Sim::new(settings));
    }

    /// Moves the simulated cache's clock on (no-op without one).
    pub fn advance_clock(&self, by: Duration) {
        if let Some(sim) = self.lock().sim.as_mut() {
            sim.advance(by);
        }
    }

    /// What the simulated cache billed since the last call, oldest first.
    pub fn take_bill(&self) -> Vec<cache::Billed> {
        self.lock()
            .sim
            .as_mut()
            .map(cache::Sim::take_ledger)
            .unwrap_or_default()
    }

    /// Everything received so far.
    pub fn received(&self) -> Vec<Received> {
        self.lock().received.clone()
    }

    /// Everything received since the last call (a long benchmark keeps
    /// only what it has not looked at yet).
    pub fn take_received(&self) -> Vec<Received> {
        std::mem::take(&mut self.lock().received)
    }

    /// Number of requests received.
    pub fn count(&self) -> usize {
        self.lock().answered
    }

    /// Stops recording what is received (`count` still counts), so a long
    /// benchmark measures the proxy's memory, not the fake's.
    pub fn forget_requests(&self) {
        let mut sh = self.lock();
        sh.forget = true;
        sh.received = Vec::new();
    }

    /// Makes `/v1/messages` and the Gemini endpoints refuse prompts over
    /// `tokens` as those APIs do.
    pub fn set_messages_window(&self, tokens: Option<u64>) {
        self.lock().messages_window = tokens;
    }

    /// Compacts as the providers do when a request asks it to (see
    /// [`provider`]); `None` turns it off.
    pub fn set_provider_compaction(&self, settings: Option<provider::Settings>) {
        self.lock().provider.settings = settings;
    }

    /// Expires every provider `compaction` item minted so far: later
    /// requests carrying one are refused as OpenAI refuses an item it can no
    /// longer decrypt (see [`provider::State::expire`]). How many expired.
    pub fn expire_provider_items(&self) -> usize {
        self.lock().provider.expire()
    }

    /// Compactions the fake's provider compaction made.
    pub fn provider_compactions(&self) -> usize {
        self.lock().provider.compactions
    }

    /// How `/v1/responses/compact` and Messages on-demand compaction
    /// answer from now on (see [`provider_compact::Behaviour`]).
    pub fn set_compact_endpoint(&self, behaviour: provider_compact::Behaviour) {
        self.lock().provider_compact = behaviour;
    }

    /// Whether `GET /v1/responses` takes a WebSocket from now on (off at
    /// start, refused with a 404): each `response.create` on one is
    /// received and answered as the streamed `POST /v1/responses` it stands
    /// for, its answer's events one message each, an error answer an
    /// `error` event, a stream scripted to break off a socket dropped.
    pub fn take_websockets(&self, on: bool) {
        self.lock().websocket = on;
    }

    /// Refuses the next upgrade with `status` (a refusal of the moment: a
    /// rate limit, a server error), whether or not WebSockets are taken.
    pub fn refuse_next_websocket(&self, status: StatusCode) {
        self.lock().ws_refuse_next.push_back(status);
    }

    /// WebSocket upgrades taken, upgrades refused, and requests answered
    /// over WebSockets, so far.
    pub fn websockets(&self) -> (usize, usize, usize) {
        let sh = self.lock();
        (sh.ws_upgrades, sh.ws_refusals, sh.ws_requests)
    }

    /// The most recent request.
    pub fn last(&self) -> Option<Received> {
        self.lock().received.last().cloned()
    }

    /// `reply` with the simulated cache's `usage` (output tokens counted
    /// from the text when the fake wrote the answer itself), and the output
    /// tokens it reports.
    fn billed_reply(
        &self,
        reply: Reply,
        body: &Value,
        usage: &cache::Usage,
        auto: bool,
    ) -> (Reply, u64) {
        let sh = self.lock();
        let Some(sim) = sh.sim.as_ref() else {
            return (reply, 0);
        };
        let count = |t: &str| sim.count(t);
        match reply {
            Reply::Messages(mut answer) => {
                if auto {
                    let text: String = answer
                        .content
                        .iter()
                        .filter_map(|b| b.get("text").and_then(Value::as_str))
                        .collect();
                    answer.output_tokens = count(&text);
                }
                let output = answer.output_tokens;
                (
                    anthropic::reply_with_usage(
                        body,
                        &answer,
                        cache::messages_usage(usage, output),
                    ),
                    output,
                )
            }
            other => {
                cache::with_usage(other, usage, auto.then_some(&count as &dyn Fn(&str) -> u64))
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A WebSocket asked on `GET /v1/responses`: taken, or refused.
    fn upgrade(&self, mut req: Request<Incoming>) -> Response<ProxyBody> {
        let (on, refused_with) = {
            let mut sh = self.lock();
            let refused_with = sh.ws_refuse_next.pop_front();
            let on = sh.websocket && refused_with.is_none();
            *if on {
                &mut sh.ws_upgrades
            } else {
                &mut sh.ws_refusals
            } += 1;
            (on, refused_with)
        };
        let accepted = on.then(|| websocket::accept(&mut req)).flatten();
        let Some((resp, upgrade)) = accepted else {
            return websocket::refusal(refused_with.unwrap_or(StatusCode::NOT_FOUND));
        };
        let headers = websocket::request_headers(req.headers());
        let (path, query) = (req.uri().path().to_string(), req.uri().query());
        let query = query.map(String::from);
        let me = self.clone();
        tokio::spawn(websocket::serve(upgrade, move |body| {
            let rec = Received {
                method: http::Method::POST,
                path: path.clone(),
                query: query.clone(),
                headers: headers.clone(),
                body,
            };
            let me = me.clone();
            async move {
                me.lock().ws_requests += 1;
                me.answer_received(rec).await
            }
        }));
        resp
    }

    async fn answer(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        if req.method() == http::Method::GET
            && req.uri().path().ends_with("/responses")
            && websocket::is_upgrade(&req)
        {
            return self.upgrade(req);
        }
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let rec = Received {
            method: parts.method,
            path: parts.uri.path().to_string(),
            query: parts.uri.query().map(String::from),
            headers: parts.headers,
            body,
        };
        self.answer_received(rec).await
    }

    async fn answer_received(&self, rec: Received) -> Response<ProxyBody> {
        let messages = rec.path.ends_with("/messages");
        let gemini = gemini::is_gemini(&rec.path);
        // Parsed once for a simulated cache (its bodies are large).
        let parsed = std::sync::OnceLock::new();
        let json = || parsed.get_or_init(|| rec.json());
        let (scripted, delay, cached, billed) = {
            let mut sh = self.lock();
            sh.answered += 1;
            if !sh.forget {
                sh.received.push(rec.clone());
            }
            // A benchmark that keeps nothing judges nothing either.
            let mut refusal = if sh.provider.on() {
                sh.provider.refusal(&rec, sh.messages_window)
            } else {
                (messages && !sh.forget)
                    .then(|| anthropic::check(json(), &rec.headers, sh.messages_window))
                    .flatten()
                    .or_else(|| {
                        let len = rec.body.len();
                        (gemini && !sh.forget)
                            .then(|| gemini::check(json(), len, sh.messages_window))
                            .flatten()
                    })
                    // The provider's compaction answers itself (and refuses a
                    // compaction item it did not mint).
                    .or_else(|| provider_compact::answer(&sh.provider_compact, &rec))
            };
            let api = cache::Api::of(&rec.path);
            let mut billed = None;
            if let (None, Some(sim), Some(api)) = (&refusal, sh.sim.as_mut(), api) {
                match sim.request(api, json(), &caller_key(&rec.headers)) {
                    Ok(usage) => billed = Some(usage),
                    Err(r) => refusal = Some(r),
                }
            }
            if let Some(refusal) = refusal {
                (Some(refusal), None, None, None)
            } else {
                // Parsed only when a summary is answered differently or a
                // prompt cache is simulated: the bench's fake answers without
                // parsing.
                let summary = (sh.summary_reply.is_some()
                    || sh.summary_delay.is_some()
                    || sh.cache.is_some()
                    || sh.sim.is_some())
                    && is_summarizer_request(json());
                let delay = sh.summary_delay.filter(|_| summary);
                let cached = match sh.cache.as_mut() {
                    Some(cache) if !summary => {
                        let cached = cached_tokens(cache, &rec.body);
                        if cache.len() == CACHED_BODIES {
                            cache.pop_front();
                        }
                        cache.push_back(rec.body.clone());
                        Some(cached)
                    }
                    _ => billed.map(|u| u.read),
                };
                let scripted = match &sh.summary_reply {
                    Some(text) if summary && messages => {
                        Some(Reply::Messages(anthropic::Answer::text(text)))
                    }
                    Some(text) if summary && gemini => {
                        Some(gemini::text(text, (rec.body.len() as u64 / 4).max(1), 60))
                    }
                    Some(text) if summary => {
                        Some(Reply::chat(text, (rec.body.len() as u64 / 4).max(1), 60))
                    }
                    // A Messages test scripts the agent's answers: the
                    // proxy's summary calls take none of them.
                    _ if messages && anthropic::is_summarizer_request(json()) => None,
                    _ if gemini && is_summarizer_request(json()) => None,
                    // With a simulated cache, only the model's turns take
                    // them (a bench scripts its agent's turns).
                    _ if sh.sim.is_some() && (summary || api.is_none()) => None,
                    _ => sh.script.pop_front(),
                };
                let billed = billed.map(|usage| (usage, summary, scripted.is_none()));
                (scripted, delay, cached, billed)
            }
        };
        let mut reply = match (scripted, cached) {
            (Some(r), _) => r,
            (None, Some(cached)) if billed.is_none() => with_cached(auto_reply(&rec), cached),
            (None, _) => auto_reply(&rec),
        };
        if let Some((usage, summary, auto)) = billed {
            let (billed_reply, output) = self.billed_reply(reply, json(), &usage, auto);
            reply = billed_reply;
            let model = json().get("model").and_then(Value::as_str).unwrap_or("");
            let mut sh = self.lock();
            if let Some(sim) = sh.sim.as_mut() {
                sim.bill(&rec.path, summary, model, usage, output);
            }
        } else if let Reply::Messages(answer) = &reply {
            let provider = self
                .lock()
                .provider
                .messages_reply(&rec, answer, cached.unwrap_or(0));
            reply = provider.unwrap_or_else(|| {
                anthropic::reply(json(), rec.body.len(), answer, cached.unwrap_or(0))
            });
        } else {
            reply = self.lock().provider.responses_reply(&rec, reply);
        }
        if let Some(d) = delay {
            reply = Reply::Delay(d, Box::new(reply));
        }
        render(reply).await
    }
}

/// The caller's key, as the cache keys prefixes by organisation.
fn caller_key(headers: &HeaderMap) -> String {
    headers
        .get("x-api-key")
        .or_else(|| headers.get("x-goog-api-key"))
        .or_else(|| headers.get(http::header::AUTHORIZATION))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

async fn render(reply: Reply) -> Response<ProxyBody> {
    match reply {
        // Made into a JSON or SSE reply by `answer`, which has the request;
        // without one, the text alone.
        Reply::Messages(answer) => {
            Box::pin(render(anthropic::reply(&json!({}), 0, &answer, 0))).await
        }
        Reply::Delay(d, inner) => {
            tokio::time::sleep(d).await;
            Box::pin(render(*inner)).await
        }
        Reply::Status(status, inner) => {
            let mut resp = Box::pin(render(*inner)).await;
            *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            resp
        }
        Reply::Full {
            status,
            headers,
            body,
        } => {
            let mut resp = Response::new(crate::error::full(body));
            *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            for (k, v) in headers {
                if let (Ok(k), Ok(v)) = (
                    http::HeaderName::from_bytes(k.as_bytes()),
                    http::HeaderValue::from_str(&v),
                ) {
                    resp.headers_mut().append(k, v);
                }
            }
            resp
        }
        Reply::Gated { chunks, at, gate } => {
            let stream =
                futures_util::stream::unfold((chunks.into_iter(), 0usize), move |(mut it, n)| {
                    let gate = gate.clone();
                    async move {
                        let chunk = it.next()?;
                        if n == at {
                            gate.notified().await;
                        }
                        Some((Ok::<_, BodyError>(Frame::data(chunk)), (it, n + 1)))
                    }
                });
            let mut resp = Response::new(StreamBody::new(stream).boxed_unsync());
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/event-stream"),
            );
            resp
        }
        Reply::Sse {
            chunks,
            gap,
            reset_after,
        } => {
            let stream = futures_util::stream::unfold(
                (chunks.into_iter(), 0usize),
                move |(mut it, n)| async move {
                    if reset_after == Some(n) {
                        let e: BodyError = "scripted reset".into();
                        return Some((Err(e), (it, n + 1)));
                    }
                    let chunk = it.next()?;
                    if !gap.is_zero() {
                        tokio::time::sleep(gap).await;
                    }
                    Some((Ok(Frame::data(chunk)), (it, n + 1)))
                },
            );
            let mut resp = Response::new(StreamBody::new(stream).boxed_unsync());
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/event-stream"),
            );
            resp.headers_mut().insert(
                http::header::CACHE_CONTROL,
                http::HeaderValue::from_static("no-cache"),
            );
            resp
        }
    }
}

#[cfg(test)]
mod cache_tests {
    use super::*;

    #[test]
    fn the_simulated_cache_serves_shared_prefixes_in_blocks() {
        let mut earlier = VecDeque::new();
        let long = vec![b'a'; 8_000];
        assert_eq!(cached_tokens(&earlier, &long), 0, "empty cache");
        earlier.push_back(Bytes::from(long.clone()));
        let mut next = long.clone();
        next.extend_from_slice(b"more");
        assert_eq!(
            cached_tokens(&earlier, &next),
            1920,
            "2000 tokens, in blocks of 128"
        );
        next[4100] = b'b';
        assert_eq!(cached_tokens(&earlier, &next), 1024, "1025 tokens shared");
        next[2000] = b'b';
        assert_eq!(cached_tokens(&earlier, &next), 0, "under 1024 tokens: none");
    }
}

#[cfg(test)]
mod simulated_cache_tests {
    use super::*;
    use crate::compaction::summary::SUMMARIZER_MARKER;

    async fn post(fake: &FakeUpstream, path: &str, body: &Value) -> (u16, Value) {
        let client = reqwest::Client::new();
        let send = client
            .post(format!("http://{}{path}", fake.addr()))
            .header("x-api-key", "k")
            .json(body)
            .send();
        let resp = tokio::time::timeout(Duration::from_secs(10), send)
            .await
            .expect("in time")
            .expect("sent");
        let status = resp.status().as_u16();
        let v = tokio::time::timeout(Duration::from_secs(10), resp.json::<Value>())
            .await
            .expect("in time")
            .unwrap_or(Value::Null);
        (status, v)
    }

    fn messages(n: usize, marker: bool) -> Value {
        let big = "lorem ipsum dolor sit amet ".repeat(400);
        let mut msgs: Vec<Value> = (0..n)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": [{"type": "text", "text": format!("{i} {big}")}]})
            })
            .collect();
        msgs.last_mut().unwrap()["content"][0]["cache_control"] = json!({"type": "ephemeral"});
        let system = if marker {
            format!("{SUMMARIZER_MARKER} summarize")
        } else {
            "You are terse.".to_string()
        };
        json!({"model": "claude-x", "max_tokens": 50, "system": system, "messages": msgs})
    }

    #[tokio::test]
    async fn answers_report_and_bill_the_simulated_cache() {
        let fake = tokio::time::timeout(Duration::from_secs(10), FakeUpstream::start())
            .await
            .unwrap()
            .unwrap();
        fake.simulate_cache(cache::Settings::default());
        fake.push(Reply::Messages(anthropic::Answer::text("scripted")));
        let (status, first) = post(&fake, "/v1/messages", &messages(1, false)).await;
        assert_eq!(status, 200);
        let u = &first["usage"];
        let written = u["cache_creation_input_tokens"].as_u64().unwrap();
        assert!(written > 1024, "{u}");
        assert_eq!(u["cache_read_input_tokens"], 0);
        assert_eq!(u["cache_creation"]["ephemeral_5m_input_tokens"], written);
        assert_eq!(first["content"][0]["text"], "scripted");
        // A summary call reads the same prefix and takes no scripted answer.
        fake.push(Reply::Messages(anthropic::Answer::text("for the agent")));
        let (_, summary) = post(&fake, "/v1/messages", &messages(3, true)).await;
        assert_ne!(summary["content"][0]["text"], "for the agent");
        assert_eq!(
            summary["usage"]["cache_read_input_tokens"], 0,
            "another system: another prefix"
        );
        let (_, second) = post(&fake, "/v1/messages", &messages(3, false)).await;
        assert_eq!(second["content"][0]["text"], "for the agent");
        assert_eq!(second["usage"]["cache_read_input_tokens"], written);
        fake.advance_clock(cache::TTL_5M + Duration::from_secs(1));
        let (_, cold) = post(&fake, "/v1/messages", &messages(3, false)).await;
        assert_eq!(cold["usage"]["cache_read_input_tokens"], 0, "expired");
        // Five breakpoints are refused, and not billed.
        let mut five = messages(5, false);
        for m in five["messages"].as_array_mut().unwrap() {
            m["content"][0]["cache_control"] = json!({"type": "ephemeral"});
        }
        assert_eq!(post(&fake, "/v1/messages", &five).await.0, 400);
        // Chat: automatic, reported as cached tokens.
        let chat = json!({"model": "gpt-x", "messages": [{"role": "user", "content": "lorem ipsum ".repeat(1500)}]});
        post(&fake, "/v1/chat/completions", &chat).await;
        let (_, again) = post(&fake, "/v1/chat/completions", &chat).await;
        let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached >= 1024 && cached % 128 == 0, "{again}");
        let bill = fake.take_bill();
        let kinds: Vec<(bool, u64)> = bill.iter().map(|b| (b.summarizer, b.usage.read)).collect();
        assert_eq!(bill.len(), 6, "{kinds:?}");
        assert!(bill[1].summarizer && !bill[0].summarizer);
        assert_eq!(bill[2].usage.read, written);
        assert_eq!(bill[5].usage.read, cached);
        assert!(bill[5].output > 0);
        assert!(fake.take_bill().is_empty());
    }
}
