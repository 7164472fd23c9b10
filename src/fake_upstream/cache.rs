//! The fake upstream's prompt cache, as each provider documents it, with a
//! simulated clock, so a benchmark can bill a session as the provider would
//! (`benches/economics.rs`). Off unless a test or bench turns it on
//! ([`super::FakeUpstream::simulate_cache`]).
//!
//! A request is cut into **blocks**, in the order the providers key their
//! caches: every tool definition, then the system prompt, then the
//! conversation. Each block is its compact JSON (`cache_control` left out,
//! the message's role in), and its tokens are counted with the proxy's own
//! estimator over that JSON ([`TokenCounter::count_text`], tiktoken
//! o200k). A prefix is identified by the hash chain of its blocks, seeded
//! with the model and the caller's key (caches are per organisation and per
//! model).
//!
//! **Anthropic Messages** (`/v1/messages`):
//! - blocks: each tool, each system block (a string system is one), each
//!   content block of each message (a string content is one); `tool_choice`
//!   and `thinking` are folded into the first message block, so changing
//!   them keeps tools and system cached and nothing after;
//! - only prefixes ending at a `cache_control` breakpoint are written (at
//!   most [`MAX_BREAKPOINTS`]; more is refused, by
//!   [`super::anthropic::check`]), and only when at least
//!   [`MIN_CACHEABLE`] tokens long;
//! - a read is found at the breakpoint or at any block boundary up to
//!   [`LOOKBACK`] blocks before it; the longest live entry wins;
//! - an entry lives 5 minutes ([`TTL_5M`]), or an hour ([`TTL_1H`]) when its
//!   breakpoint says `"ttl": "1h"`; a read refreshes every entry the read
//!   prefix covers;
//! - usage: `cache_read_input_tokens` (the prefix read),
//!   `cache_creation_input_tokens` (from there to the last breakpoint, split
//!   into `cache_creation.ephemeral_5m_input_tokens` /
//!   `ephemeral_1h_input_tokens` by the breakpoint that closes each
//!   segment), `input_tokens` (the rest).
//!
//! **OpenAI** (`/v1/chat/completions`, `/v1/responses`): automatic prefix
//! caching, no breakpoints. Blocks are each tool, then each message (Chat)
//! or `instructions` and each input item (Responses). Every request writes
//! every prefix of at least [`MIN_CACHEABLE`] tokens; a request reads its
//! longest live prefix, reported as `cached_tokens` rounded down to
//! [`OPENAI_STEP`] tokens. OpenAI documents 5 to 10 minutes of inactivity
//! before eviction: the fake takes the lower bound, [`TTL_5M`], refreshed on
//! read.
//!
//! With a window set ([`Settings::window`]), a prompt over it (in the
//! fake's tokens) is refused as each API refuses it, and on Messages so is
//! a prompt whose `max_tokens` does not fit beside it. Every answered
//! request is recorded in a ledger ([`Billed`]) with the usage it reported.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::reply::Reply;
use crate::tokens::TokenCounter;

/// Anthropic's limit on `cache_control` breakpoints per request.
pub const MAX_BREAKPOINTS: usize = crate::wire::messages::MAX_CACHE_BREAKPOINTS;
/// How many block boundaries before a breakpoint a read is looked for.
pub const LOOKBACK: usize = 20;
/// The shortest prefix either provider caches.
pub const MIN_CACHEABLE: u64 = 1024;
/// OpenAI reports cached tokens in steps of this many.
pub const OPENAI_STEP: u64 = 128;
/// The default lifetime of an entry (Anthropic's `ephemeral`; OpenAI's
/// shortest documented idle time).
pub const TTL_5M: Duration = Duration::from_secs(5 * 60);
/// Anthropic's `"ttl": "1h"`.
pub const TTL_1H: Duration = Duration::from_secs(60 * 60);

/// What the simulation enforces.
#[derive(Debug, Clone, Copy, Default)]
pub struct Settings {
    /// The model's window in the fake's tokens, when enforced.
    pub window: Option<u64>,
}

/// The usage of one request as the simulated cache bills it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Input neither read from nor written to the cache.
    pub input: u64,
    /// Input read from the cache.
    pub read: u64,
    /// Input written to the cache with a 5-minute lifetime.
    pub write_5m: u64,
    /// Input written to the cache with a 1-hour lifetime.
    pub write_1h: u64,
}

impl Usage {
    /// The whole prompt.
    pub fn prompt(&self) -> u64 {
        self.input + self.read + self.write_5m + self.write_1h
    }
}

/// One answered request, as the fake billed it.
#[derive(Debug, Clone)]
pub struct Billed {
    /// The request's path.
    pub path: String,
    /// A summary call of the proxy's (it carries the summarizer marker).
    pub summarizer: bool,
    /// The simulated time it was answered at.
    pub at: Duration,
    /// The input's usage.
    pub usage: Usage,
    /// Output tokens the answer reported.
    pub output: u64,
    /// The model asked for.
    pub model: String,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    expires: Duration,
    ttl: Duration,
}

type Hash = [u8; 32];

/// One block of a request: its chained prefix hash, its tokens, and the
/// lifetime its breakpoint asks for (Messages only).
struct Block {
    prefix: Hash,
    tokens: u64,
    breakpoint: Option<Duration>,
}

/// The simulated caches of one fake upstream, its clock and its ledger.
pub struct Sim {
    settings: Settings,
    now: Duration,
    entries: HashMap<Hash, Entry>,
    counted: HashMap<Hash, u64>,
    counter: TokenCounter,
    ledger: Vec<Billed>,
}

/// Which rules a path is judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/messages`.
    Messages,
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/responses`.
    Responses,
}

impl Api {
    /// The API a request path is for; `None` for anything else (model
    /// lists, token counting, compaction endpoints).
    pub fn of(path: &str) -> Option<Api> {
        if path.ends_with("/messages") {
            Some(Api::Messages)
        } else if path.ends_with("/chat/completions") {
            Some(Api::Chat)
        } else if path.ends_with("/responses") {
            Some(Api::Responses)
        } else {
            None
        }
    }
}

impl Sim {
    /// An empty cache at time zero.
    pub fn new(settings: Settings) -> Sim {
        Sim {
            settings,
            now: Duration::ZERO,
            entries: HashMap::new(),
            counted: HashMap::new(),
            counter: TokenCounter::default(),
            ledger: Vec::new(),
        }
    }

    /// Moves the clock on (an idle gap, the time a turn takes).
    pub fn advance(&mut self, by: Duration) {
        self.now += by;
    }

    /// The simulated time.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// The ledger so far, emptied.
    pub fn take_ledger(&mut self) -> Vec<Billed> {
        std::mem::take(&mut self.ledger)
    }

    /// Records an answered request.
    pub fn bill(&mut self, path: &str, summarizer: bool, model: &str, usage: Usage, output: u64) {
        self.ledger.push(Billed {
            path: path.to_string(),
            summarizer,
            at: self.now,
            usage,
            output,
            model: model.to_string(),
        });
    }

    /// Tokens of a text, as the fake counts them.
    pub fn count(&self, text: &str) -> u64 {
        self.counter.count_text(text)
    }

    /// Judges and bills `body` sent to `api` by the caller holding `key`:
    /// the refusal the API would give (a prompt over the window), or the
    /// usage it reports, the cache updated.
    pub fn request(&mut self, api: Api, body: &Value, key: &str) -> Result<Usage, Reply> {
        let blocks = self.blocks(api, body, key);
        let total: u64 = blocks.iter().map(|b| b.tokens).sum();
        if let Some(refusal) = self.refusal(api, body, total) {
            return Err(refusal);
        }
        Ok(match api {
            Api::Messages => self.anthropic(&blocks),
            Api::Chat | Api::Responses => self.openai(&blocks),
        })
    }

    fn refusal(&self, api: Api, body: &Value, total: u64) -> Option<Reply> {
        let window = self.settings.window?;
        match api {
            Api::Messages => {
                let refuse = |message: String| {
                    Reply::json(
                        400,
                        json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}}),
                    )
                };
                if total > window {
                    return Some(refuse(format!(
                        "prompt is too long: {total} tokens > {window} maximum"
                    )));
                }
                let max = body.get("max_tokens").and_then(Value::as_u64).unwrap_or(0);
                (total + max > window).then(|| refuse(format!(
                    "input length and `max_tokens` exceed context limit: {total} + {max} > {window}, decrease input length or `max_tokens` and try again"
                )))
            }
            Api::Chat | Api::Responses => (total > window).then(|| {
                Reply::json(
                    400,
                    json!({"error": {"message": format!("This model's maximum context length is {window} tokens. However, your messages resulted in {total} tokens. Please reduce the length of the messages."),
                        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
                )
            }),
        }
    }

    fn live(&self, h: &Hash) -> bool {
        self.entries.get(h).is_some_and(|e| e.expires > self.now)
    }

    /// Refreshes every live entry among the first `upto` blocks' prefixes.
    fn refresh(&mut self, blocks: &[Block], upto: usize) {
        let now = self.now;
        for b in &blocks[..upto] {
            if let Some(e) = self.entries.get_mut(&b.prefix) {
                if e.expires > now {
                    e.expires = now + e.ttl;
                }
            }
        }
    }

    fn write(&mut self, h: Hash, ttl: Duration) {
        let expires = self.now + ttl;
        let e = self.entries.entry(h).or_insert(Entry { expires, ttl });
        // A 1-hour entry rewritten with a 5-minute breakpoint keeps the
        // longer lifetime it was paid for.
        if e.expires <= self.now || ttl >= e.ttl {
            e.ttl = ttl;
        }
        e.expires = e.expires.max(expires);
    }

    fn anthropic(&mut self, blocks: &[Block]) -> Usage {
        let cum: Vec<u64> = blocks
            .iter()
            .scan(0, |acc, b| {
                *acc += b.tokens;
                Some(*acc)
            })
            .collect();
        let total = cum.last().copied().unwrap_or(0);
        let breakpoints: Vec<usize> = (0..blocks.len())
            .filter(|&i| blocks[i].breakpoint.is_some())
            .collect();
        // The longest live prefix found from any breakpoint's lookback.
        let mut read_at: Option<usize> = None;
        for &bp in &breakpoints {
            let found = (bp.saturating_sub(LOOKBACK)..=bp)
                .rev()
                .find(|&k| self.live(&blocks[k].prefix));
            read_at = read_at.max(found);
        }
        let read = read_at.map_or(0, |k| cum[k]);
        if let Some(k) = read_at {
            self.refresh(blocks, k + 1);
        }
        let mut usage = Usage {
            read,
            ..Usage::default()
        };
        let mut covered = read;
        for &bp in &breakpoints {
            let ttl = blocks[bp].breakpoint.unwrap_or(TTL_5M);
            if cum[bp] < MIN_CACHEABLE {
                continue;
            }
            if cum[bp] > covered {
                if ttl >= TTL_1H {
                    usage.write_1h += cum[bp] - covered;
                } else {
                    usage.write_5m += cum[bp] - covered;
                }
                covered = cum[bp];
            }
            self.write(blocks[bp].prefix, ttl);
        }
        usage.input = total - covered;
        usage
    }

    fn openai(&mut self, blocks: &[Block]) -> Usage {
        let mut acc = 0;
        let cum: Vec<u64> = blocks
            .iter()
            .map(|b| {
                acc += b.tokens;
                acc
            })
            .collect();
        let total = cum.last().copied().unwrap_or(0);
        let read_at = (0..blocks.len())
            .rev()
            .find(|&k| self.live(&blocks[k].prefix));
        let matched = read_at.map_or(0, |k| cum[k]);
        let read = if matched >= MIN_CACHEABLE {
            matched / OPENAI_STEP * OPENAI_STEP
        } else {
            0
        };
        if let Some(k) = read_at {
            self.refresh(blocks, k + 1);
        }
        for (b, &c) in blocks.iter().zip(&cum) {
            if c >= MIN_CACHEABLE {
                self.write(b.prefix, TTL_5M);
            }
        }
        Usage {
            input: total - read,
            read,
            ..Usage::default()
        }
    }

    /// The request's blocks in cache order, hashed as a chain and counted.
    fn blocks(&mut self, api: Api, body: &Value, key: &str) -> Vec<Block> {
        let model = body.get("model").and_then(Value::as_str).unwrap_or("");
        let seed = blake3::hash(format!("{api:?}\0{model}\0{key}").as_bytes());
        let mut chain = Chain {
            prefix: *seed.as_bytes(),
            blocks: Vec::new(),
        };
        let list = |k: &str| {
            body.get(k)
                .and_then(Value::as_array)
                .map(Vec::as_slice)
                .unwrap_or_default()
        };
        for t in list("tools") {
            self.push(&mut chain, "tool", t, "");
        }
        match api {
            Api::Messages => {
                self.push_each(&mut chain, "system", body.get("system"));
                // Changing these invalidates the cached messages only.
                let mut params = json!({"tool_choice": body.get("tool_choice"), "thinking": body.get("thinking")}).to_string();
                for m in list("messages") {
                    let role = m.get("role").and_then(Value::as_str).unwrap_or("");
                    match m.get("content") {
                        Some(Value::Array(blocks)) => {
                            for b in blocks {
                                self.push(&mut chain, role, b, &params);
                                params.clear();
                            }
                        }
                        Some(c) => {
                            self.push(&mut chain, role, c, &params);
                            params.clear();
                        }
                        None => {}
                    }
                }
            }
            Api::Chat => {
                for m in list("messages") {
                    self.push(&mut chain, "", m, "");
                }
            }
            Api::Responses => {
                if let Some(i) = body.get("instructions").filter(|i| !i.is_null()) {
                    self.push(&mut chain, "instructions", i, "");
                }
                self.push_each(&mut chain, "", body.get("input"));
            }
        }
        chain.blocks
    }

    /// Appends each item of a list, or a string as one block.
    fn push_each(&mut self, chain: &mut Chain, role: &str, v: Option<&Value>) {
        match v {
            Some(Value::Array(items)) => {
                for i in items {
                    self.push(chain, role, i, "");
                }
            }
            Some(s @ Value::String(_)) => self.push(chain, role, s, ""),
            _ => {}
        }
    }

    /// Appends one block: `role` and `extra` go into its hash (not its
    /// count), `cache_control` into neither.
    fn push(&mut self, chain: &mut Chain, role: &str, block: &Value, extra: &str) {
        let breakpoint = block
            .get("cache_control")
            .filter(|c| !c.is_null())
            .map(|c| match c.get("ttl").and_then(Value::as_str) {
                Some("1h") => TTL_1H,
                _ => TTL_5M,
            });
        let text = match block {
            Value::Object(o) if o.contains_key("cache_control") => {
                let mut o = o.clone();
                o.remove("cache_control");
                Value::Object(o).to_string()
            }
            _ => block.to_string(),
        };
        let own = *blake3::hash(text.as_bytes()).as_bytes();
        let tokens = match self.counted.get(&own) {
            Some(&t) => t,
            None => {
                let t = self.counter.count_text(&text).max(1);
                self.counted.insert(own, t);
                t
            }
        };
        let mut h = blake3::Hasher::new();
        h.update(&chain.prefix);
        h.update(role.as_bytes());
        h.update(&[0]);
        h.update(extra.as_bytes());
        h.update(&[0]);
        h.update(&own);
        chain.prefix = *h.finalize().as_bytes();
        chain.blocks.push(Block {
            prefix: chain.prefix,
            tokens,
            breakpoint,
        });
    }
}

struct Chain {
    prefix: Hash,
    blocks: Vec<Block>,
}

/// Anthropic's usage object for `usage` and `output` tokens.
pub fn messages_usage(usage: &Usage, output: u64) -> Value {
    json!({
        "input_tokens": usage.input,
        "cache_creation_input_tokens": usage.write_5m + usage.write_1h,
        "cache_read_input_tokens": usage.read,
        "cache_creation": {
            "ephemeral_5m_input_tokens": usage.write_5m,
            "ephemeral_1h_input_tokens": usage.write_1h,
        },
        "output_tokens": output,
    })
}

/// `reply` with its JSON body edited by `edit`, when it is a complete
/// JSON answer (anything else is left as it is).
pub fn edit_json(reply: Reply, edit: impl FnOnce(&mut Value)) -> Reply {
    match reply {
        Reply::Full {
            status,
            headers,
            body,
        } => {
            let body = match serde_json::from_slice::<Value>(&body) {
                Ok(mut v) => {
                    edit(&mut v);
                    bytes::Bytes::from(v.to_string())
                }
                Err(_) => body,
            };
            Reply::Full {
                status,
                headers,
                body,
            }
        }
        other => other,
    }
}

/// `reply` (a complete Chat or Responses JSON answer) with its input usage
/// replaced by `usage`; with `recount`, its output tokens counted from the
/// answer's text by `count`. The reply, and the output tokens it reports.
pub fn with_usage(
    reply: Reply,
    usage: &Usage,
    recount: Option<&dyn Fn(&str) -> u64>,
) -> (Reply, u64) {
    let mut output = 0;
    let reply = edit_json(reply, |v| {
        let text = answer_text(v);
        let Some(u) = v.get_mut("usage").and_then(Value::as_object_mut) else {
            return;
        };
        let chat = u.contains_key("prompt_tokens");
        let (in_key, out_key, details) = if chat {
            (
                "prompt_tokens",
                "completion_tokens",
                "prompt_tokens_details",
            )
        } else {
            ("input_tokens", "output_tokens", "input_tokens_details")
        };
        output = match recount {
            Some(count) => count(&text),
            None => u.get(out_key).and_then(Value::as_u64).unwrap_or(0),
        };
        let prompt = usage.prompt();
        u.insert(in_key.into(), json!(prompt));
        u.insert(out_key.into(), json!(output));
        u.insert("total_tokens".into(), json!(prompt + output));
        u.insert(details.into(), json!({"cached_tokens": usage.read}));
    });
    (reply, output)
}

/// The text of a Chat or Responses answer.
fn answer_text(v: &Value) -> String {
    let list = |v: Option<&Value>| -> Vec<Value> {
        v.and_then(Value::as_array).cloned().unwrap_or_default()
    };
    let chat = list(v.get("choices"))
        .into_iter()
        .filter_map(|c| c.pointer("/message/content").cloned());
    let responses = list(v.get("output"))
        .into_iter()
        .flat_map(|item| list(item.get("content")))
        .filter_map(|c| c.get("text").cloned());
    chat.chain(responses)
        .filter_map(|t| t.as_str().map(String::from))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A text of about `tokens` tokens (as the fake counts them), different
    /// for each `tag`: the word ` tag` repeated (each word is split apart
    /// before tokenizing, so it counts the same every time).
    fn text(tag: &str, tokens: usize) -> String {
        let word = format!(" {tag}");
        let each = TokenCounter::default().count_text(&word).max(1) as usize;
        word.repeat(tokens.div_ceil(each))
    }

    fn sim() -> Sim {
        Sim::new(Settings::default())
    }

    /// A Messages body: a system of about `system` tokens (with a
    /// breakpoint), and one user message per entry of `msgs` (tag, tokens),
    /// the last one carrying a breakpoint with `ttl`.
    fn messages(system: usize, msgs: &[(&str, usize)], ttl: Option<&str>) -> Value {
        let mut list: Vec<Value> = msgs
            .iter()
            .enumerate()
            .map(|(i, (tag, n))| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": [{"type": "text", "text": text(tag, *n)}]})
            })
            .collect();
        if let Some(last) = list.last_mut() {
            let mut cc = json!({"type": "ephemeral"});
            if let Some(t) = ttl {
                cc["ttl"] = json!(t);
            }
            last["content"][0]["cache_control"] = cc;
        }
        json!({
            "model": "claude-test", "max_tokens": 100,
            "system": [{"type": "text", "text": text("sys", system), "cache_control": {"type": "ephemeral"}}],
            "messages": list,
        })
    }

    fn anthropic(s: &mut Sim, body: &Value) -> Usage {
        s.request(Api::Messages, body, "k").expect("answered")
    }

    #[test]
    fn a_breakpoint_writes_and_the_next_request_reads_up_to_it() {
        let mut s = sim();
        let first = messages(2000, &[("a", 1500)], None);
        let u1 = anthropic(&mut s, &first);
        assert_eq!(u1.read, 0, "cold cache");
        assert_eq!(
            u1.input, 0,
            "everything up to the last breakpoint is written"
        );
        assert!(u1.write_5m > 3000, "{u1:?}");
        assert_eq!(u1.write_1h, 0);
        // The breakpoint moves to the newest message, as Claude Code moves it.
        let second = messages(2000, &[("a", 1500), ("b", 300), ("c", 400)], None);
        let u2 = anthropic(&mut s, &second);
        assert_eq!(u1.write_5m, body_tokens(&mut s, &first));
        assert_eq!(u2.read, u1.write_5m, "read up to the old breakpoint");
        assert_eq!(
            u2.write_5m,
            body_tokens(&mut s, &second) - u1.write_5m,
            "the new messages written"
        );
        assert_eq!(u2.prompt(), u2.read + u2.write_5m);
        // Without breakpoints nothing is read or written.
        let mut bare = second.clone();
        bare["system"][0]
            .as_object_mut()
            .unwrap()
            .remove("cache_control");
        bare["messages"][2]["content"][0]
            .as_object_mut()
            .unwrap()
            .remove("cache_control");
        let u3 = anthropic(&mut s, &bare);
        assert_eq!((u3.read, u3.write_5m, u3.input), (0, 0, u2.prompt()));
    }

    #[test]
    fn a_read_is_found_at_most_twenty_blocks_before_a_breakpoint() {
        let step: Vec<(&str, usize)> = std::iter::once(("head", 1500))
            .chain(std::iter::repeat_n(("x", 10), 40))
            .collect();
        for (added, hit) in [(20, true), (21, false)] {
            let mut s = sim();
            let first = messages(10, &step[..1], None);
            let w = anthropic(&mut s, &first).write_5m;
            let later = messages(10, &step[..1 + added], None);
            let u = anthropic(&mut s, &later);
            if hit {
                assert_eq!(u.read, w, "{added} blocks later: found");
            } else {
                assert_eq!(u.read, 0, "{added} blocks later: out of the lookback");
                assert_eq!(u.write_5m, u.prompt(), "all written again");
            }
        }
    }

    #[test]
    fn entries_live_five_minutes_refreshed_on_read_or_an_hour_when_asked() {
        let mut s = sim();
        let body = messages(2000, &[("a", 1500)], None);
        anthropic(&mut s, &body);
        s.advance(Duration::from_secs(4 * 60));
        assert!(anthropic(&mut s, &body).read > 0, "4 minutes: still there");
        s.advance(Duration::from_secs(4 * 60));
        assert!(
            anthropic(&mut s, &body).read > 0,
            "8 minutes after the write, 4 after the read that refreshed it"
        );
        s.advance(Duration::from_secs(5 * 60 + 1));
        let cold = anthropic(&mut s, &body);
        assert_eq!(cold.read, 0, "past 5 minutes idle: gone");
        assert_eq!(cold.write_5m, cold.prompt(), "written again");

        // A read through the lookback refreshes the entry it found, though
        // that request writes its own elsewhere.
        let mut s = sim();
        let short = messages(2000, &[("a", 1500)], None);
        let long = messages(2000, &[("a", 1500), ("b", 300), ("c", 300)], None);
        let written = anthropic(&mut s, &short).write_5m;
        s.advance(Duration::from_secs(4 * 60));
        assert_eq!(anthropic(&mut s, &long).read, written);
        s.advance(Duration::from_secs(4 * 60));
        assert_eq!(
            anthropic(&mut s, &short).read,
            written,
            "8 minutes after its write, 4 after the read that found it"
        );

        let mut s = sim();
        let hour = messages(2000, &[("a", 1500)], Some("1h"));
        let u = anthropic(&mut s, &hour);
        assert!(u.write_1h > 1500, "the last segment at 1 h: {u:?}");
        assert!(u.write_5m > 1500, "the system's breakpoint at 5 min: {u:?}");
        s.advance(Duration::from_secs(50 * 60));
        let again = anthropic(&mut s, &hour);
        assert_eq!(again.read, u.prompt(), "50 minutes: the 1 h entry serves");
        s.advance(Duration::from_secs(61 * 60));
        assert_eq!(anthropic(&mut s, &hour).read, 0, "61 minutes idle: gone");
    }

    #[test]
    fn prefixes_under_1024_tokens_are_not_cached() {
        let mut s = sim();
        let small = messages(100, &[("a", 300)], None);
        let u = anthropic(&mut s, &small);
        assert_eq!((u.read, u.write_5m, u.input), (0, 0, u.prompt()));
        assert_eq!(anthropic(&mut s, &small).read, 0);
        // The system alone is too short; with the message it is not.
        let larger = messages(100, &[("a", 1200)], None);
        let u = anthropic(&mut s, &larger);
        assert_eq!(u.write_5m, u.prompt());
    }

    #[test]
    fn tools_come_first_so_a_new_tool_reads_nothing() {
        let mut s = sim();
        let mut body = messages(2000, &[("a", 1500)], None);
        body["tools"] =
            json!([{"name": "Read", "description": text("tool", 500), "input_schema": {}}]);
        anthropic(&mut s, &body);
        assert_eq!(anthropic(&mut s, &body).read, body_tokens(&mut s, &body));
        body["tools"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "recall", "description": "more", "input_schema": {}}));
        assert_eq!(anthropic(&mut s, &body).read, 0, "the prefix changed first");
        // Another key shares nothing.
        let other = s.request(Api::Messages, &body, "other").unwrap();
        assert_eq!(other.read, 0);
    }

    fn body_tokens(s: &mut Sim, body: &Value) -> u64 {
        s.blocks(Api::Messages, body, "k")
            .iter()
            .map(|b| b.tokens)
            .sum()
    }

    #[test]
    fn openai_caches_every_prefix_from_1024_tokens_in_steps_of_128() {
        let mut s = sim();
        let msgs = |n: usize| -> Value {
            let list: Vec<Value> = (0..n)
                .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": text(&format!("m{i}"), 700)}))
                .collect();
            json!({"model": "gpt-test", "messages": list})
        };
        let one = s.request(Api::Chat, &msgs(1), "k").unwrap();
        assert_eq!(one.read, 0);
        let two = s.request(Api::Chat, &msgs(2), "k").unwrap();
        assert_eq!(
            two.read, 0,
            "the first request was under 1024 tokens: not cached"
        );
        let three = s.request(Api::Chat, &msgs(3), "k").unwrap();
        assert!(three.read >= MIN_CACHEABLE, "{three:?}");
        assert_eq!(three.read % OPENAI_STEP, 0, "{three:?}");
        assert!(three.read <= two.prompt() && two.prompt() - three.read < OPENAI_STEP);
        s.advance(TTL_5M + Duration::from_secs(1));
        assert_eq!(
            s.request(Api::Chat, &msgs(3), "k").unwrap().read,
            0,
            "expired"
        );
    }

    #[test]
    fn a_window_refuses_as_the_apis_do() {
        let mut s = Sim::new(Settings { window: Some(2000) });
        let big = messages(2000, &[("a", 1500)], None);
        let refused = |r: Result<Usage, Reply>| match r {
            Err(Reply::Full { status, body, .. }) => {
                (status, String::from_utf8_lossy(&body).into_owned())
            }
            _ => (200, String::new()),
        };
        let (status, msg) = refused(s.request(Api::Messages, &big, "k"));
        assert_eq!(status, 400);
        assert!(msg.contains("prompt is too long"), "{msg}");
        let mut fits = messages(800, &[("a", 400)], None);
        fits["max_tokens"] = json!(1500);
        assert!(refused(s.request(Api::Messages, &fits, "k"))
            .1
            .contains("exceed context limit"));
        let chat =
            json!({"model": "m", "messages": [{"role": "user", "content": text("u", 3000)}]});
        assert!(refused(s.request(Api::Chat, &chat, "k"))
            .1
            .contains("context_length_exceeded"));
        assert!(s.take_ledger().is_empty(), "refusals are not billed");
    }
}
