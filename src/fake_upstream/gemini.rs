//! The fake upstream's Gemini endpoints (`/models/{model}:generateContent`,
//! `:streamGenerateContent`, `:countTokens` below its base): answers as the
//! API does (JSON, a JSON array, or SSE chunks with `alt=sse`, each chunk a
//! whole `GenerateContentResponse`, usage in `usageMetadata`) and refuses
//! what the API refuses, so that a test sees a request the proxy rewrote
//! judged by the same rules:
//!
//! - a content of `functionResponse` parts answers the content right
//!   before it, a `model` content with as many function calls ("Please
//!   ensure that the number of function response parts is equal to the
//!   number of function call parts of the function call turn.");
//! - a window, when one is set ([`super::FakeUpstream::set_messages_window`]):
//!   "The input token count (N) exceeds the maximum number of tokens
//!   allowed (W)." with `INVALID_ARGUMENT`.
//!
//! Tokens are counted as the other endpoints of the fake count them: bytes
//! of the request body / 4.

use serde_json::{json, Value};

use super::reply::{Received, Reply, AUTO_TEXT};

/// Whether a path is one of the Gemini endpoints.
pub fn is_gemini(path: &str) -> bool {
    [":generateContent", ":streamGenerateContent", ":countTokens"]
        .iter()
        .any(|m| path.ends_with(m))
}

fn streams(rec: &Received) -> bool {
    rec.path.ends_with(":streamGenerateContent")
}

fn sse(rec: &Received) -> bool {
    crate::wire::gemini::asks_sse(rec.query.as_deref())
}

/// Google's error body.
pub fn error(code: u16, status: &str, message: &str) -> Reply {
    Reply::json(
        code,
        json!({"error": {"code": code, "message": message, "status": status}}),
    )
}

/// The refusal the API gives a prompt over its window.
pub fn too_long(tokens: u64, window: u64) -> Reply {
    error(
        400,
        "INVALID_ARGUMENT",
        &format!(
            "The input token count ({tokens}) exceeds the maximum number of tokens allowed ({window})."
        ),
    )
}

/// What the API refuses of a request `body` of `len` bytes, if anything.
pub fn check(body: &Value, len: usize, window: Option<u64>) -> Option<Reply> {
    let contents = body.get("contents").and_then(Value::as_array)?;
    let calls = |c: &Value| {
        c.get("role").and_then(Value::as_str) == Some("model")
            && crate::wire::gemini::function_calls(c).next().is_some()
    };
    let count_calls = |c: &Value| crate::wire::gemini::function_calls(c).count();
    let count_responses = |c: &Value| crate::wire::gemini::function_responses(c).count();
    let mismatch = "Please ensure that the number of function response parts is equal to the number of function call parts of the function call turn.";
    for (i, c) in contents.iter().enumerate() {
        let responses = count_responses(c);
        if responses > 0 {
            let before = i.checked_sub(1).map(|j| &contents[j]);
            if before.is_none_or(|b| !calls(b) || count_calls(b) != responses) {
                return Some(error(400, "INVALID_ARGUMENT", mismatch));
            }
        }
    }
    let tokens = (len as u64 / 4).max(1);
    match window {
        Some(w) if tokens > w => Some(too_long(tokens, w)),
        _ => None,
    }
}

/// The body as a chat request (system instruction, then the contents as
/// messages), for the summarizer's checks of the other endpoints.
pub fn as_chat(body: &Value) -> Value {
    let text = |c: &Value| crate::wire::gemini::text_of(c);
    let mut messages = Vec::new();
    if let Some(s) = body.get("systemInstruction") {
        messages.push(json!({"role": "system", "content": text(s)}));
    }
    for c in body
        .get("contents")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let role = match c.get("role").and_then(Value::as_str) {
            Some("model") => "assistant",
            _ => "user",
        };
        messages.push(json!({"role": role, "content": text(c)}));
    }
    json!({ "messages": messages })
}

/// A `generateContent` answer of `parts`, with its usage.
pub fn body(parts: Value, prompt: u64, output: u64) -> Value {
    json!({
        "candidates": [{"content": {"role": "model", "parts": parts},
                        "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": prompt, "candidatesTokenCount": output,
                          "totalTokenCount": prompt + output},
        "modelVersion": "fake",
        "responseId": "fake-gemini",
    })
}

/// A text answer.
pub fn text(text: &str, prompt: u64, output: u64) -> Reply {
    Reply::json(200, body(json!([{ "text": text }]), prompt, output))
}

/// An answer calling functions: (name, args, id).
pub fn calls(calls: &[(&str, Value, Option<&str>)], prompt: u64, output: u64) -> Reply {
    let parts: Vec<Value> = calls
        .iter()
        .map(|(name, args, id)| {
            let mut call = json!({"name": name, "args": args});
            if let Some(id) = id {
                call["id"] = json!(id);
            }
            json!({ "functionCall": call })
        })
        .collect();
    Reply::json(200, body(Value::Array(parts), prompt, output))
}

/// A streamed text answer (`alt=sse`): a chunk per piece, the last with
/// the finish reason and the usage.
pub fn stream(pieces: &[&str], prompt: u64, output: u64) -> Reply {
    let n = pieces.len();
    let events = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut chunk = json!({"candidates": [{"content": {"role": "model", "parts": [{"text": p}]}, "index": 0}],
                                   "usageMetadata": {"promptTokenCount": prompt, "totalTokenCount": prompt},
                                   "responseId": "fake-gemini"});
            if i + 1 == n {
                chunk["candidates"][0]["finishReason"] = json!("STOP");
                chunk["usageMetadata"] = json!({"promptTokenCount": prompt,
                    "candidatesTokenCount": output, "totalTokenCount": prompt + output});
            }
            format!("data: {chunk}\r\n\r\n")
        })
        .collect();
    Reply::sse(events)
}

/// What the fake answers a Gemini request when nothing is scripted: the
/// `narrative` when it is a summary call.
pub fn auto_reply(rec: &Received, narrative: Option<String>) -> Reply {
    let prompt = (rec.body.len() as u64 / 4).max(1);
    if rec.path.ends_with(":countTokens") {
        return Reply::json(200, json!({ "totalTokens": prompt }));
    }
    if let Some(narrative) = narrative {
        return text(&narrative, prompt, 60);
    }
    let pieces = ["Hello", " from the", " fake upstream."];
    match (streams(rec), sse(rec)) {
        (true, true) => stream(&pieces, prompt, 7),
        (true, false) => {
            let chunks: Vec<Value> = pieces.iter().map(|p| body_of_piece(p, prompt)).collect();
            Reply::json(200, Value::Array(chunks))
        }
        _ => text(AUTO_TEXT, prompt, 7),
    }
}

fn body_of_piece(piece: &str, prompt: u64) -> Value {
    body(json!([{ "text": piece }]), prompt, 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_must_answer_the_calls_right_before_them() {
        let call =
            json!({"role": "model", "parts": [{"functionCall": {"name": "ls", "args": {}}}]});
        let answer = json!({"role": "user", "parts": [{"functionResponse": {"name": "ls", "response": {}}}]});
        let user = json!({"role": "user", "parts": [{"text": "hi"}]});
        let ok = json!({"contents": [user, call, answer]});
        assert!(check(&ok, 10, None).is_none());
        let orphan = json!({"contents": [user, answer]});
        assert!(check(&orphan, 10, None).is_some());
        let two = json!({"role": "user", "parts": [answer["parts"][0], answer["parts"][0]]});
        assert!(check(&json!({"contents": [user, call, two]}), 10, None).is_some());
        let pending = json!({"contents": [user, call]});
        assert!(check(&pending, 10, None).is_none());
        assert!(check(&ok, 4000, Some(100)).is_some());
    }
}
