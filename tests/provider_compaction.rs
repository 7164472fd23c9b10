//! A client's own provider compaction through the proxy, against the fake
//! upstream's provider compaction (`compactor::fake_upstream::provider`),
//! which implements what OpenAI and Anthropic document: the Responses
//! `compaction` item is minted opaque and accepted back only as minted;
//! the Messages `compaction` block drops everything before it; usage
//! reports the compaction iteration apart.
//!
//! The real thresholds are large (Anthropic's trigger is at least 50,000
//! tokens): the fake's minimum is lowered so that long sessions in small
//! windows show what the real APIs only show at scale.
//!
//! - While a client asks the provider to compact, the proxy's threshold
//!   trigger stays off: no double compaction.
//! - The provider's items go upstream byte-identical on every later
//!   request, through the proxy's own compactions too.
//! - The proxy counts from the newest provider item on (the window it
//!   checks is what the provider reads), and when the upstream still says
//!   too long it compacts only after that item, and the request succeeds.
//! - Context edits that are not compaction (`clear_thinking_*`,
//!   `clear_tool_uses_*`) leave compaction to the proxy.
//! - The record keeps every item the client sent, the opaque ones verbatim.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::anthropic::Answer;
use compactor::fake_upstream::provider::{Settings, COMPACT_BETA};
use compactor::fake_upstream::{Received, Reply};
use serde_json::{json, Value};
use support::responses::{output_text, responses_call, responses_output, responses_text};
use support::*;

const KEY: &str = "sk-test-provider-0001";

/// What the proxy's summarizer answers, should it be asked (it takes none
/// of the replies the tests script for the client).
const SUMMARY: &str = "## TASK\nbuild the modules";

/// A 3000-token window for `prov*` models (the proxy's trigger past 2025
/// tokens, 0.75 of its hard limit 2700).
fn prov_window(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "prov*".into(),
        context_window: 3000,
        max_output_tokens: Some(300),
        trigger_ratio: None,
        ..Default::default()
    });
}

/// A window the proxy believes large, for a fake upstream that refuses
/// sooner: only the upstream's "too long" makes the proxy compact.
fn roomy_window(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "prov*".into(),
        context_window: 100_000,
        max_output_tokens: Some(300),
        trigger_ratio: None,
        ..Default::default()
    });
}

fn provider(min_threshold: u64, responses_window: Option<u64>) -> Option<Settings> {
    Some(Settings {
        min_threshold,
        responses_window,
    })
}

/// The requests the fake received for the client (not the proxy's own
/// summarizer calls), with their bodies as text.
fn client_requests(h: &Harness, path: &str) -> Vec<(Received, String)> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| r.path == path && !is_summary_call(r))
        .map(|r| {
            let text = String::from_utf8_lossy(&r.body).into_owned();
            (r, text)
        })
        .collect()
}

/// The proxy's compactions of the conversation, applied or not.
async fn proxy_compactions(h: &Harness) -> i64 {
    // The store's writer imports them in batches.
    let _ = h.state.store.flush().await;
    compactions(h)
}

/// Upstream tokens per estimated token the proxy learned for the one
/// conversation of the test: its estimates count what the provider reads,
/// from the newest compaction item on, as the reported usage does (an
/// estimate of the whole history would drive it to its floor, 0.5).
fn calibration(h: &Harness) -> f64 {
    let rows: Vec<String> = column(&*h.sql(), "SELECT tenant FROM exchanges ORDER BY id");
    let conversations: Vec<String> = column(
        &*h.sql(),
        "SELECT conversation_id FROM exchanges ORDER BY id",
    );
    h.state
        .compactions
        .calibration(rows.last().unwrap(), conversations.last().unwrap())
}

// ---------------------------------------------------------------- Responses

/// A Responses client holding its whole history, as a stateless client does.
struct ResponsesClient {
    input: Vec<Value>,
    body: Value,
    /// Each provider compaction item as the client received it, serialized.
    minted: Vec<String>,
    requests: usize,
}

impl ResponsesClient {
    fn new(threshold: u64) -> Self {
        ResponsesClient {
            input: Vec::new(),
            body: json!({"model": "prov-mini", "instructions": "You are a build agent.",
                         "context_management": [{"type": "compaction", "compact_threshold": threshold}],
                         "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]}),
            minted: Vec::new(),
            requests: 0,
        }
    }

    /// Sends the history, appends the answer's output; returns it.
    async fn send(&mut self, h: &Harness, streamed: bool) -> Vec<Value> {
        let mut body = self.body.clone();
        body["input"] = Value::from(self.input.clone());
        body["stream"] = json!(streamed);
        let (status, _, bytes) = post(&format!("{}/responses", h.url()), KEY, &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        self.requests += 1;
        let output = responses_output(&bytes, streamed);
        for item in &output {
            if item["type"] == "compaction" {
                self.minted.push(item.to_string());
            }
        }
        self.input.extend(output.iter().cloned());
        output
    }

    /// One turn: a user message, a tool call and its output, an answer.
    async fn turn(&mut self, h: &Harness, n: usize, output_bytes: usize) {
        self.input.push(json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": format!("step {n}: build module {n}")}]}));
        let call_id = format!("call_{n}");
        h.fake.push(responses_call(&call_id, n.is_multiple_of(3)));
        self.send(h, n.is_multiple_of(3)).await;
        self.input
            .push(json!({"type": "function_call_output", "call_id": call_id,
            "output": output_text(n, output_bytes)}));
        h.fake
            .push(responses_text(&format!("module {n} built"), n % 4 == 1));
        self.send(h, n % 4 == 1).await;
    }
}

/// Every provider item the client received goes, byte for byte, in every
/// later request the upstream received.
fn assert_items_verbatim_later(h: &Harness, path: &str, minted: &[String]) {
    let requests = client_requests(h, path);
    for (k, item) in minted.iter().enumerate() {
        let first = requests
            .iter()
            .position(|(_, text)| text.contains(item.as_str()));
        // Only the answer to the session's last request goes unanswered.
        let Some(first) = first else {
            assert_eq!(k + 1, minted.len(), "the item was sent back: {item}");
            continue;
        };
        for (i, (_, text)) in requests.iter().enumerate().skip(first) {
            assert!(
                text.contains(item.as_str()),
                "request {i} carries the provider's item byte for byte: {item}"
            );
        }
    }
}

/// The provider compactions `/metrics` counted.
async fn provider_trigger_count(h: &Harness) -> usize {
    let text = h.scrape().await;
    text.lines()
        .find(|l| l.starts_with("compactor_compaction_triggers_total{trigger=\"provider\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as usize)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_client_compacting_at_the_provider_is_not_compacted_twice() {
    let h = Harness::start_with(prov_window).await;
    h.fake.set_provider_compaction(provider(100, None));
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    // Past the proxy's trigger (2025), under its hard limit (2700): a
    // proxy that ignored the request would compact before the provider.
    let mut c = ResponsesClient::new(2400);
    for n in 0..24 {
        c.turn(&h, n, 700).await;
    }
    h.wait_exchanges(c.requests as i64).await;
    assert_eq!(
        provider_trigger_count(&h).await,
        h.fake.provider_compactions(),
        "every compaction the provider made is counted by trigger"
    );
    assert!(
        h.fake.provider_compactions() >= 2,
        "the provider compacted: {}",
        h.fake.provider_compactions()
    );
    assert_eq!(c.minted.len(), h.fake.provider_compactions());
    assert!(calibration(&h) > 0.6, "calibration {}", calibration(&h));
    assert_eq!(
        proxy_compactions(&h).await,
        0,
        "the proxy left compaction to the provider"
    );
    let requests = client_requests(&h, "/v1/responses");
    let whole: usize = requests.last().unwrap().1.len();
    assert!(
        whole / 4 > 2700,
        "the history the client holds is past the proxy's hard limit ({} tokens), \
         which counts only from the newest compaction item on",
        whole / 4
    );
    for (r, _) in &requests {
        assert_eq!(
            r.json()["context_management"],
            c.body["context_management"],
            "the request goes as sent"
        );
    }
    assert_items_verbatim_later(&h, "/v1/responses", &c.minted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_overflow_is_compacted_after_the_provider_item_only() {
    let h = Harness::start_with(roomy_window).await;
    h.fake.set_provider_compaction(provider(100, Some(2600)));
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    let mut c = ResponsesClient::new(1500);
    for n in 0..8 {
        c.turn(&h, n, 600).await;
    }
    assert!(!c.minted.is_empty(), "the provider compacted");
    let boundary = c.minted.last().unwrap().clone();
    let at = c
        .input
        .iter()
        .rposition(|i| serde_json::to_string(i).is_ok_and(|t| t == boundary))
        .unwrap();
    let before: Vec<String> = c.input[..=at].iter().map(Value::to_string).collect();
    // A tool output past what the upstream reads: it says too long.
    c.input.push(json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "step 8: read the whole log"}]}));
    h.fake.push(responses_call("call_big", false));
    c.send(&h, false).await;
    c.input.push(
        json!({"type": "function_call_output", "call_id": "call_big",
        "output": output_text(8, 14_000)}),
    );
    h.fake.push(responses_text("the log says ok", false));
    let refused_before = h.fake.count();
    c.send(&h, false).await;
    let requests = client_requests(&h, "/v1/responses");
    let sent: Vec<&(Received, String)> = requests
        .iter()
        .filter(|(r, _)| r.json()["input"].as_array().is_some_and(|i| i.len() >= at))
        .collect();
    let last = &sent.last().unwrap().0;
    assert!(
        h.fake.count() > refused_before + 1,
        "the upstream refused once, the proxy sent again"
    );
    let items = last.json()["input"].as_array().cloned().unwrap();
    let sent_before: Vec<String> = items[..=at].iter().map(Value::to_string).collect();
    assert_eq!(
        sent_before, before,
        "everything up to the provider's item went as the client sent it"
    );
    assert!(
        !last
            .body
            .windows(14_000)
            .any(|w| w == output_text(8, 14_000).as_bytes()),
        "the big output after the item was compacted"
    );
    assert!(proxy_compactions(&h).await >= 1);
    // Later turns, through the proxy's compaction and the provider's next.
    for n in 9..16 {
        c.turn(&h, n, 600).await;
    }
    h.wait_exchanges(c.requests as i64).await;
    assert!(c.minted.len() >= 2, "the provider compacted again");
    assert_items_verbatim_later(&h, "/v1/responses", &c.minted);

    // The record keeps every item the client sent, the opaque ones verbatim.
    let conversation: String = column(
        &*h.sql(),
        "SELECT conversation_id FROM exchanges ORDER BY id",
    )
    .pop()
    .unwrap();
    let export = h
        .get_json(&format!("/admin/api/conversations/{conversation}/export"))
        .await;
    let original = export["original_items"].as_array().cloned().unwrap();
    // The record's first item is the request's `instructions`.
    assert_eq!(
        original[0]["content"], c.body["instructions"],
        "{}",
        original[0]
    );
    let original = original[1..].to_vec();
    assert_eq!(
        original, c.input,
        "the whole history as the client holds it"
    );
    for item in &c.minted {
        assert!(
            original.iter().any(|i| &i.to_string() == item),
            "the record holds the provider's item verbatim: {item}"
        );
    }
    // `conversations show` names the boundary and what the record keeps
    // of the part before it.
    if !on_postgres() {
        let newest = original
            .iter()
            .rposition(|i| &i.to_string() == c.minted.last().unwrap())
            .unwrap();
        let (code, out, err) = cli(
            &["conversations", "show", &conversation],
            &[("COMPACTOR_DB", h.db.to_str().unwrap())],
        )
        .await;
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains(&format!(
                "provider    compacted: item {} of {} is its newest compaction item",
                // The record's items start with the instructions.
                newest + 2,
                original.len() + 1
            )),
            "{out}"
        );
    }
}

// ---------------------------------------------------------------- Messages

const BETA: (&str, &str) = ("anthropic-beta", COMPACT_BETA);

async fn send_messages(h: &Harness, body: &Value, beta: bool) -> (u16, Vec<u8>) {
    let mut req = client()
        .post(format!("{}/messages", h.url()))
        .header("x-api-key", KEY)
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(body).unwrap());
    if beta {
        req = req.header(BETA.0, BETA.1);
    }
    let resp = within(req.send()).await.expect("request");
    let status = resp.status().as_u16();
    let bytes = within(resp.bytes()).await.expect("body");
    (status, bytes.to_vec())
}

/// The assistant message of an answer, JSON or SSE.
fn assistant_of(bytes: &[u8], streamed: bool) -> Value {
    if !streamed {
        let v: Value = serde_json::from_slice(bytes).expect("JSON answer");
        return json!({"role": "assistant", "content": v["content"]});
    }
    let mut c = compactor::wire::messages::MessagesCollector::default();
    let text = String::from_utf8_lossy(bytes);
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
    assert!(c.finished(), "the stream ended: {text}");
    c.items().remove(0)
}

struct MessagesClient {
    messages: Vec<Value>,
    body: Value,
    beta: bool,
    /// Each assistant message holding a compaction block, serialized.
    minted: Vec<String>,
    requests: usize,
}

impl MessagesClient {
    fn new(edits: Value, beta: bool) -> Self {
        MessagesClient {
            messages: Vec::new(),
            body: json!({"model": "prov-claude", "max_tokens": 200,
                "system": "You are a build agent.",
                "context_management": {"edits": edits},
                "tools": [{"name": "Bash", "description": "runs a command", "input_schema": {"type": "object"}}]}),
            beta,
            minted: Vec::new(),
            requests: 0,
        }
    }

    async fn send(&mut self, h: &Harness, streamed: bool) -> Value {
        let mut body = self.body.clone();
        body["messages"] = Value::from(self.messages.clone());
        body["stream"] = json!(streamed);
        let (status, bytes) = send_messages(h, &body, self.beta).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        self.requests += 1;
        let a = assistant_of(&bytes, streamed);
        if a["content"]
            .as_array()
            .is_some_and(|b| b.iter().any(|b| b["type"] == "compaction"))
        {
            self.minted.push(a.to_string());
        }
        self.messages.push(a.clone());
        a
    }

    async fn turn(&mut self, h: &Harness, n: usize, output_bytes: usize) {
        self.messages
            .push(json!({"role": "user", "content": format!("step {n}: build module {n}")}));
        let id = format!("toolu_{n}");
        h.fake.push(Reply::Messages(Answer::tool_use(
            &id,
            "Bash",
            json!({"command": format!("make module_{n}")}),
        )));
        self.send(h, n.is_multiple_of(3)).await;
        self.messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id, "content": output_text(n, output_bytes)}]}));
        h.fake
            .push(Reply::Messages(Answer::text(&format!("module {n} built"))));
        self.send(h, n % 4 == 1).await;
    }
}

fn compact_edit(trigger: u64) -> Value {
    json!([{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": trigger}}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_client_compacting_at_the_provider_is_not_compacted_twice() {
    let h = Harness::start_with(prov_window).await;
    h.fake.set_provider_compaction(provider(100, None));
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    let mut c = MessagesClient::new(compact_edit(2400), true);
    for n in 0..24 {
        c.turn(&h, n, 700).await;
    }
    h.wait_exchanges(c.requests as i64).await;
    assert_eq!(
        provider_trigger_count(&h).await,
        h.fake.provider_compactions(),
        "every compaction the provider made is counted by trigger"
    );
    assert!(
        h.fake.provider_compactions() >= 2,
        "the provider compacted: {}",
        h.fake.provider_compactions()
    );
    assert_eq!(
        proxy_compactions(&h).await,
        0,
        "the proxy left compaction to the provider"
    );
    assert!(calibration(&h) > 0.6, "calibration {}", calibration(&h));
    let requests = client_requests(&h, "/v1/messages");
    assert!(requests.last().unwrap().1.len() / 4 > 2700);
    assert_items_verbatim_later(&h, "/v1/messages", &c.minted);
    // The prompt the proxy learned of a compacting answer is its message
    // iteration's, not the compaction's (which read the whole history).
    let learned: Vec<i64> = column(&*h.sql(), "SELECT input_tokens FROM exchanges ORDER BY id");
    assert!(
        learned.iter().all(|&t| t <= 2400 + 400),
        "each recorded prompt is what the provider read: {learned:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compaction_beta_is_the_clients_to_send() {
    let h = Harness::start_with(prov_window).await;
    h.fake.set_provider_compaction(provider(100, None));
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    let mut body = MessagesClient::new(compact_edit(2400), false).body;
    body["messages"] = json!([{"role": "user", "content": "hello"}]);
    let (status, bytes) = send_messages(&h, &body, false).await;
    assert_eq!(status, 400, "the upstream's refusal is relayed");
    assert!(String::from_utf8_lossy(&bytes).contains(COMPACT_BETA));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_context_edits_leave_compaction_to_the_proxy() {
    let h = Harness::start_with(prov_window).await;
    h.fake.set_provider_compaction(provider(100, None));
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    let edits = json!([{"type": "clear_thinking_20251015", "keep": "all"},
                       {"type": "clear_tool_uses_20250919"}]);
    let mut c = MessagesClient::new(edits.clone(), false);
    for n in 0..14 {
        c.turn(&h, n, 700).await;
    }
    h.wait_exchanges(c.requests as i64).await;
    assert_eq!(h.fake.provider_compactions(), 0);
    assert!(
        proxy_compactions(&h).await >= 1,
        "the proxy compacts as usual beside edits that only trim"
    );
    for (r, _) in client_requests(&h, "/v1/messages") {
        assert_eq!(
            r.json()["context_management"]["edits"],
            edits,
            "the edits go as sent"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_overflow_is_compacted_after_the_compaction_block_only() {
    let h = Harness::start_with(roomy_window).await;
    h.fake.set_provider_compaction(provider(100, None));
    h.fake.set_messages_window(Some(2600));
    let mut c = MessagesClient::new(compact_edit(1500), true);
    for n in 0..8 {
        c.turn(&h, n, 600).await;
    }
    assert!(!c.minted.is_empty(), "the provider compacted");
    let boundary = c.minted.last().unwrap().clone();
    let at = c
        .messages
        .iter()
        .rposition(|m| serde_json::to_string(m).is_ok_and(|t| t == boundary))
        .unwrap();
    let before: Vec<String> = c.messages[..=at].iter().map(Value::to_string).collect();
    c.messages
        .push(json!({"role": "user", "content": "step 8: read the whole log"}));
    h.fake.push(Reply::Messages(Answer::tool_use(
        "toolu_big",
        "Bash",
        json!({"command": "cat build.log"}),
    )));
    c.send(&h, false).await;
    c.messages.push(json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_big", "content": output_text(8, 14_000)}]}));
    h.fake
        .push(Reply::Messages(Answer::text("the log says ok")));
    c.send(&h, false).await;
    let last = client_requests(&h, "/v1/messages").pop().unwrap().0;
    let msgs = last.json()["messages"].as_array().cloned().unwrap();
    let sent_before: Vec<String> = msgs[..=at].iter().map(Value::to_string).collect();
    assert_eq!(
        sent_before, before,
        "everything up to the compaction block went as the client sent it"
    );
    assert!(proxy_compactions(&h).await >= 1);
    for n in 9..16 {
        c.turn(&h, n, 600).await;
    }
    h.wait_exchanges(c.requests as i64).await;
    assert_items_verbatim_later(&h, "/v1/messages", &c.minted);

    let conversation: String = column(
        &*h.sql(),
        "SELECT conversation_id FROM exchanges ORDER BY id",
    )
    .pop()
    .unwrap();
    let export = h
        .get_json(&format!("/admin/api/conversations/{conversation}/export"))
        .await;
    let original = export["original_items"].as_array().cloned().unwrap();
    assert_eq!(
        original[..],
        c.messages[..original.len()],
        "the whole history as the client holds it"
    );
    for m in &c.minted {
        assert!(
            original.iter().any(|i| &i.to_string() == m),
            "the record holds the compaction block verbatim: {m}"
        );
    }
}

// ---------------------------------------------------------------- properties

mod properties {
    use std::sync::Arc;

    use compactor::compaction::boundary;
    use compactor::compaction::items::{call_ids, is_summary, output_ids};
    use compactor::compaction::{cut, rewrite, Compaction};
    use compactor::wire::messages::finish_replacement_after;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::support::ladder::{compact, params};

    /// What happens after a user message.
    #[derive(Debug, Clone)]
    enum Step {
        /// Tool calls (output sizes), opened by the provider's compaction
        /// when set.
        Tools(Vec<usize>, bool),
        /// The answer, opened by the provider's compaction when set.
        Answer(usize, bool),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (
                prop::collection::vec(prop_oneof![1usize..300, 2_000usize..12_000], 1..3),
                prop::bool::weighted(0.2)
            )
                .prop_map(|(s, c)| Step::Tools(s, c)),
            (1usize..200, prop::bool::weighted(0.3)).prop_map(|(n, c)| Step::Answer(n, c)),
        ]
    }

    struct Gen {
        messages: bool,
        next: usize,
    }

    impl Gen {
        fn turn(&mut self, items: &mut Vec<Value>, user_len: usize, steps: &[Step]) {
            let n = self.next;
            self.next += 1;
            let text = format!("user {n}: {}", "u".repeat(user_len));
            items.push(if self.messages {
                json!({"role": "user", "content": text})
            } else {
                json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
            });
            for (si, s) in steps.iter().enumerate() {
                match s {
                    Step::Tools(sizes, compacted) => {
                        let opaque = format!("gAAAAB-provider-{n}-{si}");
                        let ids: Vec<String> = (0..sizes.len())
                            .map(|k| format!("call_{n}_{si}_{k}"))
                            .collect();
                        let out =
                            |k: usize| format!("output of {}: {}", ids[k], "o".repeat(sizes[k]));
                        if self.messages {
                            let mut uses: Vec<Value> = ids.iter().map(|id| json!({"type": "tool_use", "id": id, "name": "Bash", "input": {"command": "ls"}})).collect();
                            if *compacted {
                                uses.insert(0, json!({"type": "compaction", "content": format!("summary {opaque}")}));
                            }
                            items.push(json!({"role": "assistant", "content": uses}));
                            let results: Vec<Value> = (0..ids.len()).map(|k| json!({"type": "tool_result", "tool_use_id": ids[k], "content": out(k)})).collect();
                            items.push(json!({"role": "user", "content": results}));
                        } else {
                            if *compacted {
                                items.push(json!({"type": "compaction", "id": format!("cmp_{n}_{si}"), "encrypted_content": opaque}));
                            }
                            for id in &ids {
                                items.push(json!({"type": "function_call", "call_id": id, "name": "shell", "arguments": "{}"}));
                            }
                            for (k, id) in ids.iter().enumerate() {
                                items.push(json!({"type": "function_call_output", "call_id": id, "output": out(k)}));
                            }
                        }
                    }
                    Step::Answer(len, compacted) => {
                        let answer = "a".repeat(*len);
                        let opaque = format!("gAAAAB-provider-{n}-{si}");
                        if self.messages {
                            let mut blocks = vec![json!({"type": "text", "text": answer})];
                            if *compacted {
                                blocks.insert(0, json!({"type": "compaction", "content": format!("summary {opaque}")}));
                            }
                            items.push(json!({"role": "assistant", "content": blocks}));
                        } else {
                            if *compacted {
                                items.push(json!({"type": "compaction", "id": format!("cmp_{n}_{si}"), "encrypted_content": opaque}));
                            }
                            items.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]}));
                        }
                    }
                }
            }
        }
    }

    /// Every output answers a call before it, and every call whose output
    /// the client sent still has it.
    fn paired(sent: &[Value]) -> Result<(), TestCaseError> {
        let mut open: Vec<String> = Vec::new();
        for (i, item) in sent.iter().enumerate() {
            for id in output_ids(item) {
                let at = open.iter().position(|o| o == id);
                prop_assert!(at.is_some(), "output {} at {} has no call before it", id, i);
                open.remove(at.unwrap_or(0));
            }
            open.extend(call_ids(item).into_iter().map(String::from));
        }
        prop_assert!(
            open.is_empty(),
            "calls left without their outputs: {:?}",
            open
        );
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// A history mixing the provider's compactions and the proxy's,
        /// compacted again and again as it grows: pairing holds, every
        /// provider item goes as the client sent it, and nothing up to the
        /// newest one changes.
        #[test]
        fn provider_and_proxy_compactions_mix_without_touching_the_providers(
            messages in any::<bool>(),
            rounds in prop::collection::vec(
                prop::collection::vec((1usize..300, prop::collection::vec(step(), 1..4)), 1..4),
                1..7,
            ),
        ) {
            let p = params();
            let mut g = Gen { messages, next: 0 };
            let mut items: Vec<Value> = Vec::new();
            let mut base: Option<Arc<Compaction>> = None;
            for turns in rounds {
                for (user_len, steps) in &turns {
                    g.turn(&mut items, *user_len, steps);
                }
                let view = match &base {
                    Some(b) => rewrite::rewrite(&items, b),
                    None => items.clone(),
                };
                let finish = |r: Vec<Value>| {
                    if messages {
                        let keep = boundary::safe_floor(&r, &cut::safe_cuts(&r));
                        finish_replacement_after(r, keep, false, is_summary)
                    } else {
                        r
                    }
                };
                let Some(c) = compact(&items, base.as_ref(), &p, finish) else {
                    continue;
                };
                let sent = rewrite::rewrite(&items, &c);
                paired(&sent)?;
                // Every provider item of the history, verbatim and in order.
                let theirs: Vec<&Value> = items.iter().filter(|i| boundary::is_provider_item(i)).collect();
                let sent_theirs: Vec<&Value> = sent.iter().filter(|i| boundary::is_provider_item(i)).collect();
                let text = |l: &[&Value]| l.iter().map(|v| v.to_string()).collect::<Vec<_>>();
                prop_assert_eq!(text(&theirs), text(&sent_theirs));
                // Up to the newest one, the request is what it was before
                // this compaction.
                if let Some(b) = boundary::newest(&view) {
                    prop_assert_eq!(&sent[..=b], &view[..=b]);
                }
                base = Some(Arc::new(c));
            }
        }
    }
}
