//! Taking what the upstream has already delivered without waiting on the
//! network: used while a stream's first events are held back (the send)
//! and between the frames of a relayed stream (the relay), so that events
//! that arrived together leave in one write. It never waits on the network.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

/// An upstream answer's body, chunk by chunk.
pub(super) type UpstreamStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// Most a frame gathers from chunks the upstream delivered together.
const GATHER_BYTES: usize = 64 * 1024;

/// Longest a frame waits for more chunks the upstream delivered together.
const GATHER_HOLD: Duration = Duration::from_millis(1);

/// Passes `take` the chunks the upstream has already delivered, up to
/// [`GATHER_BYTES`] (`take` returns the size so far, starting at `size`),
/// and returns how the body ended if it did meanwhile.
///
/// The upstream connection hands a body over one chunk at a time, and the
/// server writes out what it has whenever the body is not ready: relayed
/// as they come, a burst of events (a Responses stream's first and last
/// ones, a short answer) costs a write per event. So while the upstream's
/// next chunk is not ready, this waits until the runtime has given the
/// other tasks (the upstream connection among them) their turn, and takes
/// what they delivered meanwhile. A turn that brought a chunk is followed
/// by another, for up to [`GATHER_HOLD`]; the first turn that brings
/// nothing ends it. It never waits on the network.
pub(super) async fn take_delivered(
    upstream: &mut UpstreamStream,
    mut size: usize,
    mut take: impl FnMut(Bytes) -> usize,
) -> Option<Option<reqwest::Result<Bytes>>> {
    let mut turn: Option<Arc<Turn>> = None;
    // When the first turn began, and whether the turn under way brought a chunk.
    let mut began: Option<Instant> = None;
    let mut brought = false;
    std::future::poll_fn(|cx| loop {
        if size >= GATHER_BYTES {
            return Poll::Ready(None);
        }
        match upstream.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                size = take(chunk);
                brought = true;
            }
            Poll::Ready(end_or_error) => return Poll::Ready(Some(end_or_error)),
            Poll::Pending => {
                if turn.as_ref().is_some_and(|t| !t.over()) {
                    return Poll::Pending;
                }
                let began = *began.get_or_insert_with(Instant::now);
                if turn.is_some() && !(brought && began.elapsed() < GATHER_HOLD) {
                    return Poll::Ready(None);
                }
                brought = false;
                turn = Some(Turn::after_others(cx));
                return Poll::Pending;
            }
        }
    })
    .await
}

/// The chunks as one, if any (copied only when there are several).
pub(super) fn concat(mut chunks: Vec<Bytes>) -> Option<Bytes> {
    match chunks.len() {
        0 => None,
        1 => chunks.pop(),
        _ => {
            let mut out = bytes::BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            for c in &chunks {
                out.extend_from_slice(c);
            }
            Some(out.freeze())
        }
    }
}

/// The other tasks' turn: over once the runtime has run the tasks that
/// were ready when it began. Tokio wakes a task that yielded only after its
/// worker ran the others (or at its next periodic check); outside a tokio
/// worker, at once.
struct Turn {
    over: AtomicBool,
    task: Waker,
}

impl Turn {
    fn after_others(cx: &Context<'_>) -> Arc<Turn> {
        let turn = Arc::new(Turn {
            over: AtomicBool::new(false),
            task: cx.waker().clone(),
        });
        let waker = Waker::from(turn.clone());
        let mut yielded = std::pin::pin!(tokio::task::yield_now());
        // The first poll hands `waker` to the runtime, to wake when the
        // others have run.
        let _ = yielded.as_mut().poll(&mut Context::from_waker(&waker));
        turn
    }

    fn over(&self) -> bool {
        self.over.load(Ordering::Acquire)
    }
}

impl std::task::Wake for Turn {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.over.store(true, Ordering::Release);
        self.task.wake_by_ref();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream body: each chunk after `pause` (None: the chunk is
    /// handed over at the next turn, as a connection task would).
    fn upstream(chunks: Vec<(&'static str, Option<Duration>)>) -> UpstreamStream {
        Box::pin(futures_util::stream::unfold(
            chunks.into_iter(),
            |mut it| async move {
                let (text, pause) = it.next()?;
                match pause {
                    Some(d) => tokio::time::sleep(d).await,
                    None => tokio::task::yield_now().await,
                }
                Some((Ok(Bytes::from_static(text.as_bytes())), it))
            },
        ))
    }

    async fn take_all(s: &mut UpstreamStream) -> (Vec<Bytes>, Option<bool>) {
        let mut taken = Vec::new();
        let end = take_delivered(s, 0, |c| {
            taken.push(c);
            taken.iter().map(Bytes::len).sum()
        })
        .await;
        (taken, end.map(|e| e.is_none()))
    }

    #[tokio::test]
    async fn chunks_delivered_turn_after_turn_are_taken_with_the_end() {
        let mut s = upstream(vec![("a", None), ("b", None), ("c", None)]);
        let (taken, end) = tokio::time::timeout(Duration::from_secs(5), take_all(&mut s))
            .await
            .unwrap();
        assert_eq!(taken, ["a", "b", "c"]);
        assert_eq!(end, Some(true), "the end of the body is reported");
    }

    #[tokio::test]
    async fn a_chunk_still_on_the_network_is_not_waited_for() {
        let pause = Duration::from_millis(300);
        let mut s = upstream(vec![("a", None), ("b", Some(pause)), ("c", None)]);
        let t = Instant::now();
        let (taken, end) = tokio::time::timeout(Duration::from_secs(5), take_all(&mut s))
            .await
            .unwrap();
        assert!(t.elapsed() < pause, "{:?}", t.elapsed());
        assert_eq!(taken, ["a"]);
        assert_eq!(end, None);
        // The rest comes with the next gathering.
        let (taken, end) = tokio::time::timeout(Duration::from_secs(5), async {
            let first = s.next().await.unwrap().unwrap();
            let (mut rest, end) = take_all(&mut s).await;
            rest.insert(0, first);
            (rest, end)
        })
        .await
        .unwrap();
        assert_eq!(taken, ["b", "c"]);
        assert_eq!(end, Some(true));
    }

    #[tokio::test]
    async fn gathering_stops_at_its_size_limit() {
        let big: &'static str = Box::leak("x".repeat(GATHER_BYTES / 2 + 1).into_boxed_str());
        let mut s = upstream(vec![(big, None), (big, None), (big, None)]);
        let (taken, end) = tokio::time::timeout(Duration::from_secs(5), take_all(&mut s))
            .await
            .unwrap();
        assert_eq!(taken.len(), 2);
        assert_eq!(end, None);
    }

    #[test]
    fn concat_joins_chunks_in_order() {
        assert_eq!(concat(Vec::new()), None);
        let one = Bytes::from_static(b"one");
        assert_eq!(concat(vec![one.clone()]), Some(one));
        let joined = concat(vec![Bytes::from_static(b"a"), Bytes::from_static(b"bc")]);
        assert_eq!(joined.as_deref(), Some(&b"abc"[..]));
    }
}
