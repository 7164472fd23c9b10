//! The SSE tee: upstream bytes go to the client as they arrive while a copy
//! is parsed (eventsource-stream) to collect output items and usage.
//!
//! Forwarding is chunk by chunk and never waits for more data (the relay in
//! `server::proxy` joins only chunks that arrived together), except in one
//! case: when the proxy asked a chat stream for usage the client did not ask
//! for, the usage must be hidden again, so bytes are released a whole event
//! at a time (upstreams send one event per chunk, so this adds no delay).
//! Such an event that is one `data:` line goes to the collector straight
//! from that framing, whose parse of its JSON also decides the rewrite; any
//! other takes the parser's way.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use eventsource_stream::EventStream;
use futures_util::Stream;
use serde_json::Value;

use super::chat::{self, ChatCollector, Strip};
use super::messages::MessagesCollector;
use super::responses::ResponsesCollector;
use super::{Api, Usage};

/// A stream the tee pushes chunks into and the event parser pulls from.
#[derive(Default, Clone)]
struct Feed(Arc<Mutex<FeedState>>);

#[derive(Default)]
struct FeedState {
    queue: VecDeque<Bytes>,
    closed: bool,
}

impl Stream for Feed {
    type Item = Result<Bytes, Infallible>;
    fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut st = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match st.queue.pop_front() {
            Some(b) => Poll::Ready(Some(Ok(b))),
            None if st.closed => Poll::Ready(None),
            // Nothing to wake later: the tee polls again after each push.
            None => Poll::Pending,
        }
    }
}

/// What the tee collected, per API.
#[derive(Debug)]
pub enum Collected {
    /// A chat stream.
    Chat(ChatCollector),
    /// A Responses stream.
    Responses(ResponsesCollector),
    /// An Anthropic Messages stream.
    Messages(MessagesCollector),
}

/// Parses a copy of an SSE body while it is forwarded.
pub struct SseTee {
    feed: Feed,
    events: EventStream<Feed>,
    /// What has been collected so far.
    pub collected: Collected,
    /// Present when usage must be hidden from the client: bytes of an event
    /// not yet complete.
    strip: Option<BytesMut>,
}

impl SseTee {
    /// A tee for `api`; `strip_usage` hides the usage the proxy injected.
    pub fn new(api: Api, strip_usage: bool) -> Self {
        let feed = Feed::default();
        Self {
            events: EventStream::new(feed.clone()),
            feed,
            collected: match api {
                Api::Chat => Collected::Chat(ChatCollector::default()),
                Api::Responses => Collected::Responses(ResponsesCollector::default()),
                Api::Messages => Collected::Messages(MessagesCollector::default()),
            },
            strip: strip_usage.then(BytesMut::new),
        }
    }

    /// Takes one upstream chunk and returns the bytes to send the client now.
    pub fn push(&mut self, chunk: Bytes) -> Bytes {
        match &mut self.strip {
            None => {
                self.parse(chunk.clone());
                chunk
            }
            Some(pending) => {
                pending.extend_from_slice(&chunk);
                self.release_complete_events()
            }
        }
    }

    /// The upstream body ended: parse what is left and return any held bytes.
    pub fn finish(&mut self) -> Bytes {
        let released = self.release_complete_events();
        // An unterminated last event is forwarded as it came.
        let rest = self.strip.as_mut().map(|p| p.split().freeze());
        let out = match rest.filter(|r| !r.is_empty()) {
            None => released,
            Some(rest) => {
                self.parse(rest.clone());
                [released, rest].concat().into()
            }
        };
        {
            let mut st = self.feed.0.lock().unwrap_or_else(|p| p.into_inner());
            st.closed = true;
        }
        self.drain_events();
        out
    }

    /// Hands bytes to the event parser and collects the events it completes.
    fn parse(&mut self, bytes: Bytes) {
        {
            let mut st = self.feed.0.lock().unwrap_or_else(|p| p.into_inner());
            st.queue.push_back(bytes);
        }
        self.drain_events();
    }

    /// Takes every complete event off the front of the held bytes, collects
    /// it, and returns the events rewritten so the usage the client did not
    /// ask for stays hidden.
    fn release_complete_events(&mut self) -> Bytes {
        let Some(mut pending) = self.strip.take() else {
            return Bytes::new();
        };
        let mut out = BytesMut::new();
        while let Some(end) = event_end(&pending) {
            let block = pending.split_to(end).freeze();
            let rewrite = match (single_data_line(&block), &mut self.collected) {
                (Some(data), Collected::Chat(c)) => {
                    let json = c.push(data);
                    data_line_rewrite(data, json)
                }
                _ => {
                    self.parse(block.clone());
                    usage_rewrite(&block)
                }
            };
            match rewrite {
                Strip::Keep => out.extend_from_slice(&block),
                Strip::Drop => {}
                Strip::Replace(data) => {
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(data.as_bytes());
                    out.extend_from_slice(b"\n\n");
                }
            }
        }
        self.strip = Some(pending);
        out.freeze()
    }

    fn drain_events(&mut self) {
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        while let Poll::Ready(Some(ev)) = Pin::new(&mut self.events).poll_next(&mut cx) {
            let Ok(ev) = ev else { continue };
            match &mut self.collected {
                Collected::Chat(c) => {
                    c.push(&ev.data);
                }
                Collected::Responses(c) => c.push(&ev.event, &ev.data),
                Collected::Messages(c) => c.push(&ev.event, &ev.data),
            }
        }
    }

    /// The stream's terminal event (`[DONE]`, `response.completed`…) was seen.
    pub fn finished(&self) -> bool {
        match &self.collected {
            Collected::Chat(c) => c.finished(),
            Collected::Responses(c) => c.finished(),
            Collected::Messages(c) => c.finished(),
        }
    }

    /// Usage collected so far.
    pub fn usage(&self) -> Option<Usage> {
        match &self.collected {
            Collected::Chat(c) => c.usage,
            Collected::Responses(c) => c.usage,
            Collected::Messages(c) => c.usage,
        }
    }

    /// Output items collected so far.
    pub fn items(&self) -> Vec<Value> {
        match &self.collected {
            Collected::Chat(c) => c.items(),
            Collected::Responses(c) => c.items(),
            Collected::Messages(c) => c.items(),
        }
    }

    /// The upstream's id for this answer.
    pub fn response_id(&self) -> Option<String> {
        match &self.collected {
            Collected::Chat(c) => c.id.clone(),
            Collected::Responses(c) => c.id.clone(),
            Collected::Messages(c) => c.id.clone(),
        }
    }

    /// An error the upstream reported inside the stream.
    pub fn error(&self) -> Option<Value> {
        match &self.collected {
            Collected::Chat(c) => c.error.clone(),
            Collected::Responses(c) => c.error.clone(),
            Collected::Messages(c) => c.error.clone(),
        }
    }
}

/// The complete events at the start of `buf` as (event name, data), and
/// the number of bytes they span. For deciding about a stream's first events
/// before any byte of it is forwarded.
pub fn complete_events(buf: &[u8]) -> (Vec<(String, String)>, usize) {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(len) = event_end(&buf[at..]) {
        let text = String::from_utf8_lossy(&buf[at..at + len]);
        let (mut name, mut data) = (String::new(), String::new());
        for line in text.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                name = v.trim_start().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if !name.is_empty() || !data.is_empty() {
            out.push((name, data));
        }
        at += len;
    }
    (out, at)
}

/// Index just past the blank line ending the first event, if complete.
fn event_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < buf.len() {
        // A line ends at \n, \r\n or \r; an empty line ends the event.
        let line_end = buf[i..].iter().position(|b| *b == b'\n' || *b == b'\r')? + i;
        let mut next = line_end + 1;
        if buf[line_end] == b'\r' {
            match buf.get(next) {
                Some(b'\n') => next += 1,
                None => return None, // a \n may still follow
                _ => {}
            }
        }
        if line_end == i && i > 0 {
            return Some(next);
        }
        if line_end == i && i == 0 {
            // A leading blank line is an empty event: release it alone.
            return Some(next);
        }
        i = next;
    }
    None
}

/// How an event must change so the client does not see the usage (any
/// shape of event; see [`data_line_rewrite`] for the common one).
fn usage_rewrite(block: &[u8]) -> Strip {
    let Ok(text) = std::str::from_utf8(block) else {
        return Strip::Keep;
    };
    let mut data = String::new();
    let mut other_fields = false;
    for line in text.lines() {
        if let Some(d) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(d.strip_prefix(' ').unwrap_or(d));
        } else if !line.is_empty() {
            other_fields = true;
        }
    }
    match chat::strip_usage(&data) {
        // Only chunks made of data lines alone are rewritten; anything else
        // is forwarded as it came.
        Strip::Replace(_) if other_fields => Strip::Keep,
        s => s,
    }
}

/// What a chat chunk ends in once the stream was asked for usage.
const NULL_USAGE_TAIL: &str = ",\"usage\":null}";

/// The data of an event that is one `data:` line and nothing else (as
/// upstreams send chat chunks), if `block` is one.
fn single_data_line(block: &[u8]) -> Option<&str> {
    let line = block.strip_suffix(b"\n\n")?;
    let data = line
        .strip_prefix(b"data: ")
        .or_else(|| line.strip_prefix(b"data:"))?;
    if memchr::memchr2(b'\n', b'\r', data).is_some() {
        return None;
    }
    std::str::from_utf8(data).ok()
}

/// [`usage_rewrite`] for an event of one `data:` line, `json` telling
/// whether its data is JSON. The common case needs no parse of its own: JSON
/// ending in `,"usage":null}` ends with the object's closing brace after a
/// `null` (not a string, not a nested value), so `"usage"` is a member of
/// the chunk itself, its last, and the chunk without it is the text without
/// those 13 bytes.
fn data_line_rewrite(data: &str, json: bool) -> Strip {
    match data.strip_suffix(NULL_USAGE_TAIL) {
        Some(head) if json => Strip::Replace(format!("{head}}}")),
        _ => chat::strip_usage(data),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_null_usage_shortcut_rewrites_as_the_parse_does() {
        let slow = |data: &str| chat::strip_usage(data);
        for data in [
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"a"}}],"usage":null}"#,
            r#"{"id":"c","choices":[],"usage":null}"#,
            r#"{"k":"v\\","usage":null}"#,
            r#"{"k":{"usage":null},"usage":null}"#,
            r#"{"id":"é","n":1.50,"choices":[ ],"usage":null}"#,
            r#"{"usage":null,"a":1}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1}}"#,
        ] {
            let block = format!("data: {data}\n\n");
            assert_eq!(single_data_line(block.as_bytes()), Some(data));
            assert_eq!(data_line_rewrite(data, true), slow(data), "{data}");
            assert_eq!(usage_rewrite(block.as_bytes()), slow(data), "{data}");
        }
        // Not one data line: another field, two data lines, CRLF.
        for block in [
            "event: x\ndata: {\"a\":1,\"usage\":null}\n\n",
            "data: {\"a\":\ndata: 1,\"usage\":null}\n\n",
            "data: {\"a\":1,\"usage\":null}\r\n\r\n",
        ] {
            assert_eq!(single_data_line(block.as_bytes()), None, "{block:?}");
        }
        assert_eq!(
            data_line_rewrite("not json,\"usage\":null}", false),
            Strip::Keep,
            "what cannot be parsed goes as it came"
        );
    }

    /// One event of a chat stream, as upstreams send them and as they
    /// might: usage null or absent, the usage chunk, `[DONE]`, comments,
    /// named events, data that is not JSON, either line ending, tricky text
    /// in the content.
    fn chat_event(kind: usize, text: &str, crlf: bool, space: bool) -> String {
        let text = serde_json::to_string(text).unwrap();
        let data = match kind {
            0 => format!(r#"{{"id":"c","choices":[{{"index":0,"delta":{{"content":{text}}}}}],"usage":null}}"#),
            1 => format!(r#"{{"id":"c","choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"function":{{"arguments":{text}}}}}]}}}}],"usage":null}}"#),
            2 => r#"{"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}"#.to_string(),
            3 => format!(r#"{{"id":"c","choices":[{{"index":0,"delta":{{"content":{text}}}}}]}}"#),
            4 => "[DONE]".to_string(),
            5 => return format!(": {}\n\n", text.trim_matches('"')),
            6 => return format!("event: chunk\ndata: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{text}}}}}],\"usage\":null}}\n\n"),
            // Not JSON, though it ends as a chunk with usage null does.
            7 => r#"{"a":[1,"usage":null}"#.to_string(),
            _ => format!(r#"{{"id":"c","choices":[{{"index":0,"delta":{{"content":{text}}},"finish_reason":"stop"}}],"usage":null}}"#),
        };
        let sep = if space { "data: " } else { "data:" };
        let end = if crlf { "\r\n\r\n" } else { "\n\n" };
        format!("{sep}{data}{end}")
    }

    /// Runs `body` through a tee in pieces cut at `cuts`.
    fn tee_in_pieces(body: &[u8], cuts: &[usize], strip: bool) -> (Vec<u8>, SseTee) {
        let mut tee = SseTee::new(Api::Chat, strip);
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
        at.extend([0, body.len()]);
        at.sort_unstable();
        at.dedup();
        let mut out = Vec::new();
        for w in at.windows(2) {
            out.extend_from_slice(&tee.push(Bytes::copy_from_slice(&body[w[0]..w[1]])));
        }
        out.extend_from_slice(&tee.finish());
        (out, tee)
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]

        /// Hiding the usage, however the stream is cut into chunks: the
        /// client gets each event rewritten as the parse of the whole event
        /// would rewrite it, and the tee collects what it collects from the
        /// same stream when nothing is hidden.
        #[test]
        fn hiding_usage_rewrites_and_collects_as_the_event_parser_does(
            events in proptest::collection::vec(
                (0usize..9, "[a-z \"\\\\é{}:,]{0,10}|,\"usage\":null\\}", proptest::bool::weighted(0.2), proptest::bool::ANY),
                0..12,
            ),
            tail in proptest::bool::weighted(0.2),
            cuts in proptest::collection::vec(0usize..4096, 0..10),
        ) {
            let mut body: String = events
                .iter()
                .map(|(kind, text, crlf, space)| chat_event(*kind, text, *crlf, *space))
                .collect();
            if tail {
                body.push_str("data: {\"choices\":[],\"usage\":null}");
            }
            let body = body.into_bytes();
            let (hidden, stripped) = tee_in_pieces(&body, &cuts, true);
            let (plain, reference) = tee_in_pieces(&body, &cuts, false);
            proptest::prop_assert_eq!(&plain, &body);
            // Each complete event through the general rewrite, the rest as it came.
            let mut expected = Vec::new();
            let mut at = 0;
            while let Some(len) = event_end(&body[at..]) {
                let block = &body[at..at + len];
                match usage_rewrite(block) {
                    Strip::Keep => expected.extend_from_slice(block),
                    Strip::Drop => {}
                    Strip::Replace(data) => {
                        expected.extend_from_slice(format!("data: {data}\n\n").as_bytes())
                    }
                }
                at += len;
            }
            expected.extend_from_slice(&body[at..]);
            proptest::prop_assert_eq!(
                String::from_utf8_lossy(&hidden),
                String::from_utf8_lossy(&expected)
            );
            proptest::prop_assert_eq!(stripped.items(), reference.items());
            proptest::prop_assert_eq!(stripped.usage(), reference.usage());
            proptest::prop_assert_eq!(stripped.finished(), reference.finished());
            proptest::prop_assert_eq!(stripped.response_id(), reference.response_id());
        }
    }

    #[test]
    fn tee_forwards_bytes_unchanged_and_collects() {
        let mut tee = SseTee::new(Api::Chat, false);
        let body = "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
        let mut out = Vec::new();
        // Split at awkward places, including inside an event.
        for piece in body.as_bytes().chunks(7) {
            out.extend_from_slice(&tee.push(Bytes::copy_from_slice(piece)));
        }
        out.extend_from_slice(&tee.finish());
        assert_eq!(out, body.as_bytes());
        assert!(tee.finished());
        assert_eq!(tee.usage().unwrap().total(), 4);
        assert_eq!(tee.items()[0]["content"], "hi");
    }

    #[test]
    fn tee_hides_injected_usage() {
        let mut tee = SseTee::new(Api::Chat, true);
        let body = "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\r\n\r\ndata: {\"id\":\"a\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
        let mut out = Vec::new();
        for piece in body.as_bytes().chunks(5) {
            out.extend_from_slice(&tee.push(Bytes::copy_from_slice(piece)));
        }
        out.extend_from_slice(&tee.finish());
        let out = String::from_utf8(out).unwrap();
        assert_eq!(
            out,
            "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"
        );
        assert_eq!(tee.usage().unwrap().input_tokens, 3);
    }

    #[test]
    fn event_boundaries() {
        assert_eq!(event_end(b"data: x\n\nrest"), Some(9));
        assert_eq!(event_end(b"data: x\r\n\r\n"), Some(11));
        assert_eq!(event_end(b"data: x\r"), None);
        assert_eq!(event_end(b"data: x\n"), None);
        assert_eq!(event_end(b"event: a\ndata: x\n\n"), Some(18));
    }
}
