//! A chat stream that says "too long" inside a 200 (`data: {"error": …}`,
//! as LiteLLM- and OpenRouter-style servers do), through real sockets: before
//! any content it is compacted and retried like the HTTP 400, so the client
//! gets the retried answer; after content it is relayed as it came.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::fake_upstream::{chat_stream_events, Reply};
use serde_json::{json, Value};
use support::*;

const KEY: &str = "sk-test-stream-errors-01";

/// What such a server sends: the error as a data chunk of a 200 stream.
fn error_chunk() -> String {
    let e = json!({"error": {"message": "This model's maximum context length is 3000 tokens. However, your messages resulted in 5200 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error", "code": 400}});
    format!("data: {e}\n\n")
}

/// A history of several turns, each with a large tool output: about
/// 5,000 tokens, over the 3,000 the upstream's error states.
fn long_history() -> Vec<Value> {
    let mut items = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Task: make the tests pass."}),
    ];
    for k in 0..6 {
        let id = format!("call_{k}");
        items.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "shell", "arguments": "{\"cmd\": \"make test\"}"}}]}));
        items.push(json!({"role": "tool", "tool_call_id": id,
            "content": format!("run {k}\n{}", "test ok\n".repeat(400))}));
    }
    items.push(json!({"role": "user", "content": "What failed?"}));
    items
}

async fn stream(h: &Harness, items: &[Value]) -> (u16, String) {
    let body = json!({"model": "tiny-1", "stream": true, "messages": items});
    let (status, _, bytes) = post(&format!("{}/chat/completions", h.url()), KEY, &body).await;
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// The proxy does not know the upstream's window (the request goes as
/// sent). The error chunk before any content is compacted and retried: the
/// client gets the retried answer and never the error.
#[tokio::test]
async fn a_too_long_error_chunk_before_content_is_compacted_and_retried() {
    let h = Harness::start_with(|c| {
        c.compaction.background = false;
    })
    .await;
    // A summary call takes none of the scripted answers.
    h.fake
        .set_summary_reply(Some("## TASK\nMake the tests pass.".into()));
    let items = long_history();
    h.fake
        .push(Reply::sse(vec![error_chunk(), "data: [DONE]\n\n".into()]));
    h.fake.push(Reply::sse(chat_stream_events(
        &["Nothing", " failed."],
        None,
    )));
    let (status, text) = stream(&h, &items).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("Nothing") && text.contains(" failed."),
        "{text}"
    );
    assert!(!text.contains("maximum context length"), "{text}");
    let calls = client_calls(&h);
    assert_eq!(calls.len(), 2, "the refused stream and the compacted one");
    let sent: usize = serde_json::to_vec(&calls[1]).unwrap().len();
    let first: usize = serde_json::to_vec(&calls[0]).unwrap().len();
    assert!(sent < first, "the retry was compacted: {sent} >= {first}");
    assert!(compactions(&h) >= 1);
}

/// After content the error chunk is the answer's: relayed as it came, no
/// retry.
#[tokio::test]
async fn an_error_chunk_after_content_is_relayed_as_it_came() {
    let h = Harness::start_with(|c| {
        c.compaction.background = false;
    })
    .await;
    let items = long_history();
    let mut events = chat_stream_events(&["Partial answer"], None);
    events.truncate(2);
    events.push(error_chunk());
    events.push("data: [DONE]\n\n".into());
    let expected: String = events.concat();
    h.fake.push(Reply::sse(events));
    let (status, text) = stream(&h, &items).await;
    assert_eq!(status, 200);
    assert_eq!(text, expected, "the stream as it came");
    assert_eq!(client_calls(&h).len(), 1, "no retry");
}
