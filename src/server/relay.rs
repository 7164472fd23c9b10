//! The relay phase (relay and tee): runs once the driver has the client's answer
//! (the send handed it on, the recall rounds found no call in it). Hands the upstream's answer to the client as it arrives
//! (chunks delivered together joined into one write), tees it for usage
//! and output, hides the usage the client did not ask for, and has the
//! exchange recorded before the last bytes are released. It must not
//! change the answer otherwise, nor send anything upstream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{self, HeaderValue};
use http::Response;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::Value;

use super::answer::{is_sse, response_head, Answer, Held, COMPACTED_HEADER};
use super::exchange::{Outcome, PendingExchange};
use super::gather::{concat, take_delivered, UpstreamStream};
use crate::app::AppState;
use crate::error::{full, BodyError, ProxyBody, ProxyError};
use crate::upstream::describe;
use crate::wire::own_calls;
use crate::wire::sse::SseTee;

/// Relays the answer the driver settled on; `started` is when
/// the request arrived (for the time to the upstream's first byte).
pub(super) async fn relay(
    state: Arc<AppState>,
    pending: PendingExchange,
    answer: Answer,
    started: Instant,
) -> Result<Response<ProxyBody>, ProxyError> {
    let applied = pending.compaction().cloned();
    let mut response = match answer {
        Answer::Held(mut held) | Answer::Live(mut held) => {
            held.take_delivered().await;
            let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
            stream_response(state, pending, held, ttfb_ms)
        }
        Answer::Upstream(resp) if is_sse(resp.headers()) => {
            let mut held = Held::unread(resp);
            held.take_delivered().await;
            let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
            stream_response(state, pending, held, ttfb_ms)
        }
        Answer::Upstream(resp) => {
            let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
            let status = resp.status();
            let headers = resp.headers().clone();
            match state.upstream.read_body(resp).await {
                Ok(b) => buffered_response(state, pending, status, headers, b, ttfb_ms).await,
                Err(err) => return Err(pending.fail(&state, err.into(), Some(ttfb_ms)).await),
            }
        }
        Answer::Error(status, headers, bytes) | Answer::Read(status, headers, bytes) => {
            let ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
            buffered_response(state, pending, status, headers, bytes, ttfb_ms).await
        }
    };
    if let Some(c) = &applied {
        if let Ok(v) = HeaderValue::from_str(&c.id) {
            response.headers_mut().insert(COMPACTED_HEADER, v);
        }
    }
    Ok(response)
}

/// A JSON (or error) answer, read whole: parsed for usage and output,
/// recorded, then released to the client byte for byte.
async fn buffered_response(
    state: Arc<AppState>,
    pending: PendingExchange,
    status: http::StatusCode,
    headers: http::HeaderMap,
    bytes: Bytes,
    ttfb_ms: f64,
) -> Response<ProxyBody> {
    let mut outcome = Outcome {
        status: status.as_u16(),
        ttfb_ms: Some(ttfb_ms),
        ..Outcome::default()
    };
    if status.is_success() {
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            outcome.usage = pending.request().api().usage(&v);
            outcome.response_items = pending.request().api().response_items(&v);
            outcome.response_id = v.get("id").and_then(Value::as_str).map(String::from);
        }
    } else {
        outcome.error = Some(String::from_utf8_lossy(&bytes).into_owned());
    }
    if !pending.finish(&state, outcome).await {
        return ProxyError::store_down("the answer could not be recorded").into_response();
    }
    let mut headers = headers;
    let bytes = if status.is_success() {
        bytes
    } else {
        let shown = state.upstream.hide_own_key(bytes);
        // The length the upstream announced is the unredacted body's.
        headers.remove(http::header::CONTENT_LENGTH);
        shown
    };
    response_head(status, &headers, pending.conversation(), full(bytes))
}

/// Why a stream ends uncleanly before its last bytes when its exchange
/// could not be recorded.
const UNRECORDED: &str = "the proxy's database is unreachable: the answer could not be recorded";

/// State of a streamed answer between chunks.
struct Relay {
    state: Arc<AppState>,
    /// What was read before the answer began (held back, or delivered with
    /// the first chunks), released first, as one frame.
    held: Option<Bytes>,
    upstream: UpstreamStream,
    tee: SseTee,
    /// Taken once the exchange is recorded; still here on drop = client left.
    pending: Option<PendingExchange>,
    status: u16,
    ttfb_ms: f64,
    done: bool,
    /// What the upstream delivered after the chunks gathered into the last
    /// frame (its end or a failure), handled next.
    peeked: Option<Option<reqwest::Result<Bytes>>>,
    /// Bytes went to the client already; the first go out at once.
    started: bool,
}

impl Relay {
    fn outcome(&self, partial: bool, error: Option<String>) -> Outcome {
        Outcome::streamed(self.status, &self.tee, partial, error, self.ttfb_ms)
    }

    /// Records the exchange; false when its last bytes must be withheld
    /// (see [`PendingExchange::finish`]).
    async fn record(&mut self, partial: bool, error: Option<String>) -> bool {
        match self.pending.take() {
            Some(p) => {
                let outcome = self.outcome(partial, error);
                p.finish(&self.state, outcome).await
            }
            None => true,
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            // The client went away mid-stream: dropping `upstream` cancels the
            // upstream request; the exchange is kept as partial.
            let outcome = self.outcome(
                true,
                Some(format!(
                    "{} before the end of the stream",
                    self.state.cut_reason()
                )),
            );
            p.finish_detached(&self.state, outcome);
        }
    }
}

/// An SSE answer: forwarded chunk by chunk as it arrives, teed for usage and
/// output. The exchange is committed before the chunk carrying the terminal
/// event is released, so whatever the client saw complete is on disk.
fn stream_response(
    state: Arc<AppState>,
    pending: PendingExchange,
    held: Held,
    ttfb_ms: f64,
) -> Response<ProxyBody> {
    let Held {
        status,
        mut headers,
        chunks,
        rest,
        end,
        ..
    } = held;
    headers.remove(header::CONTENT_LENGTH);
    let conversation = pending.conversation().to_string();
    let relay = Relay {
        tee: SseTee::new(pending.request().api(), pending.request().strip_usage()).rewritten(
            own_calls::rewrite(pending.request().api(), &pending.own_tools()),
        ),
        state,
        held: concat(chunks),
        upstream: rest,
        pending: Some(pending),
        status: status.as_u16(),
        ttfb_ms,
        done: false,
        peeked: end,
        started: false,
    };
    let body = futures_util::stream::unfold(relay, next_frame);
    response_head(
        status,
        &headers,
        &conversation,
        BodyExt::boxed_unsync(StreamBody::new(body)),
    )
}

/// `out` followed by the chunks the upstream has already delivered (see
/// [`take_delivered`]), so that events that arrived together leave in one
/// write, not one each. The end of the upstream body ends the gathering, so
/// that the last events and the end of the answer leave together.
async fn gather(r: &mut Relay, out: Bytes) -> Bytes {
    let mut joined: Option<bytes::BytesMut> = None;
    let (tee, upstream) = (&mut r.tee, &mut r.upstream);
    r.peeked = take_delivered(upstream, out.len(), |chunk| {
        let more = tee.push(chunk);
        let joined = joined.get_or_insert_with(|| bytes::BytesMut::from(&out[..]));
        joined.extend_from_slice(&more);
        joined.len()
    })
    .await;
    joined.map_or(out, bytes::BytesMut::freeze)
}

async fn next_frame(mut r: Relay) -> Option<(Result<Frame<Bytes>, BodyError>, Relay)> {
    loop {
        if r.done {
            return None;
        }
        let idle: Duration = r.state.upstream.idle_timeout;
        let held = r.held.take();
        let gathered = held.is_some();
        let next = if let Some(chunk) = held {
            Ok(Some(Ok(chunk)))
        } else if let Some(peeked) = r.peeked.take() {
            Ok(peeked)
        } else {
            tokio::time::timeout(idle, r.upstream.next()).await
        };
        match next {
            Ok(Some(Ok(chunk))) => {
                let mut out = r.tee.push(chunk);
                if r.started && !gathered {
                    out = gather(&mut r, out).await;
                }
                r.started |= !out.is_empty();
                if r.tee.finished() && !r.record(false, None).await {
                    // Not acknowledged: the stream ends without its end.
                    r.done = true;
                    return Some((Err(UNRECORDED.into()), r));
                }
                if out.is_empty() {
                    continue;
                }
                return Some((Ok(Frame::data(out)), r));
            }
            Ok(None) => {
                let out = r.tee.finish();
                let complete = r.tee.finished();
                let released = r
                    .record(
                        !complete,
                        (!complete)
                            .then(|| "upstream ended the stream without a final event".into()),
                    )
                    .await;
                r.done = true;
                if !released {
                    return Some((Err(UNRECORDED.into()), r));
                }
                if out.is_empty() {
                    return None;
                }
                return Some((Ok(Frame::data(out)), r));
            }
            Ok(Some(Err(e))) => {
                // Upstream broke off: end the client's stream uncleanly too,
                // as a direct connection would.
                let msg = describe(&e);
                r.record(true, Some(msg.clone())).await;
                r.done = true;
                return Some((Err(msg.into()), r));
            }
            Err(_) => {
                let msg = format!("upstream stream silent for {} s", idle.as_secs());
                r.record(true, Some(msg.clone())).await;
                r.done = true;
                return Some((Err(msg.into()), r));
            }
        }
    }
}
