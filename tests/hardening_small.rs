//! Small holes of the fourth round, each through real sockets where the
//! behaviour is seen there: per-conversation memory that only grew, a
//! gateway's one small model, a stream larger than what is kept of it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::engine::Compactions;

/// The turn each conversation last asked for a compaction in, and the
/// conversations that had a round the proxy answered itself, were kept for
/// every conversation ever seen: a proxy serving many short conversations
/// grew without bound. Both keep the recent conversations, like every
/// other cache: one the proxy has not seen for long is forgotten (its
/// agent turn can be scheduled again), a recent one is not.
#[test]
fn per_conversation_marks_keep_the_recent_conversations_only() {
    let c = Compactions::default();
    let turn = [7u8; 32];
    assert!(c.schedule_agent_turn("t", "old", turn));
    assert!(!c.schedule_agent_turn("t", "old", turn), "one per turn");
    c.mark_hidden_round("t", "old");
    c.mark_hidden_round("t", "recent");
    for i in 0..100_000 {
        let conversation = format!("c{i}");
        c.schedule_agent_turn("t", &conversation, turn);
        c.mark_hidden_round("t", &conversation);
        if i % 1000 == 0 {
            assert!(c.had_hidden_round("t", "recent"), "seen again, so kept");
        }
    }
    assert!(c.had_hidden_round("t", "recent"));
    assert!(!c.had_hidden_round("t", "old"), "forgotten");
    assert!(
        c.schedule_agent_turn("t", "old", turn),
        "its turn forgotten too"
    );
}

/// A streamed answer far longer than anything a model writes: every byte
/// reaches the client, and the record keeps what the proxy collects of one
/// answer at most, marked cut (the proxy collected and recorded all of it:
/// a 192 MB stream grew it by 1.2 GB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_stream_is_relayed_whole_and_recorded_cut() {
    use compactor::fake_upstream::Reply;
    use compactor::wire::sse::MAX_COLLECTED;
    let h = support::Harness::start().await;
    let piece = "lorem ipsum dolor sit amet ".repeat(40);
    let count = MAX_COLLECTED / piece.len() * 5 / 4;
    let pieces: Vec<&str> = std::iter::repeat_n(piece.as_str(), count).collect();
    h.fake.push(Reply::chat_stream(&pieces, Some((40, 9))));
    let body = serde_json::json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": "Write it all out."}]});
    let url = format!("{}/chat/completions", h.url());
    let (status, _, got) = support::post(&url, "sk-huge", &body).await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&got);
    let content: usize = text
        .split("\n\n")
        .filter_map(|b| b.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v.pointer("/choices/0/delta/content")?
                .as_str()
                .map(str::len)
        })
        .sum();
    assert_eq!(content, piece.len() * count, "every byte relayed");
    assert!(text.trim_end().ends_with("data: [DONE]"));
    let db = h.sql();
    let partial: Vec<bool> = support::column(&*db, "SELECT partial FROM exchanges");
    let error: Vec<Option<String>> = support::column(&*db, "SELECT error FROM exchanges");
    assert_eq!(partial, [true], "{error:?}");
    assert!(
        error[0]
            .as_deref()
            .is_some_and(|e| e.contains("recorded cut")),
        "{error:?}"
    );
    let stored: Vec<i64> = support::column(&*db, "SELECT length(body) FROM items");
    let stored: i64 = stored.iter().sum();
    assert!(
        (stored as usize) < MAX_COLLECTED + (1 << 20),
        "{stored} bytes stored"
    );
}

/// The windows `/admin/api/windows` shows: (model, window, source).
async fn admin_windows(h: &support::Harness) -> Vec<(String, u64, String)> {
    let v: serde_json::Value = h.get_json("/admin/api/windows").await;
    let s = |m: &serde_json::Value, k: &str| m[k].as_str().unwrap_or_default().to_string();
    v["models"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            (
                s(m, "model"),
                m["context_window"].as_u64().unwrap_or(0),
                s(m, "source"),
            )
        })
        .collect()
}

/// A gateway whose `/v1/models` lists one small model of its own, and
/// routes other names elsewhere: its window was taken for every model
/// asked, and a 128k model was compacted as if it had 2048 tokens. It is
/// its named model's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateways_one_listed_window_is_its_models_alone() {
    use compactor::fake_upstream::Reply;
    let h = support::Harness::start_with(|c| c.upstream.discover_windows = true).await;
    let listed = serde_json::json!({"object": "list", "data": [
        {"id": "small-local", "object": "model", "owned_by": "vllm", "max_model_len": 2048}]});
    let url = format!("{}/chat/completions", h.url());
    for model in ["gpt-4o", "small-local"] {
        h.fake.push(Reply::json(200, listed.clone()));
        let body = serde_json::json!({"model": model,
            "messages": [{"role": "user", "content": "hello"}]});
        let (status, _, _) = support::post(&url, "sk-gateway", &body).await;
        assert_eq!(status, 200, "{model}");
    }
    let windows = admin_windows(&h).await;
    assert!(
        windows.contains(&("small-local".into(), 2048, "discovered".into())),
        "{windows:?}"
    );
    assert!(
        !windows.iter().any(|(m, w, _)| m == "gpt-4o" && *w == 2048),
        "{windows:?}"
    );
    let (limits, _) = h.state.model_window("gpt-4o");
    assert!(limits.context_window > 100_000, "{limits:?}");
}

/// Claude Code's own compaction request, with no compaction stored and
/// too long for the upstream: it is compacted there and then, its summary
/// prompt kept as sent, and the client gets its summary, not the refusal
/// (what the reference says; it promised no fresh summary, which the proxy
/// made all along).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_compaction_request_refused_as_too_long_is_compacted_once() {
    use compactor::fake_upstream::anthropic::{self, Answer};
    use compactor::fake_upstream::Reply;
    use serde_json::{json, Value};
    const PROMPT: &str = "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\nYour task is to create a detailed summary of the conversation so far, paying close attention to the user's explicit requests and your previous actions.";
    let h = support::Harness::start().await;
    h.fake.set_messages_window(Some(9000));
    let mut messages = Vec::new();
    for turn in 0..8 {
        let text = format!(
            "Step {turn}: {}",
            (0..220)
                .map(|i| format!("the parser module {i} of step {turn} was rebuilt; "))
                .collect::<String>()
        );
        messages.push(json!({"role": "user", "content": [{"type": "text", "text": text}]}));
        messages.push(json!({"role": "assistant", "content": [{"type": "text", "text": format!("Done with step {turn}.")}]}));
    }
    messages.push(json!({"role": "user", "content": [
        {"type": "text", "text": "Carry on."}, {"type": "text", "text": PROMPT}]}));
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 1000, "messages": messages});
    assert!(anthropic::prompt_tokens(&body) > 9000, "too long as sent");
    h.fake.push(Reply::Messages(Answer::text(
        "<summary>the steps so far</summary>",
    )));
    let resp = support::post_messages(&h, "sk-ant-own", "", &body).await;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = support::within(resp.text()).await.unwrap();
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("the steps so far"), "{text}");
    assert!(headers.get("x-compactor-compacted").is_some());
    let sent = support::client_calls(&h);
    assert_eq!(sent.len(), 2, "as sent, refused; then compacted");
    let last: &Value = sent.last().unwrap();
    assert!(anthropic::prompt_tokens(last) <= 9000);
    let last_message = last["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .to_string();
    assert!(
        last_message.contains("create a detailed summary"),
        "{last_message}"
    );
    assert_eq!(support::summary_calls(&h).len(), 1, "one summary, made now");
}

/// A compacted Messages request with thinking on that the upstream refuses
/// (not as too long) goes again as the client sent it: its history may
/// hold thinking the API signed against compacted requests, so the resend
/// lets the API drop such blocks, body and beta alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_uncompacted_resend_lets_the_api_drop_thinking() {
    use compactor::fake_upstream::anthropic::Answer;
    use compactor::fake_upstream::Reply;
    use compactor::wire::messages::BLOCK_BINDING_BETA;
    use serde_json::json;
    let h = support::Harness::start().await;
    let mut messages = Vec::new();
    for turn in 0..8 {
        let text = format!(
            "Step {turn}: {}",
            "the parser module was rebuilt; ".repeat(110)
        );
        messages.push(json!({"role": "user", "content": text}));
        // Signed against a compacted request the client never saw.
        messages.push(json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": format!("Thinking of step {turn}."), "signature": "c2lnbmVk"},
            {"type": "text", "text": format!("Done with step {turn}.")}]}));
    }
    messages.push(json!({"role": "user", "content": "Carry on."}));
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 500,
        "thinking": {"type": "enabled", "budget_tokens": 400}, "messages": messages});
    h.fake.push(Reply::json(
        400,
        json!({"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages.3: something the API refuses"}}),
    ));
    h.fake.push(Reply::Messages(Answer::text("Carrying on.")));
    let resp = support::client()
        .post(format!("{}/messages", h.url()))
        .header("x-api-key", "sk-ant-resend")
        .header("anthropic-version", "2023-06-01")
        .header("x-compactor-compact", "now")
        .json(&body)
        .send();
    let resp = support::within(resp).await.unwrap();
    let status = resp.status().as_u16();
    let text = support::within(resp.text()).await.unwrap();
    assert_eq!(status, 200, "{text}");
    let sent: Vec<_> = h
        .fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/messages" && !support::is_summary_call(r))
        .filter(|r| !compactor::fake_upstream::anthropic::is_summarizer_request(&r.json()))
        .collect();
    assert_eq!(sent.len(), 2, "compacted and refused, then as sent");
    assert!(sent[0].json()["messages"].as_array().unwrap().len() < 17);
    let resent = &sent[1];
    assert_eq!(
        resent.json()["messages"],
        body["messages"],
        "the client's items"
    );
    assert_eq!(
        resent.json()["thinking"]["block_binding"],
        json!({"prefix_mismatch_behavior": "drop_block"})
    );
    let beta = resent
        .headers
        .get_all("anthropic-beta")
        .iter()
        .filter_map(|v| v.to_str().ok());
    assert!(beta
        .into_iter()
        .any(|v| v.split(',').any(|b| b.trim() == BLOCK_BINDING_BETA)));
}
