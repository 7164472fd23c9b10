//! The send phase: runs once the items that go upstream are chosen, and
//! again each time the driver sends the request again. Sends the request
//! once, reads as much of the answer as the decision needs (an error
//! answer whole, a Responses stream's first events), and decides with
//! [`decide`], a pure function of what the attempt came to and what was
//! tried before, whether to hand the answer on, compact and send again,
//! resend the client's own request, apply the stored compaction it went
//! without, take the recall rounds back, rebuild it from the record, send
//! again on a new connection, or give up; it changes the exchange for what
//! needs no compaction, and the driver acts on the rest ([`Sent`]). It
//! must not compact, answer the client or record the exchange.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::Method;

use super::answer::{is_sse, Answer, Held};
use super::exchange::Unanswered;
use super::gather::{take_delivered, UpstreamStream};
use crate::app::AppState;
use crate::compaction::{boundary, policy, rebuild};
use crate::config::Mode;
use crate::error::ProxyError;
use crate::upstream::SendFailure;
use crate::wire::format::Start;
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
    /// "Too long", in a mode where the upstream's "too long" is the
    /// client's (the proxy compacts nothing then).
    TooLongForTheClient,
    /// "Too long", to the client's own compaction request sent without the
    /// stored compaction of its prefix, which there is.
    TooLongWithoutStored,
    /// "Too long", with what the recall rounds added after the request.
    TooLongWithRounds,
    /// The provider refused its own compaction item (see [`refusal`]); as
    /// an answer, an error answer (`Some(client_error)`) or a held stream
    /// that failed before any output (`None`).
    ItemRefused {
        /// As for [`Reply::Refused`], for a stream `None`.
        client_error: Option<bool>,
    },
}

/// What was tried for this request before the attempt judged. Kept by
/// [`send`] and the driver's acts on it ([`Tried::new_body`],
/// [`Tried::compacted_again`], [`Tried::rebuilt`]); read by [`decide`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Tried {
    /// Reactive compactions made.
    reactive: u32,
    /// The request was sent again after a refusal (compacted after "too
    /// long", or as the client sent it).
    resent: bool,
    /// The body of this attempt was already sent again on a new connection.
    stale_retried: bool,
    /// A compaction applies to the body of this attempt.
    compacted: bool,
    /// The request was rebuilt from the record once already, after the
    /// provider refused its own compaction item.
    rebuilt: bool,
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
    /// Apply the stored compaction of the request's prefix and send again.
    ApplyStored,
    /// Take back what the recall rounds added and send again.
    WithdrawRecall,
    /// Rebuild the request from the record and send it again.
    RebuildFromRecord,
}

/// The retry decision. A closed pooled connection is retried once per
/// body; "too long" is compacted and sent again up to
/// [`MAX_REACTIVE_RETRIES`] times, then relayed (first without the recall
/// rounds, or, for the client's own compaction request, with the stored
/// compaction it went without; in a mode that compacts nothing, relayed at
/// once); a compacted request refused with another 4xx is sent once as the
/// client sent it, since a compaction must never turn a request that would
/// have succeeded into a failure; a request whose provider compaction item
/// is refused is rebuilt from the record once; everything else is relayed
/// as the upstream said it.
pub(super) fn decide(reply: Reply, tried: Tried) -> Next {
    let room = tried.reactive < MAX_REACTIVE_RETRIES;
    match reply {
        Reply::ItemRefused { .. } if !tried.rebuilt => Next::RebuildFromRecord,
        Reply::ItemRefused {
            client_error: Some(client_error),
        } => decide(Reply::Refused { client_error }, tried),
        Reply::ItemRefused { client_error: None } => decide(Reply::Answer, tried),
        Reply::TooLongForTheClient => Next::Relay,
        Reply::TooLongWithoutStored if room => Next::ApplyStored,
        Reply::TooLongWithRounds if room => Next::WithdrawRecall,
        Reply::TooLongWithoutStored | Reply::TooLongWithRounds => Next::Relay,
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

/// What an attempt comes to, for the driver in `server::proxy`.
pub(super) enum Sent {
    /// The answer to hand on (to the recall rounds, then the relay).
    Answer(Answer),
    /// Send again: the exchange was changed for it (a stored compaction
    /// applied, the recall rounds withdrawn, the client's own items), or
    /// the same bytes go again on a new connection.
    Again,
    /// A compacted request refused with this 4xx: compacted again with the
    /// local summarizer if the compaction was the provider's
    /// (`compact_now::local_instead`), else sent as the client sent it
    /// ([`resend_uncompacted`]); then sent again.
    Refused(http::StatusCode),
    /// The provider refused its own compaction item (`how`: see
    /// [`refusal`]): rebuild the request from the record and send it again
    /// (`compact_now::rebuild_from_record`), or, if the record does not hold
    /// what the item stood for, hand the `answer` on as it came.
    ItemRefused {
        /// How it refused, for the compaction's reason.
        how: String,
        /// Its answer, relayed if the request cannot be rebuilt.
        answer: Answer,
    },
    /// The upstream said the request does not fit: compact it to the
    /// size `stated` and send again, or, if none can be made, hand the
    /// `answer` on.
    Overflow {
        /// The limits the upstream stated.
        stated: policy::Stated,
        /// How it said it (for the compaction's reason).
        why: String,
        /// Its answer, relayed if no compaction can be made.
        answer: Answer,
    },
}

impl Tried {
    /// The request goes again with another body.
    pub(super) fn resent(&mut self) {
        self.resent = true;
        self.new_body();
    }

    /// The request goes again with another body, made in place of a
    /// refused one (a local compaction, a rebuild): its connection may be
    /// retried again.
    pub(super) fn new_body(&mut self) {
        self.stale_retried = false;
    }

    /// The request is rebuilt from the record (after the provider refused
    /// its own compaction item): never a second time.
    pub(super) fn rebuilt(&mut self) {
        self.rebuilt = true;
    }

    /// The request goes again compacted after "too long".
    pub(super) fn compacted_again(&mut self) {
        self.reactive += 1;
        self.resent();
    }
}

/// Where a request's attempts go: the upstream URL and headers, and, for
/// a request that came over the client's WebSocket, its upstream socket
/// (see [`crate::upstream::Upstream::send_over`]).
#[derive(Clone)]
pub(super) struct Target {
    pub(super) url: reqwest::Url,
    pub(super) headers: http::HeaderMap,
    pub(super) socket: Option<Arc<crate::upstream::Socket>>,
}

/// Sends the exchange's request once and says, through [`decide`], what
/// the driver does next. `tried` is what was tried for it before, and is
/// kept up to date. The error is the client's; the driver records it.
pub(super) async fn send(
    state: &Arc<AppState>,
    pending: &mut Unanswered,
    target: &Target,
    tried: &mut Tried,
) -> Result<Sent, ProxyError> {
    tried.compacted = pending.compaction().is_some();
    // The client's bytes, or the body with the compaction applied now.
    let body = pending.upstream_bytes()?;
    let attempt_headers = pending.upstream_headers(&target.headers).into_owned();
    let (url, upstream) = (&target.url, &state.upstream);
    let sent = match &target.socket {
        Some(socket) => {
            upstream
                .send_over(socket, url, attempt_headers, &body)
                .await
        }
        None => {
            upstream
                .send_once(Method::POST, url, attempt_headers, &body)
                .await
        }
    };
    let got = match sent {
        Ok(resp) => read_start(state, pending.request().api(), resp)
            .await
            .map_err(SendFailure::Failed),
        Err(failure) => Err(failure.into()),
    };
    let auto = matches!(pending.request().mode(), Mode::Auto | Mode::Manual);
    // The client's own compaction request goes with the stored compaction
    // of its prefix, if it went without, before it is compacted: its
    // overflow is never the client's.
    let stored = match &got {
        Ok((_, Some(_)))
            if auto && pending.client_compaction() && pending.compaction().is_none() =>
        {
            state
                .compactions
                .find(pending.request().tenant(), pending.chains())
        }
        _ => None,
    };
    let refused_item = match &got {
        Ok((answer, None)) => item_refused(pending, answer),
        _ => None,
    };
    let reply = match &got {
        Err(failure) => Reply::Failed {
            retry_allowed: failure.retry_allowed(),
        },
        Ok((answer, None)) if refused_item.is_some() => Reply::ItemRefused {
            client_error: match answer {
                Answer::Error(status, ..) => Some(status.is_client_error()),
                _ => None,
            },
        },
        Ok((_, Some(_))) if !auto => Reply::TooLongForTheClient,
        Ok((_, Some(_))) if stored.is_some() => Reply::TooLongWithoutStored,
        Ok((_, Some(_))) if !pending.extra().is_empty() => Reply::TooLongWithRounds,
        Ok((_, Some(_))) => Reply::TooLong,
        Ok((Answer::Error(status, ..), None)) => Reply::Refused {
            client_error: status.is_client_error(),
        },
        Ok(_) => Reply::Answer,
    };
    let next = decide(reply, *tried);
    let (answer, overflow) = match (next, got) {
        (Next::RetryStale, Err(failure)) => {
            tracing::debug!(error = %failure, "retrying once");
            tried.stale_retried = true;
            return Ok(Sent::Again);
        }
        (_, Err(failure)) => return Err(failure.into_proxy_error()),
        (_, Ok(got)) => got,
    };
    match next {
        Next::CompactAndRetry => match overflow {
            Some((stated, why)) => Ok(Sent::Overflow {
                stated,
                why,
                answer,
            }),
            None => Ok(Sent::Answer(answer)),
        },
        Next::ResendUncompacted => {
            if let Answer::Error(status, ..) = &answer {
                return Ok(Sent::Refused(*status));
            }
            resend_uncompacted(pending, tried, None);
            Ok(Sent::Again)
        }
        Next::ApplyStored => {
            if let Some(c) = stored {
                pending.apply(c);
            }
            tried.resent();
            Ok(Sent::Again)
        }
        // What recall rounds added goes first: the request fitted without.
        Next::WithdrawRecall => {
            tracing::info!("too long with the recall rounds: sent again without them");
            pending.withdraw_recall(true);
            tried.resent();
            Ok(Sent::Again)
        }
        // The driver rebuilds the request from the record, once.
        Next::RebuildFromRecord => Ok(Sent::ItemRefused {
            how: refused_item.unwrap_or_default(),
            answer,
        }),
        Next::Relay | Next::GiveUp | Next::RetryStale => Ok(Sent::Answer(answer)),
    }
}

/// A compacted request refused (with `status`), and no local compaction
/// made in its place: the client's own request goes, once.
pub(super) fn resend_uncompacted(
    pending: &mut Unanswered,
    tried: &mut Tried,
    status: Option<http::StatusCode>,
) {
    if let Some(status) = status {
        tracing::warn!(%status, "compacted request refused; resending it uncompacted");
    }
    pending.unapply();
    tried.resent();
}

/// [`refusal`] of an answer in hand: an error answer, or a held stream
/// that failed before any output.
fn item_refused(pending: &Unanswered, answer: &Answer) -> Option<String> {
    match answer {
        Answer::Error(status, _, body) => refusal(pending, Some(*status), body),
        Answer::Held(held) => held
            .failure
            .as_deref()
            .and_then(|data| refusal(pending, None, data.as_bytes())),
        _ => None,
    }
}

/// How the upstream refused an encrypted item it can no longer read, when
/// it did: `status` and `body` of an error answer, or (`status` `None`) the
/// data of a Responses stream's failure event before any output. Only in a
/// mode that rewrites requests, when the client's items hold a provider
/// compaction item; `None` otherwise.
pub(super) fn refusal(
    pending: &Unanswered,
    status: Option<http::StatusCode>,
    body: &[u8],
) -> Option<String> {
    let request = pending.request();
    if !request.mode().rewrites() || boundary::newest_in(request.items()).is_none() {
        return None;
    }
    match status {
        Some(status) if rebuild::refuses_encrypted_item(request.api(), status.as_u16(), body) => {
            Some(status.to_string())
        }
        None if request.api() == crate::wire::Api::Responses
            && rebuild::stream_refuses_encrypted_item(body) =>
        {
            Some("its stream failed".to_string())
        }
        _ => None,
    }
}

/// Reads as much of an answer as the decision needs: an error answer
/// whole (it is small, and says whether the prompt did not fit), a stream
/// up to its first event past the prelude.
async fn read_start(
    state: &AppState,
    api: Api,
    resp: reqwest::Response,
) -> Result<(Answer, Option<Overflow>), ProxyError> {
    if resp.status().is_success() {
        if !is_sse(resp.headers()) {
            return Ok((Answer::Upstream(resp), None));
        }
        // Hold the first events back until the upstream commits to an
        // answer, so a start that fails for lack of room can be retried.
        let held = hold_back(resp, api, state.upstream.idle_timeout).await?;
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

/// Longest time a Responses or Messages stream's first events are held back waiting
/// for the upstream to commit (a reasoning model may think silently first).
const MAX_HOLD_BACK: Duration = Duration::from_secs(10);

/// Reads a stream until its first event past the prelude: an output event
/// (committed) or a failure (a Responses `response.failed`, an `error`
/// event, a chat stream's error chunk).
async fn hold_back(resp: reqwest::Response, api: Api, idle: Duration) -> Result<Held, ProxyError> {
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
            let failure = match api.format().stream_start(&name, &data) {
                Start::Prelude => continue,
                Start::Failed => Some(data),
                Start::Committed => None,
            };
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
            Some(Some(Err(e))) => return Err(crate::upstream::Error::broke(e).into()),
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
            Err(_) => return Err(crate::upstream::Error::silent(idle).into()),
        };
        let Some(chunk) = next else {
            end = Some(None);
            break;
        };
        let chunk = chunk.map_err(crate::upstream::Error::broke)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    const FIRST: Tried = Tried {
        reactive: 0,
        resent: false,
        stale_retried: false,
        compacted: false,
        rebuilt: false,
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
