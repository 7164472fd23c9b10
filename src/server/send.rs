//! Phase 3, send: runs once the items that go upstream are chosen. Sends
//! the request, reads as much of the answer as the decision needs (an
//! error answer whole, a Responses stream's first events), and decides
//! with [`decide`], a pure function of what the attempt came to and what
//! was tried before, whether to relay it, compact and send again, resend
//! the client's own request, send again on a new connection, or give up.
//! It must not answer the client or record the exchange.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::header;
use http::Method;

use super::exchange::{PendingExchange, Unanswered};
use super::gather::{take_delivered, UpstreamStream};
use super::identify::compact_on_overflow;
use crate::app::AppState;
use crate::compaction::policy;
use crate::config::Mode;
use crate::error::ProxyError;
use crate::upstream::{describe, SendFailure};
use crate::wire::{self, Api};

/// Most reactive compactions of one request. The first fits the limit the
/// upstream stated; a second is for an upstream whose tokenizer counts
/// well above the estimate, and aims [`policy::FIT_MARGIN`] below the size
/// refused again.
const MAX_REACTIVE_RETRIES: u32 = 2;

/// What one attempt came to, as far as [`decide`] needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reply {
    /// No answer: the send failed, or the answer broke off before it could
    /// be judged. `retry_allowed` when a pooled connection turned out
    /// closed before the request reached the upstream.
    Failed {
        /// Whether sending the same bytes again is safe.
        retry_allowed: bool,
    },
    /// An answer to relay as it is: a success (a Responses stream once it
    /// committed to an answer), or a stream that failed for another reason
    /// than its length.
    Answer,
    /// The upstream said the request does not fit its window.
    TooLong,
    /// Any other error answer.
    Refused {
        /// A 4xx (the request was refused, not the upstream broken).
        client_error: bool,
    },
}

/// What was tried for this request before the attempt judged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Tried {
    /// Reactive compactions made.
    pub reactive: u32,
    /// The request was sent again after a refusal (compacted after "too
    /// long", or as the client sent it).
    pub resent: bool,
    /// The body of this attempt was already sent again on a new connection.
    pub stale_retried: bool,
    /// A compaction applies to the body of this attempt.
    pub compacted: bool,
}

/// What to do after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Next {
    /// Hand the answer to the relay.
    Relay,
    /// Compact the request to the size the upstream allows and send it again.
    CompactAndRetry,
    /// Send the client's own request, without the compaction.
    ResendUncompacted,
    /// Send the same bytes again on a new connection.
    RetryStale,
    /// Answer the client with the failure.
    GiveUp,
}

/// The retry decision. A closed pooled connection is retried once per
/// body; "too long" is compacted and sent again up to
/// [`MAX_REACTIVE_RETRIES`] times, then relayed; a compacted request
/// refused with another 4xx is sent once as the client sent it, since a
/// compaction must never turn a request that would have succeeded into a
/// failure; everything else is relayed as the upstream said it.
pub(super) fn decide(reply: Reply, tried: Tried) -> Next {
    match reply {
        Reply::Failed {
            retry_allowed: true,
        } if !tried.stale_retried => Next::RetryStale,
        Reply::Failed { .. } => Next::GiveUp,
        Reply::Answer => Next::Relay,
        Reply::TooLong if tried.reactive < MAX_REACTIVE_RETRIES => Next::CompactAndRetry,
        Reply::TooLong => Next::Relay,
        Reply::Refused { client_error: true } if tried.compacted && !tried.resent => {
            Next::ResendUncompacted
        }
        Reply::Refused { .. } => Next::Relay,
    }
}

/// What the upstream said of a request too long: the limits it stated,
/// and how it said it (for the compaction's reason).
type Overflow = (policy::Stated, String);

/// Sends the exchange's request until [`decide`] says to relay the answer
/// or give up. The error is the client's; the caller records it.
pub(super) async fn send(
    state: &Arc<AppState>,
    pending: &mut Unanswered,
    url: &reqwest::Url,
    headers: &http::HeaderMap,
) -> Result<Answer, ProxyError> {
    let mut tried = Tried::default();
    let mut rebuilt = false;
    loop {
        tried.compacted = pending.compaction.is_some();
        // The client's bytes, or the body with the compaction applied now.
        let body = pending.upstream_bytes()?;
        let attempt_headers = pending.upstream_headers(headers).into_owned();
        let got = match state
            .upstream
            .send_once(Method::POST, url, attempt_headers, &body)
            .await
        {
            Ok(resp) => read_start(state, pending.api, resp)
                .await
                .map_err(SendFailure::Failed),
            Err(failure) => Err(failure),
        };
        let reply = match &got {
            Err(failure) => Reply::Failed {
                retry_allowed: failure.retry_allowed(),
            },
            Ok((_, Some(_))) => Reply::TooLong,
            Ok((Answer::Error(status, ..), None)) => Reply::Refused {
                client_error: status.is_client_error(),
            },
            Ok(_) => Reply::Answer,
        };
        // The provider refused its own compaction item: the request is
        // rebuilt from the record and sent again, once (`super::rebuild`).
        let refused = match (&got, rebuilt) {
            (Ok((Answer::Error(status, _, body), None)), false) => {
                super::rebuild::refusal(pending, Some(*status), body)
            }
            (Ok((Answer::Held(held), None)), false) => held
                .failure
                .as_deref()
                .and_then(|data| super::rebuild::refusal(pending, None, data.as_bytes())),
            _ => None,
        };
        if let Some(how) = refused {
            if super::rebuild::rebuilt(state, pending, how).await {
                rebuilt = true;
                tried.stale_retried = false;
                continue;
            }
        }
        let (answer, overflow) = match (decide(reply, tried), got) {
            (Next::RetryStale, Err(failure)) => {
                tracing::debug!(error = %failure, "retrying once");
                tried.stale_retried = true;
                continue;
            }
            (_, Err(failure)) => return Err(failure.into_proxy_error()),
            (next, Ok(got)) => match next {
                Next::CompactAndRetry => got,
                Next::ResendUncompacted => {
                    // The provider's compaction refused: the local
                    // summarizer's in its place, in this request.
                    if let Answer::Error(status, ..) = &got.0 {
                        if local_instead(state, pending, *status).await {
                            tried.stale_retried = false;
                            continue;
                        }
                    }
                    if let Answer::Error(status, ..) = &got.0 {
                        tracing::warn!(%status, "compacted request refused; resending it uncompacted");
                    }
                    pending.unapply();
                    tried.resent = true;
                    tried.stale_retried = false;
                    continue;
                }
                _ => return Ok(got.0),
            },
        };
        // Outside auto mode the upstream's "too long" is the client's.
        let Some((stated, why)) =
            overflow.filter(|_| matches!(pending.mode, Mode::Auto | Mode::Manual))
        else {
            return Ok(answer);
        };
        // The client's own compaction request: the stored compaction of its
        // prefix, if it went without. Only when that is not enough is it
        // compacted below: its overflow is never the client's.
        if pending.client_compaction && pending.compaction.is_none() {
            if let Some(c) = state.compactions.find(&pending.tenant, &pending.chains) {
                pending.apply(c);
                tried.resent = true;
                tried.stale_retried = false;
                continue;
            }
        }
        // What recall rounds added goes first: the request fitted without.
        if !pending.extra.is_empty() {
            tracing::info!("too long with the recall rounds: sent again without them");
            pending.withdraw_recall(true);
            tried.resent = true;
            tried.stale_retried = false;
            continue;
        }
        if !compact_on_overflow(state, pending, stated, &why).await {
            return Ok(answer);
        }
        tried.reactive += 1;
        tried.resent = true;
        tried.stale_retried = false;
        state.metrics.reactive_retry();
    }
}

/// A compacted request refused whose summary was the provider's
/// (`engine::provider::refused`): compacted again from the client's items
/// with the local summarizer. False when it was no provider compaction, or
/// no local one could be made (the client's items are then what goes).
async fn local_instead(
    state: &Arc<AppState>,
    pending: &mut PendingExchange,
    status: http::StatusCode,
) -> bool {
    let Some(c) = pending.compaction.clone() else {
        return false;
    };
    if !crate::engine::provider::refused(
        state,
        &pending.tenant,
        &pending.ident.conversation,
        &c,
        status,
    ) {
        return false;
    }
    pending.unapply();
    let trigger = c
        .reason
        .trim_end_matches(crate::compaction::provider::PROVIDER_REASON)
        .trim_end_matches("; ");
    let reason = format!("{trigger}; the provider's compaction refused upstream ({status})");
    super::identify::compact_now(state, pending, reason, crate::engine::Goal::Shrink).await
}

/// Reads as much of an answer as the decision needs: an error answer
/// whole (it is small, and says whether the prompt did not fit), a
/// Responses stream up to its first event past the prelude.
async fn read_start(
    state: &AppState,
    api: Api,
    resp: reqwest::Response,
) -> Result<(Answer, Option<Overflow>), ProxyError> {
    if resp.status().is_success() {
        if !matches!(api, Api::Responses | Api::Messages) || !is_sse(resp.headers()) {
            return Ok((Answer::Upstream(resp), None));
        }
        // Hold the first events back until the upstream commits to an
        // answer, so a start that fails for lack of room can be retried.
        let held = hold_back(resp, state.upstream.idle_timeout).await?;
        let overflow = held
            .failure
            .as_ref()
            .filter(|data| policy::is_context_overflow(400, data.as_bytes()))
            .map(|data| {
                let stated = policy::stated_limits(data.as_bytes());
                (stated, "upstream stream failed".to_string())
            });
        return Ok((Answer::Held(held), overflow));
    }
    let status = resp.status();
    let headers = resp.headers().clone();
    // One the upstream broke off, or too large to read whole, is the
    // proxy's 502: relaying the status without its body would not be
    // what the upstream said.
    let bytes = state.upstream.read_body(resp).await?;
    let overflow = policy::is_context_overflow(status.as_u16(), &bytes).then(|| {
        (
            policy::stated_limits(&bytes),
            format!("upstream answered {status}"),
        )
    });
    Ok((Answer::Error(status, headers, bytes), overflow))
}

/// What the upstream finally answered.
pub(super) enum Answer {
    /// A success, body not yet read.
    Upstream(reqwest::Response),
    /// A stream whose first events were read and held back.
    Held(Held),
    /// An error answer, read whole.
    Error(http::StatusCode, http::HeaderMap, Bytes),
    /// A success read whole (to see whether it calls the recall tool).
    Read(http::StatusCode, http::HeaderMap, Bytes),
    /// A stream offered the recall tool that began with reasoning: relayed
    /// as it comes, the recall rounds spliced onto it (`server::splice`).
    Live(Held),
}

/// A stream whose first events are held back.
pub(super) struct Held {
    pub status: http::StatusCode,
    pub headers: http::HeaderMap,
    /// Bytes read so far, in order.
    pub chunks: Vec<Bytes>,
    /// The data of a `response.failed` / `error` event seen before any output.
    pub failure: Option<String>,
    /// The rest of the body.
    pub rest: UpstreamStream,
    /// How the body ended (or failed), if it did while being read.
    pub end: Option<Option<reqwest::Result<Bytes>>>,
    /// Set once the splice read it: how many of its bytes the client has.
    pub relayed: Option<usize>,
}

impl Held {
    /// A stream of which nothing was read yet.
    pub(super) fn unread(resp: reqwest::Response) -> Held {
        Held {
            status: resp.status(),
            headers: resp.headers().clone(),
            chunks: Vec::new(),
            failure: None,
            rest: Box::pin(resp.bytes_stream()),
            end: None,
            relayed: None,
        }
    }

    /// Adds to the chunks what the upstream delivered with them (see
    /// [`take_delivered`]), so that the answer's first write carries it all:
    /// with a short answer, the whole of it.
    pub(super) async fn take_delivered(&mut self) {
        if self.end.is_some() {
            return;
        }
        let chunks = &mut self.chunks;
        let mut size: usize = chunks.iter().map(Bytes::len).sum();
        self.end = take_delivered(&mut self.rest, size, |chunk| {
            size += chunk.len();
            chunks.push(chunk);
            size
        })
        .await;
    }
}

/// Longest time a Responses or Messages stream's first events are held back waiting
/// for the upstream to commit (a reasoning model may think silently first).
const MAX_HOLD_BACK: Duration = Duration::from_secs(10);

/// Event types that come before a Responses stream commits to an answer.
const PRELUDE_EVENTS: &[&str] = &[
    "response.created",
    "response.in_progress",
    "response.queued",
    // Anthropic Messages: the message opens, then its first content block
    // commits to an answer.
    "message_start",
    "ping",
];

/// Reads a Responses stream until its first event past the prelude: an
/// output event (committed) or a failure.
async fn hold_back(resp: reqwest::Response, idle: Duration) -> Result<Held, ProxyError> {
    let status = resp.status();
    let headers = resp.headers().clone();
    let mut rest: UpstreamStream = Box::pin(resp.bytes_stream());
    let mut chunks = Vec::new();
    let mut framer = wire::sse::Framer::new();
    let release_at = tokio::time::Instant::now() + MAX_HOLD_BACK;
    let mut end = None;
    loop {
        // What the upstream has delivered already is taken without arming a
        // timer: a timer due before every other one wakes the runtime's
        // driver (a syscall), and the first events of an answer usually
        // come together.
        let mut size: usize = chunks.iter().map(Bytes::len).sum();
        let delivered = take_delivered(&mut rest, size, |chunk| {
            size += chunk.len();
            framer.push(&chunk);
            chunks.push(chunk);
            size
        })
        .await;
        while let Some(block) = framer.next_block() {
            let Some(wire::sse::Event { name, data }) = block.event else {
                continue;
            };
            let kind = wire::responses::event_type(&data).unwrap_or(name);
            if PRELUDE_EVENTS.contains(&kind.as_str()) {
                continue;
            }
            let failure = (kind == "response.failed" || kind == "error").then_some(data);
            return Ok(Held {
                status,
                headers,
                chunks,
                failure,
                rest,
                end: delivered,
                relayed: None,
            });
        }
        match delivered {
            Some(Some(Err(e))) => return Err(ProxyError::UpstreamUnreachable(describe(&e))),
            Some(_) => {
                end = Some(None);
                break;
            }
            None => {}
        }
        // Past the hold-back limit the stream is released as it is (a later
        // failure is relayed); the client must not wait on a silent start.
        let wait = release_at.saturating_duration_since(tokio::time::Instant::now());
        if wait.is_zero() {
            break;
        }
        let next = match tokio::time::timeout(wait.min(idle), rest.next()).await {
            Ok(next) => next,
            Err(_) if wait <= idle => break,
            Err(_) => return Err(ProxyError::UpstreamTimeout(idle.as_secs())),
        };
        let Some(chunk) = next else {
            end = Some(None);
            break;
        };
        let chunk = chunk.map_err(|e| ProxyError::UpstreamUnreachable(describe(&e)))?;
        framer.push(&chunk);
        chunks.push(chunk);
    }
    Ok(Held {
        status,
        headers,
        chunks,
        failure: None,
        rest,
        end,
        relayed: None,
    })
}

/// Whether an answer is an SSE stream.
pub(super) fn is_sse(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIRST: Tried = Tried {
        reactive: 0,
        resent: false,
        stale_retried: false,
        compacted: false,
    };

    #[test]
    fn a_closed_pooled_connection_is_retried_once_per_body() {
        let closed = Reply::Failed {
            retry_allowed: true,
        };
        assert_eq!(decide(closed, FIRST), Next::RetryStale);
        let again = Tried {
            stale_retried: true,
            ..FIRST
        };
        assert_eq!(decide(closed, again), Next::GiveUp);
        // A new body (after a compaction) may be retried again.
        let compacted = Tried {
            reactive: 1,
            resent: true,
            compacted: true,
            ..FIRST
        };
        assert_eq!(decide(closed, compacted), Next::RetryStale);
    }

    #[test]
    fn other_failures_give_up_at_once() {
        let failed = Reply::Failed {
            retry_allowed: false,
        };
        assert_eq!(decide(failed, FIRST), Next::GiveUp);
    }

    #[test]
    fn answers_are_relayed() {
        assert_eq!(decide(Reply::Answer, FIRST), Next::Relay);
        let server_error = Reply::Refused {
            client_error: false,
        };
        let compacted = Tried {
            compacted: true,
            ..FIRST
        };
        // A 5xx is the upstream's trouble, not the compaction's.
        assert_eq!(decide(server_error, compacted), Next::Relay);
        assert_eq!(
            decide(Reply::Refused { client_error: true }, FIRST),
            Next::Relay
        );
    }

    #[test]
    fn too_long_is_compacted_up_to_the_limit_then_relayed() {
        for reactive in 0..MAX_REACTIVE_RETRIES {
            let tried = Tried {
                reactive,
                resent: reactive > 0,
                compacted: reactive > 0,
                ..FIRST
            };
            assert_eq!(decide(Reply::TooLong, tried), Next::CompactAndRetry);
        }
        let exhausted = Tried {
            reactive: MAX_REACTIVE_RETRIES,
            resent: true,
            compacted: true,
            ..FIRST
        };
        assert_eq!(decide(Reply::TooLong, exhausted), Next::Relay);
    }

    #[test]
    fn a_refused_compaction_is_resent_as_the_client_sent_it_once() {
        let refused = Reply::Refused { client_error: true };
        let compacted = Tried {
            compacted: true,
            ..FIRST
        };
        assert_eq!(decide(refused, compacted), Next::ResendUncompacted);
        // Not after a reactive compaction (the client's own request was
        // too long), nor a second time.
        let resent = Tried {
            resent: true,
            ..compacted
        };
        assert_eq!(decide(refused, resent), Next::Relay);
    }
}
