//! Reasoning relayed as it comes while `compactor_recall` is offered,
//! through real sockets: the fake upstream streams reasoning and holds the
//! rest of its answer (a recall call) until the test lets it go; the
//! client has the first reasoning before that, and then one well-formed
//! stream, the continuation spliced onto the reasoning, with no trace of
//! the recall call.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;

use bytes::Bytes;
use compactor::compaction::ladder::archive_ref;
use compactor::compaction::recall::TOOL;
use compactor::fake_upstream::Reply;
use compactor::wire::item_hash;
use serde_json::{json, Value};
use support::{client, post, small_window, wait_compactions, within, Harness};
use tokio::sync::Notify;

const MODEL: &str = "tiny-test";

/// An agent conversation whose long error log the cheap rungs truncate,
/// as chat messages or Responses items: (history, the log's reference).
fn conversation(responses: bool) -> (Vec<Value>, String) {
    let log = format!(
        "error[E0308]: mismatched types in src/think.rs\n{}\ntest result: FAILED. exit 101\n",
        "   compiling think ... line of build output\n".repeat(260)
    );
    if responses {
        let output =
            json!({"type": "function_call_output", "call_id": "call_build", "output": log});
        let reference = archive_ref(&item_hash(&output));
        let input = vec![
            json!({"role": "user", "content": "Build the project and fix what fails."}),
            json!({"type": "function_call", "call_id": "call_build", "name": "shell", "arguments": "{\"cmd\":\"cargo build\"}"}),
            output,
            json!({"role": "assistant", "content": "The build failed; looking into it."}),
        ];
        return (input, reference);
    }
    let output = json!({"role": "tool", "tool_call_id": "call_build", "content": log});
    let reference = archive_ref(&item_hash(&output));
    let history = vec![
        json!({"role": "system", "content": "You are a careful coding agent."}),
        json!({"role": "user", "content": "Build the project and fix what fails."}),
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_build", "type": "function",
            "function": {"name": "shell", "arguments": "{\"cmd\":\"cargo build\"}"}}]}),
        output,
        json!({"role": "assistant", "content": "The build failed; looking into it."}),
    ];
    (history, reference)
}

fn chat_body(history: &[Value], stream: bool) -> Value {
    let mut messages = history.to_vec();
    if stream {
        messages.push(json!({"role": "user", "content": "What exactly was the error?"}));
    }
    let mut body = json!({"model": MODEL, "messages": messages, "tools": [{"type": "function",
        "function": {"name": "shell", "parameters": {"type": "object"}}}]});
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

fn responses_body(input: &[Value], stream: bool) -> Value {
    let mut input = input.to_vec();
    if stream {
        input.push(json!({"role": "user", "content": "What exactly was the error?"}));
    }
    json!({"model": MODEL, "instructions": "You are a careful coding agent.", "stream": stream,
           "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
           "input": input})
}

/// Posts a streamed request; returns the client's stream once its first
/// bytes came (under a timeout).
async fn open_stream(url: &str, key: &str, body: &Value) -> reqwest::Response {
    let resp = within(
        client()
            .post(url)
            .header("authorization", format!("Bearer {key}"))
            .json(body)
            .send(),
    )
    .await
    .expect("the response starts");
    assert_eq!(resp.status(), 200);
    resp
}

/// Reads the stream until `until` is in what came; returns it.
async fn read_until(resp: &mut reqwest::Response, seen: &mut Vec<u8>, until: &str) {
    while !String::from_utf8_lossy(seen).contains(until) {
        let chunk: Option<Bytes> = within(resp.chunk()).await.expect("the stream goes on");
        let Some(chunk) = chunk else {
            panic!(
                "the stream ended before {until:?}: {}",
                String::from_utf8_lossy(seen)
            );
        };
        seen.extend_from_slice(&chunk);
    }
}

async fn read_rest(resp: &mut reqwest::Response, seen: &mut Vec<u8>) {
    while let Some(chunk) = within(resp.chunk()).await.expect("the stream goes on") {
        seen.extend_from_slice(&chunk);
    }
}

/// The `data:` JSON of every event of an SSE body, with its event name.
fn events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut name = String::new();
            let mut data = None;
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = Some(d.to_string());
                }
            }
            let data = data?;
            let v = serde_json::from_str(&data).unwrap_or(Value::String(data));
            Some((name, v))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_reasoning_reaches_the_client_before_a_recall_and_the_continuation_follows_it() {
    let h = Harness::start_with(small_window).await;
    let url = format!("{}/chat/completions", h.url());
    let key = "sk-think-chat";
    let (history, reference) = conversation(false);
    let before = support::compactions(&h);
    assert_eq!(post(&url, key, &chat_body(&history, false)).await.0, 200);
    wait_compactions(&h, before + 1).await;

    let head =
        r#""id":"chatcmpl-think","object":"chat.completion.chunk","created":1,"model":"fake""#;
    let args = serde_json::to_string(&json!({"ref": reference}).to_string()).unwrap();
    let gate = Arc::new(Notify::new());
    let first = [
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"reasoning_content\":\"The log was cut;\"}},\"finish_reason\":null}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"reasoning_content\":\" read it back.\"}},\"finish_reason\":null}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\"id\":\"call_think\",\"type\":\"function\",\"function\":{{\"name\":\"{TOOL}\",\"arguments\":{args}}}}}]}},\"finish_reason\":null}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"tool_calls\"}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[],\"usage\":{{\"prompt_tokens\":700,\"completion_tokens\":11,\"total_tokens\":711}}}}\n\n"),
        "data: [DONE]\n\n".to_string(),
    ];
    h.fake.push(Reply::Gated {
        chunks: first.into_iter().map(Bytes::from).collect(),
        at: 1,
        gate: gate.clone(),
    });
    h.fake.push(Reply::chat_stream(
        &["The error", " is E0308."],
        Some((1400, 6)),
    ));
    let mut resp = open_stream(&url, key, &chat_body(&history, true)).await;
    let mut seen = Vec::new();
    // The first reasoning delta arrives while the fake holds the rest.
    read_until(&mut resp, &mut seen, "The log was cut;").await;
    gate.notify_one();
    read_rest(&mut resp, &mut seen).await;
    let text = String::from_utf8_lossy(&seen).into_owned();
    assert!(
        !text.contains(TOOL) && !text.contains("call_think"),
        "no trace of the recall: {text}"
    );
    let chunks = events(&text);
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|(_, v)| v.pointer("/choices/0/delta"))
        .collect();
    let roles = deltas.iter().filter(|d| d.get("role").is_some()).count();
    assert_eq!(roles, 1, "one role delta: {text}");
    let joined = |k: &str| -> String {
        deltas
            .iter()
            .filter_map(|d| d.get(k).and_then(Value::as_str))
            .collect()
    };
    assert_eq!(
        joined("reasoning_content"),
        "The log was cut; read it back."
    );
    assert_eq!(joined("content"), "The error is E0308.");
    let finals = chunks
        .iter()
        .filter(|(_, v)| {
            v.pointer("/choices/0/finish_reason")
                .is_some_and(|f| !f.is_null())
        })
        .count();
    assert_eq!(finals, 1, "one final chunk: {text}");
    let done = chunks.iter().filter(|(_, v)| v == &json!("[DONE]")).count();
    assert_eq!(done, 1, "one [DONE]: {text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let ids: Vec<&str> = chunks
        .iter()
        .filter_map(|(_, v)| v.get("id").and_then(Value::as_str))
        .collect();
    assert!(ids.iter().all(|id| *id == "chatcmpl-think"), "{ids:?}");
    assert!(
        text.contains("\"prompt_tokens\":1400"),
        "the final usage: {text}"
    );
    // The continued request answered the recall from the request's items.
    let last = h.fake.last().expect("a request").json();
    let messages = last["messages"].as_array().unwrap();
    let tool = messages.last().unwrap();
    assert_eq!(tool["role"], "tool", "{tool}");
    assert!(tool["content"]
        .as_str()
        .unwrap()
        .starts_with("error[E0308]: mismatched types in src/think.rs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_reasoning_item_reaches_the_client_before_a_recall_and_the_continuation_follows_it(
) {
    let h = Harness::start_with(small_window).await;
    let url = format!("{}/responses", h.url());
    let key = "sk-think-resp";
    let (input, reference) = conversation(true);
    let before = support::compactions(&h);
    assert_eq!(post(&url, key, &responses_body(&input, false)).await.0, 200);
    wait_compactions(&h, before + 1).await;

    let event = |kind: &str, seq: u64, data: Value| {
        let mut data = data;
        data["type"] = json!(kind);
        data["sequence_number"] = json!(seq);
        format!("event: {kind}\ndata: {data}\n\n")
    };
    let reasoning = json!({"type": "reasoning", "id": "rs_1", "summary": [
        {"type": "summary_text", "text": "The log was cut; read it back."}]});
    let call = json!({"type": "function_call", "id": "fc_1", "call_id": "call_think", "name": TOOL,
        "arguments": json!({"ref": reference}).to_string(), "status": "completed"});
    let response = |status: &str, output: Value| {
        json!({"id": "resp_think", "object": "response", "status": status, "model": "fake",
            "output": output, "usage": {"input_tokens": 600, "output_tokens": 8, "total_tokens": 608}})
    };
    let gate = Arc::new(Notify::new());
    let first = [
        event(
            "response.created",
            0,
            json!({"response": response("in_progress", json!([]))}),
        ),
        event(
            "response.output_item.added",
            1,
            json!({"output_index": 0, "item": {"type": "reasoning", "id": "rs_1", "summary": []}}),
        ),
        event(
            "response.reasoning_summary_text.delta",
            2,
            json!({"output_index": 0, "item_id": "rs_1", "summary_index": 0, "delta": "The log was cut;"}),
        ),
        event(
            "response.reasoning_summary_text.delta",
            3,
            json!({"output_index": 0, "item_id": "rs_1", "summary_index": 0, "delta": " read it back."}),
        ),
        event(
            "response.output_item.done",
            4,
            json!({"output_index": 0, "item": reasoning}),
        ),
        event(
            "response.output_item.added",
            5,
            json!({"output_index": 1, "item": call}),
        ),
        event(
            "response.output_item.done",
            6,
            json!({"output_index": 1, "item": call}),
        ),
        event(
            "response.completed",
            7,
            json!({"response": response("completed", json!([reasoning, call]))}),
        ),
    ];
    h.fake.push(Reply::Gated {
        chunks: first.into_iter().map(Bytes::from).collect(),
        at: 3,
        gate: gate.clone(),
    });
    h.fake
        .push(Reply::responses_stream(&["E0308", " again."], 1350, 5));
    let mut resp = open_stream(&url, key, &responses_body(&input, true)).await;
    let mut seen = Vec::new();
    read_until(&mut resp, &mut seen, "The log was cut;").await;
    gate.notify_one();
    read_rest(&mut resp, &mut seen).await;
    let text = String::from_utf8_lossy(&seen).into_owned();
    assert!(
        !text.contains(TOOL) && !text.contains("call_think"),
        "no trace of the recall: {text}"
    );
    let evs = events(&text);
    let kinds: Vec<&str> = evs
        .iter()
        .map(|(_, v)| v["type"].as_str().unwrap_or(""))
        .collect();
    let count = |k: &str| kinds.iter().filter(|x| **x == k).count();
    assert_eq!(count("response.created"), 1, "{kinds:?}");
    assert_eq!(count("response.completed"), 1, "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"response.completed"), "{kinds:?}");
    // Output indices follow the items sent: the reasoning, then the answer.
    let added: Vec<(u64, String)> = evs
        .iter()
        .filter(|(_, v)| v["type"] == "response.output_item.added")
        .map(|(_, v)| {
            (
                v["output_index"].as_u64().unwrap(),
                v["item"]["type"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        added,
        [(0, "reasoning".to_string()), (1, "message".to_string())]
    );
    let seqs: Vec<u64> = evs
        .iter()
        .filter_map(|(_, v)| v["sequence_number"].as_u64())
        .collect();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "sequence numbers follow each other: {seqs:?}"
    );
    let completed = &evs.last().unwrap().1["response"];
    assert_eq!(completed["id"], "resp_think", "{completed}");
    let output: Vec<&str> = completed["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect();
    assert_eq!(output, ["reasoning", "message"], "what the client saw");
    assert_eq!(completed["usage"]["input_tokens"], 1350);
    let last = h.fake.last().expect("a request").json();
    let sent = last["input"].as_array().unwrap();
    assert_eq!(sent.last().unwrap()["type"], "function_call_output");
}

/// A chat answer of reasoning and a recall call.
fn reasoning_then_recall(id: &str, thought: &str, reference: &str) -> Reply {
    let head =
        format!(r#""id":"{id}","object":"chat.completion.chunk","created":1,"model":"fake""#);
    let args = serde_json::to_string(&json!({"ref": reference}).to_string()).unwrap();
    Reply::sse(vec![
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"reasoning_content\":\"{thought}\"}},\"finish_reason\":null}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\"id\":\"call_{id}\",\"type\":\"function\",\"function\":{{\"name\":\"{TOOL}\",\"arguments\":{args}}}}}]}},\"finish_reason\":\"tool_calls\"}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[],\"usage\":{{\"prompt_tokens\":700,\"completion_tokens\":11,\"total_tokens\":711}}}}\n\n"),
        "data: [DONE]\n\n".to_string(),
    ])
}

/// A model that reasons and recalls again once the rounds are spent: the
/// tool is withdrawn and its call never reaches the client, whose stream
/// holds each answer's reasoning and the final text, well formed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recall_after_the_last_round_never_reaches_a_client_that_saw_the_reasoning() {
    let h = Harness::start_with(|c| {
        small_window(c);
        c.compaction.recall_max_rounds = 1;
    })
    .await;
    let url = format!("{}/chat/completions", h.url());
    let key = "sk-think-rounds";
    let (history, reference) = conversation(false);
    let before = support::compactions(&h);
    assert_eq!(post(&url, key, &chat_body(&history, false)).await.0, 200);
    wait_compactions(&h, before + 1).await;
    let sent_before = h.fake.received().len();
    h.fake.push(reasoning_then_recall(
        "chatcmpl-a",
        "First thought.",
        &reference,
    ));
    h.fake.push(reasoning_then_recall(
        "chatcmpl-b",
        " Second thought.",
        &reference,
    ));
    h.fake.push(Reply::chat_stream(&["Done."], Some((1400, 2))));
    let mut resp = open_stream(&url, key, &chat_body(&history, true)).await;
    let mut seen = Vec::new();
    read_rest(&mut resp, &mut seen).await;
    let text = String::from_utf8_lossy(&seen).into_owned();
    assert!(
        !text.contains(TOOL) && !text.contains("call_chatcmpl"),
        "no trace of a recall call: {text}"
    );
    let chunks = events(&text);
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|(_, v)| v.pointer("/choices/0/delta"))
        .collect();
    let joined = |k: &str| -> String {
        deltas
            .iter()
            .filter_map(|d| d.get(k).and_then(Value::as_str))
            .collect()
    };
    assert_eq!(
        joined("reasoning_content"),
        "First thought. Second thought."
    );
    assert_eq!(joined("content"), "Done.");
    assert_eq!(deltas.iter().filter(|d| d.get("role").is_some()).count(), 1);
    let done = chunks.iter().filter(|(_, v)| v == &json!("[DONE]")).count();
    assert_eq!(done, 1, "{text}");
    // The last request went without the recall tool.
    let received = h.fake.received();
    assert_eq!(received.len() - sent_before, 3, "the request and two more");
    let last = received.last().unwrap().json();
    assert!(!last["tools"].to_string().contains(TOOL), "{last}");
}
