//! The proxy's own tools cannot fail a request, through real sockets: a
//! model that keeps calling `compactor_compact` made the proxy bill six
//! calls and answer 502 naming `compactor_recall`. After the rounds the
//! proxy answers, the request goes once more without its tools, and the
//! client gets that answer with the proxy's calls taken out and a normal
//! stop reason (JSON and SSE; Chat Completions, Responses and Anthropic
//! Messages), the logs naming the tool the model called.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

#[path = "support/agent_loop.rs"]
mod agent_loop;

use agent_loop::{agent_on, Loop, Shape, SHAPES};
use compactor::compaction::agent_tool::TOOL;
use serde_json::{json, Value};
use support::{captured_logs, Harness};

const MODEL: &str = "agent-own";

/// The events of an SSE body, as JSON.
fn events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|block| {
            block
                .lines()
                .find_map(|l| l.strip_prefix("data:"))
                .and_then(|d| serde_json::from_str(d.trim()).ok())
        })
        .collect()
}

/// The stop reason the client got, and the names of the calls it got.
fn stop_and_calls(shape: Shape, stream: bool, body: &str) -> (String, Vec<String>) {
    let s = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_string();
    let all = if stream {
        events(body)
    } else {
        vec![serde_json::from_str(body).expect("a JSON answer")]
    };
    let mut stop = String::new();
    let mut calls = Vec::new();
    for v in &all {
        match shape {
            Shape::Chat => {
                let choice = &v["choices"][0];
                if let Some(f) = choice["finish_reason"].as_str() {
                    stop = f.to_string();
                }
                let message = if stream {
                    &choice["delta"]
                } else {
                    &choice["message"]
                };
                for c in message["tool_calls"].as_array().into_iter().flatten() {
                    if let Some(name) = c.pointer("/function/name").and_then(Value::as_str) {
                        calls.push(name.to_string());
                    }
                }
            }
            Shape::Responses => {
                let done = if stream {
                    (v["type"] == "response.completed").then(|| &v["response"])
                } else {
                    Some(v)
                };
                if let Some(r) = done {
                    stop = s(r.get("status"));
                    for item in r["output"].as_array().into_iter().flatten() {
                        if item["type"] == "function_call" {
                            calls.push(s(item.get("name")));
                        }
                    }
                }
                if v["type"] == "response.output_item.added" && v["item"]["type"] == "function_call"
                {
                    calls.push(s(v["item"].get("name")));
                }
            }
            Shape::Messages => {
                if let Some(r) = v["stop_reason"]
                    .as_str()
                    .or_else(|| v.pointer("/delta/stop_reason").and_then(Value::as_str))
                {
                    stop = r.to_string();
                }
                let blocks = if stream {
                    vec![v["content_block"].clone()]
                } else {
                    v["content"].as_array().cloned().unwrap_or_default()
                };
                for b in blocks {
                    if b["type"] == "tool_use" {
                        calls.push(s(b.get("name")));
                    }
                }
            }
        }
    }
    (stop, calls)
}

/// The stop reason of an answer that calls no tool.
fn normal_stop(shape: Shape) -> &'static str {
    match shape {
        Shape::Chat => "stop",
        Shape::Responses => "completed",
        Shape::Messages => "end_turn",
    }
}

async fn a_model_that_keeps_compacting(shape: Shape, stream: bool) {
    let h = Harness::start_with(agent_on).await;
    let mut l = Loop::new(
        shape,
        MODEL,
        &format!("sk-own-{shape:?}-{stream}-0001"),
        6,
        1900,
    );
    l.stream = stream;
    for n in 0..8 {
        let args = json!({"reason": format!("again {n}")});
        h.fake
            .push(l.call_reply(&format!("call_own_{n}"), TOOL, args, l.prompt_tokens()));
    }
    let (status, headers, body) = l.send(&h).await;
    let text = String::from_utf8_lossy(&body).to_string();
    let what = format!("{shape:?}, stream {stream}");
    assert_eq!(status, 200, "{what}: {text}");
    assert!(!text.contains(TOOL), "{what}: the client got {text}");
    let (stop, calls) = stop_and_calls(shape, stream, &text);
    assert_eq!(stop, normal_stop(shape), "{what}: {text}");
    assert!(calls.is_empty(), "{what}: {calls:?}");
    let upstream = l.upstream(&h);
    assert_eq!(
        upstream.len(),
        4,
        "{what}: two rounds answered, the third past them, then one resend"
    );
    for (i, r) in upstream.iter().enumerate() {
        let offered = l.tool_names(r).contains(&TOOL.to_string());
        assert_eq!(offered, i < 3, "{what}, request {i}: {:?}", l.tool_names(r));
    }
    let conversation = headers
        .get("x-compactor-conversation")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let logs = captured_logs();
    let told: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains(&conversation) && l.contains("called"))
        .filter(|l| l.contains("without the proxy's tools") || l.contains("without those calls"))
        .collect();
    assert_eq!(told.len(), 2, "{what}: the resend and the answer: {told:?}");
    for line in told {
        assert!(
            line.contains(&format!("{TOOL} called")) && !line.contains("compactor_recall"),
            "{what}: {line}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_keeps_compacting_gets_its_answer_without_the_calls() {
    captured_logs();
    for shape in SHAPES {
        for stream in [false, true] {
            a_model_that_keeps_compacting(shape, stream).await;
        }
    }
}

/// A chat stream of reasoning and then a call of `compactor_compact`.
fn reasoning_then_compact(n: usize, prompt: u64) -> compactor::fake_upstream::Reply {
    let head = format!(
        r#""id":"chatcmpl-r{n}","object":"chat.completion.chunk","created":1,"model":"fake""#
    );
    let chunk = |delta: Value, finish: Value| {
        let choice = json!({"index": 0, "delta": delta, "finish_reason": finish});
        format!("data: {{{head},\"choices\":[{choice}]}}\n\n")
    };
    let args = json!({"reason": format!("again {n}")}).to_string();
    compactor::fake_upstream::Reply::sse(vec![
        chunk(
            json!({"role": "assistant", "reasoning_content": format!("thought {n}. ")}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": format!("call_r{n}"), "type": "function",
                "function": {"name": TOOL, "arguments": args}}]}),
            json!("tool_calls"),
        ),
        format!("data: {{{head},\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":9,\"total_tokens\":{}}}}}\n\n", prompt + 9),
        "data: [DONE]\n\n".to_string(),
    ])
}

/// The same model reasoning before each call: the client has each
/// answer's reasoning as it comes (a splice), and the stream ends well
/// formed, without the calls; it broke off mid-stream once the splice had
/// handed back more answers than the recall rounds allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_reasons_and_keeps_compacting_gets_a_whole_stream() {
    let h = Harness::start_with(agent_on).await;
    let mut l = Loop::new(Shape::Chat, MODEL, "sk-own-reasoning-0001", 6, 1900);
    l.stream = true;
    for n in 0..8 {
        h.fake.push(reasoning_then_compact(n, l.prompt_tokens()));
    }
    let (status, _, body) = l.send(&h).await;
    let text = String::from_utf8_lossy(&body).to_string();
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains(TOOL), "the client got {text}");
    let (stop, calls) = stop_and_calls(Shape::Chat, true, &text);
    assert_eq!((stop.as_str(), calls.len()), ("stop", 0), "{text}");
    let reasoning: String = events(&text)
        .iter()
        .filter_map(|v| v.pointer("/choices/0/delta/reasoning_content"))
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        reasoning, "thought 0. thought 1. thought 2. thought 3. ",
        "{text}"
    );
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(
        l.upstream(&h).len(),
        4,
        "two rounds, one past them, one resend"
    );
}

/// A streamed answer that says something first and then calls
/// `compactor_compact` (as Claude does: a sentence, then the call) is
/// relayed as it comes: the call reached the client, which never declared
/// the tool. It is taken out of the stream, with a normal stop reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_speaks_before_calling_the_proxys_tool_reaches_the_client_without_the_call() {
    use compactor::fake_upstream::anthropic::Answer;
    use compactor::fake_upstream::Reply;
    let args = json!({"reason": "the context is filling up"});
    for shape in SHAPES {
        let h = Harness::start_with(agent_on).await;
        let mut l = Loop::new(
            shape,
            MODEL,
            &format!("sk-own-text-{shape:?}-0001"),
            6,
            1900,
        );
        l.stream = true;
        let said = "I will compact the context first.";
        let event = |kind: &str, mut data: Value| {
            data["type"] = json!(kind);
            format!("event: {kind}\ndata: {data}\n\n")
        };
        h.fake.push(match shape {
            Shape::Messages => Reply::Messages(Answer {
                content: vec![
                    json!({"type": "text", "text": said}),
                    json!({"type": "tool_use", "id": "toolu_own", "name": TOOL, "input": args}),
                ],
                stop_reason: "tool_use".into(),
                output_tokens: 30,
            }),
            Shape::Chat => {
                let chunk = |delta: Value, finish: Value| {
                    let choice = json!({"index": 0, "delta": delta, "finish_reason": finish});
                    format!("data: {}\n\n", json!({"id": "chatcmpl-t", "object": "chat.completion.chunk", "choices": [choice]}))
                };
                Reply::sse(vec![
                    chunk(json!({"role": "assistant", "content": said}), Value::Null),
                    chunk(
                        json!({"tool_calls": [{"index": 0, "id": "call_own", "type": "function",
                            "function": {"name": TOOL, "arguments": args.to_string()}}]}),
                        Value::Null,
                    ),
                    chunk(json!({}), json!("tool_calls")),
                    "data: [DONE]\n\n".to_string(),
                ])
            }
            Shape::Responses => {
                let message = json!({"type": "message", "id": "msg_t", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": said, "annotations": []}]});
                let call = json!({"type": "function_call", "id": "fc_own", "call_id": "call_own",
                    "name": TOOL, "arguments": args.to_string(), "status": "completed"});
                let done = json!({"id": "resp_t", "object": "response", "status": "completed",
                    "output": [message, call], "usage": {"input_tokens": 900, "output_tokens": 30, "total_tokens": 930}});
                Reply::sse(vec![
                    event("response.created", json!({"sequence_number": 0, "response": {"id": "resp_t", "status": "in_progress", "output": []}})),
                    event("response.output_item.added", json!({"sequence_number": 1, "output_index": 0, "item": message})),
                    event("response.output_text.delta", json!({"sequence_number": 2, "output_index": 0, "content_index": 0, "delta": said})),
                    event("response.output_item.done", json!({"sequence_number": 3, "output_index": 0, "item": message})),
                    event("response.output_item.added", json!({"sequence_number": 4, "output_index": 1, "item": call})),
                    event("response.output_item.done", json!({"sequence_number": 5, "output_index": 1, "item": call})),
                    event("response.completed", json!({"sequence_number": 6, "response": done})),
                ])
            }
        });
        let (status, _, body) = l.send(&h).await;
        let text = String::from_utf8_lossy(&body).to_string();
        assert_eq!(status, 200, "{shape:?}: {text}");
        assert!(
            text.contains("compact the context first"),
            "{shape:?}: {text}"
        );
        assert!(!text.contains(TOOL), "{shape:?}: the client got {text}");
        let (stop, calls) = stop_and_calls(shape, true, &text);
        assert_eq!(stop, normal_stop(shape), "{shape:?}: {text}");
        assert!(calls.is_empty(), "{shape:?}: {calls:?}");
        assert_eq!(l.upstream(&h).len(), 1, "{shape:?}: relayed as it came");
    }
}
