//! Responses answers as the fake upstream scripts them (JSON, or the SSE
//! events of a stream) and what a client reads back of them, for the tests
//! of provider compaction.

use compactor::fake_upstream::Reply;
use serde_json::{json, Value};

/// A tool's output: a few hundred bytes that name the turn.
pub fn output_text(turn: usize, bytes: usize) -> String {
    let line = format!("turn {turn}: build step ok, wrote target/out_{turn}.o\n");
    line.repeat(bytes / line.len() + 1)[..bytes].to_string()
}

/// A Responses answer of `output`, JSON or the SSE events of a stream.
pub fn responses_answer(output: Value, streamed: bool) -> Reply {
    let done = json!({"id": compactor::fake_upstream::next_response_id(), "object": "response",
        "status": "completed", "model": "prov", "output": output,
        "usage": {"input_tokens": 1, "output_tokens": 12, "total_tokens": 13}});
    if !streamed {
        return Reply::json(200, done);
    }
    let mut events = Vec::new();
    let mut push = |kind: &str, mut data: Value| {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(events.len());
        events.push(format!("event: {kind}\ndata: {data}\n\n"));
    };
    let created =
        json!({"id": done["id"], "object": "response", "status": "in_progress", "output": []});
    push("response.created", json!({"response": created}));
    push("response.in_progress", json!({"response": created}));
    for (i, item) in done["output"].as_array().unwrap().iter().enumerate() {
        push(
            "response.output_item.added",
            json!({"output_index": i, "item": item}),
        );
        push(
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
    }
    push("response.completed", json!({"response": done}));
    Reply::sse(events)
}

/// A Responses function call answer.
pub fn responses_call(call_id: &str, streamed: bool) -> Reply {
    responses_answer(
        json!([{"type": "function_call", "id": format!("fc_{call_id}"), "call_id": call_id,
                "name": "shell", "arguments": "{\"cmd\":\"make\"}", "status": "completed"}]),
        streamed,
    )
}

/// A Responses text answer.
pub fn responses_text(text: &str, streamed: bool) -> Reply {
    responses_answer(
        json!([{"type": "message", "id": "msg_text", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}]),
        streamed,
    )
}

/// The output items of a Responses answer, JSON or SSE.
pub fn responses_output(bytes: &[u8], streamed: bool) -> Vec<Value> {
    if !streamed {
        let v: Value = serde_json::from_slice(bytes).expect("JSON answer");
        return v["output"].as_array().cloned().unwrap_or_default();
    }
    let text = String::from_utf8_lossy(bytes);
    text.split("\n\n")
        .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["type"] == "response.completed")
        .and_then(|v| v["response"]["output"].as_array().cloned())
        .unwrap_or_else(|| panic!("a completed stream: {text}"))
}

/// The model a [`Session`] asks for (a `tiny*` window, see `small_window`).
pub const CODEX_MODEL: &str = "tiny-codex";

/// A Codex-like session: developer prompt, environment context, task, then
/// reasoning + function calls with outputs every turn. Full input each turn.
pub struct Session {
    pub input: Vec<Value>,
    pub n: usize,
}

impl Session {
    pub fn new() -> Session {
        Session {
            input: vec![
                json!({"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]}),
                json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>cwd=/work</environment_context>"}]}),
                json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "TASK: fix the flaky parser test"}]}),
            ],
            n: 0,
        }
    }

    /// Appends one agent step: reasoning, a shell call and its (long) output.
    pub fn step(&mut self) {
        let n = self.n;
        self.n += 1;
        self.input.push(json!({"type": "reasoning", "id": format!("rs_{n}"), "summary": [], "encrypted_content": format!("gAAAA-opaque-{n}")}));
        self.input.push(json!({"type": "function_call", "call_id": format!("call_{n}"), "name": "shell",
                               "arguments": format!("{{\"command\":[\"cat\",\"src/parser_{n}.rs\"]}}")}));
        self.input.push(
            json!({"type": "function_call_output", "call_id": format!("call_{n}"),
                               "output": format!("fn parse_{n}() {{ let x = tokens.next(); }}")}),
        );
        self.input.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text",
                               "text": format!("parse_{n} reads one token; {}", "the lexer hands tokens over one at a time and ".repeat(12))}]}));
    }

    pub fn body(&self, stream: bool) -> Value {
        json!({"model": CODEX_MODEL, "instructions": "Be precise.", "input": self.input, "store": false,
               "stream": stream, "prompt_cache_key": "019a-codex-session"})
    }

    /// The `response.create` a WebSocket client sends for it.
    pub fn event(&self) -> Value {
        let mut e = self.body(false);
        e.as_object_mut().unwrap().remove("stream");
        e["type"] = json!("response.create");
        e
    }
}

impl Default for Session {
    fn default() -> Self {
        Self::new()
    }
}
