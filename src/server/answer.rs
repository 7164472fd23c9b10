//! What the phases hand on and the driver passes between them: the
//! upstream's answer as far as it was read ([`Answer`], [`Held`]), and the
//! head of the client's response with the headers the proxy adds ([`response_head`]).
//! Not a phase: it calls none.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::Response;

use super::gather::{take_delivered, UpstreamStream};
use crate::error::ProxyBody;
use crate::upstream::strip_hop_by_hop;

/// Response header naming the conversation.
pub const CONVERSATION_HEADER: &str = "x-compactor-conversation";
/// Response header naming the compaction applied to the request.
pub const COMPACTED_HEADER: &str = "x-compactor-compacted";

/// Copies the upstream's status and end-to-end headers and adds ours.
pub(super) fn response_head(
    status: http::StatusCode,
    upstream: &http::HeaderMap,
    conversation: &str,
    body: ProxyBody,
) -> Response<ProxyBody> {
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = strip_hop_by_hop(upstream);
    if let Ok(v) = HeaderValue::from_str(conversation) {
        out.headers_mut().insert(CONVERSATION_HEADER, v);
    }
    out
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

/// Whether an answer is an SSE stream.
pub(super) fn is_sse(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"))
}
