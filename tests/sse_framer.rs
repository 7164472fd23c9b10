//! The SSE framer (`wire::sse::Framer`), which the tee, the send's
//! hold-back and recall all read streams through: it gives the same events
//! however the stream is cut into chunks, the same as a general SSE parser
//! (eventsource-stream) reading the whole stream, and blocks whose bytes are
//! the stream's own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use compactor::wire::sse::{Event, Framer};
use futures_util::Stream;
use proptest::prelude::*;

/// Frames `body` fed in pieces cut at `cuts`: the events, the blocks' bytes
/// joined with what was left at the end.
fn framed(body: &[u8], cuts: &[usize]) -> (Vec<Event>, Vec<u8>) {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    at.extend([0, body.len()]);
    at.sort_unstable();
    at.dedup();
    let mut framer = Framer::new();
    let (mut events, mut bytes) = (Vec::new(), Vec::new());
    for w in at.windows(2) {
        framer.push(&body[w[0]..w[1]]);
        while let Some(block) = framer.next_block() {
            bytes.extend_from_slice(&block.raw);
            events.extend(block.event);
        }
    }
    bytes.extend_from_slice(&framer.rest());
    (events, bytes)
}

/// The events eventsource-stream reads from `body`, as (type, data). Its
/// own skipping of a leading byte-order mark slices one byte into the
/// three-byte character and panics, so the reference is handed the stream
/// after it.
fn reference(body: &[u8]) -> Vec<(String, String)> {
    let body = body.strip_prefix("\u{feff}".as_bytes()).unwrap_or(body);
    let chunks = vec![Ok::<_, std::convert::Infallible>(Bytes::copy_from_slice(
        body,
    ))];
    let mut stream = eventsource_stream::EventStream::new(futures_util::stream::iter(chunks));
    let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
    let mut out = Vec::new();
    // The stream over an iterator is always ready.
    while let Poll::Ready(Some(ev)) = Pin::new(&mut stream).poll_next(&mut cx) {
        let ev = ev.expect("the generated streams are valid UTF-8");
        out.push((ev.event, ev.data));
    }
    out
}

fn pairs(events: &[Event]) -> Vec<(String, String)> {
    events
        .iter()
        .map(|e| (e.name.clone(), e.data.clone()))
        .collect()
}

/// One line of a stream, with one of the three line ends.
fn line() -> impl Strategy<Value = String> {
    let text = "[a-z {}\":,é€]{0,8}";
    let field = prop_oneof![
        text.prop_map(|t| format!("data: {t}")),
        text.prop_map(|t| format!("data:{t}")),
        Just("data".to_string()),
        Just("data:".to_string()),
        "[a-z.]{0,6}".prop_map(|n| format!("event: {n}")),
        text.prop_map(|t| format!(": {t}")),
        text.prop_map(|t| format!("id: {t}")),
        Just("retry: 10".to_string()),
        Just(String::new()),
    ];
    let end = prop_oneof![Just("\n"), Just("\r\n"), Just("\r")];
    (field, end).prop_map(|(f, e)| format!("{f}{e}"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// However the stream is cut, the framer reads the events a general SSE
    /// parser reads from the whole of it (CR, LF, CRLF, comments, multi-line
    /// data, `event:`, `id:`, a last event without its blank line), and its
    /// blocks with what is left are the stream's bytes, in order.
    #[test]
    fn the_framer_reads_the_same_events_however_the_stream_is_cut(
        lines in proptest::collection::vec(line(), 0..24),
        bom in proptest::bool::weighted(0.1),
        cuts in proptest::collection::vec(0usize..4096, 0..12),
    ) {
        let mut body = String::new();
        if bom {
            body.push('\u{feff}');
        }
        body.extend(lines);
        let body = body.into_bytes();
        let (whole, whole_bytes) = framed(&body, &[]);
        prop_assert_eq!(&whole_bytes, &body);
        prop_assert_eq!(pairs(&whole), reference(&body));
        let (cut, cut_bytes) = framed(&body, &cuts);
        prop_assert_eq!(&cut_bytes, &body);
        prop_assert_eq!(cut, whole);
    }
}

/// A stream with every edge case, cut in two at every byte and fed a byte
/// at a time: always the same events and bytes.
#[test]
fn a_stream_split_at_every_byte_reads_the_same() {
    let body = "\u{feff}: comment\r\n\
                event: response.created\r\ndata: {\"a\":1}\r\n\r\n\
                data: one\rdata: two\r\r\
                data:\n\n\
                event:\ndata: é€\n\n\
                id: 7\ndata: x\nretry: 5\n\n\
                \n\
                data: [DONE]\n\n\
                data: no blank line at the end\n"
        .as_bytes();
    let (whole, bytes) = framed(body, &[]);
    assert_eq!(bytes, body);
    assert_eq!(pairs(&whole), reference(body));
    let names: Vec<&str> = whole.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "message",
            "message",
            "message",
            "message",
            "message"
        ]
    );
    assert_eq!(whole[1].data, "one\ntwo");
    assert_eq!(whole[2].data, "", "an empty data line is an event");
    assert_eq!(whole[5].data, "[DONE]");
    for at in 0..=body.len() {
        let (events, bytes) = framed(body, &[at]);
        assert_eq!(events, whole, "cut at {at}");
        assert_eq!(bytes, body, "cut at {at}");
    }
    let every: Vec<usize> = (0..=body.len()).collect();
    let (events, bytes) = framed(body, &every);
    assert_eq!(events, whole);
    assert_eq!(bytes, body);
}

/// The blocks' bytes are the stream's own, cut where each event ends, so
/// that the hold-back and recall can relay exactly what came.
#[test]
fn each_block_is_the_bytes_of_one_event() {
    let mut framer = Framer::new();
    framer.push(b"data: a\r\n\r\nevent: e\ndata: b\n");
    let first = framer.next_block().expect("a complete block");
    assert_eq!(&first.raw[..], b"data: a\r\n\r\n");
    assert!(first.data_only);
    assert!(framer.next_block().is_none(), "the second is not complete");
    assert_eq!(framer.pending(), 17);
    framer.push(b"\n");
    let second = framer.next_block().expect("now complete");
    assert_eq!(&second.raw[..], b"event: e\ndata: b\n\n");
    assert!(!second.data_only, "an event: line is not data");
    assert_eq!(second.event.map(|e| e.name).as_deref(), Some("e"));
    assert_eq!(framer.pending(), 0);
}
