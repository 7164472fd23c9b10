//! What the proxy adds over going direct to the upstream, against the
//! budgets `docs/PERFORMANCE.md` states.
//!
//! `cargo bench --bench proxy` runs every scenario; `BENCH_QUICK=1` runs a
//! short smoke version. Other knobs (environment):
//!
//! - `BENCH_FILTER=text` (or a first free argument): only scenarios whose
//!   name contains `text`, e.g. `300KB` or `sse c=1`; `a|b`: either
//!   (`grow|msgs`: the chat rows beside the Messages rows).
//! - `BENCH_PROXY_THREADS` (default 1): worker threads of the proxy's runtime.
//! - `BENCH_LOAD_THREADS` (default 1): worker threads of the runtime that runs
//!   the clients and the fake upstream.
//! - `BENCH_CN_N` (default 8000): measured requests per side at c=32, in 8
//!   rounds per side. A proxied round ends once the proxies' stores have
//!   taken its exchanges and the accounting thread its jobs, so the work it
//!   deferred is not done in the direct round that follows.
//! - `BENCH_POSTGRES=1`: every scenario runs a second time with the store on
//!   PostgreSQL (rows marked `pg`), on a throwaway cluster started for the
//!   run (`initdb`, fsync on), a fresh database per scenario. The `commit`
//!   column is the mean time of the store's commits, which a PostgreSQL
//!   exchange's answer waits for. `BENCH_PG_SYNC=off` (or another value
//!   of `store.synchronous_commit`) sets the proxy sessions' commit mode;
//!   `BENCH_PG_JOURNAL=1` sets `store.local_journal` (answers released once
//!   journaled, committed within `store.commit_delay_ms`, which
//!   `BENCH_PG_COMMIT_DELAY_MS` sets).
//! - `BENCH_PG_FILL=N` (with `BENCH_POSTGRES=1`; default 20000, 0 with
//!   `BENCH_QUICK`): each PostgreSQL scenario's database first gets N
//!   exchanges of another tenant, with item bodies, and `ANALYZE`, so that
//!   it is measured as a store that has served a while is, with plans made
//!   from statistics of its size. `0`: an empty database, whose
//!   connections keep the plans of an empty one (sequential scans) until
//!   autovacuum analyzes it, a minute or more later.
//! - `BENCH_PG_STATEMENTS=1` (with `BENCH_POSTGRES=1`): the cluster loads
//!   `pg_stat_statements`, and each PostgreSQL scenario prints the
//!   statements the database spent most time in during its measured
//!   requests.
//! - `BENCH_REPLICAS=2` (with `BENCH_POSTGRES=1`): the PostgreSQL scenarios
//!   run a third time with two proxies on one database (rows marked `pg2`),
//!   each on a runtime of its own, a session's requests going to each in
//!   turn (so every request's conversation was last served by the other
//!   replica). Printed beside them: the proxies' and the database's CPU per
//!   request, the request path's round trips to the database, and the
//!   model of what two replicas would serve with cores of their own.
//!   `BENCH_STICKY=1` adds a fourth run of them, `pg2s`: the same replicas
//!   behind a balancer with session affinity, each session's requests all
//!   going to one of them.
//! - `BENCH_PG_CPU=N` (with `BENCH_POSTGRES=1`): the cluster's processes
//!   run on CPU `N` alone and this process on the others, in every row
//!   (direct and SQLite too), as when the database has a host of its own:
//!   the database's CPU then takes nothing from the proxy's or the load's.
//! - `BENCH_UPSTREAM_WS=1`: the fake upstream takes the Responses WebSocket,
//!   so the `codx ws` rows' proxied side is asked over one, and their
//!   direct side goes to it over one too (a socket per session, as
//!   through the proxy), so that each transport's added latency is
//!   against a direct side over its own transport.
//!
//! Set-up, per scenario (so each starts from an empty store and the fake
//! upstream's record of received bodies is freed afterwards):
//!
//! - runtime "bench-load": the reqwest clients and the in-process
//!   [`FakeUpstream`] ("the rest of the world");
//! - runtime "compactor": the proxy (`server::run`) over a fresh SQLite store
//!   in a temp dir, upstream = the fake. Its store writer, WAL checkpointer
//!   and accounting thread (token estimates) are further OS threads.
//!
//! With 2 cores and one worker each, the proxy gets roughly a core of its own
//! and the load generator + upstream the other, as when the upstream is
//! another machine.
//!
//! Direct and proxied requests alternate (per request at c=1, per round at
//! c=32) so machine noise hits both. Both sides send byte-identical bodies
//! (same generator seeds). After the warm-up the bench waits until the
//! process is idle: the first request of each session brings a whole new
//! history, which the proxy tokenizes in the background. Only 127.0.0.1 is
//! contacted. Nothing is asserted: the budgets are printed as PASS / MISS,
//! with a line saying how much CPU other processes took meanwhile.
//!
//! Besides latency and throughput it prints the CPU per request of the
//! proxy's threads and of the load runtime (read from /proc), and
//! single-thread timings of the proxy's per-request steps (parse, clone,
//! hash, …) on one body of each size, to show what the added latency is.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use compactor::app::AppState;
use compactor::config::Config;
use compactor::fake_upstream::{FakeUpstream, AUTO_TEXT};
use compactor::server;
use serde_json::json;
use tokio::runtime::Runtime;
use tokio::sync::oneshot;

/// The binary's allocator, so the proxy measured here allocates as it does in
/// `compactor serve` (the load side shares it).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

// ---------------------------------------------------------------- options

struct Opts {
    quick: bool,
    c1_warm: usize,
    c1_n: usize,
    cn_warm_per_worker: usize,
    cn_n: usize,
    cn_rounds: usize,
    proxy_threads: usize,
    load_threads: usize,
    filter: Option<String>,
    postgres: bool,
    pg_statements: bool,
    replicas: usize,
    /// `BENCH_STICKY`: the replicas' rows also run with each session kept
    /// on one replica.
    sticky: bool,
    /// `BENCH_PG_CPU`: the CPU the database has to itself.
    pg_cpu: Option<usize>,
    /// `BENCH_UPSTREAM_WS`: the fake takes the Responses WebSocket, and
    /// the `codx ws` rows' direct side goes to it over one.
    upstream_ws: bool,
    /// `BENCH_PG_FILL`: exchanges of another tenant each PostgreSQL
    /// scenario's database holds, analyzed, before its first request.
    pg_fill: usize,
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default)
}

/// A switch: set to anything but empty or `0`.
fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

fn opts() -> Opts {
    let quick = env_flag("BENCH_QUICK");
    // `cargo bench` passes `--bench`; a free argument is a filter.
    let arg_filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let filter = std::env::var("BENCH_FILTER")
        .ok()
        .filter(|s| !s.is_empty())
        .or(arg_filter);
    Opts {
        quick,
        c1_warm: if quick { 5 } else { 30 },
        c1_n: if quick { 30 } else { 300 },
        cn_warm_per_worker: if quick { 1 } else { 2 },
        cn_n: env_usize("BENCH_CN_N", if quick { 192 } else { 8000 }),
        cn_rounds: if quick { 2 } else { 8 },
        proxy_threads: env_usize("BENCH_PROXY_THREADS", 1),
        load_threads: env_usize("BENCH_LOAD_THREADS", 1),
        filter,
        postgres: env_flag("BENCH_POSTGRES"),
        pg_statements: env_flag("BENCH_PG_STATEMENTS"),
        replicas: env_usize("BENCH_REPLICAS", 1).min(4),
        sticky: env_flag("BENCH_STICKY"),
        upstream_ws: env_flag("BENCH_UPSTREAM_WS"),
        pg_cpu: std::env::var("BENCH_PG_CPU")
            .ok()
            .and_then(|v| v.parse().ok()),
        pg_fill: std::env::var("BENCH_PG_FILL")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(if quick { 0 } else { 20_000 }),
    }
}

// ---------------------------------------------------------------- request bodies

/// xorshift64*: deterministic content without a dependency.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03 | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

const WORDS: &[&str] = &[
    "the", "function", "returns", "error", "file", "module", "test", "value", "config", "request",
    "proxy", "stream", "buffer", "handler", "should", "because", "when", "index", "update",
    "parse", "async", "await", "struct", "field", "cache", "thread", "lock", "result", "option",
    "match", "string", "vector", "commit", "branch", "merge", "build", "crate", "trait", "bytes",
    "header", "client", "server", "latency", "budget", "history", "summary", "and", "of", "to",
    "in", "is", "that", "it", "with", "for", "not", "we", "this", "but", "instead", "first",
    "then", "after", "fails", "passes", "missing", "called", "once", "every", "time",
];
const IDENTS: &[&str] = &[
    "conn", "state", "body", "items", "chain", "prefix", "store", "batch", "reply", "tenant",
    "usage", "limit", "chunk", "event", "frame", "index", "writer", "reader", "token", "window",
];
const TYPES: &[&str] = &[
    "Bytes", "Value", "String", "Vec<u8>", "Request", "Response", "Config", "Store",
];
const TOOL_NAMES: &[&str] = &[
    "read_file",
    "run_shell",
    "search_code",
    "list_dir",
    "apply_patch",
    "write_file",
];

fn prose(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    let mut capital = true;
    while s.len() < bytes {
        let w = rng.pick(WORDS);
        if capital {
            let mut c = w.chars();
            if let Some(f) = c.next() {
                s.extend(f.to_uppercase());
                s.push_str(c.as_str());
            }
            capital = false;
        } else {
            s.push(' ');
            s.push_str(w);
        }
        match rng.below(14) {
            0 => {
                s.push_str(". ");
                capital = true;
            }
            1 => s.push(','),
            2 => s.push_str(&format!(" `{}`", rng.pick(IDENTS))),
            _ => {}
        }
    }
    s.push('.');
    s
}

/// Something like a numbered source listing, as a file-reading tool returns.
fn code(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 128);
    let mut line = 1 + rng.below(300);
    while s.len() < bytes {
        let (a, b, c) = (rng.pick(IDENTS), rng.pick(IDENTS), rng.pick(IDENTS));
        let t = rng.pick(TYPES);
        let text = match rng.below(6) {
            0 => format!("pub fn {a}_{b}(&self, {c}: &str) -> Result<{t}, Error> {{"),
            1 => format!(
                "    let {a} = self.{b}.get(\"{c}\").ok_or_else(|| anyhow!(\"missing {c}\"))?;"
            ),
            2 => format!(
                "    if {a}.len() > {} {{ return Err(Error::TooLarge(\"{b}\")); }}",
                rng.range(1, 9999)
            ),
            3 => format!("    // {}", prose(rng, 40)),
            4 => format!("    {a}.{b}({c}.clone()).await?;"),
            _ => "}".to_string(),
        };
        s.push_str(&format!("{line:>5}\t{text}\n"));
        line += 1;
    }
    s
}

fn tools_json() -> serde_json::Value {
    let tools: Vec<_> = TOOL_NAMES
        .iter()
        .enumerate()
        .map(|(i, name)| {
            json!({"type": "function", "function": {
                "name": name,
                "description": prose(&mut Rng::new(900 + i as u64), 220),
                "parameters": {"type": "object", "additionalProperties": false,
                    "required": ["path"],
                    "properties": {
                        "path": {"type": "string", "description": "Path relative to the workspace root."},
                        "command": {"type": "string", "description": "Shell command to run, with arguments."},
                        "timeout_ms": {"type": "integer", "description": "Give up after this many milliseconds."}}}}})
        })
        .collect();
    serde_json::Value::Array(tools)
}

/// `{"model":…,"stream":…,"tools":[…],"messages":[` — shared by all sessions.
/// The model has a 1M-token window, so no size here comes near a compaction
/// threshold: this measures the pass-through path.
fn body_head(stream: bool) -> Arc<Vec<u8>> {
    body_head_for("gpt-4.1-mini", stream)
}

/// The model of the `cmpt` rows: its window (set per scenario, see
/// [`Rig::start`]) puts the `last` history over the trigger, so each
/// session's first answer starts a compaction and every later request of
/// it is sent compacted.
const COMPACTED_MODEL: &str = "bench-compacted";

fn body_head_for(model: &str, stream: bool) -> Arc<Vec<u8>> {
    let mut head = format!(
        "{{\"model\":\"{model}\",\"temperature\":0.2,\"stream\":{stream},\"tools\":{},\"messages\":[",
        tools_json()
    );
    head.shrink_to_fit();
    Arc::new(head.into_bytes())
}

const SYSTEM_SEED: u64 = 7;

/// The wire shape of a session's bodies.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// Chat Completions `messages`, as the SDKs send them.
    Chat,
    /// A Responses request as Codex CLI sends one: `input` items (a
    /// developer message, reasoning, function calls and their outputs),
    /// then the tools and the other parameters, with a `prompt_cache_key`
    /// per session.
    Codex,
    /// An Anthropic Messages request as Claude Code sends one: `system` a
    /// top-level field, `tool_use` blocks and user messages of
    /// `tool_result` blocks.
    Messages,
    /// A Gemini `generateContent` request as Gemini CLI sends one:
    /// `contents` of `user` and `model` parts (`functionCall` parts with
    /// their `thoughtSignature`, user contents of `functionResponse`
    /// parts), then `systemInstruction`, the tools as
    /// `functionDeclarations` and `generationConfig`.
    Gemini,
}

impl Shape {
    fn text(self, role: &str, text: &str) -> serde_json::Value {
        match self {
            Shape::Chat => json!({"role": role, "content": text}),
            Shape::Codex => {
                let kind = if role == "assistant" {
                    "output_text"
                } else {
                    "input_text"
                };
                json!({"type": "message", "role": role, "content": [{"type": kind, "text": text}]})
            }
            Shape::Messages => json!({"role": role, "content": [{"type": "text", "text": text}]}),
            Shape::Gemini => {
                let role = if role == "assistant" { "model" } else { "user" };
                json!({"role": role, "parts": [{"text": text}]})
            }
        }
    }

    fn system(self, text: &str) -> serde_json::Value {
        self.text(
            if self == Shape::Chat {
                "system"
            } else {
                "developer"
            },
            text,
        )
    }
}

/// What a client appends after the fake's answer (its automatic text).
fn assistant_reply(shape: Shape) -> String {
    shape.text("assistant", AUTO_TEXT).to_string()
}

/// `{"model":…,"stream":…,"system":…,"tools":[…],"messages":[` — shared by
/// all Messages sessions (the system prompt a top-level field).
fn messages_head(stream: bool) -> Arc<Vec<u8>> {
    let system = prose(&mut Rng::new(SYSTEM_SEED), 3000);
    let head = format!(
        "{{\"model\":\"claude-sonnet-4-5\",\"max_tokens\":1024,\"stream\":{stream},\"system\":{},\"tools\":{},\"messages\":[",
        serde_json::Value::String(system),
        tools_json()
    );
    Arc::new(head.into_bytes())
}

/// `{"model":…,"stream":true,"input":[` — shared by all Codex sessions.
fn codex_head() -> Arc<Vec<u8>> {
    Arc::new(b"{\"model\":\"gpt-5-codex\",\"stream\":true,\"input\":[".to_vec())
}

/// The tools' functions (`name`, `description`, `parameters`), each as
/// `declare` makes it into an API's declaration.
fn declared_tools(declare: impl Fn(&serde_json::Value) -> serde_json::Value) -> serde_json::Value {
    tools_json()
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| declare(&t["function"]))
        .collect()
}

/// What follows a Codex session's items: its tools and parameters.
fn codex_tail(session: u64) -> Arc<Vec<u8>> {
    let tools = declared_tools(|f| {
        json!({"type": "function", "name": f["name"], "description": f["description"],
               "strict": false, "parameters": f["parameters"]})
    });
    let rest = json!({"tools": tools, "tool_choice": "auto", "parallel_tool_calls": false,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": false,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": format!("01a229d2-2989-7b93-bd82-{session:012x}")})
    .to_string();
    // `],` then the parameters' members.
    Arc::new(format!("],{}", &rest[1..]).into_bytes())
}

/// `{"contents":[` — shared by all Gemini sessions.
fn gemini_head() -> Arc<Vec<u8>> {
    Arc::new(b"{\"contents\":[".to_vec())
}

/// What follows a Gemini session's contents: the system instruction, the
/// tools and the generation parameters, as Gemini CLI sends them.
fn gemini_tail() -> Arc<Vec<u8>> {
    let declarations = declared_tools(|f| {
        json!({"name": f["name"], "description": f["description"],
               "parametersJsonSchema": f["parameters"]})
    });
    let system = prose(&mut Rng::new(SYSTEM_SEED), 3000);
    let rest = json!({"systemInstruction": {"role": "user", "parts": [{"text": system}]},
        "tools": [{"functionDeclarations": declarations}],
        "generationConfig": {"temperature": 0, "topP": 1,
            "thinkingConfig": {"includeThoughts": true, "thinkingBudget": 8192}}})
    .to_string();
    // `],` then the parameters' members.
    Arc::new(format!("],{}", &rest[1..]).into_bytes())
}

/// One conversation's message history, serialised, comma-joined.
struct Conv {
    hist: Vec<u8>,
    tag: u64,
    seq: u64,
    rng: Rng,
    shape: Shape,
}

impl Conv {
    /// An agent-like history that makes the body about `target` bytes:
    /// a system prompt, then turns of user / assistant tool call / tool
    /// output, and now and then an assistant text.
    fn new(tag: u64, target: usize, head_len: usize, shape: Shape) -> Conv {
        let mut rng = Rng::new(tag);
        // All sessions share the system prompt, as agents do.
        let system = prose(&mut Rng::new(SYSTEM_SEED), 3000);
        let mut hist = match shape {
            // The system prompt is in the head or the tail: the history
            // opens with the user.
            Shape::Messages | Shape::Gemini => {
                shape.text("user", "Begin.").to_string().into_bytes()
            }
            _ => shape.system(&system).to_string().into_bytes(),
        };
        let max_tool = (target / 40).clamp(1500, 6000);
        let reserve = 450; // the varying last user message and the tail
        let mut k = 0;
        while head_len + hist.len() + reserve < target {
            let mut push = |v: serde_json::Value| {
                hist.push(b',');
                hist.extend_from_slice(v.to_string().as_bytes());
            };
            let n = rng.range(80, 400);
            push(shape.text("user", &prose(&mut rng, n)));
            let name = rng.pick(TOOL_NAMES);
            let call_id = format!("call_{tag:x}_{k}");
            let args = json!({"path": format!("src/{}/{}.rs", rng.pick(IDENTS), rng.pick(IDENTS)),
                              "command": format!("cargo test -p {} -- {}", rng.pick(IDENTS), rng.pick(IDENTS))});
            let n = rng.range(300, max_tool);
            let output = code(&mut rng, n);
            match shape {
                Shape::Chat => {
                    push(json!({"role": "assistant", "content": null, "tool_calls": [
                        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args.to_string()}}]}));
                    push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
                }
                Shape::Codex => {
                    // Encrypted reasoning rides along with every call.
                    let sealed: String = (0..400)
                        .map(|_| rng.pick(&["A", "b", "7", "+", "Q", "z"]))
                        .collect();
                    push(
                        json!({"type": "reasoning", "summary": [], "content": null, "encrypted_content": sealed}),
                    );
                    push(
                        json!({"type": "function_call", "name": name, "arguments": args.to_string(), "call_id": call_id}),
                    );
                    push(
                        json!({"type": "function_call_output", "call_id": call_id, "output": output}),
                    );
                }
                Shape::Messages => {
                    push(json!({"role": "assistant", "content": [
                        {"type": "tool_use", "id": call_id, "name": name, "input": args}]}));
                    push(json!({"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": call_id, "content": output}]}));
                }
                Shape::Gemini => {
                    // The call's signature rides along, as the API needs
                    // it back; the API gives calls no id, so they pair
                    // by name.
                    let sealed: String = (0..400)
                        .map(|_| rng.pick(&["A", "b", "7", "+", "Q", "z"]))
                        .collect();
                    push(json!({"role": "model", "parts": [
                        {"functionCall": {"name": name, "args": args}, "thoughtSignature": sealed}]}));
                    push(json!({"role": "user", "parts": [
                        {"functionResponse": {"name": name, "response": {"output": output}}}]}));
                }
            }
            if k % 3 == 2 {
                let n = rng.range(100, 600);
                push(shape.text("assistant", &prose(&mut rng, n)));
            }
            k += 1;
        }
        Conv {
            hist,
            tag,
            seq: 0,
            rng,
            shape,
        }
    }

    /// The next request body (`head`, the history, a new user message,
    /// `tail`) and the user message.
    fn body(&mut self, head: &[u8], tail: &[u8]) -> (Vec<u8>, String) {
        self.seq += 1;
        let n = self.rng.range(150, 350);
        let text = format!(
            "[session {:x} request {}] {}",
            self.tag,
            self.seq,
            prose(&mut self.rng, n)
        );
        let user = self.shape.text("user", &text).to_string();
        let mut b = Vec::with_capacity(head.len() + self.hist.len() + user.len() + tail.len() + 1);
        b.extend_from_slice(head);
        b.extend_from_slice(&self.hist);
        b.push(b',');
        b.extend_from_slice(user.as_bytes());
        b.extend_from_slice(tail);
        (b, user)
    }

    /// Continues the conversation: the user message and the answer join it.
    fn extend(&mut self, user: &str, reply: &str) {
        self.hist.push(b',');
        self.hist.extend_from_slice(user.as_bytes());
        self.hist.push(b',');
        self.hist.extend_from_slice(reply.as_bytes());
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    /// Same history every time; only the last user message differs.
    Last,
    /// Each request continues the previous one: the user message and the
    /// answer join the history. A conversation starts at `GROW_FROM`% of the
    /// target size and is replaced by a new one past `GROW_TO`%, so sizes
    /// average the target and most requests add only a little new content.
    Grow,
    /// A reference, not a budget: the bodies of `Last`, sent to a path the
    /// proxy relays without parsing or recording (`/v1/embeddings`), so the
    /// row shows what the HTTP hop alone costs on this machine.
    Hop,
    /// Like `Grow`, as Codex CLI sends it: `/v1/responses`, streamed.
    Codex,
    /// `Codex`, the proxied side over the proxy's WebSocket (one socket
    /// per session, each request a `response.create`), the direct side
    /// over HTTP + SSE as for `Codex`, or over the upstream's WebSocket
    /// when it takes one ([`Opts::upstream_ws`]) (c=1 only).
    CodexWs,
    /// Every client sends the same bytes every time, as a load tool that
    /// repeats one body does: one conversation, whose requests all arrive
    /// together (c=32 only).
    Same,
    /// Like `Grow`, as Claude Code sends it: `/v1/messages`.
    Messages,
    /// Like `Grow`, as Gemini CLI sends it: `:generateContent`, or
    /// streamed `:streamGenerateContent?alt=sse` (c=1 only).
    Gemini,
    /// `Last` for a model whose window the history overflows: once the
    /// session's compaction is stored (during the warm-up), every request
    /// goes upstream compacted.
    Compacted,
}

impl Variant {
    fn shape(self) -> Shape {
        match self {
            Variant::Codex | Variant::CodexWs => Shape::Codex,
            Variant::Messages => Shape::Messages,
            Variant::Gemini => Shape::Gemini,
            _ => Shape::Chat,
        }
    }

    fn grows(self) -> bool {
        matches!(
            self,
            Variant::Grow | Variant::Codex | Variant::CodexWs | Variant::Messages | Variant::Gemini
        )
    }
}

const GROW_FROM: usize = 85;
const GROW_TO: usize = 115;

/// A client session: produces bodies, continues its conversation.
struct Session {
    variant: Variant,
    shape: Shape,
    head: Arc<Vec<u8>>,
    tail: Arc<Vec<u8>>,
    target: usize,
    seed: u64,
    generation: u64,
    conv: Conv,
    reply: String,
    /// `Same`: the one body (and user message), made on the first request.
    fixed: Option<(Vec<u8>, String)>,
    /// Requests made so far.
    sent: usize,
    /// Every request to one replica (see [`Scenario::sticky`]).
    sticky: bool,
}

impl Session {
    fn new(variant: Variant, stream: bool, target: usize, seed: u64) -> Session {
        // One seed for all: every session of `Same` is the same conversation.
        let seed = if variant == Variant::Same { 1 } else { seed };
        let shape = variant.shape();
        let (head, tail) = match shape {
            Shape::Chat if variant == Variant::Compacted => (
                body_head_for(COMPACTED_MODEL, stream),
                Arc::new(b"]}".to_vec()),
            ),
            Shape::Chat => (body_head(stream), Arc::new(b"]}".to_vec())),
            Shape::Codex => (codex_head(), codex_tail(seed)),
            Shape::Messages => (messages_head(stream), Arc::new(b"]}".to_vec())),
            // The path says whether it streams.
            Shape::Gemini => (gemini_head(), gemini_tail()),
        };
        let first = if variant.grows() {
            // Staggered, so sessions do not all start over at once.
            target * (GROW_FROM + (seed as usize * 7) % (GROW_TO - GROW_FROM)) / 100
        } else {
            target
        };
        let conv = Conv::new(seed << 16, first, head.len() + tail.len(), shape);
        Session {
            variant,
            shape,
            head,
            tail,
            target,
            seed,
            generation: 0,
            conv,
            reply: assistant_reply(shape),
            fixed: None,
            sent: 0,
            sticky: false,
        }
    }

    /// Where the next request goes, of `urls` (the replicas): each in
    /// turn, so that a conversation's next request goes to a replica that
    /// did not serve the one before; or, sticky, always the same one.
    fn url<'a>(&self, urls: &'a [String]) -> &'a str {
        let turn = if self.sticky { 0 } else { self.sent };
        &urls[(self.seed as usize + turn) % urls.len()]
    }

    fn next(&mut self) -> (Vec<u8>, String) {
        self.sent += 1;
        if self.variant != Variant::Same {
            return self.conv.body(&self.head, &self.tail);
        }
        let (head, tail) = (&self.head, &self.tail);
        let conv = &mut self.conv;
        self.fixed
            .get_or_insert_with(|| conv.body(head, tail))
            .clone()
    }

    fn done(&mut self, user: &str) {
        if self.variant.grows() {
            self.conv.extend(user, &self.reply);
            let fixed = self.head.len() + self.tail.len();
            if fixed + self.conv.hist.len() + 450 > self.target * GROW_TO / 100 {
                self.generation += 1;
                self.conv = Conv::new(
                    (self.seed << 16) + self.generation,
                    self.target * GROW_FROM / 100,
                    fixed,
                    self.shape,
                );
            }
        }
    }
}

// ---------------------------------------------------------------- load

#[derive(Clone, Copy)]
struct Sample {
    total: Duration,
    ttfb: Duration,
    bytes: usize,
    /// The proxy said it sent the request compacted.
    compacted: bool,
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// One request of a session of `shape`; the clock runs from just before
/// sending to the last byte.
async fn send(
    client: &reqwest::Client,
    url: &str,
    body: Vec<u8>,
    stream: bool,
    shape: Shape,
) -> Result<Sample, String> {
    let bytes = body.len();
    // Gemini's key goes in its own header.
    let key = match shape {
        Shape::Gemini => ("x-goog-api-key", "AIzaSy-bench-00000000000000000000000"),
        _ => ("authorization", "Bearer sk-bench-0000000000000000"),
    };
    let t0 = Instant::now();
    let mut resp = client
        .post(url)
        .header(key.0, key.1)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = resp.status();
    let compacted = resp.headers().contains_key("x-compactor-compacted");
    let mut ttfb = None;
    let mut buf = Vec::with_capacity(2048);
    while let Some(chunk) = resp.chunk().await.map_err(|e| format!("body: {e}"))? {
        if ttfb.is_none() && !chunk.is_empty() {
            ttfb = Some(t0.elapsed());
        }
        buf.extend_from_slice(&chunk);
    }
    let total = t0.elapsed();
    if !status.is_success() {
        return Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&buf[..buf.len().min(300)])
        ));
    }
    let ok = if stream {
        // A chat stream ends with [DONE], a Responses stream with its
        // completed event, a Messages stream with `message_stop`, a
        // Gemini stream with a chunk that gives the finish reason.
        (buf.ends_with(b"data: [DONE]\n\n")
            || contains(&buf, b"\"response.completed\"")
            || contains(&buf, b"\"message_stop\"")
            || (shape == Shape::Gemini && contains(&buf, b"\"finishReason\":\"STOP\"")))
            && contains(&buf, b"fake upstream.")
    } else {
        // A chat answer, or the fake's answer to any other path (the hop rows).
        contains(&buf, AUTO_TEXT.as_bytes()) || contains(&buf, b"\"path\":\"/v1/embeddings\"")
    };
    sample(ok, &buf, total, ttfb, bytes, compacted)
}

/// The sample of an answer `buf` that was as expected (`ok`).
fn sample(
    ok: bool,
    buf: &[u8],
    total: Duration,
    ttfb: Option<Duration>,
    bytes: usize,
    compacted: bool,
) -> Result<Sample, String> {
    if !ok {
        return Err(format!(
            "unexpected answer: {}",
            String::from_utf8_lossy(&buf[..buf.len().min(300)])
        ));
    }
    Ok(Sample {
        total,
        ttfb: ttfb.unwrap_or(total),
        bytes,
        compacted,
    })
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// One request over the WebSocket at `url` (its `http://` URL: the
/// proxy's, or the upstream's when it takes one), opened on the first: the
/// body as a `response.create`, the clock from just before sending to the
/// message with its final event.
async fn send_ws(socket: &mut Option<Ws>, url: &str, body: Vec<u8>) -> Result<Sample, String> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::{client::IntoClientRequest, Message};
    let ws = match socket {
        Some(ws) => ws,
        None => {
            let mut req = url
                .replacen("http://", "ws://", 1)
                .into_client_request()
                .map_err(|e| format!("ws url: {e}"))?;
            req.headers_mut().insert(
                "authorization",
                http::HeaderValue::from_static("Bearer sk-bench-0000000000000000"),
            );
            let (ws, _) = tokio_tungstenite::connect_async_with_config(req, None, true)
                .await
                .map_err(|e| format!("ws connect: {e}"))?;
            socket.insert(ws)
        }
    };
    let bytes = body.len();
    // The same members, after the event's type.
    let text = format!(
        "{{\"type\":\"response.create\",{}",
        std::str::from_utf8(&body[1..]).map_err(|e| e.to_string())?
    );
    let t0 = Instant::now();
    if let Err(e) = ws.send(Message::Text(text.into())).await {
        *socket = None;
        return Err(format!("ws send: {e}"));
    }
    let mut ttfb = None;
    let mut buf = Vec::with_capacity(2048);
    loop {
        let m = match ws.next().await {
            Some(Ok(Message::Text(t))) => t,
            Some(Ok(_)) => continue,
            other => {
                *socket = None;
                return Err(format!("ws: {other:?}"));
            }
        };
        ttfb.get_or_insert_with(|| t0.elapsed());
        buf.extend_from_slice(m.as_bytes());
        if contains(m.as_bytes(), b"\"type\":\"error\"") {
            return Err(format!("error event: {m}"));
        }
        if contains(m.as_bytes(), b"\"response.completed\"") {
            break;
        }
    }
    let total = t0.elapsed();
    let ok = contains(&buf, b"fake upstream.");
    sample(ok, &buf, total, ttfb, bytes, false)
}

#[derive(Default)]
struct Collected {
    samples: Vec<Sample>,
    /// Wall time of the measured requests (sum of rounds; at c=1 the sum of latencies).
    wall: Duration,
    errors: usize,
    first_error: Option<String>,
}

impl Collected {
    fn error(&mut self, e: String) {
        self.errors += 1;
        self.first_error.get_or_insert(e);
    }
    fn absorb(&mut self, other: Collected) {
        self.samples.extend(other.samples);
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

/// `count` requests spread over the sessions (one task each, so concurrency
/// = number of sessions). Returns the sessions for the next round.
async fn burst(
    client: &reqwest::Client,
    urls: &[String],
    sessions: Vec<Session>,
    count: usize,
    stream: bool,
) -> (Vec<Session>, Collected) {
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|mut s| {
            let (client, urls, next) = (client.clone(), urls.to_vec(), next.clone());
            tokio::spawn(async move {
                let mut c = Collected::default();
                while next.fetch_add(1, Ordering::Relaxed) < count {
                    let url = s.url(&urls).to_string();
                    let (body, user) = s.next();
                    match send(&client, &url, body, stream, s.shape).await {
                        Ok(sample) => {
                            s.done(&user);
                            c.samples.push(sample);
                        }
                        Err(e) => c.error(e),
                    }
                }
                (s, c)
            })
        })
        .collect();
    let mut sessions = Vec::new();
    let mut all = Collected::default();
    for t in tasks {
        let (s, c) = t.await.expect("load task");
        sessions.push(s);
        all.absorb(c);
    }
    all.wall = t0.elapsed();
    (sessions, all)
}

// ---------------------------------------------------------------- rig

/// `BENCH_PG_CPU`: the cluster's processes on CPU `cpu` alone, this
/// process (every row's clients, fake upstream and proxies) on the others,
/// as when the database has a host of its own. The server's backends, forked
/// later, inherit its CPU.
fn pin_apart(cpu: usize, cluster: &pg_cluster::PgCluster) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let others: Vec<String> = (0..cpus)
        .filter(|&c| c != cpu)
        .map(|c| c.to_string())
        .collect();
    assert!(
        cpu < cpus && !others.is_empty(),
        "BENCH_PG_CPU={cpu}: this machine has CPUs 0..{cpus}, and the bench needs one more"
    );
    let pin = |list: &str, pid: u32| {
        let out = std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", list, &pid.to_string()])
            .output()
            .expect("taskset (util-linux)");
        assert!(out.status.success(), "taskset {list} {pid}: {out:?}");
    };
    let (_, processes) = cluster.processes();
    assert!(!processes.is_empty(), "the cluster's processes not found");
    for (pid, _) in processes {
        pin(&cpu.to_string(), pid);
    }
    pin(&others.join(","), std::process::id());
    eprintln!(
        "BENCH_PG_CPU: the database on CPU {cpu}, this process on CPU {} (in every row, \
         the direct and SQLite ones too)",
        others.join(",")
    );
}

/// The throwaway PostgreSQL cluster of `BENCH_POSTGRES=1`.
#[path = "../tests/support/postgres.rs"]
#[allow(dead_code)]
mod pg_cluster;

/// One proxy: its runtime, state and server task.
struct Replica {
    rt: Runtime,
    state: Arc<AppState>,
    addr: std::net::SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl Replica {
    fn start(o: &Opts, config: Config) -> Replica {
        // The runtime `compactor serve` runs on (its threads are named
        // "compactor"), with the bench's number of workers.
        let rt = server::runtime_builder()
            .worker_threads(o.proxy_threads)
            // Idle blocking threads must not exit (and take their CPU
            // counters with them) while a scenario runs.
            .thread_keep_alive(Duration::from_secs(600))
            .build()
            .expect("proxy runtime");
        let (state, listener) = rt.block_on(async {
            let state = AppState::open(config).expect("open proxy state");
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            (state, listener)
        });
        // Blocks until the tokenizer (loaded in the background) is ready, so
        // its loading does not land in the measurements.
        state.tokens.count_text("warm up");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        let server = rt.spawn(server::run(listener, state.clone(), async move {
            let _ = rx.await;
        }));
        Replica {
            rt,
            state,
            addr,
            shutdown: Some(tx),
            server: Some(server),
        }
    }

    fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = self
                .rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(5), server).await });
        }
        let Replica { rt, state, .. } = self;
        drop(state);
        rt.shutdown_timeout(Duration::from_secs(2));
    }
}

struct Rig {
    load_rt: Runtime,
    fake: FakeUpstream,
    /// The proxies: one, or with `BENCH_REPLICAS` several on one
    /// PostgreSQL database.
    replicas: Vec<Replica>,
    db: PathBuf,
    /// The PostgreSQL database, when the store is there.
    pg_url: Option<String>,
    _dir: tempfile::TempDir,
}

impl Rig {
    fn start(o: &Opts, size: usize, pg_url: Option<String>, replicas: usize) -> Rig {
        let load_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(o.load_threads)
            .thread_name("bench-load")
            .enable_all()
            .build()
            .expect("load runtime");
        let fake = load_rt
            .block_on(FakeUpstream::start())
            .expect("fake upstream");
        // The fake would keep every body it receives; peak memory should be
        // the proxy's.
        fake.forget_requests();
        fake.take_websockets(o.upstream_ws);
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("bench.db");
        let mut config = Config::default();
        config.upstream.base_url = fake.url();
        config.store.path = db.display().to_string();
        config.store.url = pg_url.clone().unwrap_or_default();
        if let Ok(sync) = std::env::var("BENCH_PG_SYNC") {
            config.store.synchronous_commit = sync;
        }
        config.store.local_journal = env_flag("BENCH_PG_JOURNAL");
        if let Some(ms) = std::env::var("BENCH_PG_COMMIT_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            config.store.commit_delay_ms = ms;
        }
        config.server.shutdown_grace_secs = 1;
        // A window of about 1.2 times the body's tokens (the fake counts a
        // token per 4 bytes): over the trigger, under the hard limit.
        config.models.insert(
            0,
            compactor::config::ModelConfig {
                pattern: COMPACTED_MODEL.into(),
                context_window: size as u64 * 3 / 10,
                max_output_tokens: Some(500),
                ..Default::default()
            },
        );
        // Gemini 2.5's window, as the chat rows' model has a 1M one: no
        // size here comes near a compaction threshold.
        config.models.insert(
            0,
            compactor::config::ModelConfig {
                pattern: "gemini-2.5-*".into(),
                context_window: 1_048_576,
                max_output_tokens: Some(65_536),
                ..Default::default()
            },
        );
        // Several replicas share a store only on PostgreSQL.
        let n = if pg_url.is_some() { replicas.max(1) } else { 1 };
        // Each with a path of its own (a PostgreSQL store's local journal
        // is beside it).
        let replicas = (0..n)
            .map(|i| {
                let mut config = config.clone();
                if i > 0 {
                    config.store.path = dir
                        .path()
                        .join(format!("bench-{i}.db"))
                        .display()
                        .to_string();
                }
                Replica::start(o, config)
            })
            .collect();
        Rig {
            load_rt,
            fake,
            replicas,
            db,
            pg_url,
            _dir: dir,
        }
    }

    /// The direct URL, and one per replica.
    fn urls(&self, variant: Variant, stream: bool) -> (String, Vec<String>) {
        let path = match variant {
            Variant::Hop => "embeddings",
            Variant::Codex | Variant::CodexWs => "responses",
            Variant::Messages => "messages",
            Variant::Gemini if stream => "models/gemini-2.5-flash:streamGenerateContent?alt=sse",
            Variant::Gemini => "models/gemini-2.5-flash:generateContent",
            _ => "chat/completions",
        };
        // Gemini CLI's version prefix; the proxy sends it below the base.
        let version = if variant == Variant::Gemini {
            "v1beta"
        } else {
            "v1"
        };
        (
            format!("{}/{path}", self.fake.url()),
            self.replicas
                .iter()
                .map(|r| format!("http://{}/{version}/{path}", r.addr))
                .collect(),
        )
    }

    fn exchanges_recorded(&self) -> i64 {
        if let Some(url) = &self.pg_url {
            return self.load_rt.block_on(async {
                let Ok((client, conn)) = tokio_postgres::connect(url, tokio_postgres::NoTls).await
                else {
                    return -1;
                };
                tokio::spawn(conn);
                client
                    .query_one("SELECT count(*) FROM exchanges", &[])
                    .await
                    .map_or(-1, |r| r.get(0))
            });
        }
        rusqlite::Connection::open_with_flags(&self.db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .and_then(|c| c.query_row("SELECT count(*) FROM exchanges", [], |r| r.get(0)))
            .unwrap_or(-1)
    }

    fn stop(self) {
        let Rig {
            load_rt, replicas, ..
        } = self;
        for r in replicas {
            r.stop();
        }
        load_rt.shutdown_timeout(Duration::from_secs(2));
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(256)
        .pool_idle_timeout(Duration::from_secs(90))
        .build()
        .expect("client")
}

// ---------------------------------------------------------------- scenarios

#[derive(Clone, Copy)]
struct Scenario {
    size: usize,
    variant: Variant,
    stream: bool,
    conc: usize,
    /// The store on PostgreSQL rather than SQLite.
    pg: bool,
    /// Proxies sharing the store (PostgreSQL), the client's requests
    /// going to each in turn.
    replicas: usize,
    /// The replicas behind a balancer with session affinity: a session's
    /// requests all go to one of them.
    sticky: bool,
}

impl Scenario {
    fn name(&self) -> String {
        format!(
            "{}KB {} {} c={}",
            self.size / 1000,
            match self.variant {
                Variant::Last => "last",
                Variant::Grow => "grow",
                Variant::Hop => "hop ",
                Variant::Codex | Variant::CodexWs => "codx",
                Variant::Same => "same",
                Variant::Messages => "msgs",
                Variant::Gemini => "gmni",
                Variant::Compacted => "cmpt",
            },
            match (self.variant, self.stream) {
                (Variant::CodexWs, _) => "ws  ",
                (_, true) => "sse ",
                (_, false) => "json",
            },
            self.conc
        ) + &match (self.pg, self.replicas) {
            (false, _) => String::new(),
            (true, 1) => " pg".into(),
            (true, n) if self.sticky => format!(" pg{n}s"),
            (true, n) => format!(" pg{n}"),
        }
    }

    /// The sessions measured in turn with the row's own at c=1, as the
    /// third and fourth sides: `CodexWs`'s over HTTP + SSE, chat
    /// completions beside `Gemini`'s.
    fn beside(&self) -> Option<Variant> {
        match self.variant {
            _ if self.conc != 1 => None,
            Variant::CodexWs => Some(Variant::CodexWs),
            Variant::Gemini => Some(Variant::Grow),
            _ => None,
        }
    }
}

struct SideStats {
    p50: f64,
    p99: f64,
    ttfb50: f64,
    rps: f64,
    n: usize,
    errors: usize,
    first_error: Option<String>,
    mean_kb: f64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    ms(sorted[idx])
}

fn stats(c: Collected) -> SideStats {
    let n = c.samples.len();
    let mut total: Vec<Duration> = c.samples.iter().map(|s| s.total).collect();
    let mut ttfb: Vec<Duration> = c.samples.iter().map(|s| s.ttfb).collect();
    total.sort_unstable();
    ttfb.sort_unstable();
    let bytes: usize = c.samples.iter().map(|s| s.bytes).sum();
    SideStats {
        p50: pct(&total, 0.50),
        p99: pct(&total, 0.99),
        ttfb50: pct(&ttfb, 0.50),
        rps: if c.wall.is_zero() {
            f64::NAN
        } else {
            n as f64 / c.wall.as_secs_f64()
        },
        n,
        errors: c.errors,
        first_error: c.first_error,
        mean_kb: if n == 0 {
            0.0
        } else {
            bytes as f64 / n as f64 / 1000.0
        },
    }
}

/// The other transport or API of a row, measured in turn with it.
struct Beside {
    direct: SideStats,
    proxy: SideStats,
}

impl Beside {
    /// Its added p50, ms.
    fn added(&self) -> f64 {
        self.proxy.p50 - self.direct.p50
    }
}

struct Row {
    sc: Scenario,
    name: String,
    side: [SideStats; 2],
    /// The row's other transport or API, measured in turn with its two
    /// sides (c=1): for `CodexWs` the proxy over HTTP + SSE, for `Gemini`
    /// chat completions (`Grow`'s sessions, same streaming); each against
    /// a direct side of its own sessions.
    beside: Option<Beside>,
    recorded: i64,
    /// Mean time of the store's commits, ms, and how many there were
    /// (those after the warm-up).
    commit: (f64, f64),
    /// Seconds waited after warm-up for the proxy's background work.
    settle: f64,
    /// CPU of all the proxy's threads per proxied request, ms.
    proxy_cpu_ms: f64,
    /// The same by thread name.
    proxy_cpu_by_thread: Vec<(String, f64)>,
    /// CPU of the load runtime (clients at c=32, the fake upstream) per request, ms.
    load_cpu_ms: f64,
    /// Share of the machine's CPU busy during the direct and the proxied
    /// rounds (c=32).
    machine_busy: [f64; 2],
    /// CPU ms per request of the load runtime during the direct / the
    /// proxied rounds (c=32 only).
    load_cpu_by_side: [f64; 2],
    /// CPU ms of the PostgreSQL cluster's processes per proxied request.
    db_cpu_ms: f64,
    /// Round trips of the request path's reads per proxied request.
    db_reads: f64,
    secs: f64,
}

impl Row {
    /// Each side measured, named.
    fn sides(&self) -> impl Iterator<Item = (&'static str, &SideStats)> {
        let [d, p] = &self.side;
        [("direct", Some(d)), ("proxy", Some(p))]
            .into_iter()
            .chain([
                ("proxy beside", self.beside.as_ref().map(|b| &b.proxy)),
                ("direct beside", self.beside.as_ref().map(|b| &b.direct)),
            ])
            .filter_map(|(name, s)| Some((name, s?)))
    }
}

fn run_scenario(o: &Opts, sc: Scenario, pg: Option<&pg_cluster::PgCluster>) -> Row {
    let started = Instant::now();
    let pg = pg.filter(|_| sc.pg);
    let pg_url = pg.map(|c| c.database());
    let rig = Rig::start(o, sc.size, pg_url.clone(), sc.replicas);
    // The proxies migrated the schema: the database gets the history and
    // the statistics of one that has served a while.
    if let (Some(c), Some(url)) = (pg, pg_url.as_deref()) {
        if o.pg_fill > 0 {
            c.fill(url, o.pg_fill).expect("fill the database");
        }
    }
    // What the database spends its time in, when asked for.
    let profiled = pg.zip(pg_url.as_deref()).filter(|_| o.pg_statements);
    let reset_statements = || {
        if let Some((c, url)) = profiled {
            if let Err(e) = c.reset_statements(url) {
                eprintln!("  pg_stat_statements: {e}");
            }
        }
    };
    let (direct_url, proxy_urls) = rig.urls(sc.variant, sc.stream);
    let urls = [vec![direct_url], proxy_urls];
    // Both sides get byte-identical sessions (same seeds).
    let sessions = |n: usize| -> Vec<Session> {
        (0..n)
            .map(|i| Session {
                sticky: sc.sticky,
                ..Session::new(sc.variant, sc.stream, sc.size, 1 + i as u64)
            })
            .collect()
    };
    // The store imports journaled exchanges in batches up to half a second
    // later: before the measured rounds and after them, what is journaled
    // is imported at once (that of the warm-up is not measured; that of
    // the last rounds is), and the count of exchanges is complete.
    let stores: Vec<Arc<AppState>> = rig.replicas.iter().map(|r| r.state.clone()).collect();
    let flush = || async {
        for state in &stores {
            let _ = state.store.flush().await;
        }
    };
    let pg_reads = || -> u64 {
        stores
            .iter()
            .filter_map(|s| s.postgres.as_ref().map(|pg| pg.reads()))
            .sum()
    };
    let db_cpu = || pg.map_or(0.0, |c| c.cpu_secs());
    // The commits' total seconds and count so far, over the replicas.
    let commits = || -> (f64, f64) {
        stores.iter().fold((0.0, 0.0), |(sum, n), s| {
            (
                sum + metric_value(&s.metrics, "compactor_store_commit_seconds_sum"),
                n + metric_value(&s.metrics, "compactor_store_commit_seconds_count"),
            )
        })
    };
    let (collected, settle, cpu, machine_busy, load_ns, db, commit) = rig.load_rt.block_on(async {
        let client = client();
        // Direct, proxied, and for `CodexWs` proxied over HTTP + SSE and
        // direct with the same session's bodies.
        let mut out: [Collected; 4] = Default::default();
        let mut settle = Duration::ZERO;
        let mut cpu0 = ThreadCpu::default();
        // The database's CPU seconds and the request path's reads of it;
        // the commits.
        let mut db0 = (0.0, 0);
        let mut commits0 = (0.0, 0.0);
        // (busy, total) ticks of the machine during each side's rounds.
        let mut machine = [(0u64, 0u64); 2];
        // CPU ns of the load runtime during each side's rounds.
        let mut load_ns = [0u64; 2];
        if sc.conc == 1 {
            // `CodexWs` and `Gemini`: a third side, the proxy over HTTP +
            // SSE (for `Gemini`, on chat completions) in turn with the
            // other two, its session another (the proxy would find the
            // WebSocket's bytes in its caches), and a fourth, direct with
            // the third's bodies, which is what the third is against: the
            // fake serves two sessions' bodies in times some tens of µs
            // apart, so each transport's added latency is against a
            // direct side with its own bodies, and two rows measured one
            // after the other drift apart by more than the margin looked
            // for. With the upstream taking the WebSocket, the direct side
            // of the WebSocket's session goes over one too.
            let mut s = vec![sessions(1).pop().unwrap(), sessions(1).pop().unwrap()];
            let mut urls = urls.to_vec();
            let ws = sc.variant == Variant::CodexWs;
            if let Some(variant) = sc.beside() {
                let (direct, proxied) = rig.urls(variant, sc.stream);
                for url in [proxied, vec![direct]] {
                    s.push(Session::new(variant, sc.stream, sc.size, 2));
                    urls.push(url);
                }
            }
            let sides = s.len();
            // `CodexWs`: the direct and the proxied session's WebSockets.
            let mut sockets = [None, None];
            for i in 0..o.c1_warm + o.c1_n {
                if i == o.c1_warm {
                    flush().await;
                    settle = quiesce().await;
                    cpu0 = thread_cpu();
                    db0 = (db_cpu(), pg_reads());
                    commits0 = commits();
                    reset_statements();
                }
                for k in 0..sides {
                    // Each side first, second, … in turn.
                    let side = if sides == 2 && i % 2 == 1 {
                        1 - k
                    } else {
                        (i + k) % sides
                    };
                    let url = s[side].url(&urls[side]).to_string();
                    let (body, user) = s[side].next();
                    let sent = if ws && (side == 1 || (side == 0 && o.upstream_ws)) {
                        send_ws(&mut sockets[side], &url, body).await
                    } else {
                        send(&client, &url, body, sc.stream, s[side].shape).await
                    };
                    match sent {
                        Ok(sample) => {
                            s[side].done(&user);
                            if i >= o.c1_warm {
                                out[side].samples.push(sample);
                                out[side].wall += sample.total;
                            }
                        }
                        Err(e) => out[side].error(e),
                    }
                }
            }
        } else {
            let mut s = [sessions(sc.conc), sessions(sc.conc)];
            // Warm-up: opens the connections (client → proxy → upstream).
            for side in 0..2 {
                let taken = std::mem::take(&mut s[side]);
                let (back, c) = burst(
                    &client,
                    &urls[side],
                    taken,
                    sc.conc * o.cn_warm_per_worker,
                    sc.stream,
                )
                .await;
                s[side] = back;
                if c.errors > 0 {
                    out[side].errors += c.errors;
                    out[side].first_error = c.first_error;
                }
            }
            flush().await;
            settle = quiesce().await;
            cpu0 = thread_cpu();
            db0 = (db_cpu(), pg_reads());
            commits0 = commits();
            reset_statements();
            let per_round = o.cn_n / o.cn_rounds;
            for round in 0..o.cn_rounds {
                let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
                for side in order {
                    let taken = std::mem::take(&mut s[side]);
                    let before = machine_ticks();
                    let load_before = load_runtime_ns();
                    let (back, mut c) =
                        burst(&client, &urls[side], taken, per_round, sc.stream).await;
                    if side == 1 {
                        // What the proxy's requests left to do (the store's
                        // import or commit, the accounting thread's jobs)
                        // is done within its round, not in the direct
                        // round after it.
                        let t = Instant::now();
                        flush().await;
                        compactor::background::Background::global()
                            .drained(Duration::from_secs(10))
                            .await;
                        c.wall += t.elapsed();
                    }
                    load_ns[side] += load_runtime_ns().saturating_sub(load_before);
                    let after = machine_ticks();
                    machine[side].0 += after.0.saturating_sub(before.0);
                    machine[side].1 += after.1.saturating_sub(before.1);
                    s[side] = back;
                    out[side].wall += c.wall;
                    out[side].absorb(c);
                }
            }
        }
        // The proxy's background work for the last requests counts too.
        flush().await;
        quiesce().await;
        let busy = machine.map(|(busy, total)| busy as f64 / total.max(1) as f64);
        let db = (db_cpu() - db0.0, pg_reads() - db0.1);
        let (sum, n) = commits();
        let (sum, n) = (sum - commits0.0, n - commits0.1);
        let commit = (sum * 1000.0 / n.max(1.0), n);
        (
            out,
            settle,
            thread_cpu().minus(&cpu0),
            busy,
            load_ns,
            db,
            commit,
        )
    });
    let recorded = rig.exchanges_recorded();
    if let Some((c, url)) = profiled {
        match c.statements(url, 8) {
            Ok(top) => eprintln!("  {}: statements by time\n{top}", sc.name()),
            Err(e) => eprintln!("  pg_stat_statements: {e}"),
        }
    }
    if sc.variant == Variant::Compacted {
        // What the row stands on: a compaction stored per session, and
        // the requests sent compacted.
        let text = rig.replicas[0].state.metrics.render(&Default::default());
        let shown: Vec<&str> = text
            .lines()
            .filter(|l| {
                (l.starts_with("compactor_compaction") || l.starts_with("compactor_summary_calls"))
                    && !l.ends_with(" 0")
            })
            .collect();
        eprintln!("  {}: {}", sc.name(), shown.join("; "));
    }
    rig.stop();
    let [d, p, proxy_beside, direct_beside] = collected;
    let beside = sc.beside().map(|_| Beside {
        direct: stats(direct_beside),
        proxy: stats(proxy_beside),
    });
    if sc.variant == Variant::Compacted {
        eprintln!(
            "  {}: {} of {} measured requests sent compacted",
            sc.name(),
            p.samples.iter().filter(|s| s.compacted).count(),
            p.samples.len()
        );
    }
    let (dn, pn) = (
        d.samples.len() + d.errors + beside.as_ref().map_or(0, |b| b.direct.n + b.direct.errors),
        p.samples.len() + p.errors + beside.as_ref().map_or(0, |b| b.proxy.n + b.proxy.errors),
    );
    let proxy_cpu_ms = cpu.proxy * 1000.0 / pn.max(1) as f64;
    let proxy_cpu_by_thread = cpu
        .proxy_by_name
        .iter()
        .map(|(name, secs)| (name.clone(), secs * 1000.0 / pn.max(1) as f64))
        .collect();
    // At c=1 the client runs on the main thread, so this is the fake alone.
    let load_cpu_ms = cpu.load * 1000.0 / (dn + pn).max(1) as f64;
    let load_cpu_by_side = [
        load_ns[0] as f64 / 1e6 / dn.max(1) as f64,
        load_ns[1] as f64 / 1e6 / pn.max(1) as f64,
    ];
    Row {
        sc,
        name: sc.name(),
        side: [stats(d), stats(p)],
        beside,
        recorded,
        commit,
        settle: settle.as_secs_f64(),
        proxy_cpu_ms,
        proxy_cpu_by_thread,
        load_cpu_ms,
        machine_busy,
        load_cpu_by_side,
        db_cpu_ms: db.0 * 1000.0 / pn.max(1) as f64,
        db_reads: db.1 as f64 / pn.max(1) as f64,
        secs: started.elapsed().as_secs_f64(),
    }
}

/// The value of metric `name` (its first sample, no labels), or 0.
fn metric_value(m: &compactor::metrics::Metrics, name: &str) -> f64 {
    m.render(&Default::default())
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// CPU seconds used so far by the proxy's threads (runtime workers, blocking
/// pool, store writer: names starting with "compactor") and by the load
/// runtime ("bench-load").
#[derive(Default)]
struct ThreadCpu {
    proxy: f64,
    load: f64,
    /// The proxy's CPU by thread name (runtime worker "compactor", store
    /// writer, accounting, checkpointer…).
    proxy_by_name: std::collections::BTreeMap<String, f64>,
}

impl ThreadCpu {
    fn minus(&self, before: &ThreadCpu) -> ThreadCpu {
        ThreadCpu {
            proxy: self.proxy - before.proxy,
            load: self.load - before.load,
            proxy_by_name: self
                .proxy_by_name
                .iter()
                .map(|(name, secs)| {
                    let was = before.proxy_by_name.get(name).copied().unwrap_or(0.0);
                    (name.clone(), secs - was)
                })
                .collect(),
        }
    }
}

fn thread_cpu() -> ThreadCpu {
    let mut t = ThreadCpu::default();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return t;
    };
    for entry in dir.flatten() {
        let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue;
        };
        let comm = comm.trim_end();
        // Run time in ns (schedstat), not the 10 ms ticks of /proc stat:
        // those are sampled, and a thread that runs a few ms in a row of
        // 2,000 requests has a tick or two, or none.
        let secs = pg_cluster::run_ns(&entry.path()) as f64 / 1e9;
        if comm.starts_with("compactor") {
            t.proxy += secs;
            *t.proxy_by_name.entry(comm.to_string()).or_default() += secs;
        } else if comm.starts_with("bench-load") {
            t.load += secs;
        }
    }
    t
}

/// CPU time of the load runtime's threads ("bench-load"), in ns (from
/// schedstat: finer than the 10 ms ticks of /proc stat, for single rounds).
fn load_runtime_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .is_ok_and(|c| c.starts_with("bench-load"))
        })
        .map(|e| pg_cluster::run_ns(&e.path()))
        .sum()
}

/// (busy, total) clock ticks of the whole machine, from /proc/stat.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = f.iter().take(8).sum();
    let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// CPU time of the whole process so far, in clock ticks (utime + stime).
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the line, so the 12th and 13th after it.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    get(11) + get(12)
}

/// Waits until the process is nearly idle (< ~10% of a core over 100 ms),
/// at most 30 s: the proxy tokenizes new content in the background after
/// answering (the warm-up's first requests bring whole histories), and that
/// must not land in whichever side is measured first.
async fn quiesce() -> Duration {
    let t0 = Instant::now();
    let mut last = cpu_ticks();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = cpu_ticks();
        if now.saturating_sub(last) <= 1 || t0.elapsed() > Duration::from_secs(30) {
            return t0.elapsed();
        }
        last = now;
    }
}

/// Single-thread timings of the CPU work the proxy does per request, on one
/// body of each size, to tell what its added latency is made of.
/// What the SSE tee costs per chunk of a streamed chat answer (one token's
/// chunk, as OpenAI sends them), with and without hiding the usage the
/// proxy asked for: a long answer is hundreds of such chunks.
fn tee_per_chunk(reps: usize) {
    use compactor::wire::sse::SseTee;
    use compactor::wire::Api;
    let chunks: Vec<bytes::Bytes> = (0..500)
        .map(|i| {
            bytes::Bytes::from(format!(
                "data: {{\"id\":\"chatcmpl-AbCdEf0123456789\",\"object\":\"chat.completion.chunk\",\
                 \"created\":1732000000,\"model\":\"gpt-4.1-mini-2025-04-14\",\"system_fingerprint\":\"fp_0123456789\",\
                 \"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" word{i}\"}},\"logprobs\":null,\
                 \"finish_reason\":null}}],\"usage\":null}}\n\n"
            ))
        })
        .collect();
    let per_chunk = |strip: bool| {
        let mut t: Vec<f64> = (0..reps)
            .map(|_| {
                let mut tee = SseTee::new(Api::Chat, strip);
                let t0 = Instant::now();
                for c in &chunks {
                    std::hint::black_box(tee.push(c.clone()));
                }
                std::hint::black_box(tee.finish());
                t0.elapsed().as_secs_f64() * 1e6 / chunks.len() as f64
            })
            .collect();
        t.sort_by(|a, b| a.total_cmp(b));
        t[t.len() / 2]
    };
    println!(
        "SSE tee, per chunk of a streamed chat answer (median µs, {} chunks of ~300 bytes): {:.2}; \
         hiding the usage the proxy asked for: {:.2}",
        chunks.len(),
        per_chunk(false),
        per_chunk(true)
    );
}

fn breakdown(o: &Opts) {
    use compactor::tokens::TokenCounter;
    use compactor::wire::items::{split_body, ItemCaches, ItemList, Tools};
    use compactor::wire::{chain_hashes, item_hash, Api};
    use serde_json::Value;

    fn median_us(reps: usize, f: &mut dyn FnMut()) -> f64 {
        let mut t: Vec<f64> = (0..reps)
            .map(|_| {
                let t0 = Instant::now();
                f();
                t0.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        t.sort_by(|a, b| a.total_cmp(b));
        t[t.len() / 2]
    }
    let reps = if o.quick { 3 } else { 21 };
    // Loads the (process-wide) tokenizer outside the timings.
    TokenCounter::default().count_text("warm up");
    println!();
    println!("proxy request-path steps, one thread, median µs (SSE body of the `last` variant):");
    println!(
        "{:>7} {:>6} | {:>7} {:>7} {:>7} {:>7} {:>7} {:>6} | {:>7} {:>6} {:>6} {:>9} {:>9} {:>10}",
        "body KB",
        "items",
        "split",
        "resume",
        "reuse",
        "hash",
        "chain",
        "splice",
        "parse",
        "canon",
        "c text",
        "store new",
        "tok warm",
        "tok cold"
    );
    for size in [30_000, 300_000] {
        let head = body_head(true);
        let tail = b"]}";
        let mut conv = Conv::new(1 << 16, size, head.len() + tail.len(), Shape::Chat);
        let (body, _) = conv.body(&head, tail);
        let body = bytes::Bytes::from(body);
        let caches = std::sync::Arc::new(ItemCaches::default());
        let split = |b: &bytes::Bytes| {
            let s = split_body(b, "messages").expect("body splits");
            let mut v = s.body;
            let items = Api::Chat
                .item_list(&mut v, b.clone(), s.spans)
                .with_caches(caches.clone());
            let tools = s
                .tools
                .map(|(span, key)| Tools::raw(b.clone(), span, key, &caches));
            (v, items, tools)
        };
        let (_, items, tools) = split(&body);
        let hashes = items.hashes();
        let split_us = median_us(reps, &mut || {
            std::hint::black_box(split(&body));
        });
        // Items seen before: a hash of their bytes finds their canonical hash.
        let hash = median_us(reps, &mut || {
            std::hint::black_box(items.hashes());
        });
        // The conversation's next request: its history is found byte for
        // byte in the previous one.
        items.hashes_and_chains("bench");
        let reuse = median_us(reps, &mut || {
            std::hint::black_box(items.hashes_and_chains("bench"));
        });
        // The split of the conversation's next request (a new last
        // message): only what follows the repeated history is parsed.
        let scope = format!("bench-resume-{size}");
        let seen = caches
            .split_body_reusing(&body, "messages", &scope)
            .expect("body splits");
        ItemList::raw(Vec::new(), body.clone(), seen.spans.expect("items"))
            .with_shell(seen.shell)
            .with_caches(caches.clone())
            .hashes_and_chains(&scope);
        let next = bytes::Bytes::from(conv.body(&head, tail).0);
        let resume = median_us(reps, &mut || {
            let s = caches
                .split_body_reusing(&next, "messages", &scope)
                .expect("body splits");
            assert!(s.reuse.is_some(), "the next request repeats the history");
            std::hint::black_box(s);
        });
        let chain = median_us(reps, &mut || {
            std::hint::black_box(chain_hashes(&hashes));
        });
        let splice = median_us(reps, &mut || {
            std::hint::black_box(compactor::wire::chat::splice_stream_usage(&body));
        });
        // What new items cost: parsing them, hashing their canonical form.
        let values = items.values();
        let parse = median_us(reps, &mut || {
            let all: Value = serde_json::from_slice(&body).unwrap();
            std::hint::black_box(&all);
        });
        let canon = median_us(reps, &mut || {
            std::hint::black_box(values.iter().map(item_hash).collect::<Vec<_>>());
        });
        let texts: Vec<String> = (0..items.len()).map(|i| items.json(i)).collect();
        let canon_text = median_us(reps, &mut || {
            std::hint::black_box(
                texts
                    .iter()
                    .map(|t| compactor::wire::hash::raw_item_hash(t.as_bytes()))
                    .collect::<Vec<_>>(),
            );
        });
        // What a request with all-new items stores (each item as JSON text).
        let store_new = median_us(reps, &mut || {
            let texts: Vec<String> = (0..items.len()).map(|i| items.json(i)).collect();
            std::hint::black_box(texts);
        });
        let warm = TokenCounter::default();
        warm.estimate(Api::Chat, &items, &hashes, tools.as_ref());
        let tok_warm = median_us(reps, &mut || {
            std::hint::black_box(warm.estimate(Api::Chat, &items, &hashes, tools.as_ref()));
        });
        let tok_cold = median_us(reps.min(5), &mut || {
            std::hint::black_box(TokenCounter::default().estimate(
                Api::Chat,
                &items,
                &hashes,
                tools.as_ref(),
            ));
        });
        println!(
            "{:>7.1} {:>6} | {:>7.0} {:>7.0} {:>7.0} {:>7.0} {:>7.0} {:>6.0} | {:>7.0} {:>6.0} {:>6.0} {:>9.0} {:>9.0} {:>10.0}",
            body.len() as f64 / 1000.0,
            items.len(),
            split_us,
            resume,
            reuse,
            hash,
            chain,
            splice,
            parse,
            canon,
            canon_text,
            store_new,
            tok_warm,
            tok_cold
        );
    }
    println!(
        "(every request: split = parse with the messages left as byte ranges (a new conversation), \
         resume = the same for a conversation's next request (only what follows the history it \
         repeats byte for byte is parsed), reuse = item and chain hashes of such a request, hash = item hashes through the bytes cache alone, chain; SSE requests without include_usage: splice of \
         stream_options into their bytes; for comparison and for new items: parse = the whole \
         body into a Value tree, canon = canonical hashes of all items, c text = the same from \
         their bytes (how new items are hashed); store new: items not \
         stored before, as JSON text; tok: token estimate after the answer, on an accounting \
         thread — cold = all items new)"
    );
    compacted_steps(reps, &median_us);
    sent_steps(reps, &median_us);
    tee_per_chunk(reps);
}

/// What every recorded Chat Completions or Messages exchange keeps for a
/// summary call that may repeat it (`engine::Sent`, made when the record
/// decides on the next compaction): its body as sent put together at once
/// (the client's tools parsed and listed with the proxy's), or only when a
/// compaction reads it. The client's bytes are split afresh each time, as
/// each request's are, so the tools are parsed again as each request's
/// would be.
fn sent_steps(reps: usize, median_us: &dyn Fn(usize, &mut dyn FnMut()) -> f64) {
    use compactor::engine::Sent;
    use compactor::wire::items::{split_body, ItemCaches, Tools};
    use compactor::wire::Api;
    println!("what a recorded exchange keeps for a summary call, one thread, median µs:");
    for size in [30_000, 300_000] {
        let head = body_head(false);
        let tail = b"]}";
        let mut conv = Conv::new(1 << 16, size, head.len() + tail.len(), Shape::Chat);
        let body = bytes::Bytes::from(conv.body(&head, tail).0);
        let caches = ItemCaches::default();
        let split = split_body(&body, "messages").expect("body splits");
        let (span, key) = split.tools.clone().expect("the bench's bodies have tools");
        let sent = || {
            let tools = Tools::raw(body.clone(), span.clone(), key, &caches);
            Sent::new(
                Api::Chat,
                split.body.clone(),
                Some(tools),
                (false, false),
                http::HeaderMap::new(),
            )
        };
        let eager = median_us(reps, &mut || {
            let sent = sent();
            std::hint::black_box(sent.body());
        });
        let lazy = median_us(reps, &mut || {
            std::hint::black_box(sent());
        });
        println!(
            "  {:>5.1} KB body, {:.1} KB of tools: made at once {eager:.1}, made when read {lazy:.1}",
            body.len() as f64 / 1000.0,
            span.len() as f64 / 1000.0,
        );
    }
}

/// What a request a stored compaction applies to costs beyond the
/// others: its body upstream (rebuilt from its parts, or the client's bytes
/// with the compaction's JSON in place of what it covers) and the hashes of
/// what was sent (recomputed, or the compaction's made once and the
/// request's own past it).
fn compacted_steps(reps: usize, median_us: &dyn Fn(usize, &mut dyn FnMut()) -> f64) {
    use compactor::compaction::replacement::Made;
    use compactor::upstream::Payload;
    use compactor::wire::items::{split_body, ItemCaches, Tools};
    use compactor::wire::Api;

    println!();
    println!(
        "a compacted request (a stored compaction of the first 80% of its items: their first, a \
         summary, their last two), one thread, median µs:"
    );
    println!(
        "{:>7} {:>6} | {:>9} {:>9} | {:>11} {:>11}",
        "body KB", "items", "rebuild", "splice", "hash again", "hash kept"
    );
    for size in [30_000, 300_000] {
        let head = body_head(true);
        let tail = b"]}";
        let mut conv = Conv::new(2 << 16, size, head.len() + tail.len(), Shape::Chat);
        let body = bytes::Bytes::from(conv.body(&head, tail).0);
        let caches = ItemCaches::default();
        let s = split_body(&body, "messages").expect("body splits");
        let mut params = s.body;
        let items = Api::Chat.item_list(&mut params, body.clone(), s.spans);
        let tools = s
            .tools
            .map(|(span, key)| Tools::raw(body.clone(), span, key, &caches));
        let hashes = items.hashes();
        let covered = items.len() * 4 / 5;
        let mut replacement = vec![items.item(0).into_owned()];
        replacement
            .push(serde_json::json!({"role": "user", "content": prose(&mut Rng::new(5), 1500)}));
        replacement.extend((covered - 2..covered).map(|i| items.item(i).into_owned()));
        let view = items.with_prefix_replaced(covered, &replacement);
        let (head_bytes, rest) =
            compactor::wire::chat::splice_stream_usage(&body).expect("an object");
        let original = Payload::joined(head_bytes, rest);
        let made = Made::default();
        let rebuild = median_us(reps, &mut || {
            std::hint::black_box(
                Api::Chat
                    .rebuild_body(&params, &view.values(), tools.as_ref())
                    .expect("serialises"),
            );
        });
        let (cut, follow) = items.covered_span(covered).expect("the client's items");
        let splice = median_us(reps, &mut || {
            std::hint::black_box(original.with_cut_replaced(
                items.body_bytes(),
                cut.clone(),
                made.array_json(Api::Chat, &replacement, follow),
            ));
        });
        let again = median_us(reps, &mut || {
            let view = items.with_prefix_replaced(covered, &replacement);
            std::hint::black_box(view.hashes());
        });
        let kept = median_us(reps, &mut || {
            let mut all = made.hashes(&replacement).to_vec();
            all.extend_from_slice(&hashes[covered..]);
            std::hint::black_box(all);
        });
        println!(
            "{:>7.1} {:>6} | {:>9.0} {:>9.1} | {:>11.0} {:>11.1}",
            body.len() as f64 / 1000.0,
            items.len(),
            rebuild,
            splice,
            again,
            kept
        );
    }
}

/// Each SQLite row against the bare hop of its size and concurrency, in the
/// same run: at c=1 the added p50 against twice the hop's + 0.05 ms, at c=32
/// the throughput ratio against 0.8 × the hop's; beside them the proxy's CPU
/// per request per KB of body, which means something on a shared machine
/// where the ratios move.
fn against_the_hop(rows: &[Row]) {
    let hop = |size: usize, conc: usize| {
        rows.iter().find(|r| {
            r.sc.variant == Variant::Hop && !r.sc.pg && r.sc.size == size && r.sc.conc == conc
        })
    };
    let measured: Vec<&Row> = rows
        .iter()
        .filter(|r| r.sc.variant != Variant::Hop && !r.sc.pg && hop(r.sc.size, r.sc.conc).is_some())
        .collect();
    if measured.is_empty() {
        return;
    }
    println!();
    println!(
        "Against the bare hop of the same size and concurrency (c=1: added p50 <= 2 x the hop's + 0.05 ms; \
         c=32: ratio >= 0.8 x the hop's; cpu = the proxy's CPU ms per request per KB of body, the hop's beside it):"
    );
    for r in measured {
        let h = hop(r.sc.size, r.sc.conc).expect("filtered on it");
        let kb = r.side[0].mean_kb.max(1.0);
        let cpu = format!(
            "cpu {:.4} (hop {:.4}) ms/req/KB",
            r.proxy_cpu_ms / kb,
            h.proxy_cpu_ms / h.side[0].mean_kb.max(1.0)
        );
        if r.sc.conc == 1 {
            let (added, hop_added) = (r.side[1].p50 - r.side[0].p50, h.side[1].p50 - h.side[0].p50);
            let bound = 2.0 * hop_added + 0.05;
            println!(
                "  {:<25} +p50 {added:+.3} ms, bound {bound:.3} (hop {hop_added:+.3})  {}  {cpu}",
                r.name,
                verdict(added <= bound)
            );
        } else {
            let (ratio, hop_ratio) = (r.side[1].rps / r.side[0].rps, h.side[1].rps / h.side[0].rps);
            println!(
                "  {:<25} ratio {ratio:.2}, bound {:.2} (hop {hop_ratio:.2})  {}  {cpu}",
                r.name,
                0.8 * hop_ratio,
                verdict(ratio >= 0.8 * hop_ratio)
            );
        }
    }
}

/// The PostgreSQL rows: what each proxied request cost the proxies and the
/// database, and, where a row ran with one replica and with several, the
/// model of what the replicas would serve with cores of their own.
fn on_postgres(rows: &[Row]) {
    let pg: Vec<&Row> = rows.iter().filter(|r| r.sc.pg).collect();
    if pg.is_empty() {
        return;
    }
    println!();
    println!(
        "PostgreSQL rows, per proxied request: CPU ms of the proxies' threads / of the database's \
         processes, the request path's round trips to the database, exchanges per commit and the \
         commit's mean ms:"
    );
    for r in &pg {
        println!(
            "  {:<25} rps {:>6.0}   cpu proxy {:.3} / db {:.3}   reads {:.2}   {:.1} per commit, {:.2} ms",
            r.name,
            r.side[1].rps,
            r.proxy_cpu_ms,
            r.db_cpu_ms,
            r.db_reads,
            r.side[1].n as f64 / r.commit.1.max(1.0),
            r.commit.0
        );
    }
    // Each row of several replicas (in turn, then sticky) beside its
    // one-replica row.
    let pairs: Vec<(&Row, &Row)> = pg
        .iter()
        .filter(|r| r.sc.replicas == 1 && r.sc.conc > 1)
        .flat_map(|one| {
            pg.iter()
                .filter(|r| {
                    r.sc.replicas > 1
                        && (r.sc.size, r.sc.variant, r.sc.stream, r.sc.conc)
                            == (one.sc.size, one.sc.variant, one.sc.stream, one.sc.conc)
                })
                .map(move |many| (*one, *many))
        })
        .collect();
    if pairs.is_empty() {
        return;
    }
    println!(
        "Replicas, a model (this machine's cores are shared, so it cannot be measured): each replica \
         on a core of its own serves 1000 / (its CPU ms per request) requests/s, the database \
         k × 1000 / (its CPU ms per request) on k cores; n replicas serve the least of n times a \
         replica's rate and the database's, against one replica on the same database (sessions \
         going to the replicas in turn, or with `sticky` each kept on one):"
    );
    for (one, many) in pairs {
        let n = many.sc.replicas as f64;
        let parts: Vec<String> = [1.0, 2.0]
            .iter()
            .map(|k| {
                let single = (1000.0 / one.proxy_cpu_ms).min(k * 1000.0 / one.db_cpu_ms);
                let proxies = n * 1000.0 / many.proxy_cpu_ms;
                let db = k * 1000.0 / many.db_cpu_ms;
                format!(
                    "database on {k} core(s): one {single:.0}/s, {n} replicas min({proxies:.0}, {db:.0}) = {:.2} × one",
                    proxies.min(db) / single
                )
            })
            .collect();
        println!(
            "  {:<20} {:<7} {}",
            one.name.trim_end_matches(" pg"),
            if many.sc.sticky { "sticky" } else { "in turn" },
            parts.join(";  ")
        );
    }
}

fn status_kb(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with(key))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "MISS"
    }
}

fn main() {
    let o = opts();
    let t0 = Instant::now();
    let (machine0, own0) = (machine_ticks(), cpu_ticks());
    let mut scenarios = Vec::new();
    for size in [30_000, 300_000] {
        for variant in [
            Variant::Last,
            Variant::Grow,
            Variant::Gemini,
            Variant::Codex,
            Variant::CodexWs,
            Variant::Messages,
            Variant::Same,
            Variant::Compacted,
            Variant::Hop,
        ] {
            for stream in [false, true] {
                for conc in [1, 32] {
                    // The hop: a reference, not streamed; Codex always streams.
                    if (variant == Variant::Hop && stream)
                        || (matches!(variant, Variant::Codex | Variant::CodexWs) && !stream)
                        || (matches!(variant, Variant::CodexWs | Variant::Gemini) && conc > 1)
                        || (variant == Variant::Same && conc == 1)
                    {
                        continue;
                    }
                    // SQLite; PostgreSQL; PostgreSQL with several replicas.
                    // Those replicas behind session affinity.
                    let mut stores = vec![(false, 1, false)];
                    if o.postgres {
                        stores.push((true, 1, false));
                    }
                    if o.postgres && o.replicas > 1 {
                        stores.push((true, o.replicas, false));
                        if o.sticky {
                            stores.push((true, o.replicas, true));
                        }
                    }
                    for (pg, replicas, sticky) in stores {
                        scenarios.push(Scenario {
                            size,
                            variant,
                            stream,
                            conc,
                            pg,
                            replicas,
                            sticky,
                        });
                    }
                }
            }
        }
    }
    if let Some(f) = &o.filter {
        // `a|b`: the scenarios whose names contain either.
        scenarios.retain(|s| f.split('|').any(|alt| s.name().contains(alt)));
    }
    println!(
        "compactor proxy bench{}: {} scenarios; c=1: {} warm-up + {} measured per side, alternating per request; \
         c=32: {} warm-up + {} measured per side in {} alternating rounds",
        if o.quick { " (BENCH_QUICK)" } else { "" },
        scenarios.len(),
        o.c1_warm,
        o.c1_n,
        32 * o.cn_warm_per_worker,
        o.cn_n / o.cn_rounds * o.cn_rounds,
        o.cn_rounds
    );
    println!(
        "runtimes: clients + fake upstream {} worker thread(s), proxy {} worker thread(s); {} CPUs. \
         last = history fixed, last user message varies; grow = each request extends the previous \
         (a conversation runs from {GROW_FROM}% to {GROW_TO}% of the size, then a new one starts); \
         codx = Codex-shaped Responses sessions to /v1/responses, streamed, growing as grow does; \
         codx ws = the same, the proxied side over the proxy's WebSocket (a socket per session, each \
         request a response.create), the direct side over HTTP + SSE, and in turn with them a third \
         side, another session through the proxy over HTTP + SSE, and a fourth, that session direct \
         over HTTP + SSE, which the third is against{}; \
         gmni = Gemini-CLI-shaped sessions to :generateContent (json) or \
         :streamGenerateContent?alt=sse (sse), growing as grow does, chat completions' sessions \
         (grow's) in turn beside them (c=1 only); \
         same = one body, byte for byte, from every client every time (one conversation); \
         hop = the `last` bodies to /v1/embeddings, which the proxy relays unparsed and unrecorded \
         (what the HTTP hop alone costs). SSE requests do not ask for usage, so the proxy \
         splices stream_options into the client's bytes.",
        o.load_threads,
        o.proxy_threads,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        if o.upstream_ws {
            " (BENCH_UPSTREAM_WS: the upstream takes the WebSocket, and the direct side goes to it over \
             one, a socket per session)"
        } else {
            ""
        }
    );
    let cluster = if o.postgres {
        let c = pg_cluster::PgCluster::start_profiled(true, o.pg_statements);
        if c.is_none() {
            scenarios.retain(|s| !s.pg);
        }
        c
    } else {
        None
    };
    if let (Some(cpu), Some(c)) = (o.pg_cpu, &cluster) {
        pin_apart(cpu, c);
    }
    let mut rows = Vec::new();
    for sc in scenarios {
        let row = run_scenario(&o, sc, cluster.as_ref());
        eprintln!(
            "  done {:<20} in {:5.1} s (settled {:.1} s after warm-up; direct p50 {:.3} ms, proxy p50 {:.3} ms)",
            row.name, row.secs, row.settle, row.side[0].p50, row.side[1].p50
        );
        rows.push(row);
    }

    println!();
    println!(
        "{:<25} {:>5} | {:>15} | {:>15} | {:>7} {:>7} | {:>6} {:>6} {:>5} | {:>13} {:>6} | {:>11} | {:>4} | {:>12}",
        "scenario",
        "KB",
        "direct p50/p99",
        "proxy p50/p99",
        "+p50",
        "+p99",
        "rps d",
        "rps p",
        "ratio",
        "ttfb50 d/p",
        "+ttfb",
        "cpu/req p/l",
        "rec",
        "commit ms/n"
    );
    println!("{}", "-".repeat(144));
    for r in &rows {
        let [d, p] = &r.side;
        let ttfb = if r.sc.stream {
            (
                format!("{:.2}/{:.2}", d.ttfb50, p.ttfb50),
                format!("{:+.3}", p.ttfb50 - d.ttfb50),
            )
        } else {
            ("-".into(), "-".into())
        };
        println!(
            "{:<25} {:>5.0} | {:>15} | {:>15} | {:>+7.3} {:>+7.2} | {:>6.0} {:>6.0} {:>5.2} | {:>13} {:>6} | {:>11} | {:>4} | {:>12}",
            r.name,
            d.mean_kb,
            format!("{:.3}/{:.2}", d.p50, d.p99),
            format!("{:.3}/{:.2}", p.p50, p.p99),
            p.p50 - d.p50,
            p.p99 - d.p99,
            d.rps,
            p.rps,
            p.rps / d.rps,
            ttfb.0,
            ttfb.1,
            format!("{:.2}/{:.2}", r.proxy_cpu_ms, r.load_cpu_ms),
            r.recorded,
            format!("{:.3}/{:.0}", r.commit.0, r.commit.1)
        );
    }
    println!(
        "(ms; rps = measured requests / wall time of their rounds, a proxied round ending once the store has taken its \
         exchanges and the accounting thread its jobs (c=1: 1 / mean latency); ratio = proxy/direct rps; \
         cpu/req p/l = CPU ms per request of the proxy's threads / of the load runtime (c=32: clients + fake; \
         c=1: fake only); rec = exchanges in the proxy's store, warm-up included; commit = mean ms of the \
         store's commits after the warm-up / their number (SQLite: the journal's imports; pg: the commits \
         answers wait for))"
    );
    println!();
    println!(
        "c=32 rows: how busy the machine's CPUs were during the direct / the proxied rounds, the load \
         runtime's CPU per request during each, and the proxy's CPU per request by thread (ms; the runtime \
         worker is `compactor`):"
    );
    for r in rows.iter().filter(|r| r.sc.conc > 1) {
        let parts: Vec<String> = r
            .proxy_cpu_by_thread
            .iter()
            .filter(|(_, ms)| *ms >= 0.005)
            .map(|(name, ms)| format!("{name} {ms:.3}"))
            .collect();
        println!(
            "  {:<20} busy {:>3.0}% / {:>3.0}%   load {:.3} / {:.3}   {}",
            r.name,
            100.0 * r.machine_busy[0],
            100.0 * r.machine_busy[1],
            r.load_cpu_by_side[0],
            r.load_cpu_by_side[1],
            parts.join(", ")
        );
    }
    on_postgres(&rows);
    for r in &rows {
        for (side, s) in r.sides() {
            if s.errors > 0 {
                println!(
                    "ERRORS {} {side}: {} failed ({} ok); first: {}",
                    r.name,
                    s.errors,
                    s.n,
                    s.first_error.as_deref().unwrap_or("?")
                );
            }
        }
    }

    println!();
    println!("Budgets (worst applicable scenario; the hop rows are a reference):");
    let worst = |pred: &dyn Fn(&Row) -> bool, val: &dyn Fn(&Row) -> f64, higher_is_worse: bool| {
        rows.iter()
            .filter(|r| r.sc.variant != Variant::Hop && pred(r))
            .map(|r| (val(r), r.name.clone()))
            .fold(None, |acc: Option<(f64, String)>, x| match acc {
                None => Some(x),
                Some(a)
                    if (higher_is_worse && x.0 > a.0)
                        || (!higher_is_worse && x.0 < a.0)
                        || a.0.is_nan() =>
                {
                    Some(x)
                }
                a => a,
            })
    };
    let line = |label: &str, w: Option<(f64, String)>, ok: &dyn Fn(f64) -> bool, unit: &str| match w
    {
        Some((v, name)) => println!(
            "  {label:<44} {v:>7.3}{unit:<3} ({name:<20}) {}",
            verdict(ok(v) && !v.is_nan())
        ),
        None => println!("  {label:<44} not measured (filtered out)"),
    };
    let added = |r: &Row| r.side[1].p50 - r.side[0].p50;
    line(
        "added p50 < 1 ms, 30 KB, c=1",
        worst(&|r| r.sc.size == 30_000 && r.sc.conc == 1, &added, true),
        &|v| v < 1.0,
        " ms",
    );
    line(
        "added p50 < 2 ms, 300 KB, c=1",
        worst(&|r| r.sc.size == 300_000 && r.sc.conc == 1, &added, true),
        &|v| v < 2.0,
        " ms",
    );
    line(
        "throughput >= 80% of direct, c=32",
        worst(
            &|r| r.sc.conc == 32,
            &|r| r.side[1].rps / r.side[0].rps,
            false,
        ),
        &|v| v >= 0.8,
        "",
    );
    line(
        "streaming TTFB overhead < 1 ms (p50, c=1)",
        worst(
            &|r| r.sc.stream && r.sc.conc == 1,
            &|r| r.side[1].ttfb50 - r.side[0].ttfb50,
            true,
        ),
        &|v| v < 1.0,
        " ms",
    );
    // The WebSocket against HTTP + SSE through the proxy, and Gemini
    // against chat completions, each in turn in the same row: each against
    // the direct side of its own sessions (and, with the upstream taking
    // the WebSocket, of its own transport).
    for r in &rows {
        let Some(beside) = &r.beside else { continue };
        let (budget, pass) = match r.sc.variant {
            Variant::CodexWs => (
                format!("WebSocket added p50 <= SSE's ({:+.3} ms)", beside.added()),
                added(r) <= beside.added(),
            ),
            _ => (
                format!(
                    "Gemini added p50 <= chat's + 0.1 ({:+.3} ms)",
                    beside.added()
                ),
                added(r) - beside.added() <= 0.1,
            ),
        };
        println!(
            "  {budget:<44} {:>7.3} ms ({:<20}) {}",
            added(r),
            r.name,
            verdict(pass)
        );
        let ([d, p], b) = (&r.side, beside);
        let (own, other) = match r.sc.variant {
            Variant::CodexWs => ("the WebSocket's session", "HTTP + SSE's session"),
            _ => ("Gemini's session", "chat's session"),
        };
        println!(
            "    (p50 {own} direct {:.3}, through the proxy {:.3}; {other} direct {:.3}, \
             through the proxy {:.3}; p99 {:.2} / {:.2}; {:.2} / {:.2} ms)",
            d.p50, p.p50, b.direct.p50, b.proxy.p50, d.p99, p.p99, b.direct.p99, b.proxy.p99
        );
    }
    for r in rows
        .iter()
        .filter(|r| r.sc.variant == Variant::Hop && r.sc.conc > 1)
    {
        println!(
            "  reference: the bare HTTP hop ({}) keeps {:.2} of direct throughput",
            r.name.trim_end(),
            r.side[1].rps / r.side[0].rps
        );
    }
    against_the_hop(&rows);
    let errors: usize = rows
        .iter()
        .flat_map(|r| r.sides())
        .map(|(_, s)| s.errors)
        .sum();
    if errors > 0 {
        println!("  WARNING: {errors} requests failed; see ERRORS above");
    }

    let (machine1, own1) = (machine_ticks(), cpu_ticks());
    let total = machine1.1.saturating_sub(machine0.1).max(1) as f64;
    let others = machine1
        .0
        .saturating_sub(machine0.0)
        .saturating_sub(own1 - own0) as f64;
    println!(
        "noise: other processes used {:.0}% of the machine's CPU during the scenarios (this bench {:.0}%); \
         load average now {}",
        100.0 * others / total,
        100.0 * (own1 - own0) as f64 / total,
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );

    breakdown(&o);

    println!();
    println!(
        "peak RSS (VmHWM) {:.1} MB, RSS now {:.1} MB: clients, fake upstream and proxy in one process, \
         with the proxy's process-wide caches (bytes -> item hash, recent requests up to 64 MiB, \
         tokenizer). Total time {:.1} s.",
        status_kb("VmHWM:").unwrap_or(0) as f64 / 1024.0,
        status_kb("VmRSS:").unwrap_or(0) as f64 / 1024.0,
        t0.elapsed().as_secs_f64()
    );
}
