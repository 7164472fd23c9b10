//! Anthropic Messages (`POST /v1/messages`) through the proxy, against the
//! fake upstream's Messages endpoint, which refuses what the API documents
//! it refuses (see `compactor::fake_upstream::anthropic`): recording and usage with
//! the cached part, the conversation ids Claude Code sends, errors in this
//! API's shape, and compaction that keeps every request valid — pairing,
//! the first role, cache breakpoints, thinking signatures — through a long
//! thinking tool loop and an overflow.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::anthropic::{self, Answer};
use compactor::fake_upstream::{Received, Reply};
use compactor::wire::messages::MessagesCollector;
use serde_json::{json, Value};
use support::*;

const KEY: &str = "sk-ant-test-key-0001";

/// POSTs a body to `path` (below `/v1`) as the anthropic SDKs do; returns
/// status, headers and body.
async fn post_anthropic(
    h: &Harness,
    path: &str,
    body: &Value,
    extra: &[(&str, &str)],
) -> (u16, http::HeaderMap, Vec<u8>) {
    let mut req = client()
        .post(format!("{}{path}", h.url()))
        .header("x-api-key", KEY)
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(body).unwrap());
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let resp = within(req.send()).await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = within(resp.bytes()).await.expect("body");
    (status, headers, bytes.to_vec())
}

/// A Messages request.
async fn send(
    h: &Harness,
    body: &Value,
    extra: &[(&str, &str)],
) -> (u16, http::HeaderMap, Vec<u8>) {
    post_anthropic(h, "/messages", body, extra).await
}

/// The assistant message of an answer, JSON or SSE.
fn assistant_of(body: &[u8], streamed: bool) -> Value {
    if !streamed {
        let v: Value = serde_json::from_slice(body).expect("JSON answer");
        return json!({"role": "assistant", "content": v["content"]});
    }
    let mut c = MessagesCollector::default();
    let text = String::from_utf8_lossy(body);
    for event in text.split("\n\n") {
        let mut name = "";
        let mut data = String::new();
        for line in event.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = n;
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push_str(d);
            }
        }
        if !data.is_empty() {
            c.push(name, &data);
        }
    }
    assert!(c.finished(), "the stream ended with message_stop: {text}");
    c.items().remove(0)
}

fn messages_requests(h: &Harness) -> Vec<Received> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/messages")
        .collect()
}

fn is_summary(r: &Received) -> bool {
    anthropic::is_summarizer_request(&r.json())
}

fn tiny_claude(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "claude-tiny*".into(),
        context_window: 9000,
        max_output_tokens: Some(1024),
        trigger_ratio: None,
        ..Default::default()
    });
}

#[tokio::test]
async fn a_messages_exchange_is_relayed_and_recorded_with_its_cached_usage() {
    let h = Harness::start().await;
    let body = json!({"model": "claude-x", "max_tokens": 100,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "hello"}]});
    let (status, headers, bytes) = send(&h, &body, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert!(headers.get("x-compactor-conversation").is_some());
    let got = h.fake.last().unwrap();
    assert_eq!(got.path, "/v1/messages");
    assert_eq!(
        got.body,
        serde_json::to_vec(&body).unwrap(),
        "the client's bytes went as they came"
    );
    assert_eq!(got.headers["x-api-key"], KEY);
    assert_eq!(got.headers["anthropic-version"], "2023-06-01");
    h.wait_exchanges(1).await;
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    let u = &answer["usage"];
    let prompt = u["input_tokens"].as_i64().unwrap()
        + u["cache_read_input_tokens"].as_i64().unwrap()
        + u["cache_creation_input_tokens"].as_i64().unwrap();
    let recorded = number(&*h.sql(), "SELECT input_tokens FROM exchanges");
    assert_eq!(recorded, prompt);
    let endpoint: Vec<String> = column(&*h.sql(), "SELECT endpoint FROM exchanges");
    assert_eq!(endpoint, vec!["/messages".to_string()]);

    // A stream: the same bytes reach the client, its usage is read from
    // `message_start` and the cumulative `message_delta`, and the cached
    // part is counted in the prompt.
    h.fake.simulate_prompt_cache();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["messages"] = json!([{"role": "user", "content": "x".repeat(20_000)}]);
    send(&h, &streamed, &[]).await;
    let (status, headers, bytes) = send(&h, &streamed, &[]).await;
    assert_eq!(status, 200);
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.starts_with("event: message_start"), "{text}");
    assert!(text.contains("event: message_stop"));
    h.wait_exchanges(3).await;
    let rows = h
        .sql()
        .rows(
            "SELECT input_tokens, output_tokens, cached_tokens FROM exchanges ORDER BY id DESC LIMIT 1",
            &[],
        )
        .unwrap();
    let (input, output, cached): (i64, i64, i64) = (
        rows[0].get(0).unwrap(),
        rows[0].get(1).unwrap(),
        rows[0].get(2).unwrap(),
    );
    let sent = h.fake.last().unwrap().body.len() as i64;
    assert_eq!(
        input,
        (sent / 4).max(1),
        "input + cache read + cache creation"
    );
    assert!(
        cached > 0,
        "the second identical request was cached: {cached}"
    );
    assert_eq!(output, 7);
}

#[tokio::test]
async fn claude_codes_session_header_and_metadata_name_one_conversation() {
    let h = Harness::start().await;
    let session = "73bb4bad-637b-48d7-8ebb-b6ba349af0aa";
    let meta = json!({"user_id": format!("{{\"device_id\": \"d\", \"account_uuid\": \"\", \"session_id\": \"{session}\"}}")});
    let first = json!({"model": "claude-x", "max_tokens": 50, "metadata": meta,
        "messages": [{"role": "user", "content": "turn one"}]});
    let (_, h1, _) = send(&h, &first, &[]).await;
    // Another history under the header alone: the same conversation.
    let other = json!({"model": "claude-x", "max_tokens": 50,
        "messages": [{"role": "user", "content": "a title for this"}]});
    let (_, h2, _) = send(&h, &other, &[("x-claude-code-session-id", session)]).await;
    assert_eq!(
        h1["x-compactor-conversation"], h2["x-compactor-conversation"],
        "metadata.user_id's session_id and x-claude-code-session-id are one key"
    );
    h.wait_exchanges(2).await;
    let sessions: Vec<String> = column(&*h.sql(), "SELECT session_id FROM exchanges");
    assert_eq!(sessions, vec![session.to_string(), session.to_string()]);
}

#[tokio::test]
async fn errors_the_proxy_makes_on_this_endpoint_are_anthropic_shaped() {
    let h = Harness::start().await;
    let (status, _, body) =
        post_raw(&format!("{}/messages", h.url()), KEY, b"{not json".to_vec()).await;
    assert_eq!(status, 400);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("JSON"),
        "{v}"
    );
    assert!(
        v.get("error").unwrap().get("code").is_none(),
        "not OpenAI's shape: {v}"
    );
    let (status, _, body) = send(
        &h,
        &json!({"model": "m", "system": 5, "messages": [{"role": "user", "content": "x"}]}),
        &[],
    )
    .await;
    assert_eq!(status, 400);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["type"], "error");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("system"),
        "{v}"
    );
    assert!(!String::from_utf8_lossy(&body).contains(KEY));
    // The other endpoints keep theirs.
    let (_, _, body) = post_raw(&format!("{}/chat/completions", h.url()), KEY, b"{".to_vec()).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "invalid_json");
    // The process keeps serving.
    let (status, _, _) = send(
        &h,
        &json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    )
    .await;
    assert_eq!(status, 200);
}

/// A 2.5 KB tool output, different every time.
fn bash_output(step: usize) -> String {
    let mut out = format!("$ cargo test step{step}\n");
    for i in 0..60 {
        out.push_str(&format!(
            "test module_{step}::case_{i:02} ... ok (line {i} of the log)\n"
        ));
    }
    out.truncate(2500);
    out
}

/// A Claude-Code-shaped agent: a Bash tool, thinking on, 2.5 KB results,
/// one `cache_control` breakpoint moved onto the newest message, and the
/// `context_management` edit Claude Code sends on every turn.
struct Agent {
    history: Vec<Value>,
    step: usize,
    /// Bytes of every request body it sent.
    sent: usize,
    /// Its `anthropic-beta` header lines.
    betas: Vec<&'static str>,
    /// Sends no session id (`metadata.user_id` left out).
    anonymous: bool,
}

fn agent_tools() -> Value {
    json!([{"name": "Bash", "description": "Runs a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"}}])
}

impl Agent {
    fn new(task: &str) -> Agent {
        Agent {
            history: vec![json!({"role": "user", "content": [{"type": "text", "text": task}]})],
            step: 0,
            sent: 0,
            betas: vec!["context-management-2025-06-27"],
            anonymous: false,
        }
    }

    /// The request for `messages`, as Claude Code shapes it.
    fn body(messages: &[Value], streamed: bool) -> Value {
        json!({"model": "claude-tiny-1", "max_tokens": 1024,
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "tools": agent_tools(), "messages": messages, "stream": streamed,
            "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "{\"session_id\": \"loop-1\"}"}})
    }

    /// The history with Claude Code's breakpoint on its newest message.
    fn messages(&self) -> Vec<Value> {
        let mut msgs = self.history.clone();
        if let Some(Value::Array(blocks)) = msgs.last_mut().and_then(|m| m.get_mut("content")) {
            if let Some(Value::Object(b)) = blocks.last_mut() {
                b.insert("cache_control".into(), json!({"type": "ephemeral"}));
            }
        }
        msgs
    }

    /// One request and its answer: a tool call, or every eighth step the
    /// end of the turn and a new user message. Every answer must be a 200.
    async fn step(&mut self, h: &Harness) {
        let step = self.step;
        self.step += 1;
        let end_of_turn = step % 8 == 7;
        let answer = if end_of_turn {
            Answer::text(&format!("Step {step} done.")).thinking("wrap up")
        } else {
            Answer::tool_use(
                &format!("toolu_{step:03}"),
                "Bash",
                json!({"command": format!("cargo test step{step}")}),
            )
            .thinking(&format!("step {step}: run the tests"))
        };
        h.fake.push(Reply::Messages(answer));
        let streamed = step % 2 == 1;
        let mut body = Agent::body(&self.messages(), streamed);
        if self.anonymous {
            body.as_object_mut().unwrap().remove("metadata");
        }
        self.sent += serde_json::to_vec(&body).unwrap().len();
        let betas: Vec<_> = self.betas.iter().map(|b| ("anthropic-beta", *b)).collect();
        let (status, _, bytes) = send(h, &body, &betas).await;
        assert_eq!(
            status,
            200,
            "step {step}: {}",
            String::from_utf8_lossy(&bytes)
        );
        let assistant = assistant_of(&bytes, streamed);
        self.history.push(assistant.clone());
        if end_of_turn {
            self.history.push(json!({"role": "user", "content": [{"type": "text", "text": format!("Now the next part, after step {step}.")}]}));
        } else {
            let id = assistant["content"][1]["id"]
                .as_str()
                .expect("the scripted call")
                .to_string();
            self.history.push(json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id, "content": bash_output(step)}]}));
        }
    }
}

const TASK: &str = "Task: make every test in crates/ledger pass; do not touch the public API.";

/// A client that names no session and moves its one breakpoint onto the
/// newest block every request, as Anthropic's docs advise: the breakpoint
/// is not content, so its requests stay one conversation, which is
/// compacted once past the threshold, and that compaction is found and
/// applied to the requests that follow.
#[tokio::test]
async fn a_client_moving_its_breakpoint_without_a_session_keeps_one_conversation() {
    let h = Harness::start_with(tiny_claude).await;
    h.fake.set_messages_window(Some(9000));
    let mut agent = Agent::new(TASK);
    agent.anonymous = true;
    let mut steps = 0;
    while compactions(&h) == 0 {
        assert!(
            steps < 16,
            "compacted past the threshold within 16 requests"
        );
        agent.step(&h).await;
        steps += 1;
    }
    wait_compactions(&h, 1).await;
    for _ in 0..4 {
        agent.step(&h).await;
    }
    let received = messages_requests(&h);
    let client_requests: Vec<Value> = received
        .iter()
        .filter(|r| !is_summary(r))
        .map(Received::json)
        .collect();
    assert_eq!(client_requests.len(), steps + 4);
    let conversations: Vec<String> =
        column(&*h.sql(), "SELECT DISTINCT conversation_id FROM exchanges");
    assert_eq!(
        conversations.len(),
        1,
        "{} requests: {conversations:?}",
        steps + 4
    );
    // Each request's breakpoint was on its newest block only.
    for r in &client_requests {
        let last = r["messages"].as_array().unwrap().last().unwrap();
        let blocks = last["content"].as_array().unwrap();
        assert!(
            blocks.last().unwrap().get("cache_control").is_some(),
            "{last}"
        );
    }
    let stored: Vec<String> = column(&*h.sql(), "SELECT id FROM compactions");
    assert_eq!(stored.len(), 1, "compacted once: {stored:?}");
    // The four requests after it went upstream compacted, with the stored
    // compaction, and every rule the API has held.
    for r in &client_requests[steps..] {
        let first = &r["messages"][0];
        assert!(compactor::compaction::items::is_summary(first), "{first}");
    }
    for r in received.iter().filter(|r| !is_summary(r)) {
        assert!(anthropic::check(&r.json(), &r.headers, None).is_none());
    }
    let applied: Vec<Option<String>> = column(
        &*h.sql(),
        "SELECT compaction_id FROM exchanges ORDER BY id DESC LIMIT 4",
    );
    assert_eq!(applied, vec![Some(stored[0].clone()); 4]);
}

/// A client that sends its betas on two header lines: a request the proxy
/// adds its own beta to (compacted inside an open tool loop with thinking
/// on) reaches the upstream with both of the client's and the proxy's.
#[tokio::test]
async fn a_clients_beta_lines_all_reach_the_upstream_when_the_proxy_adds_one() {
    let h = Harness::start_with(tiny_claude).await;
    h.fake.set_messages_window(Some(9000));
    let mut agent = Agent::new(TASK);
    agent.betas = vec![
        "context-management-2025-06-27",
        "interleaved-thinking-2025-05-14",
    ];
    let bound = |r: &Received| {
        r.json()["thinking"]["block_binding"]["prefix_mismatch_behavior"] == "drop_block"
    };
    while !messages_requests(&h).iter().any(bound) {
        agent.step(&h).await;
        assert!(agent.step < 48, "no request the proxy added its beta to");
    }
    let received = messages_requests(&h);
    for r in received.iter().filter(|r| !is_summary(r)) {
        let betas: Vec<&str> = r
            .headers
            .get_all("anthropic-beta")
            .iter()
            .flat_map(|v| v.to_str().unwrap().split(','))
            .map(str::trim)
            .collect();
        for client in &agent.betas {
            assert!(betas.contains(client), "{client} lost: {betas:?}");
        }
        let binding = betas.contains(&compactor::wire::messages::BLOCK_BINDING_BETA);
        assert_eq!(binding, bound(r), "{betas:?}");
    }
}

/// A Claude-Code-shaped agent loop with thinking on against an upstream
/// whose window it exceeds several times over: every answer reaches the
/// client as a 200, every request the upstream received keeps the API's
/// rules, and the conversation was compacted.
#[tokio::test]
async fn a_long_thinking_tool_loop_runs_past_a_small_window_with_every_request_valid() {
    let h = Harness::start_with(tiny_claude).await;
    h.fake.set_messages_window(Some(9000));
    let mut agent = Agent::new(TASK);
    for _ in 0..48 {
        agent.step(&h).await;
    }
    let sent_total = agent.sent;
    let received = messages_requests(&h);
    let client_requests: Vec<&Received> = received.iter().filter(|r| !is_summary(r)).collect();
    for r in &client_requests {
        // Every rule but the window (an overflow is answered, then retried).
        assert!(
            anthropic::check(&r.json(), &r.headers, None).is_none(),
            "a request the API would refuse went upstream: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
    assert!(compactions(&h) >= 1, "the conversation was compacted");
    // A compacted request inside an open tool loop keeps the last
    // assistant message's own thinking block (the API requires it) and lets
    // the API drop it, since its prefix changed; any other thinking from
    // before the compaction is gone.
    let mut inside_loop = 0;
    for r in &client_requests {
        let v = r.json();
        let msgs = v["messages"].as_array().unwrap();
        let compacted = compactor::compaction::items::is_summary(&msgs[0]);
        if !compacted {
            continue;
        }
        let open = msgs
            .last()
            .is_some_and(compactor::wire::messages::is_tool_result_message);
        let kept = msgs
            .iter()
            .filter(|m| compactor::wire::messages::has_thinking(m))
            .count();
        if open && kept > 0 {
            inside_loop += 1;
            assert_eq!(
                v["thinking"]["block_binding"]["prefix_mismatch_behavior"], "drop_block",
                "{v}"
            );
            let beta = r.headers["anthropic-beta"].to_str().unwrap();
            assert!(beta.starts_with("context-management-2025-06-27,"), "{beta}");
            assert!(
                beta.contains(compactor::wire::messages::BLOCK_BINDING_BETA),
                "{beta}"
            );
        }
    }
    eprintln!(
        "{} requests, {} compacted inside a tool loop, {} compactions",
        client_requests.len(),
        inside_loop,
        compactions(&h)
    );
    assert!(
        sent_total / 4 > 3 * 9000,
        "the loop is several windows long: {} tokens",
        sent_total / 4
    );
    let last = client_requests.last().unwrap().json();
    assert!(
        anthropic::prompt_tokens(&last) <= 9000,
        "the last request fits"
    );
    let first = &last["messages"][0];
    assert_eq!(first["role"], "user");
    let text = compactor::compaction::items::text_of(first);
    assert!(
        text.starts_with(compactor::compaction::items::SUMMARY_MARKER),
        "{text}"
    );
    assert!(text.contains(TASK), "the task survives: {text}");
    // The client's own parameters went as sent.
    assert_eq!(
        last["context_management"]["edits"][0]["type"],
        "clear_thinking_20251015"
    );
    assert_eq!(last["thinking"]["type"], "adaptive");
    // Summaries were asked of the same API, with the client's key.
    let summary = received
        .iter()
        .find(|r| is_summary(r))
        .expect("a summary call");
    assert_eq!(summary.headers["x-api-key"], KEY);
    assert!(summary.headers.get("anthropic-version").is_some());
    // Asked of the request the upstream last saw: its system as sent.
    assert_eq!(summary.json()["system"], last["system"]);
}

/// "prompt is too long" from an upstream whose window the proxy did not
/// know: compacted at once and sent again, so the client sees a 200; the
/// window is learned.
#[tokio::test]
async fn an_overflow_is_compacted_and_retried_and_the_window_learned() {
    let h = Harness::start_with(|c| c.compaction.background = false).await;
    h.fake.set_messages_window(Some(6000));
    let mut history = vec![json!({"role": "user", "content": "Task: tidy the build scripts."})];
    let mut overflowed = false;
    for step in 0..14 {
        let answer = Answer::tool_use(&format!("toolu_{step}"), "Bash", json!({"command": "make"}));
        h.fake.push(Reply::Messages(answer));
        let body = json!({"model": "claude-unknown", "max_tokens": 500, "messages": history});
        let before = h.fake.received().len();
        let (status, _, bytes) = send(&h, &body, &[]).await;
        assert_eq!(
            status,
            200,
            "step {step}: {}",
            String::from_utf8_lossy(&bytes)
        );
        let upstream = h.fake.received();
        overflowed |= upstream.len() > before + 1;
        let assistant = assistant_of(&bytes, false);
        let id = assistant["content"][0]["id"].as_str().unwrap().to_string();
        history.push(assistant);
        history.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id, "content": bash_output(step)}]}));
    }
    assert!(overflowed, "the upstream refused at least once");
    let windows: Vec<i64> = column(
        &*h.sql(),
        "SELECT context_window FROM exchanges ORDER BY id DESC LIMIT 1",
    );
    assert_eq!(windows, vec![6000], "the stated window is learned");
    for r in messages_requests(&h).iter().filter(|r| !is_summary(r)) {
        assert!(anthropic::check(&r.json(), &r.headers, None).is_none());
    }
}

/// POSTs a body to `/v1/messages/count_tokens` as Claude Code does.
async fn count_tokens(h: &Harness, body: &Value, extra: &[(&str, &str)]) -> (u16, Value) {
    let mut headers = vec![("anthropic-beta", "token-counting-2024-11-01")];
    headers.extend_from_slice(extra);
    let (status, _, bytes) =
        post_anthropic(h, "/messages/count_tokens?beta=true", body, &headers).await;
    (status, serde_json::from_slice(&bytes).expect("JSON"))
}

/// A client that sizes its next request by count_tokens is told the size
/// of what the proxy would send for it, so it does not compact early; a
/// body that extends no compacted conversation — a single tool result
/// sized under the same session id — goes as it came.
#[tokio::test]
async fn count_tokens_answers_what_the_proxy_would_send_for_a_compacted_conversation() {
    let h = Harness::start_with(tiny_claude).await;
    h.fake.set_messages_window(Some(9000));
    let mut agent = Agent::new(TASK);
    while compactions(&h) == 0 || agent.step < 12 {
        agent.step(&h).await;
        assert!(agent.step < 48, "no compaction in 48 steps");
    }
    // The next request as the client would send it, sized first.
    let mut body = Agent::body(&agent.messages(), false);
    body.as_object_mut().unwrap().remove("stream");
    let (status, counted) = count_tokens(&h, &body, &[]).await;
    assert_eq!(status, 200, "{counted}");
    let upstream = h.fake.last().unwrap();
    assert_eq!(upstream.path, "/v1/messages/count_tokens");
    assert_eq!(upstream.query.as_deref(), Some("beta=true"));
    assert_eq!(upstream.headers["x-api-key"], KEY);
    let sized = upstream.json();
    assert_ne!(
        sized["messages"], body["messages"],
        "the compacted body was counted"
    );
    assert_eq!(sized["system"], body["system"]);
    let n = counted["input_tokens"].as_u64().unwrap();
    assert_eq!(n, anthropic::prompt_tokens(&sized));
    assert!(
        n < anthropic::prompt_tokens(&body),
        "{n} is less than the client's own body counts"
    );
    // What the proxy then sends for the same request counts the same.
    h.fake.push(Reply::Messages(Answer::text("ok")));
    let (status, _, _) = send(&h, &body, &[]).await;
    assert_eq!(status, 200);
    let sent = h.fake.last().unwrap().json();
    assert_eq!(anthropic::prompt_tokens(&sent), n);
    // Claude Code also sizes a single tool result here, under the session id.
    let single = json!({"model": "claude-tiny-1", "messages": [{"role": "user", "content": bash_output(99)}]});
    let (status, _) = count_tokens(&h, &single, &[("x-claude-code-session-id", "loop-1")]).await;
    assert_eq!(status, 200);
    assert_eq!(
        h.fake.last().unwrap().body,
        serde_json::to_vec(&single).unwrap(),
        "forwarded as it came"
    );
    // Nothing of this is recorded as an exchange.
    let exchanges = number(&*h.sql(), "SELECT count(*) FROM exchanges");
    assert_eq!(exchanges as usize, agent.step + 1);
}

/// The text Claude Code appends to the last user message when it asks the
/// model to compact the conversation itself.
const CLAUDE_COMPACT_PROMPT: &str = "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\nYour task is to create a detailed summary of the conversation so far, paying close attention to the user's explicit requests and your previous actions.";

/// Claude Code's own compaction request: the history, its summary prompt
/// appended to the last user message.
fn claude_compaction_request(history: &[Value]) -> Value {
    let mut msgs = history.to_vec();
    let last = msgs.last_mut().unwrap();
    if let Some(Value::Array(blocks)) = last.get_mut("content") {
        blocks.push(json!({"type": "text", "text": CLAUDE_COMPACT_PROMPT}));
    }
    let mut body = Agent::body(&msgs, false);
    body.as_object_mut().unwrap().remove("tools");
    body
}

/// Claude Code's own compaction request goes as it came while it fits;
/// over the window it goes with the stored compaction of the prefix it
/// covers — never a fresh summary of a summary — and its overflow never
/// reaches the client. It starts no compaction of its own.
#[tokio::test]
async fn claude_codes_own_compaction_request_goes_as_it_came_or_with_the_stored_replacement() {
    let h = Harness::start_with(tiny_claude).await;
    h.fake.set_messages_window(Some(9000));
    let mut agent = Agent::new(TASK);
    // Until a compaction is stored and the history alone is over the window.
    while compactions(&h) == 0
        || anthropic::prompt_tokens(&claude_compaction_request(&agent.history)) <= 9000
    {
        agent.step(&h).await;
        assert!(agent.step < 60, "no compaction in 60 steps");
    }
    let summaries = || {
        messages_requests(&h)
            .iter()
            .filter(|r| is_summary(r))
            .count()
    };
    // What the agent's own last exchange started has finished.
    within(async {
        loop {
            let seen = (compactions(&h), summaries());
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            if (compactions(&h), summaries()) == seen {
                break;
            }
        }
    })
    .await;
    let stored = compactions(&h);
    let before = summaries();

    // A short history under a compaction: it fits, so it goes untouched.
    let short = Agent::new("Task: say hi.");
    let mut short_body = claude_compaction_request(&short.history);
    short_body["metadata"] = json!({"user_id": "{\"session_id\": \"other\"}"});
    h.fake
        .push(Reply::Messages(Answer::text("<summary>hi</summary>")));
    let (status, _, _) = send(&h, &short_body, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(
        h.fake.last().unwrap().body,
        serde_json::to_vec(&short_body).unwrap()
    );

    // The long one does not fit: the stored replacement of its prefix.
    let body = claude_compaction_request(&agent.history);
    assert!(
        anthropic::prompt_tokens(&body) > 9000,
        "over the window as sent"
    );
    h.fake.push(Reply::Messages(Answer::text(
        "<summary>the work so far</summary>",
    )));
    let (status, headers, bytes) = send(&h, &body, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert!(headers.get("x-compactor-compacted").is_some());
    let sent = h.fake.last().unwrap().json();
    assert!(anthropic::prompt_tokens(&sent) <= 9000);
    let msgs = sent["messages"].as_array().unwrap();
    let last_text = compactor::compaction::items::text_of(msgs.last().unwrap());
    assert!(
        last_text.contains(CLAUDE_COMPACT_PROMPT),
        "its prompt goes as sent"
    );
    assert_eq!(
        summaries(),
        before,
        "no summary of a summary was made for it"
    );
    h.wait_exchanges(agent.step as i64 + 2).await;
    // Give a background compaction the chance it must not take.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(compactions(&h), stored, "it started no compaction");
    assert_eq!(summaries(), before);
}

/// A compacted Messages request whose tool outputs were shortened gets the
/// `compactor_recall` tool (Anthropic's shape: `input_schema`); a call of
/// it is answered by the proxy — in JSON and in a stream — and the request
/// continued, so the client sees only the final answer and never a call of
/// a tool it did not declare.
#[tokio::test]
async fn a_recall_round_is_answered_by_the_proxy_in_json_and_in_streams() {
    let h = Harness::start_with(|c| {
        tiny_claude(c);
        c.compaction.tool_output_max_bytes = 1000;
        c.compaction.tool_output_keep_bytes = 300;
    })
    .await;
    h.fake.set_messages_window(Some(9000));
    let mut agent = Agent::new(TASK);
    let offered = |r: &Received| {
        r.json()["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|d| d["name"] == "compactor_recall"))
    };
    while !messages_requests(&h).iter().any(offered) {
        agent.step(&h).await;
        assert!(agent.step < 48, "the recall tool was never offered");
    }
    let definition = messages_requests(&h)
        .into_iter()
        .find(offered)
        .unwrap()
        .json()["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "compactor_recall")
        .cloned()
        .unwrap();
    assert!(definition["input_schema"].is_object(), "{definition}");
    for streamed in [false, true] {
        let before = messages_requests(&h).len();
        h.fake.push(Reply::Messages(
            Answer::tool_use(
                "toolu_recall",
                "compactor_recall",
                json!({"ref": "item:0000000000000000"}),
            )
            .thinking("read the original"),
        ));
        h.fake
            .push(Reply::Messages(Answer::text("Read it; carrying on.")));
        let body = Agent::body(&agent.messages(), streamed);
        let (status, _, bytes) = send(&h, &body, &[]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let answer = assistant_of(&bytes, streamed);
        assert_eq!(
            answer["content"],
            json!([{"type": "text", "text": "Read it; carrying on."}]),
            "the client sees the final answer only"
        );
        assert!(!String::from_utf8_lossy(&bytes).contains("compactor_recall"));
        let upstream = messages_requests(&h);
        let rounds: Vec<&Received> = upstream[before..]
            .iter()
            .filter(|r| !is_summary(r))
            .collect();
        assert_eq!(rounds.len(), 2, "the request, then its continuation");
        let cont = rounds[1].json();
        let msgs = cont["messages"].as_array().unwrap();
        let n = msgs.len();
        assert_eq!(msgs[n - 2]["content"][1]["name"], "compactor_recall");
        let result = &msgs[n - 1]["content"][0];
        assert_eq!(result["type"], "tool_result");
        assert_eq!(result["tool_use_id"], "toolu_recall");
        assert!(result["content"]
            .as_str()
            .unwrap()
            .contains("knows no archived output"));
        assert!(
            anthropic::check(&cont, &rounds[1].headers, None).is_none(),
            "{cont}"
        );
        // The client's next request goes on from what it saw.
        agent.history.push(answer);
        agent
            .history
            .push(json!({"role": "user", "content": [{"type": "text", "text": "Go on."}]}));
    }
}

/// A compacted request the upstream refuses for another reason than its
/// length is sent again as the client sent it — which, once earlier
/// requests went compacted, holds thinking the API signed against those:
/// the resent request lets the API drop such blocks, so it is not refused
/// for a signature.
#[tokio::test]
async fn a_refused_compacted_request_resent_as_sent_lets_the_api_drop_stale_thinking() {
    let h = Harness::start_with(tiny_claude).await;
    let mut agent = Agent::new(TASK);
    // Compactions applied to a few requests, so the client's own history
    // holds thinking signed against compacted requests. No window: the
    // client's full history fits the upstream.
    while compactions(&h) == 0 || agent.step < 20 {
        agent.step(&h).await;
        assert!(agent.step < 48, "no compaction in 48 steps");
    }
    let before = messages_requests(&h).len();
    h.fake.push(Reply::json(
        400,
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "a refusal of the compacted request"}}),
    ));
    h.fake.push(Reply::Messages(Answer::text("done")));
    let body = Agent::body(&agent.messages(), false);
    let (status, headers, bytes) = send(&h, &body, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert!(
        headers.get("x-compactor-compacted").is_none(),
        "the client's own request answered"
    );
    let sent: Vec<Received> = messages_requests(&h)[before..]
        .iter()
        .filter(|r| !is_summary(r))
        .cloned()
        .collect();
    assert_eq!(sent.len(), 2, "the compacted request, then the client's");
    let resent = sent[1].json();
    assert_eq!(
        resent["messages"], body["messages"],
        "as the client sent it"
    );
    assert_eq!(
        resent["thinking"]["block_binding"]["prefix_mismatch_behavior"],
        "drop_block"
    );
    assert!(anthropic::check(&resent, &sent[1].headers, None).is_none());
}
