//! Recall of elided tool outputs, answered inside the proxy, through real
//! sockets: the model calls `compactor_recall` for an archived error log,
//! the proxy answers from the request's own items and sends the continued
//! request; the client sees the final answer alone. Streamed and not; a
//! reference of another tenant, or none, gets a tool error; a recall beside
//! the client's own tool call is sent again without the tool.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::compaction::ladder::archive_ref;
use compactor::compaction::recall::TOOL;
use compactor::fake_upstream::Reply;
use compactor::wire::item_hash;
use serde_json::{json, Value};
use support::{client, post, small_window, wait_compactions, within, Harness};

const MODEL: &str = "tiny-test";

/// An agent conversation whose one tool output, a long error log, the
/// cheap rungs truncate: (history, the log's archive reference).
fn conversation(tag: &str) -> (Vec<Value>, String) {
    let log = format!(
        "error[E0308]: mismatched types in src/{tag}.rs\n{}\ntest result: FAILED. exit 101 ({tag})\n",
        format!("   compiling {tag} ... line of build output\n").repeat(260)
    );
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

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "shell", "description": "run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}])
}

/// Sends the conversation once (its usage crosses the trigger) and waits
/// for the background compaction, so the next request is compacted.
async fn compacted(h: &Harness, key: &str, history: &[Value]) {
    let url = format!("{}/chat/completions", h.url());
    let before = support::compactions(h);
    let body = json!({"model": MODEL, "tools": tools(), "messages": history});
    assert_eq!(post(&url, key, &body).await.0, 200);
    wait_compactions(h, before + 1).await;
}

fn recall_call(id: &str, reference: &str) -> (String, String, String) {
    (
        id.to_string(),
        TOOL.to_string(),
        json!({"ref": reference}).to_string(),
    )
}

/// The request of the next turn.
fn next_turn(history: &[Value], stream: bool) -> Value {
    let mut messages = history.to_vec();
    messages.push(json!({"role": "user", "content": "What exactly was the error?"}));
    let mut body = json!({"model": MODEL, "tools": tools(), "messages": messages});
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// The text of the tool message the proxy answered the recall with, in
/// the continued request the upstream received last.
fn recalled_text(h: &Harness) -> String {
    let last = h.fake.last().expect("a request").json();
    let messages = last["messages"].as_array().unwrap();
    let tool = messages.last().unwrap();
    assert_eq!(tool["role"], "tool", "{tool}");
    assert_eq!(
        messages[messages.len() - 2]["tool_calls"][0]["function"]["name"],
        TOOL
    );
    tool["content"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_recalls_an_archived_error_log_and_then_answers() {
    let h = Harness::start_with(small_window).await;
    let (history, reference) = conversation("lib");
    compacted(&h, "sk-recall-a", &history).await;
    let calls = [recall_call("call_r", &reference)];
    let calls: Vec<(&str, &str, &str)> = calls
        .iter()
        .map(|(a, b, c)| (a.as_str(), b.as_str(), c.as_str()))
        .collect();
    h.fake.push(Reply::chat_tool_calls(&calls, 900, 12));
    h.fake.push(Reply::chat(
        "E0308: mismatched types in src/lib.rs",
        1500,
        9,
    ));
    let url = format!("{}/chat/completions", h.url());
    let (status, headers, body) = post(&url, "sk-recall-a", &next_turn(&history, false)).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let answer: Value = serde_json::from_slice(&body).unwrap();
    // One answer, no trace of the round trip: the final text and usage.
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        "E0308: mismatched types in src/lib.rs"
    );
    assert!(
        answer["choices"][0]["message"]["tool_calls"].is_null(),
        "{answer}"
    );
    assert_eq!(answer["usage"]["prompt_tokens"], 1500);
    // The first request offered the tool after the client's own, and its
    // marker says how to use it.
    let received = h.fake.received();
    let offered = received[received.len() - 2].json();
    let names: Vec<&str> = offered["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["shell", TOOL]);
    assert!(offered.to_string().contains(&format!(
        "{reference}; when the compactor_recall tool is offered"
    )));
    // The continued request carries the original log, from the request's own items.
    let text = recalled_text(&h);
    assert!(
        text.starts_with("error[E0308]: mismatched types in src/lib.rs"),
        "{text}"
    );
    assert!(
        text.contains("test result: FAILED. exit 101 (lib)"),
        "head and tail: {text}"
    );
    let (rounds, input, usage_in): (i64, i64, i64) = h
        .db()
        .query_row(
            "SELECT recall_rounds, recall_input_tokens, input_tokens FROM exchanges ORDER BY id DESC LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(
        (rounds, input, usage_in),
        (1, 900, 1500),
        "the recall round's usage is recorded apart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_that_recalls_reaches_the_client_as_the_final_stream() {
    let h = Harness::start_with(small_window).await;
    let (history, reference) = conversation("stream");
    compacted(&h, "sk-recall-s", &history).await;
    let head = r#""id":"chatcmpl-r","object":"chat.completion.chunk","created":1,"model":"fake""#;
    let args = serde_json::to_string(&json!({"ref": reference}).to_string()).unwrap();
    let events = vec![
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{{\"index\":0,\"id\":\"call_s\",\"type\":\"function\",\"function\":{{\"name\":\"{TOOL}\",\"arguments\":\"\"}}}}]}},\"finish_reason\":null}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\"function\":{{\"arguments\":{args}}}}}]}},\"finish_reason\":\"tool_calls\"}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[],\"usage\":{{\"prompt_tokens\":700,\"completion_tokens\":11,\"total_tokens\":711}}}}\n\n"),
        "data: [DONE]\n\n".to_string(),
    ];
    h.fake.push(Reply::sse(events));
    h.fake.push(Reply::chat_stream(
        &["The error", " is E0308."],
        Some((1400, 6)),
    ));
    let (status, _, body) = support::post_raw(
        &format!("{}/chat/completions", h.url()),
        "sk-recall-s",
        serde_json::to_vec(&next_turn(&history, true)).unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains(TOOL) && !text.contains("call_s"),
        "no trace of the recall: {text}"
    );
    let content: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
                .map(String::from)
        })
        .collect();
    assert_eq!(content, "The error is E0308.");
    assert!(
        text.contains("\"prompt_tokens\":1400"),
        "the final usage: {text}"
    );
    assert!(recalled_text(&h).starts_with("error[E0308]: mismatched types in src/stream.rs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_reference_and_an_unknown_one_get_a_tool_error() {
    let h = Harness::start_with(small_window).await;
    let (alice, alice_ref) = conversation("alice");
    compacted(&h, "sk-alice", &alice).await;
    let (bob, _) = conversation("bob");
    compacted(&h, "sk-bob", &bob).await;
    let url = format!("{}/chat/completions", h.url());
    for reference in [alice_ref.as_str(), "item:0000000000000000"] {
        let call = recall_call("call_x", reference);
        h.fake.push(Reply::chat_tool_calls(
            &[(&call.0, &call.1, &call.2)],
            800,
            10,
        ));
        h.fake
            .push(Reply::chat("I cannot read that output.", 820, 7));
        let (status, _, body) = post(&url, "sk-bob", &next_turn(&bob, false)).await;
        assert_eq!(status, 200, "a tool error, not a failure");
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            answer["choices"][0]["message"]["content"],
            "I cannot read that output."
        );
        let text = recalled_text(&h);
        assert!(
            text.starts_with("error: compactor_recall knows no archived output"),
            "{text}"
        );
        assert!(
            !text.contains("src/alice.rs"),
            "never another tenant's bytes: {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recall_beside_a_client_tool_call_is_sent_again_without_the_tool() {
    let h = Harness::start_with(small_window).await;
    let (history, reference) = conversation("mixed");
    compacted(&h, "sk-recall-m", &history).await;
    let call = recall_call("call_r", &reference);
    h.fake.push(Reply::chat_tool_calls(
        &[
            (&call.0, &call.1, &call.2),
            ("call_ls", "shell", "{\"cmd\":\"ls\"}"),
        ],
        800,
        10,
    ));
    h.fake.push(Reply::chat_tool_calls(
        &[("call_cat", "shell", "{\"cmd\":\"cat src/mixed.rs\"}")],
        810,
        9,
    ));
    let url = format!("{}/chat/completions", h.url());
    let (status, _, body) = post(&url, "sk-recall-m", &next_turn(&history, false)).await;
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_slice(&body).unwrap();
    let calls = answer["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        calls[0]["id"], "call_cat",
        "the client's own call, from the resent request"
    );
    let resent = h.fake.last().unwrap().json();
    assert!(
        !resent["tools"].to_string().contains(TOOL),
        "resent without the recall tool"
    );
    // And with x-compactor-mode: off the tool is never offered.
    let body = next_turn(&history, false);
    let resp = within(
        client()
            .post(&url)
            .header("authorization", "Bearer sk-recall-m")
            .header("x-compactor-mode", "off")
            .json(&body)
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(!h.fake.last().unwrap().json()["tools"]
        .to_string()
        .contains(TOOL));
}

/// A client that changes its own tools after the proxy compacted: the
/// same conversation, still compacted; the upstream gets the client's
/// tools byte for byte as it sent them, then the recall tool, the same
/// definition every time; a recall after the change is answered by the
/// proxy. A request without tools of its own is offered none (nothing
/// could call it) and still goes compacted; its tools back, the recall
/// tool is back after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_changes_its_tools_keeps_its_conversation_and_its_recall() {
    let h = Harness::start_with(small_window).await;
    let key = "sk-recall-tools-change";
    let (history, reference) = conversation("tools");
    compacted(&h, key, &history).await;
    let url = format!("{}/chat/completions", h.url());
    let recall = compactor::compaction::recall::definition(compactor::wire::Api::Chat);
    // The shell's description edited, a tool added.
    let tools = json!([
        {"type": "function", "function": {"name": "shell", "description": "run a command in bash",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "read_file", "description": "read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
    ]);
    let mut body = next_turn(&history, false);
    body["tools"] = tools.clone();
    let call = recall_call("call_r", &reference);
    h.fake.push(Reply::chat_tool_calls(
        &[(&call.0, &call.1, &call.2)],
        900,
        12,
    ));
    h.fake.push(Reply::chat("E0308 in src/tools.rs.", 1500, 9));
    let (status, headers, answer) = post(&url, key, &body).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        "E0308 in src/tools.rs."
    );
    let received = h.fake.received();
    let offered = &received[received.len() - 2];
    let text = String::from_utf8_lossy(&offered.body);
    let clients = serde_json::to_string(&tools).unwrap();
    let recall_bytes = serde_json::to_string(&recall).unwrap();
    assert!(
        text.contains(&format!(
            "{},{recall_bytes}]",
            &clients[..clients.len() - 1]
        )),
        "the client's tools as it sent them, then the recall tool: {text}"
    );
    assert!(recalled_text(&h).starts_with("error[E0308]: mismatched types in src/tools.rs"));
    // Without tools of its own.
    let mut body = next_turn(&history, false);
    body.as_object_mut().unwrap().remove("tools");
    h.fake.push(Reply::chat("Nothing to run.", 800, 5));
    let (status, headers, _) = post(&url, key, &body).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let sent = h.fake.last().unwrap().json();
    assert!(sent.get("tools").is_none(), "{sent}");
    assert!(
        sent["messages"].to_string().contains("original archived"),
        "compacted"
    );
    // Its tools back.
    let mut body = next_turn(&history, false);
    body["tools"] = tools.clone();
    h.fake.push(Reply::chat("Back to work.", 800, 5));
    assert_eq!(post(&url, key, &body).await.0, 200);
    let sent = h.fake.last().unwrap().json();
    assert_eq!(sent["tools"], json!([tools[0], tools[1], recall]));
    let conversations: Vec<String> =
        support::column(&*h.sql(), "SELECT DISTINCT conversation_id FROM exchanges");
    assert_eq!(
        conversations.len(),
        1,
        "one conversation: {conversations:?}"
    );
}

/// The same agent conversation in the Responses API's items.
fn responses_conversation() -> (Vec<Value>, String) {
    let log = format!(
        "error[E0308]: mismatched types in src/resp.rs\n{}\ntest result: FAILED. exit 101 (resp)\n",
        "   compiling resp ... line of build output\n".repeat(260)
    );
    let output = json!({"type": "function_call_output", "call_id": "call_build", "output": log});
    let reference = archive_ref(&item_hash(&output));
    let input = vec![
        json!({"role": "user", "content": "Build the project and fix what fails."}),
        json!({"type": "function_call", "call_id": "call_build", "name": "shell", "arguments": "{\"cmd\":\"cargo build\"}"}),
        output,
        json!({"role": "assistant", "content": "The build failed; looking into it."}),
    ];
    (input, reference)
}

fn responses_body(input: &[Value], stream: bool) -> Value {
    json!({"model": MODEL, "instructions": "You are a careful coding agent.", "stream": stream,
           "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
           "input": input})
}

/// A Responses answer calling the recall tool.
fn responses_recall(reference: &str) -> Value {
    json!({"id": "resp_recall", "object": "response", "status": "completed", "model": "fake",
           "output": [{"type": "function_call", "id": "fc_1", "call_id": "call_r", "name": TOOL,
                       "arguments": json!({"ref": reference}).to_string(), "status": "completed"}],
           "usage": {"input_tokens": 600, "output_tokens": 8, "total_tokens": 608}})
}

/// The function_call_output the proxy answered with, in the last request.
fn recalled_output(h: &Harness) -> String {
    let last = h.fake.last().expect("a request").json();
    let input = last["input"].as_array().unwrap();
    let out = input.last().unwrap();
    assert_eq!(out["type"], "function_call_output", "{out}");
    assert_eq!(input[input.len() - 2]["name"], TOOL);
    out["output"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_responses_api_recalls_too_streamed_and_not() {
    let h = Harness::start_with(small_window).await;
    let url = format!("{}/responses", h.url());
    let (mut input, reference) = responses_conversation();
    let before = support::compactions(&h);
    assert_eq!(
        post(&url, "sk-recall-r", &responses_body(&input, false))
            .await
            .0,
        200
    );
    wait_compactions(&h, before + 1).await;
    input.push(json!({"role": "user", "content": "What exactly was the error?"}));

    // JSON.
    h.fake.push(Reply::json(200, responses_recall(&reference)));
    h.fake
        .push(Reply::responses("E0308 in src/resp.rs", 1300, 7));
    let (status, headers, body) = post(&url, "sk-recall-r", &responses_body(&input, false)).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert!(!answer.to_string().contains(TOOL), "{answer}");
    assert_eq!(answer["usage"]["input_tokens"], 1300);
    assert!(recalled_output(&h).starts_with("error[E0308]: mismatched types in src/resp.rs"));

    // SSE: the call's events are held, the final stream is relayed.
    let done = responses_recall(&reference);
    let item = done["output"][0].clone();
    let event = |kind: &str, data: Value| {
        let mut data = data;
        data["type"] = json!(kind);
        format!("event: {kind}\ndata: {data}\n\n")
    };
    let mut created = done.clone();
    created["status"] = json!("in_progress");
    created["output"] = json!([]);
    h.fake.push(Reply::sse(vec![
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
    ]));
    h.fake
        .push(Reply::responses_stream(&["E0308", " again."], 1350, 5));
    let (status, _, body) = support::post_raw(
        &url,
        "sk-recall-r",
        serde_json::to_vec(&responses_body(&input, true)).unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains(TOOL) && !text.contains("resp_recall"),
        "{text}"
    );
    assert!(
        text.contains("E0308") && text.contains("response.completed"),
        "{text}"
    );
    assert!(recalled_output(&h).starts_with("error[E0308]: mismatched types in src/resp.rs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_is_offered_whatever_the_order_of_the_request_members() {
    let h = Harness::start_with(small_window).await;
    let (mut messages, _) = conversation("order");
    let url = format!("{}/chat/completions", h.url());
    // The members in the order an SDK writes them, tools after the
    // history, turn after turn: the third request and later take over the
    // split of the first. The tools pretty-printed, as the proxy never
    // writes JSON.
    let client_tools = serde_json::to_string_pretty(&tools()).unwrap();
    for turn in 0..4 {
        let body = format!(
            "{{\"model\":\"{MODEL}\",\"messages\":{},\"tools\":{client_tools}}}",
            Value::from(messages.clone()),
        );
        let (status, _, _) = support::post_raw(&url, "sk-recall-o", body.into_bytes()).await;
        assert_eq!(status, 200);
        if turn == 0 {
            wait_compactions(&h, 1).await;
        }
        let raw = h.fake.last().unwrap().body;
        if turn > 0 {
            // The client's bytes with the recall tool after its own:
            // nothing was rebuilt.
            let kept = format!("\"tools\":{},{{", &client_tools[..client_tools.len() - 1]);
            assert!(
                raw.windows(kept.len()).any(|w| w == kept.as_bytes()),
                "turn {turn}: the client's tools as it sent them, then the proxy's: {}",
                String::from_utf8_lossy(&raw)
            );
        }
        let sent = h.fake.last().unwrap().json();
        let names: Vec<&str> = sent["tools"]
            .as_array()
            .unwrap_or_else(|| panic!("turn {turn}: tools {}", sent["tools"]))
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        let want: &[&str] = if turn == 0 {
            &["shell"]
        } else {
            &["shell", TOOL]
        };
        assert_eq!(
            names, want,
            "turn {turn}: the client's tools, and the recall tool once compacted"
        );
        messages.push(json!({"role": "user", "content": format!("turn {turn}: go on")}));
    }
}

/// The chunks of a streamed answer that calls `name` with `args`.
fn streamed_call(id: &str, name: &str, args: &str) -> Reply {
    let head = r#""id":"chatcmpl-t","object":"chat.completion.chunk","created":1,"model":"fake""#;
    let args = serde_json::to_string(args).unwrap();
    Reply::sse(vec![
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{{\"index\":0,\"id\":\"{id}\",\"type\":\"function\",\"function\":{{\"name\":\"{name}\",\"arguments\":\"\"}}}}]}},\"finish_reason\":null}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\"function\":{{\"arguments\":{args}}}}}]}},\"finish_reason\":\"tool_calls\"}}]}}\n\n"),
        format!("data: {{{head},\"choices\":[],\"usage\":{{\"prompt_tokens\":700,\"completion_tokens\":11,\"total_tokens\":711}}}}\n\n"),
        "data: [DONE]\n\n".to_string(),
    ])
}

/// A recall round fills no more than the room the window leaves: the
/// continued request, recalled text included, still fits the 3,000-token
/// window with the answer's 300 (each answer was up to 16 KiB whatever the
/// window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recall_answer_is_bounded_by_the_room_the_window_leaves() {
    let h = Harness::start_with(small_window).await;
    let (history, reference) = conversation("room");
    compacted(&h, "sk-recall-room", &history).await;
    let call = recall_call("call_r", &reference);
    h.fake.push(Reply::chat_tool_calls(
        &[(&call.0, &call.1, &call.2)],
        900,
        12,
    ));
    h.fake.push(Reply::chat("E0308.", 1500, 9));
    let url = format!("{}/chat/completions", h.url());
    let (status, _, _) = post(&url, "sk-recall-room", &next_turn(&history, false)).await;
    assert_eq!(status, 200);
    let text = recalled_text(&h);
    assert!(text.starts_with("error[E0308]"), "the head: {text}");
    let continued = h.fake.last().unwrap().json();
    let tokens = h.state.tokens.count_text(&continued.to_string());
    assert!(
        tokens <= 3000 - 300,
        "the continued request takes {tokens} tokens of a 3,000 window (recalled {} bytes)",
        text.len()
    );
}

/// After the last allowed round the model may call the tool again from the
/// calls the rounds left in the request: the request goes once more
/// without the tool, and a call of it in that answer is taken out of what
/// the client gets, streamed or not, with a normal stop reason (the proxy
/// gave the request up with a 502 after three more sends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recall_call_after_the_last_round_never_reaches_the_client() {
    let h = Harness::start_with(|c| {
        small_window(c);
        c.compaction.recall_max_rounds = 1;
    })
    .await;
    let (history, reference) = conversation("last");
    compacted(&h, "sk-recall-last", &history).await;
    let url = format!("{}/chat/completions", h.url());
    let args = json!({"ref": reference}).to_string();
    for stream in [false, true] {
        for n in 0..3 {
            let id = format!("call_{n}");
            h.fake.push(if stream {
                streamed_call(&id, TOOL, &args)
            } else {
                Reply::chat_tool_calls(&[(&id, TOOL, &args)], 800, 10)
            });
        }
        let before = h.fake.received().len();
        let (status, _, body) = post(&url, "sk-recall-last", &next_turn(&history, stream)).await;
        let text = String::from_utf8_lossy(&body);
        assert_eq!(status, 200, "{text}");
        assert!(
            !text.contains(TOOL) && !text.contains("call_2"),
            "stream {stream}: the client got {text}"
        );
        assert!(text.contains("\"finish_reason\":\"stop\""), "{text}");
        assert!(!text.contains("tool_calls"), "{text}");
        let sent: Vec<Value> = h.fake.received()[before..]
            .iter()
            .map(|r| r.json())
            .collect();
        assert_eq!(sent.len(), 3, "one round, then once without the tool");
        assert!(sent[..2]
            .iter()
            .all(|s| s["tools"].to_string().contains(TOOL)));
        assert!(
            !sent[2]["tools"].to_string().contains(TOOL),
            "stream {stream}: {}",
            sent[2]["tools"]
        );
    }
}

/// Identical or made-up references cannot amplify one request: each
/// distinct reference is answered once, at most a few per round, and an
/// unknown reference is not echoed back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_and_huge_references_do_not_amplify_a_request() {
    let h = Harness::start_with(small_window).await;
    let (history, reference) = conversation("amp");
    compacted(&h, "sk-recall-amp", &history).await;
    let url = format!("{}/chat/completions", h.url());
    let args = json!({"ref": reference}).to_string();
    let ids: Vec<String> = (0..40).map(|i| format!("call_{i}")).collect();
    let calls: Vec<(&str, &str, &str)> = ids
        .iter()
        .map(|id| (id.as_str(), TOOL, args.as_str()))
        .collect();
    h.fake.push(Reply::chat_tool_calls(&calls, 800, 10));
    h.fake.push(Reply::chat("Done.", 900, 3));
    let request = next_turn(&history, false);
    let sent_by_client = serde_json::to_vec(&request).unwrap().len();
    let (status, _, _) = post(&url, "sk-recall-amp", &request).await;
    assert_eq!(status, 200);
    let continued = h.fake.last().unwrap();
    assert!(
        continued.body.len() < sent_by_client * 2,
        "{} bytes upstream for a {sent_by_client}-byte request",
        continued.body.len()
    );
    let tools: Vec<Value> = continued.json()["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool" && m["tool_call_id"] != "call_build")
        .cloned()
        .collect();
    assert_eq!(tools.len(), 40, "every call is answered");
    let full: Vec<&Value> = tools
        .iter()
        .filter(|m| m["content"].as_str().unwrap().starts_with("error[E0308]"))
        .collect();
    assert_eq!(full.len(), 1, "the original once");

    let huge = format!("item:{}", "f".repeat(1 << 20));
    let huge_args = json!({"ref": huge}).to_string();
    h.fake.push(Reply::chat_tool_calls(
        &[("call_h", TOOL, &huge_args)],
        800,
        10,
    ));
    h.fake.push(Reply::chat("Done.", 900, 3));
    let (status, _, _) = post(&url, "sk-recall-amp", &request).await;
    assert_eq!(status, 200);
    let continued = h.fake.last().unwrap().json();
    let answer = continued["messages"].as_array().unwrap().last().unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(answer.starts_with("error:"), "{answer}");
    assert!(answer.len() < 300, "{} bytes echoed", answer.len());

    let Err(err) =
        compactor::config::Config::from_toml("[compaction]\nrecall_max_rounds = 1000000\n")
    else {
        panic!("recall_max_rounds = 1000000 is accepted");
    };
    assert!(err.to_string().contains("recall_max_rounds"), "{err}");
}

/// A client tool of the proxy's tool name is the client's: offered once,
/// and its calls reach the client. A request for several choices is not
/// offered recall (a call in one choice could not be answered alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_tool_named_like_the_recall_tool_and_several_choices_get_no_recall() {
    let h = Harness::start_with(small_window).await;
    let (history, reference) = conversation("own");
    compacted(&h, "sk-recall-own", &history).await;
    let url = format!("{}/chat/completions", h.url());
    let mut body = next_turn(&history, false);
    body["tools"].as_array_mut().unwrap().push(json!({"type": "function",
        "function": {"name": TOOL, "description": "the client's own", "parameters": {"type": "object"}}}));
    let args = json!({"ref": reference}).to_string();
    h.fake.push(Reply::chat_tool_calls(
        &[("call_own", TOOL, &args)],
        800,
        10,
    ));
    let (status, _, answer) = post(&url, "sk-recall-own", &body).await;
    assert_eq!(status, 200);
    let sent = h.fake.last().unwrap().json();
    let named = sent["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["function"]["name"] == TOOL)
        .count();
    assert_eq!(named, 1, "the client's tool alone: {}", sent["tools"]);
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(
        answer["choices"][0]["message"]["tool_calls"][0]["id"], "call_own",
        "the client's tool's call is the client's"
    );

    let mut body = next_turn(&history, false);
    body["n"] = json!(2);
    h.fake.push(Reply::chat("Two answers.", 800, 10));
    let (status, _, _) = post(&url, "sk-recall-own", &body).await;
    assert_eq!(status, 200);
    let sent = h.fake.last().unwrap().json();
    assert!(
        sent["messages"].to_string().contains("original archived"),
        "compacted"
    );
    assert!(
        !sent["tools"].to_string().contains(TOOL),
        "{}",
        sent["tools"]
    );
}

/// A request compacted after identification (here by `x-compactor-compact:
/// now`) is offered recall like one a stored compaction covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_compacted_on_request_is_offered_recall() {
    let h = Harness::start_with(support::small_window_foreground).await;
    let (history, reference) = conversation("now");
    let url = format!("{}/chat/completions", h.url());
    let call = recall_call("call_r", &reference);
    h.fake.push(Reply::chat_tool_calls(
        &[(&call.0, &call.1, &call.2)],
        900,
        12,
    ));
    h.fake.push(Reply::chat("E0308 in src/now.rs.", 1500, 9));
    let resp = within(
        client()
            .post(&url)
            .header("authorization", "Bearer sk-recall-now")
            .header("x-compactor-compact", "now")
            .json(&next_turn(&history, false))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let answer: Value = within(resp.json()).await.unwrap();
    assert_eq!(
        answer["choices"][0]["message"]["content"], "E0308 in src/now.rs.",
        "{answer}"
    );
    assert!(recalled_text(&h).starts_with("error[E0308]: mismatched types in src/now.rs"));
}

/// A continued request the upstream finds too long goes again without the
/// recall rounds: the request fitted before them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_long_after_a_recall_round_drops_the_rounds_first() {
    let h = Harness::start_with(small_window).await;
    let (history, reference) = conversation("over");
    compacted(&h, "sk-recall-over", &history).await;
    let compactions = support::compactions(&h);
    let call = recall_call("call_r", &reference);
    h.fake.push(Reply::chat_tool_calls(
        &[(&call.0, &call.1, &call.2)],
        900,
        12,
    ));
    h.fake.push(Reply::context_length_exceeded());
    h.fake
        .push(Reply::chat("From the marker alone: E0308.", 1200, 9));
    let before = h.fake.received().len();
    let url = format!("{}/chat/completions", h.url());
    let (status, _, body) = post(&url, "sk-recall-over", &next_turn(&history, false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let sent: Vec<Value> = h.fake.received()[before..]
        .iter()
        .map(|r| r.json())
        .collect();
    assert_eq!(sent.len(), 3, "the round, the overflow, the request again");
    let last = &sent[2];
    assert!(!last["tools"].to_string().contains(TOOL));
    assert!(
        !last["messages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["tool_calls"].to_string().contains(TOOL)),
        "the rounds are gone"
    );
    assert_eq!(
        last["messages"].as_array().unwrap().len(),
        sent[0]["messages"].as_array().unwrap().len(),
        "the request as compacted before the rounds"
    );
    assert_eq!(support::compactions(&h), compactions, "no fresh compaction");
}
