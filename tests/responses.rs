//! Compaction for the Responses API: input items, reasoning, streamed
//! overflow before commit, `previous_response_id` chains, and compaction the
//! client asks for (`/v1/responses/compact`, Codex's `compaction_trigger`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use compactor::fake_upstream::{responses_stream_events, Reply};
use serde_json::{json, Value};
use support::responses::Session;
use support::{
    client, client_calls, compactions, last_client_call, post, raw_upstream, read_request,
    small_window, small_window_foreground, within, Harness,
};

const KEY: &str = "sk-responses-tests";
const MODEL: &str = "tiny-codex";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_input_sessions_compact_and_keep_reasoning_only_in_the_tail() {
    let h = Harness::start_with(small_window).await;
    let url = format!("{}/responses", h.url());
    let mut s = Session::new();
    let mut turns = 0;
    while compactions(&h) == 0 {
        s.step();
        let (status, _, _) = post(&url, KEY, &s.body(false)).await;
        assert_eq!(status, 200);
        turns += 1;
        assert!(turns < 40, "never compacted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.step();
    // A new user message: the turn boundary a waiting compaction applies at.
    s.input.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go on"}]}));
    let (status, headers, _) = post(&url, KEY, &s.body(true)).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_some());
    let sent = last_client_call(&h);
    assert_eq!(
        sent["instructions"], "Be precise.",
        "instructions untouched"
    );
    let input = sent["input"].as_array().unwrap();
    assert_eq!(input[0], s.input[0], "developer prompt verbatim");
    assert!(input.iter().any(|i| i["content"]
        .as_str()
        .is_some_and(|t| t.starts_with("[compactor summary"))));
    // Reasoning of the summarized part is gone; the tail's is verbatim.
    let tail_start = input
        .iter()
        .position(|i| i["type"] == "reasoning")
        .expect("tail keeps its reasoning");
    assert_eq!(
        &input[tail_start..],
        &s.input[s.input.len() - (input.len() - tail_start)..]
    );
    let kept_reasoning = input.iter().filter(|i| i["type"] == "reasoning").count();
    assert!(kept_reasoning < s.n);
    // Every function_call_output still has its call.
    for (i, item) in input.iter().enumerate() {
        if item["type"] == "function_call_output" {
            assert!(input[..i]
                .iter()
                .any(|c| c["type"] == "function_call" && c["call_id"] == item["call_id"]));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_fails_for_lack_of_room_is_compacted_and_retried_before_the_client_sees_it() {
    let h = Harness::start_with(small_window_foreground).await;
    let url = format!("{}/responses", h.url());
    let mut s = Session::new();
    for _ in 0..8 {
        s.step();
        assert_eq!(post(&url, KEY, &s.body(false)).await.0, 200);
    }
    let failed = vec![
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_f\",\"status\":\"in_progress\"}}\n\n".to_string(),
        "event: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"response\":{\"id\":\"resp_f\",\"status\":\"in_progress\"}}\n\n".to_string(),
        "event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"id\":\"resp_f\",\"status\":\"failed\",\"error\":{\"code\":\"context_length_exceeded\",\"message\":\"Your input exceeds the context window of this model.\"}}}\n\n".to_string(),
    ];
    h.fake.push(Reply::sse(failed));
    s.step();
    let (status, headers, body) = post(&url, KEY, &s.body(true)).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        !text.contains("response.failed") && !text.contains("resp_f\""),
        "the failed start never reached the client: {text}"
    );
    assert!(text.contains("event: response.completed"));
    assert!(headers.get("x-compactor-compacted").is_some());

    // A stream that commits normally is relayed byte for byte.
    let events = responses_stream_events("resp_ok", &["a", "b"], 10, 2);
    h.fake.push(Reply::sse(events.clone()));
    let (_, _, body) = post(
        &url,
        "sk-another-tenant",
        &json!({"model": MODEL, "input": "hi", "stream": true}),
    )
    .await;
    assert_eq!(String::from_utf8(body.to_vec()).unwrap(), events.concat());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_response_id_chains_are_expanded_from_the_proxys_records() {
    let h = Harness::start().await;
    let url = format!("{}/responses", h.url());
    let (status, _, body) = post(
        &url,
        KEY,
        &json!({"model": "gpt-5", "instructions": "be brief", "input": "turn one"}),
    )
    .await;
    assert_eq!(status, 200);
    let first: Value = serde_json::from_slice(&body).unwrap();
    let id1 = first["id"].as_str().unwrap().to_string();
    let (status, h2, body) = post(&url, KEY, &json!({"model": "gpt-5", "input": "turn two", "previous_response_id": id1, "stream": true})).await;
    assert_eq!(status, 200);
    let sent = last_client_call(&h);
    assert!(
        sent.get("previous_response_id").is_none(),
        "the upstream needs no stored responses"
    );
    assert!(
        sent.get("stream_options").is_none(),
        "stream usage is a Chat Completions matter"
    );
    let input = sent["input"].as_array().unwrap();
    assert_eq!(input[0], json!({"role": "user", "content": "turn one"}));
    assert_eq!(input[1], first["output"][0]);
    assert_eq!(input[2], json!({"role": "user", "content": "turn two"}));
    // A third turn chains onto the streamed second one.
    let text = String::from_utf8(body.to_vec()).unwrap();
    let id2 = text
        .split("\"id\":\"")
        .filter_map(|p| p.split('"').next())
        .find(|i| i.starts_with("resp_") && *i != id1)
        .unwrap()
        .to_string();
    let (status, h3, _) = post(
        &url,
        KEY,
        &json!({"model": "gpt-5", "input": "turn three", "previous_response_id": id2}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(last_client_call(&h)["input"].as_array().unwrap().len(), 5);
    assert_eq!(
        h2.get("x-compactor-conversation"),
        h3.get("x-compactor-conversation")
    );
    // Another tenant cannot continue this chain: the id goes upstream as sent.
    let (_, _, _) = post(
        &url,
        "sk-intruder",
        &json!({"model": "gpt-5", "input": "x", "previous_response_id": id1}),
    )
    .await;
    assert_eq!(last_client_call(&h)["previous_response_id"], id1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compact_endpoint_returns_an_item_the_proxy_expands_later() {
    let h = Harness::start_with(small_window).await;
    let mut s = Session::new();
    for _ in 0..8 {
        s.step();
    }
    let before = client_calls(&h).len();
    let (status, headers, body) = post(
        &format!("{}/responses/compact", h.url()),
        KEY,
        &json!({"model": MODEL, "input": s.input, "instructions": "Be precise."}),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(headers.get("x-compactor-compacted").is_some());
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["object"], "response.compaction");
    assert!(answer["usage"]["input_tokens"].as_u64().unwrap() > 0);
    let output = answer["output"].as_array().unwrap().clone();
    let item = output
        .iter()
        .find(|i| i["type"] == "compaction")
        .expect("a compaction item");
    assert!(item["encrypted_content"]
        .as_str()
        .unwrap()
        .starts_with("compactor.v1."));
    assert_eq!(client_calls(&h).len(), before, "served by the proxy itself");

    // The client continues from the returned output.
    let mut next = vec![s.input[0].clone()];
    next.extend(output.clone());
    next.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "continue"}]}));
    let (status, _, _) = post(
        &format!("{}/responses", h.url()),
        KEY,
        &json!({"model": MODEL, "input": next}),
    )
    .await;
    assert_eq!(status, 200);
    let sent = last_client_call(&h);
    let input = sent["input"].as_array().unwrap();
    assert!(
        input.iter().all(|i| i["type"] != "compaction"),
        "the token never reaches the upstream"
    );
    assert!(
        input[1]["content"]
            .as_str()
            .unwrap()
            .contains("TASK: fix the flaky parser test"),
        "{}",
        input[1]
    );
    // Another tenant's request carrying the same item is not expanded.
    let (_, _, _) = post(
        &format!("{}/responses", h.url()),
        "sk-intruder",
        &json!({"model": MODEL, "input": next}),
    )
    .await;
    assert!(last_client_call(&h)["input"]
        .as_array()
        .unwrap()
        .iter()
        .any(|i| i["type"] == "compaction"));
}

/// A history too short to cut is refused with a code that says so, not as
/// a malformed body, and a message that gives the reason once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compact_endpoint_says_nothing_to_compact_with_its_own_code() {
    let h = Harness::start().await;
    for input in [
        json!("hello"),
        json!([]),
        json!([{"role": "user", "content": "hi"}]),
    ] {
        let (status, _, body) = post(
            &format!("{}/responses/compact", h.url()),
            KEY,
            &json!({"model": MODEL, "input": input}),
        )
        .await;
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(answer["error"]["code"], "nothing_to_compact", "{answer}");
        assert_eq!(answer["error"]["type"], "invalid_request_error");
        let message = answer["error"]["message"].as_str().unwrap();
        assert_eq!(
            message.matches("nothing to compact").count(),
            1,
            "the reason is said once: {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_in_band_trigger_is_answered_with_exactly_one_compaction_item() {
    let h = Harness::start_with(small_window).await;
    let mut s = Session::new();
    for _ in 0..8 {
        s.step();
    }
    let mut body = s.body(true);
    body["input"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "compaction_trigger"}));
    let before = client_calls(&h).len();
    let resp = within(
        client()
            .post(format!("{}/responses", h.url()))
            .header("authorization", format!("Bearer {KEY}"))
            .header("session-id", "019a-codex-session")
            .json(&body)
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers().get("content-type").unwrap(),
        "text/event-stream"
    );
    let text = within(resp.text()).await.unwrap();
    assert_eq!(client_calls(&h).len(), before);
    let completed: Value = text
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .find(|v| v["type"] == "response.completed")
        .expect("response.completed");
    let output = completed["response"]["output"].as_array().unwrap();
    assert_eq!(output.len(), 1);
    assert_eq!(output[0]["type"], "compaction");
    // Next turn: Codex keeps its initial context and the compaction item.
    let next = vec![
        s.input[0].clone(),
        output[0].clone(),
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go on"}]}),
    ];
    let (status, _, _) = post(
        &format!("{}/responses", h.url()),
        KEY,
        &json!({"model": MODEL, "input": next}),
    )
    .await;
    assert_eq!(status, 200);
    let input = last_client_call(&h)["input"].as_array().unwrap().clone();
    assert!(input[1]["content"]
        .as_str()
        .unwrap()
        .starts_with("[compactor summary"));
    assert!(input.iter().all(|i| i["type"] != "compaction"));
    assert_eq!(input.last().unwrap()["content"][0]["text"], "go on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stays_silent_after_its_prelude_is_released_after_ten_seconds() {
    // The upstream sends `response.created` and `response.in_progress`,
    // then nothing until the test lets it go on.
    let events = responses_stream_events("resp_quiet", &["think", "ing"], 5, 2);
    let (prelude, rest) = (events[..2].concat(), events[2..].concat());
    let go_on = Arc::new(tokio::sync::Notify::new());
    let gate = go_on.clone();
    let (first, second) = (prelude.clone(), rest.clone());
    let (url, requests) = raw_upstream(move |_, mut s, requests| {
        let (gate, first, second) = (gate.clone(), first.clone(), second.clone());
        async move {
            use tokio::io::AsyncWriteExt;
            if read_request(&mut s, &mut Vec::new()).await.is_none() {
                return;
            }
            requests.fetch_add(1, Ordering::SeqCst);
            let chunk = |t: &str| format!("{:x}\r\n{t}\r\n", t.len());
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            let _ = s.write_all(format!("{head}{}", chunk(&first)).as_bytes()).await;
            gate.notified().await;
            let _ = s.write_all(format!("{}0\r\n\r\n", chunk(&second)).as_bytes()).await;
        }
    })
    .await;
    let h = Harness::start_with(|c| c.upstream.base_url = url).await;
    let started = std::time::Instant::now();
    let mut resp = within(
        client()
            .post(format!("{}/responses", h.url()))
            .bearer_auth(KEY)
            .json(&json!({"model": MODEL, "input": "think first", "stream": true}))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let mut got = Vec::new();
    while got.len() < prelude.len() {
        let chunk = within(resp.chunk()).await.unwrap().expect("the prelude");
        got.extend_from_slice(&chunk);
    }
    let held = started.elapsed();
    assert!(
        held >= Duration::from_millis(9_500),
        "held back for the upstream to commit: {held:?}"
    );
    assert_eq!(
        String::from_utf8_lossy(&got),
        prelude,
        "released as it came"
    );
    // Still silent upstream: what follows is relayed as it comes.
    go_on.notify_one();
    while let Some(chunk) = within(resp.chunk()).await.unwrap() {
        got.extend_from_slice(&chunk);
    }
    assert_eq!(String::from_utf8(got).unwrap(), format!("{prelude}{rest}"));
    assert_eq!(requests.load(Ordering::SeqCst), 1);
    h.wait_exchanges(1).await;
    let (status, partial, output): (i64, i64, Option<i64>) = h
        .db()
        .query_row(
            "SELECT status, partial, output_tokens FROM exchanges",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!((status, partial, output), (200, 0, Some(2)));
}
