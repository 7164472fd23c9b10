//! Server-sent events: one incremental framer ([`Framer`]) and the tee
//! built on it.
//!
//! The framer takes bytes as they arrive and hands back complete events,
//! each with the exact bytes it spanned: the send's hold-back, recall and
//! the tee all read a stream through it, and what they relay is those bytes
//! untouched (or, to hide usage, a whole event rewritten).
//!
//! The tee: upstream bytes go to the client as they arrive while a copy
//! is framed to collect output items and usage. Forwarding is chunk by
//! chunk and never waits for more data (the relay in `server::relay` joins
//! only chunks that arrived together), except in one case: when the proxy
//! asked a chat stream for usage the client did not ask for, the usage must
//! be hidden again, so bytes are released a whole event at a time
//! (upstreams send one event per chunk, so this adds no delay).

use bytes::{Bytes, BytesMut};
use serde_json::Value;

use super::api::Api;
use super::chat::{self, ChatCollector, Strip};
use super::messages::MessagesCollector;
use super::responses::ResponsesCollector;
use super::usage::Usage;

/// One block of a stream: the bytes up to and including the blank line
/// that ends it, and the event they dispatch, if any (a block of comments
/// alone, or without `data:`, dispatches none, as the SSE rules say).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The block's bytes, exactly as they came.
    pub raw: Bytes,
    /// The event, if the block dispatches one.
    pub event: Option<Event>,
    /// Every non-empty line of the block is a `data:` field (no comment,
    /// `event:`, `id:` or other field): such a block can be rewritten as
    /// `data:` lines without losing anything.
    pub data_only: bool,
}

/// An event: its type (`message` unless a non-empty `event:` line named it) and its
/// data (the `data:` lines' values joined by `\n`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The `event:` field, else `message`.
    pub name: String,
    /// The data.
    pub data: String,
}

/// Frames an SSE byte stream incrementally: [`Framer::push`] bytes as they
/// arrive, [`Framer::next_block`] the blocks they complete. A line ends at
/// `\n`, `\r\n` or `\r` (a `\r` at the end of what has arrived waits for
/// the next byte); a blank line ends a block; a leading byte-order mark is
/// skipped; `id:` and `retry:` are of no use to a proxy and are not kept.
/// Bytes after the last blank line when the stream ends are no event
/// ([`Framer::rest`]).
#[derive(Debug, Default)]
pub struct Framer {
    /// Bytes of the block under way (every complete block was split off).
    buf: BytesMut,
    /// Where the first line not yet read starts in `buf`.
    line: usize,
    /// The block under way so far.
    name: Option<String>,
    data: Option<String>,
    data_lines: usize,
    /// A line other than a `data:` field was read.
    other_lines: bool,
    /// The first line of the stream was read (a byte-order mark is skipped
    /// only before it).
    started: bool,
}

impl Framer {
    /// A framer at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next bytes of the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes taken and not yet part of a block returned.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete block, if the bytes taken complete one.
    pub fn next_block(&mut self) -> Option<Block> {
        loop {
            let (mut start, end, next) = self.next_line()?;
            self.line = next;
            if !self.started {
                self.started = true;
                if self.buf[start..end].starts_with(b"\xEF\xBB\xBF") {
                    start += 3;
                }
            }
            if start == end {
                let raw = self.buf.split_to(next).freeze();
                self.line = 0;
                return Some(self.dispatch(raw));
            }
            self.field(start, end);
        }
    }

    /// What is left once the stream ended: bytes after the last complete
    /// block (an event without its blank line is no event).
    pub fn rest(&mut self) -> Bytes {
        self.line = 0;
        self.name = None;
        self.data = None;
        self.data_lines = 0;
        self.other_lines = false;
        self.buf.split().freeze()
    }

    /// The next whole line from `self.line`: where it starts, where its text
    /// ends, where the next one starts.
    fn next_line(&self) -> Option<(usize, usize, usize)> {
        let from = self.line;
        let at = memchr::memchr2(b'\n', b'\r', &self.buf[from..])? + from;
        let next = match self.buf[at] {
            b'\n' => at + 1,
            _ => match self.buf.get(at + 1) {
                Some(b'\n') => at + 2,
                Some(_) => at + 1,
                // A `\n` may still follow.
                None => return None,
            },
        };
        Some((from, at, next))
    }

    /// Reads the field on `buf[start..end]` into the block under way.
    fn field(&mut self, start: usize, end: usize) {
        let line = &self.buf[start..end];
        let (field, value) = match memchr::memchr(b':', line) {
            Some(0) => {
                // A comment.
                self.other_lines = true;
                return;
            }
            Some(c) => {
                let v = &line[c + 1..];
                (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                let data = self.data.get_or_insert_with(String::new);
                if self.data_lines > 0 {
                    data.push('\n');
                }
                self.data_lines += 1;
                match std::str::from_utf8(value) {
                    Ok(v) => data.push_str(v),
                    Err(_) => data.push_str(&String::from_utf8_lossy(value)),
                }
            }
            b"event" => {
                self.other_lines = true;
                self.name = Some(String::from_utf8_lossy(value).into_owned());
            }
            _ => self.other_lines = true,
        }
    }

    /// Ends the block under way: the event it makes, if its data has a line.
    fn dispatch(&mut self, raw: Bytes) -> Block {
        let name = self.name.take();
        let data = self.data.take();
        let lines = std::mem::take(&mut self.data_lines);
        let data_only = !std::mem::take(&mut self.other_lines);
        let event = (lines > 0).then(|| Event {
            name: name
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| "message".to_string()),
            data: data.unwrap_or_default(),
        });
        Block {
            raw,
            event,
            data_only,
        }
    }
}
/// An event's bytes, as [`write_event`] writes them.
pub fn event_bytes(name: &str, data: &Value) -> Bytes {
    let mut out = BytesMut::new();
    write_event(&mut out, name, data.to_string().as_bytes());
    out.freeze()
}

/// The one writer of an SSE event the proxy makes: its `event:` line
/// unless it is a `message` (or has no name), then `data` (one line) and
/// the blank line that ends it.
pub fn write_event(out: &mut BytesMut, name: &str, data: &[u8]) {
    if !name.is_empty() && name != "message" {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\n");
    }
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
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
    /// A Gemini stream (`alt=sse`).
    Gemini(super::gemini::Collector),
}

/// Frames a copy of an SSE body while it is forwarded.
pub struct SseTee {
    framer: Framer,
    /// What has been collected so far.
    pub collected: Collected,
    /// Usage must be hidden from the client: bytes are released a whole
    /// event at a time.
    strip: bool,
    /// Bytes of event data handed to the collector so far.
    seen: usize,
    /// Most of them whose text the collector keeps (see [`MAX_COLLECTED`]).
    cap: usize,
    /// What rewrites each event before it is released and collected (the
    /// proxy's own tool calls taken out): bytes are then released a whole
    /// event at a time.
    calls: Option<Box<dyn Rewrite>>,
}

/// Rewrites a stream's events one by one as they are relayed.
pub trait Rewrite: Send + Sync {
    /// The bytes the client gets for `block`, if any.
    fn block(&mut self, block: &Block) -> Option<Bytes>;
    /// The names of what was taken out so far (for the logs).
    fn removed(&self) -> &[String];
}

/// Most bytes of a streamed answer's events whose text and items are
/// collected (and recorded): past them the stream is still relayed whole
/// and its usage and end still read, but nothing more of its output is
/// kept, and the exchange is recorded as cut (see [`SseTee::cut`]). A
/// 192 MB stream grew the proxy by 1.2 GB when every byte was kept.
pub const MAX_COLLECTED: usize = 4 << 20;

impl SseTee {
    /// A tee for `api`; `strip_usage` hides the usage the proxy injected.
    pub fn new(api: Api, strip_usage: bool) -> Self {
        Self {
            framer: Framer::new(),
            collected: match api {
                Api::Chat => Collected::Chat(ChatCollector::default()),
                Api::Responses => Collected::Responses(ResponsesCollector::default()),
                Api::Messages => Collected::Messages(MessagesCollector::default()),
                Api::Gemini => Collected::Gemini(Default::default()),
            },
            strip: strip_usage,
            seen: 0,
            cap: MAX_COLLECTED,
            calls: None,
        }
    }

    /// The same tee, each event rewritten by `rewrite` before it is
    /// released and collected (the proxy's own tool calls taken out of a
    /// stream relayed as it comes, which no round can answer).
    pub fn rewritten(mut self, rewrite: Option<Box<dyn Rewrite>>) -> Self {
        self.calls = rewrite;
        self
    }

    /// What the rewrite took out.
    pub fn calls_removed(&self) -> &[String] {
        self.calls.as_ref().map_or(&[], |c| c.removed())
    }

    /// The same tee, collecting the text of at most `cap` bytes of events.
    pub fn with_cap(mut self, cap: usize) -> Self {
        self.cap = cap;
        self
    }

    /// Why what was collected is not the whole answer, when it is not:
    /// the stream went past what is collected of it.
    pub fn cut(&self) -> Option<String> {
        (self.seen > self.cap).then(|| {
            format!(
                "the streamed answer was longer than the {} MiB the proxy records of one: relayed whole, recorded cut",
                self.cap >> 20
            )
        })
    }

    /// Takes one upstream chunk and returns the bytes to send the client now.
    pub fn push(&mut self, chunk: Bytes) -> Bytes {
        self.framer.push(&chunk);
        if !self.strip && self.calls.is_none() {
            while let Some(block) = self.framer.next_block() {
                self.collect(&block);
            }
            return chunk;
        }
        self.release_complete_events()
    }

    /// The upstream body ended: returns any held bytes. What follows the
    /// last complete event is no event, and is forwarded as it came.
    pub fn finish(&mut self) -> Bytes {
        let whole_events = self.strip || self.calls.is_some();
        let released = if whole_events {
            self.release_complete_events()
        } else {
            Bytes::new()
        };
        let rest = self.framer.rest();
        if !whole_events || rest.is_empty() {
            return released;
        }
        if released.is_empty() {
            return rest;
        }
        [released, rest].concat().into()
    }

    /// Hands one block's event to the collector; for a chat chunk, whether
    /// its data is JSON.
    fn collect(&mut self, block: &Block) -> bool {
        let Some(ev) = &block.event else {
            return false;
        };
        self.seen = self.seen.saturating_add(ev.data.len());
        if self.seen > self.cap {
            match &mut self.collected {
                Collected::Chat(c) => c.capped = true,
                Collected::Responses(c) => c.capped = true,
                Collected::Messages(c) => c.capped = true,
                Collected::Gemini(c) => c.capped = true,
            }
        }
        match &mut self.collected {
            Collected::Chat(c) => c.push(&ev.data),
            Collected::Responses(c) => {
                c.push(&ev.name, &ev.data);
                false
            }
            Collected::Messages(c) => {
                c.push(&ev.name, &ev.data);
                false
            }
            Collected::Gemini(c) => {
                c.push(&ev.data);
                false
            }
        }
    }

    /// Takes every complete event the framer holds, collects it, and returns
    /// the events rewritten so the usage the client did not ask for stays
    /// hidden.
    fn release_complete_events(&mut self) -> Bytes {
        let mut out = BytesMut::new();
        while let Some(block) = self.framer.next_block() {
            let Some(block) = self.without_own_calls(block) else {
                continue;
            };
            let json = self.collect(&block);
            if !self.strip {
                out.extend_from_slice(&block.raw);
                continue;
            }
            let rewrite = match (&block.event, &self.collected) {
                (None, _) => Strip::Keep,
                (Some(ev), Collected::Chat(_)) if single_data_line(&block.raw).is_some() => {
                    data_line_rewrite(&ev.data, json)
                }
                // Only events made of data lines alone are rewritten;
                // anything else is forwarded as it came.
                (Some(ev), _) => match chat::strip_usage(&ev.data) {
                    Strip::Replace(_) if !block.data_only => Strip::Keep,
                    s => s,
                },
            };
            match rewrite {
                Strip::Keep => out.extend_from_slice(&block.raw),
                Strip::Drop => {}
                Strip::Replace(data) => write_event(&mut out, "", data.as_bytes()),
            }
        }
        out.freeze()
    }

    /// `block` as the client gets it once the proxy's calls are out (see
    /// [`SseTee::without_calls`]), if anything is left of it.
    fn without_own_calls(&mut self, block: Block) -> Option<Block> {
        let Some(calls) = self.calls.as_mut() else {
            return Some(block);
        };
        let bytes = calls.block(&block)?;
        if bytes == block.raw {
            return Some(block);
        }
        let mut framer = Framer::new();
        framer.push(&bytes);
        framer.next_block()
    }

    /// The stream's terminal event (`[DONE]`, `response.completed`…) was seen.
    pub fn finished(&self) -> bool {
        match &self.collected {
            Collected::Chat(c) => c.finished(),
            Collected::Responses(c) => c.finished(),
            Collected::Messages(c) => c.finished(),
            Collected::Gemini(c) => c.finished(),
        }
    }

    /// Usage collected so far.
    pub fn usage(&self) -> Option<Usage> {
        match &self.collected {
            Collected::Chat(c) => c.usage,
            Collected::Responses(c) => c.usage,
            Collected::Messages(c) => c.usage,
            Collected::Gemini(c) => c.usage,
        }
    }

    /// Output items collected so far.
    pub fn items(&self) -> Vec<Value> {
        match &self.collected {
            Collected::Chat(c) => c.items(),
            Collected::Responses(c) => c.items(),
            Collected::Messages(c) => c.items(),
            Collected::Gemini(c) => c.items(),
        }
    }

    /// The upstream's id for this answer.
    pub fn response_id(&self) -> Option<String> {
        match &self.collected {
            Collected::Chat(c) => c.id.clone(),
            Collected::Responses(c) => c.id.clone(),
            Collected::Messages(c) => c.id.clone(),
            Collected::Gemini(c) => c.id.clone(),
        }
    }

    /// An error the upstream reported inside the stream.
    pub fn error(&self) -> Option<Value> {
        match &self.collected {
            Collected::Chat(c) => c.error.clone(),
            Collected::Responses(c) => c.error.clone(),
            Collected::Messages(c) => c.error.clone(),
            Collected::Gemini(c) => c.error.clone(),
        }
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

/// The rewrite of a chat chunk's usage ([`chat::strip_usage`]) for an event of one `data:` line, `json` telling
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

    /// How a whole block is rewritten when its parse decides: a chunk of
    /// data lines alone through [`chat::strip_usage`], anything else kept.
    fn usage_rewrite(block: &[u8]) -> Strip {
        let mut framer = Framer::new();
        framer.push(block);
        match framer.next_block() {
            Some(Block {
                event: Some(ev),
                data_only,
                ..
            }) => match chat::strip_usage(&ev.data) {
                Strip::Replace(_) if !data_only => Strip::Keep,
                s => s,
            },
            _ => Strip::Keep,
        }
    }

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
            let mut whole = Framer::new();
            whole.push(&body);
            let mut at = 0;
            while let Some(block) = whole.next_block() {
                match usage_rewrite(&block.raw) {
                    Strip::Keep => expected.extend_from_slice(&block.raw),
                    Strip::Drop => {}
                    Strip::Replace(data) => {
                        expected.extend_from_slice(format!("data: {data}\n\n").as_bytes())
                    }
                }
                at += block.raw.len();
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
    fn block_boundaries() {
        let ends = |body: &[u8]| {
            let mut f = Framer::new();
            f.push(body);
            let mut out = Vec::new();
            while let Some(b) = f.next_block() {
                out.push(b.raw.len());
            }
            (out, f.pending())
        };
        assert_eq!(ends(b"data: x\n\nrest"), (vec![9], 4));
        assert_eq!(ends(b"data: x\r\n\r\n"), (vec![11], 0));
        assert_eq!(
            ends(b"data: x\r\r"),
            (vec![], 9),
            "a \\n may follow the last \\r"
        );
        assert_eq!(ends(b"data: x\r\rdata: y"), (vec![9], 7));
        assert_eq!(ends(b"data: x\n"), (vec![], 8));
        assert_eq!(ends(b"event: a\ndata: x\n\n"), (vec![18], 0));
        assert_eq!(
            ends(b"\ndata: x\n\n"),
            (vec![1, 9], 0),
            "a leading blank line alone"
        );
    }
}
