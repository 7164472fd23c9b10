//! An agent's tool loop in the shapes of the three parsed APIs (Chat
//! Completions, Responses, Anthropic Messages), for the tests of when a
//! compaction applies and of the `compactor_compact` tool: the client's
//! history, the scripted answers of the fake upstream (a tool call, a text,
//! JSON or SSE), and what the upstream received.

#![allow(dead_code)]

use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::anthropic::Answer;
use compactor::fake_upstream::{Received, Reply};
use serde_json::{json, Value};

use crate::support::{client, is_summary_call, within, Harness};

/// A 6000-token window for the models `agent-*` (trigger at 4500, hard
/// limit at 5800), `compactor_compact` offered.
pub fn agent_on(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "agent-*".into(),
        context_window: 6000,
        max_output_tokens: Some(200),
        trigger_ratio: None,
        ..Default::default()
    });
    c.compaction.agent_tool = true;
}

/// Which API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Chat,
    Responses,
    Messages,
}

pub const SHAPES: [Shape; 3] = [Shape::Chat, Shape::Responses, Shape::Messages];

/// A tool output of about `bytes` bytes, varied English-like lines (their
/// tokens near a quarter of their bytes, as the fake counts them).
pub fn output_text(n: usize, bytes: usize) -> String {
    const WORDS: [&str; 16] = [
        "parser",
        "network",
        "storage",
        "planner",
        "session",
        "render",
        "config",
        "metrics",
        "journal",
        "scheduler",
        "reader",
        "writer",
        "cache",
        "server",
        "client",
        "router",
    ];
    let mut s = String::new();
    let mut i = 0usize;
    while s.len() < bytes {
        let a = WORDS[(n * 7 + i) % WORDS.len()];
        let b = WORDS[(n * 3 + i * 5 + 1) % WORDS.len()];
        s.push_str(&format!(
            "step {n} line {i}: the {a} tests passed after the {b} module was rebuilt\n"
        ));
        i += 1;
    }
    s
}

/// A conversation as the client keeps it.
pub struct Loop {
    pub shape: Shape,
    pub model: String,
    pub items: Vec<Value>,
    /// The number of the next tool call.
    pub n: usize,
    pub stream: bool,
    /// The client's tool definitions (its own `shell`, and any other).
    pub tools: Value,
    pub key: String,
    /// The prompt tokens scripted answers report, when not the client's
    /// request's own (a compacted request is smaller than what the client
    /// sent, and its usage says so).
    pub reported: Option<u64>,
}

impl Loop {
    /// The task and `rounds` tool calls with outputs of `bytes` each.
    pub fn new(shape: Shape, model: &str, key: &str, rounds: usize, bytes: usize) -> Loop {
        let mut l = Loop {
            shape,
            model: model.to_string(),
            items: Vec::new(),
            n: 0,
            stream: false,
            tools: Value::Null,
            key: key.to_string(),
            reported: None,
        };
        l.tools = json!([l.tool_def("shell")]);
        if shape == Shape::Chat {
            l.items
                .push(json!({"role": "system", "content": "You are a careful coding agent."}));
        }
        l.user("Build the project in ./loop and fix every failing test; the port is 8123.");
        for _ in 0..rounds {
            l.round(bytes);
        }
        l
    }

    /// A tool definition named `name` in this API's shape.
    pub fn tool_def(&self, name: &str) -> Value {
        let params = json!({"type": "object", "properties": {"cmd": {"type": "string"}}});
        match self.shape {
            Shape::Chat => json!({"type": "function", "function": {"name": name,
                "description": "run a command", "parameters": params}}),
            Shape::Responses => json!({"type": "function", "name": name,
                "description": "run a command", "parameters": params}),
            Shape::Messages => json!({"name": name, "description": "run a command",
                "input_schema": params}),
        }
    }

    pub fn user(&mut self, text: &str) {
        self.items.push(match self.shape {
            Shape::Messages => json!({"role": "user", "content": [{"type": "text", "text": text}]}),
            _ => json!({"role": "user", "content": text}),
        });
    }

    pub fn assistant(&mut self, text: &str) {
        self.items.push(match self.shape {
            Shape::Chat => json!({"role": "assistant", "content": text}),
            Shape::Responses => json!({"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": text}]}),
            Shape::Messages => {
                json!({"role": "assistant", "content": [{"type": "text", "text": text}]})
            }
        });
    }

    pub fn call_id(&self) -> String {
        format!("call_{}", self.n)
    }

    fn cmd(&self) -> String {
        format!("cargo test --step {}", self.n)
    }

    /// The tool call the model makes next and its output (of `bytes`).
    pub fn round(&mut self, bytes: usize) {
        let (id, cmd) = (self.call_id(), self.cmd());
        let args = json!({"cmd": cmd}).to_string();
        let out = output_text(self.n, bytes);
        match self.shape {
            Shape::Chat => {
                self.items.push(json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": id, "type": "function", "function": {"name": "shell", "arguments": args}}]}));
                self.items
                    .push(json!({"role": "tool", "tool_call_id": id, "content": out}));
            }
            Shape::Responses => {
                self.items
                    .push(json!({"type": "function_call", "call_id": id,
                    "name": "shell", "arguments": args}));
                self.items
                    .push(json!({"type": "function_call_output", "call_id": id, "output": out}));
            }
            Shape::Messages => {
                self.items.push(json!({"role": "assistant", "content": [
                    {"type": "tool_use", "id": id, "name": "shell", "input": {"cmd": cmd}}]}));
                self.items.push(json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": id, "content": out}]}));
            }
        }
        self.n += 1;
    }

    /// The request body.
    pub fn body(&self) -> Value {
        let mut b = match self.shape {
            Shape::Chat => {
                json!({"model": self.model, "tools": self.tools, "messages": self.items})
            }
            Shape::Responses => {
                json!({"model": self.model, "instructions": "You are a careful coding agent.",
                "tools": self.tools, "input": self.items})
            }
            Shape::Messages => json!({"model": self.model, "max_tokens": 200,
                "system": "You are a careful coding agent.", "tools": self.tools,
                "messages": self.items}),
        };
        if self.stream {
            b["stream"] = json!(true);
            if self.shape == Shape::Chat {
                b["stream_options"] = json!({"include_usage": true});
            }
        }
        b
    }

    /// What the fake would report as the prompt of this request (a token
    /// per four bytes), so the usage the tests script agrees with the
    /// proxy's estimate.
    pub fn prompt_tokens(&self) -> u64 {
        (serde_json::to_vec(&self.body()).unwrap().len() / 4) as u64
    }

    /// The prompt tokens a scripted answer reports.
    fn reported_tokens(&self) -> u64 {
        self.reported.unwrap_or_else(|| self.prompt_tokens())
    }

    pub fn path(&self) -> &'static str {
        match self.shape {
            Shape::Chat => "/v1/chat/completions",
            Shape::Responses => "/v1/responses",
            Shape::Messages => "/v1/messages",
        }
    }

    /// Sends the request; status, headers, body.
    pub async fn send(&self, h: &Harness) -> (u16, http::HeaderMap, Vec<u8>) {
        let url = format!("http://{}{}", h.addr, self.path());
        let mut req = client()
            .post(url)
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&self.body()).unwrap());
        req = match self.shape {
            Shape::Messages => req
                .header("x-api-key", &self.key)
                .header("anthropic-version", "2023-06-01"),
            _ => req.header("authorization", format!("Bearer {}", self.key)),
        };
        let resp = within(req.send()).await.expect("request");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = within(resp.bytes()).await.expect("body");
        (status, headers, bytes.to_vec())
    }

    /// A scripted answer calling `name` with `args` (id `id`), usage
    /// `prompt`; as a stream when the loop streams.
    pub fn call_reply(&self, id: &str, name: &str, args: Value, prompt: u64) -> Reply {
        let text = args.to_string();
        match (self.shape, self.stream) {
            (Shape::Messages, _) => Reply::Messages(Answer::tool_use(id, name, args)),
            (Shape::Chat, false) => Reply::chat_tool_calls(&[(id, name, &text)], prompt, 20),
            (Shape::Chat, true) => {
                let head = r#""id":"chatcmpl-l","object":"chat.completion.chunk","created":1,"model":"fake""#;
                let first = json!({"index": 0, "delta": {"role": "assistant", "content": null,
                    "tool_calls": [{"index": 0, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]}, "finish_reason": null});
                let rest = json!({"index": 0, "delta": {"tool_calls": [{"index": 0,
                    "function": {"arguments": text}}]}, "finish_reason": "tool_calls"});
                Reply::sse(vec![
                    format!("data: {{{head},\"choices\":[{first}]}}\n\n"),
                    format!("data: {{{head},\"choices\":[{rest}]}}\n\n"),
                    format!("data: {{{head},\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":20,\"total_tokens\":{}}}}}\n\n", prompt + 20),
                    "data: [DONE]\n\n".to_string(),
                ])
            }
            (Shape::Responses, stream) => {
                let item = json!({"type": "function_call", "id": format!("fc_{id}"), "call_id": id,
                    "name": name, "arguments": text, "status": "completed"});
                let done = json!({"id": format!("resp_{id}"), "object": "response", "created_at": 1,
                    "status": "completed", "model": "fake", "output": [item],
                    "usage": {"input_tokens": prompt, "output_tokens": 20, "total_tokens": prompt + 20}});
                if !stream {
                    return Reply::json(200, done);
                }
                let event = |kind: &str, mut data: Value| {
                    data["type"] = json!(kind);
                    format!("event: {kind}\ndata: {data}\n\n")
                };
                let mut created = done.clone();
                created["status"] = json!("in_progress");
                created["output"] = json!([]);
                Reply::sse(vec![
                    event("response.created", json!({"response": created})),
                    event(
                        "response.output_item.added",
                        json!({"output_index": 0, "item": item}),
                    ),
                    event(
                        "response.output_item.done",
                        json!({"output_index": 0, "item": item}),
                    ),
                    event("response.completed", json!({"response": done})),
                ])
            }
        }
    }

    /// A scripted answer calling the client's `shell` for the next round.
    pub fn shell_reply(&self) -> Reply {
        let args = json!({"cmd": self.cmd()});
        self.call_reply(&self.call_id(), "shell", args, self.reported_tokens())
    }

    /// A scripted text answer.
    pub fn text_reply(&self, text: &str) -> Reply {
        let prompt = self.reported_tokens();
        match (self.shape, self.stream) {
            (Shape::Messages, _) => Reply::Messages(Answer::text(text)),
            (Shape::Chat, false) => Reply::chat(text, prompt, 9),
            (Shape::Chat, true) => Reply::chat_stream(&[text], Some((prompt, 9))),
            (Shape::Responses, false) => Reply::responses(text, prompt, 9),
            (Shape::Responses, true) => Reply::responses_stream(&[text], prompt, 9),
        }
    }

    /// The requests of this API the fake received, summarizer calls aside.
    pub fn upstream(&self, h: &Harness) -> Vec<Received> {
        h.fake
            .received()
            .into_iter()
            .filter(|r| r.path == self.path() && !is_summary_call(r))
            .collect()
    }

    /// Sends the request with `reply` scripted; asserts a 200. The
    /// answer's headers.
    pub async fn step(&self, h: &Harness, reply: Reply) -> http::HeaderMap {
        h.fake.push(reply);
        let (status, headers, body) = self.send(h).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        headers
    }

    /// Whether the upstream got the client's latest request smaller than
    /// the client sent it (a compaction replaced a prefix: pruned or
    /// summarized).
    pub fn upstream_shorter(&self, h: &Harness) -> bool {
        let last = self.upstream(h).pop().expect("an upstream request");
        let size = |items: &[Value]| serde_json::to_vec(items).unwrap().len();
        size(&self.items_of(&last)) < size(&self.items)
    }

    /// The items of an upstream request.
    pub fn items_of(&self, r: &Received) -> Vec<Value> {
        let key = match self.shape {
            Shape::Responses => "input",
            _ => "messages",
        };
        r.json()[key].as_array().cloned().unwrap_or_default()
    }

    /// The names of the tools an upstream request offered.
    pub fn tool_names(&self, r: &Received) -> Vec<String> {
        r.json()["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| {
                t.pointer("/function/name")
                    .or_else(|| t.get("name"))
                    .and_then(Value::as_str)
                    .map(String::from)
            })
            .collect()
    }
}
