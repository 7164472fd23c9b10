//! Between recall and the client, when a streamed answer to a request
//! offered `compactor_recall` begins with reasoning (chat
//! `reasoning_content` deltas, a Responses `reasoning` item): the reasoning
//! reaches the client as it comes instead of waiting for the model to say
//! whether it recalls. (Anthropic Messages `thinking` stays held: a
//! thinking block is signed for the request that produced it.)
//!
//! The client's response starts at once and a task carries on: it relays
//! each answer's reasoning, then at the answer's first output either relays
//! the rest (text: the model answers) or reads the tool call to its end and
//! hands it to the driver's rounds ([`Rounds`], which `server::proxy`
//! gives it: the recall rounds and sends it takes, as for any answer); it
//! must not send the request or answer a call itself. A recall round's
//! tool call never reaches the client; the continuation's stream is
//! spliced onto what the client already has, so that it sees one
//! well-formed stream ([`Splice`], the wire formats' part): chat, one role delta, one final chunk,
//! one `[DONE]`; Responses, one `response.created`, output indices and
//! sequence numbers following what was sent, one `response.completed`
//! whose `output` lists every item the client saw. The exchange is
//! recorded from the spliced stream, before its last event is released.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use http::header::{self, HeaderValue};
use http::Response;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::sync::mpsc;

use super::answer::{is_sse, response_head, Answer, Held, COMPACTED_HEADER};
use super::exchange::{Outcome, Unanswered};
use super::gather::UpstreamStream;
use crate::app::AppState;
use crate::error::{BodyError, ProxyBody, ProxyError};
use crate::upstream::describe;
use crate::wire::format::First;
use crate::wire::own_calls;
use crate::wire::splice::Splice;
use crate::wire::sse::{Block, Framer, SseTee};

/// What the task hands the client's body.
type Chunk = Result<Bytes, BodyError>;

/// Tool-call answers, beyond `compaction.recall_max_rounds`, the task may
/// still hand the rounds: the compact rounds, the answer to the request
/// sent again without the proxy's tools, and the one their calls are taken
/// out of (see `server::recall`). Past them it gives the request up, which
/// the rounds never leave it to do.
const EXTRA_ENTRIES: u32 = 4;

/// The driver's rounds for an answer that calls a tool: the answer the
/// request comes to once the recall rounds it calls for are answered and
/// sent (the driver's loop in `server::proxy`, from that answer on).
pub(super) type Rounds = Box<
    dyn for<'a> Fn(&'a mut Unanswered, Answer) -> BoxFuture<'a, Result<Answer, ProxyError>>
        + Send
        + Sync,
>;

/// [`Rounds`] from a closure (which takes its signature from here).
pub(super) fn rounds<F>(f: F) -> Rounds
where
    F: for<'a> Fn(&'a mut Unanswered, Answer) -> BoxFuture<'a, Result<Answer, ProxyError>>
        + Send
        + Sync
        + 'static,
{
    Box::new(f)
}

/// Starts the client's response for a stream that began with reasoning
/// (`held`, read up to its first reasoning event) and leaves the rest of
/// the request to a task, which hands each tool call to `rounds`.
pub(super) fn relay_live(
    state: Arc<AppState>,
    pending: Unanswered,
    rounds: Rounds,
    held: Held,
    started: Instant,
) -> Response<ProxyBody> {
    let (tx, rx) = mpsc::channel::<Chunk>(32);
    let mut head = held.headers.clone();
    head.remove(header::CONTENT_LENGTH);
    let status = held.status;
    let conversation = pending.conversation().to_string();
    let applied = pending.compaction().map(|c| c.id.clone());
    let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
    tokio::spawn(run(state, pending, rounds, held, ttfb_ms, tx));
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((chunk.map(Frame::data), rx))
    });
    let mut response = response_head(
        status,
        &head,
        &conversation,
        BodyExt::boxed_unsync(StreamBody::new(body)),
    );
    if let Some(v) = applied.and_then(|id| HeaderValue::from_str(&id).ok()) {
        response.headers_mut().insert(COMPACTED_HEADER, v);
    }
    response
}

/// The client's side of the task: the spliced stream, teed for the record.
struct Client {
    state: Arc<AppState>,
    tx: mpsc::Sender<Chunk>,
    tee: SseTee,
    splice: Splice,
    status: u16,
    ttfb_ms: f64,
    /// Until the exchange is recorded.
    pending: Option<Unanswered>,
}

impl Client {
    /// Sends one upstream block as the splice rewrites it; records the
    /// exchange first when it ends the stream. False once the client is
    /// gone or the stream was ended.
    async fn send(&mut self, state: &Arc<AppState>, block: &Block) -> bool {
        let Some(bytes) = self.splice.rewrite(block) else {
            return true;
        };
        let out = self.tee.push(bytes);
        if self.tee.finished() && !self.record(state, false, None).await {
            let _ = self
                .tx
                .send(Err("the answer could not be recorded".into()))
                .await;
            return false;
        }
        if out.is_empty() {
            return true;
        }
        self.tx.send(Ok(out)).await.is_ok()
    }

    /// Records the exchange from what the client was sent; false when its
    /// last bytes must be withheld.
    async fn record(
        &mut self,
        state: &Arc<AppState>,
        partial: bool,
        error: Option<String>,
    ) -> bool {
        let Some(p) = self.pending.take() else {
            return true;
        };
        let outcome = Outcome::streamed(self.status, &self.tee, partial, error, self.ttfb_ms);
        p.into_inner().finish(state, outcome).await
    }

    /// The upstream body ended: records the exchange if no final event did,
    /// then releases what the tee still holds.
    async fn end(&mut self, state: &Arc<AppState>) {
        let out = self.tee.finish();
        if self.pending.is_some() {
            let complete = self.tee.finished();
            let why = (!complete).then(|| "upstream ended the stream without a final event".into());
            if !self.record(state, !complete, why).await {
                let _ = self
                    .tx
                    .send(Err("the answer could not be recorded".into()))
                    .await;
                return;
            }
        }
        if !out.is_empty() {
            let _ = self.tx.send(Ok(out)).await;
        }
    }

    /// Ends the client's stream uncleanly with `why`, recorded as partial.
    async fn break_off(&mut self, state: &Arc<AppState>, why: String) {
        self.record(state, true, Some(why.clone())).await;
        let _ = self.tx.send(Err(why.into())).await;
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            // The client left (or the task ended) before the record: kept
            // as partial.
            let why = "the client left before the end of the stream".to_string();
            let outcome = Outcome::streamed(self.status, &self.tee, true, Some(why), self.ttfb_ms);
            p.into_inner().finish_detached(&self.state, outcome);
        }
    }
}

/// One answer's bytes, read in order: what was read before, then the rest.
struct Reading {
    queued: VecDeque<Bytes>,
    rest: UpstreamStream,
    end: Option<Option<reqwest::Result<Bytes>>>,
}

impl Reading {
    fn new(held: Held) -> Reading {
        Reading {
            queued: held.chunks.into(),
            rest: held.rest,
            end: held.end,
        }
    }

    /// The next chunk; `Ok(None)` at the end of the body.
    async fn next(&mut self, idle: std::time::Duration) -> Result<Option<Bytes>, String> {
        if let Some(c) = self.queued.pop_front() {
            return Ok(Some(c));
        }
        let next = match self.end.take() {
            Some(end) => end,
            None => match tokio::time::timeout(idle, self.rest.next()).await {
                Ok(next) => next,
                Err(_) => return Err(format!("upstream stream silent for {} s", idle.as_secs())),
            },
        };
        match next {
            None => Ok(None),
            Some(Ok(c)) => Ok(Some(c)),
            Some(Err(e)) => Err(describe(&e)),
        }
    }
}

/// The task: relays answers until one is the client's, splicing each onto
/// the last.
async fn run(
    state: Arc<AppState>,
    pending: Unanswered,
    rounds: Rounds,
    held: Held,
    ttfb_ms: f64,
    tx: mpsc::Sender<Chunk>,
) {
    let api = pending.request().api();
    let max_entries = pending.recall_rounds() + EXTRA_ENTRIES;
    let mut client = Client {
        state: state.clone(),
        tx,
        tee: SseTee::new(api, pending.request().strip_usage())
            .rewritten(own_calls::rewrite(api, &pending.own_tools())),
        splice: Splice::new(api),
        status: held.status.as_u16(),
        ttfb_ms,
        pending: Some(pending),
    };
    let idle = state.upstream.idle_timeout;
    let mut held = held;
    let mut entries = 0;
    loop {
        let (status, headers_of) = (held.status, held.headers.clone());
        let mut reading = Reading::new(held);
        let mut framer = Framer::new();
        // This answer's bytes, kept for the recall rounds while its first
        // output is a tool call; how many of them the client has.
        let mut kept: Vec<Bytes> = Vec::new();
        let mut relayed = 0;
        let mut first = None;
        loop {
            let chunk = match reading.next(idle).await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(why) => {
                    client.break_off(&state, why).await;
                    return;
                }
            };
            framer.push(&chunk);
            if first != Some(First::Text) {
                kept.push(chunk);
            }
            while let Some(block) = framer.next_block() {
                if first.is_none() {
                    first = block
                        .event
                        .as_ref()
                        .and_then(|ev| api.format().first_output(&ev.name, &ev.data));
                }
                match first {
                    Some(First::ToolCall) => continue,
                    Some(First::Text) => kept.clear(),
                    None => relayed += block.raw.len(),
                }
                if !client.send(&state, &block).await {
                    return;
                }
            }
        }
        if first != Some(First::ToolCall) {
            // The client's answer, relayed whole. What follows its last
            // event is no event: the first answer's goes as it came, a
            // continuation's is dropped.
            let rest = framer.rest();
            if client.splice.first_answer() && !rest.is_empty() {
                let out = client.tee.push(rest);
                let _ = client.tx.send(Ok(out)).await;
            }
            client.end(&state).await;
            return;
        }
        // A tool call: the rounds decide whether the client gets it.
        entries += 1;
        let Some(pending) = client.pending.as_mut() else {
            return;
        };
        if entries > max_entries {
            let err = ProxyError::from(crate::upstream::Error::Misbehaved(
                "the model kept calling the proxy's tools after its reasoning".into(),
            ));
            client.break_off(&state, err.to_string()).await;
            return;
        }
        let answer = Held {
            status,
            headers: headers_of,
            chunks: kept,
            failure: None,
            rest: Box::pin(futures_util::stream::empty()),
            end: Some(None),
            relayed: Some(relayed),
        };
        let settled = rounds(pending, Answer::Held(answer)).await;
        held = match settled {
            // The tool call was the client's: the rest of it follows what
            // was relayed.
            Ok(Answer::Held(h)) if h.relayed.is_some() => {
                let mut framer = Framer::new();
                let bytes = super::gather::concat(h.chunks).unwrap_or_default();
                let from = h.relayed.unwrap_or(0).min(bytes.len());
                framer.push(&bytes[from..]);
                while let Some(block) = framer.next_block() {
                    if !client.send(&state, &block).await {
                        return;
                    }
                }
                client.end(&state).await;
                return;
            }
            Ok(Answer::Live(h) | Answer::Held(h)) => h,
            Ok(Answer::Upstream(resp)) if is_sse(resp.headers()) => Held::unread(resp),
            Ok(_) => {
                client
                    .break_off(
                        &state,
                        "the continued request was not answered as a stream".into(),
                    )
                    .await;
                return;
            }
            Err(e) => {
                let msg = e.to_string();
                if let Some(p) = client.pending.take() {
                    p.into_inner().fail(&state, e, None).await;
                }
                let _ = client.tx.send(Err(msg.into())).await;
                return;
            }
        };
        // A recall round: what the client saw of this answer stays, the
        // rest never reaches it.
        client.splice.next_answer();
    }
}
