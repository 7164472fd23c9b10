//! A request body in memory, sent in pieces: the client's bytes with a
//! few bytes put before them or in a part's place.

use std::ops::Range;
use std::task::{Context, Poll};

use bytes::Bytes;

/// A request body in memory: the client's bytes, or pieces of them with a
/// few bytes put before them or in a part's place, sent one after the
/// other (with their total length) rather than copied into one buffer.
#[derive(Clone, Debug, Default)]
pub struct Payload {
    pieces: [Bytes; PIECES],
}

/// Most pieces a [`Payload`] is sent in: a head put before the client's
/// bytes, and two cuts of them (the items a compaction covers, the end of
/// the tool definitions).
const PIECES: usize = 6;

impl Payload {
    /// `head` then `rest`.
    pub fn joined(head: Bytes, rest: Bytes) -> Payload {
        Payload {
            pieces: [
                head,
                rest,
                Bytes::new(),
                Bytes::new(),
                Bytes::new(),
                Bytes::new(),
            ],
        }
    }

    /// This payload with the bytes `cut` of `body` replaced by `insert`,
    /// when its last piece is a tail of `body` (the client's body as read)
    /// that holds all of `cut`: what came before that tail stays as it is.
    /// `None` when this payload is not such a tail of `body`.
    pub fn with_cut_replaced(
        &self,
        body: &Bytes,
        cut: Range<usize>,
        insert: Bytes,
    ) -> Option<Payload> {
        self.with_cuts_replaced(body, vec![(cut, insert)])
    }

    /// [`Payload::with_cut_replaced`] for at most two cuts (an empty one
    /// inserts), in any order; `None` also when they overlap.
    pub fn with_cuts_replaced(
        &self,
        body: &Bytes,
        mut edits: Vec<(Range<usize>, Bytes)>,
    ) -> Option<Payload> {
        let [head, rest, others @ ..] = &self.pieces;
        if edits.len() > (PIECES - 2) / 2 || others.iter().any(|p| !p.is_empty()) {
            return None;
        }
        // Where `rest` starts in `body`: it must be the same memory.
        let from = (rest.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
        if from.checked_add(rest.len()) != Some(body.len()) {
            return None;
        }
        edits.sort_by_key(|(cut, _)| cut.start);
        let mut pieces: [Bytes; PIECES] = Default::default();
        pieces[0] = head.clone();
        let (mut at, mut n) = (from, 1);
        for (cut, insert) in edits {
            if cut.start < at || cut.end < cut.start || cut.end > body.len() {
                return None;
            }
            pieces[n] = body.slice(at..cut.start);
            pieces[n + 1] = insert;
            (at, n) = (cut.end, n + 2);
        }
        pieces[n] = body.slice(at..);
        Some(Payload { pieces })
    }

    /// All its bytes in one buffer (a copy only when it is in pieces).
    pub fn to_bytes(&self) -> Bytes {
        let mut full = self.pieces.iter().filter(|p| !p.is_empty());
        match (full.next(), full.next()) {
            (None, _) => Bytes::new(),
            (Some(one), None) => one.clone(),
            _ => self.pieces.concat().into(),
        }
    }

    pub(super) fn body(&self) -> reqwest::Body {
        if self.pieces.iter().filter(|p| !p.is_empty()).count() < 2 {
            return reqwest::Body::from(self.to_bytes());
        }
        reqwest::Body::wrap(Pieces(self.pieces.clone()))
    }
}

impl PartialEq for Payload {
    /// The same bytes, however they are cut into pieces.
    fn eq(&self, other: &Payload) -> bool {
        self.to_bytes() == other.to_bytes()
    }
}

impl From<Bytes> for Payload {
    fn from(rest: Bytes) -> Payload {
        Payload::joined(Bytes::new(), rest)
    }
}

/// The pieces of a [`Payload`] as a body of known length.
struct Pieces([Bytes; PIECES]);

impl hyper::body::Body for Pieces {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let next = self
            .0
            .iter_mut()
            .find(|b| !b.is_empty())
            .map(std::mem::take);
        Poll::Ready(next.map(|b| Ok(hyper::body::Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.iter().all(Bytes::is_empty)
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.0.iter().map(|b| b.len() as u64).sum())
    }
}
