//! What the fake upstream answers with and what it received: the scripted
//! [`Reply`]s (an Anthropic Messages one made of an [`Answer`]) and each
//! request as [`Received`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use serde_json::{json, Value};

use super::bodies::{
    chat_body, chat_stream_events, next_response_id, responses_body, responses_stream_events,
    usage_chat,
};

/// The text the automatic replies answer with.
pub const AUTO_TEXT: &str = "Hello from the fake upstream.";

/// One request as the upstream received it.
#[derive(Debug, Clone)]
pub struct Received {
    /// Method.
    pub method: http::Method,
    /// Path (no query).
    pub path: String,
    /// Query string.
    pub query: Option<String>,
    /// Headers.
    pub headers: HeaderMap,
    /// Body bytes.
    pub body: Bytes,
}

impl Received {
    /// The body parsed as JSON (`Null` if it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// A scripted answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A complete body.
    Full {
        /// Status.
        status: u16,
        /// Extra headers (a content type is added if none is given).
        headers: Vec<(String, String)>,
        /// Body bytes.
        body: Bytes,
    },
    /// An SSE body sent chunk by chunk.
    Sse {
        /// The chunks, sent as separate writes.
        chunks: Vec<Bytes>,
        /// Pause before each chunk.
        gap: Duration,
        /// Break the connection after this many chunks.
        reset_after: Option<usize>,
    },
    /// An SSE body whose chunks from index `at` on wait until the test
    /// opens `gate` (`notify_one`): a stream still being generated.
    Gated {
        /// The chunks, sent as separate writes.
        chunks: Vec<Bytes>,
        /// The first chunk held back.
        at: usize,
        /// Opened by the test.
        gate: Arc<tokio::sync::Notify>,
    },
    /// Wait, then answer.
    Delay(Duration, Box<Reply>),
    /// The answer with this status instead (e.g. an SSE body as an error).
    Status(u16, Box<Reply>),
    /// An Anthropic Messages answer, made for the request it answers (its
    /// usage, JSON or stream as asked, thinking signed for it).
    Messages(Answer),
}

impl Reply {
    /// A JSON answer.
    pub fn json(status: u16, body: Value) -> Reply {
        Reply::Full {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::from(body.to_string()),
        }
    }

    /// A chat completion with the given text and usage.
    pub fn chat(text: &str, prompt_tokens: u64, completion_tokens: u64) -> Reply {
        Reply::json(200, chat_body(text, prompt_tokens, completion_tokens))
    }

    /// A chat completion asking for tool calls: (id, name, arguments).
    pub fn chat_tool_calls(
        calls: &[(&str, &str, &str)],
        prompt_tokens: u64,
        completion_tokens: u64,
    ) -> Reply {
        let tool_calls: Vec<Value> = calls
            .iter()
            .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
            .collect();
        Reply::json(
            200,
            json!({
                "id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": "fake",
                "choices": [{"index": 0, "finish_reason": "tool_calls",
                             "message": {"role": "assistant", "content": null, "tool_calls": tool_calls}}],
                "usage": usage_chat(prompt_tokens, completion_tokens),
            }),
        )
    }

    /// A streamed chat completion: one chunk per text piece, then (when
    /// `usage` is given) the usage-only chunk, then `[DONE]`. Chunks carry
    /// `"usage": null` when usage is given, as OpenAI does.
    pub fn chat_stream(pieces: &[&str], usage: Option<(u64, u64)>) -> Reply {
        Reply::sse(chat_stream_events(pieces, usage))
    }

    /// A Responses answer with the given text and usage.
    pub fn responses(text: &str, input_tokens: u64, output_tokens: u64) -> Reply {
        Reply::json(
            200,
            responses_body(&next_response_id(), text, input_tokens, output_tokens),
        )
    }

    /// A streamed Responses answer.
    pub fn responses_stream(pieces: &[&str], input_tokens: u64, output_tokens: u64) -> Reply {
        Reply::sse(responses_stream_events(
            &next_response_id(),
            pieces,
            input_tokens,
            output_tokens,
        ))
    }

    /// An SSE body from complete event strings (each must end in a blank line).
    pub fn sse(events: Vec<String>) -> Reply {
        Reply::Sse {
            chunks: events.into_iter().map(Bytes::from).collect(),
            gap: Duration::ZERO,
            reset_after: None,
        }
    }

    /// OpenAI's context-length error.
    pub fn context_length_exceeded() -> Reply {
        Reply::json(
            400,
            json!({"error": {"message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.",
                             "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
        )
    }
}

/// What the answer is made of: `content` blocks (a `thinking` block whose
/// `signature` is `"SIGN"` is signed for the request it answers), and the
/// output tokens reported.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The content blocks.
    pub content: Vec<Value>,
    /// `stop_reason`.
    pub stop_reason: String,
    /// Output tokens reported.
    pub output_tokens: u64,
}

impl Answer {
    /// A text answer.
    pub fn text(text: &str) -> Answer {
        Answer {
            content: vec![json!({"type": "text", "text": text})],
            stop_reason: "end_turn".into(),
            output_tokens: 7,
        }
    }

    /// A call of `name` with `input`, id `id`.
    pub fn tool_use(id: &str, name: &str, input: Value) -> Answer {
        Answer {
            content: vec![json!({"type": "tool_use", "id": id, "name": name, "input": input})],
            stop_reason: "tool_use".into(),
            output_tokens: 20,
        }
    }

    /// The same answer, opened by a thinking block signed for its request.
    pub fn thinking(mut self, thought: &str) -> Answer {
        self.content.insert(
            0,
            json!({"type": "thinking", "thinking": thought, "signature": SIGN_HERE}),
        );
        self
    }
}

/// The placeholder signature the fake replaces with the request's own.
pub const SIGN_HERE: &str = "SIGN";
