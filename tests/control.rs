//! Trying compactor safely, through real sockets: observe mode forwards the
//! client's bytes and records what compaction would have saved; a client
//! turns compaction off (or on, now) for one request; an operator can
//! forbid that.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{client, is_summary_call, small_window, within, Harness};

const KEY: &str = "sk-control-tests";
const MODEL: &str = "tiny-test";

fn turn_text(i: usize) -> String {
    format!(
        "Step {i}: please look at src/module_{i}.rs and explain it. {}",
        "lorem ipsum dolor ".repeat(25)
    )
}

/// POSTs `body` to the chat endpoint with `headers`; status, headers, body.
async fn chat(
    h: &Harness,
    body: &[u8],
    headers: &[(&str, &str)],
) -> (u16, http::HeaderMap, bytes::Bytes) {
    let mut req = client()
        .post(format!("{}/chat/completions", h.url()))
        .header("authorization", format!("Bearer {KEY}"))
        .header("content-type", "application/json")
        .body(body.to_vec());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = within(req.send()).await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, within(resp.bytes()).await.expect("body"))
}

/// The value of one series in `/metrics`.
async fn metric(h: &Harness, series: &str) -> f64 {
    let text = h.scrape().await;
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

/// A conversation grown turn by turn; each request's bytes are returned.
struct Conversation {
    history: Vec<Value>,
}

impl Conversation {
    fn new() -> Self {
        Conversation {
            history: vec![json!({"role": "system", "content": "You are a careful coding agent."})],
        }
    }

    /// The next request's bytes: the history plus a user turn (`stream`
    /// requests ask for no usage, which auto mode would have added).
    fn next(&mut self, i: usize, stream: bool) -> Vec<u8> {
        self.history
            .push(json!({"role": "user", "content": turn_text(i)}));
        let mut body = json!({"model": MODEL, "temperature": 0.2, "messages": self.history});
        if stream {
            body["stream"] = json!(true);
        }
        serde_json::to_vec(&body).unwrap()
    }

    fn answered(&mut self) {
        self.history
            .push(json!({"role": "assistant", "content": "Done."}));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_mode_forwards_the_clients_bytes_and_records_the_potential_savings() {
    let h = Harness::start_with(|c| {
        small_window(c);
        c.compaction.mode = compactor::config::Mode::Observe;
    })
    .await;
    let mut conv = Conversation::new();
    let mut sent = Vec::new();
    for i in 0..24 {
        // Every fifth request streams without asking for usage.
        let body = conv.next(i, i % 5 == 4);
        let (status, headers, _) = chat(&h, &body, &[]).await;
        assert_eq!(status, 200);
        assert!(
            headers.get("x-compactor-compacted").is_none(),
            "observe mode never compacts"
        );
        sent.push(body);
        conv.answered();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    // Byte-identity against direct: what the upstream received is what the
    // client sent, every time, and the proxy's own call never happened.
    let received: Vec<_> = h.fake.received();
    assert!(
        received.iter().all(|r| !is_summary_call(r)),
        "no summarizer call"
    );
    let bodies: Vec<&[u8]> = received.iter().map(|r| &r.body[..]).collect();
    assert_eq!(bodies.len(), sent.len());
    for (i, (got, want)) in bodies.iter().zip(&sent).enumerate() {
        assert!(got == want, "request {i} was changed on its way upstream");
    }
    // What it would have done is recorded.
    let db = h.db();
    let observed: i64 = db
        .query_row(
            "SELECT count(*) FROM compactions WHERE observed = 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let applied: i64 = db
        .query_row(
            "SELECT count(*) FROM compactions WHERE observed = 0",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(
        observed >= 1 && applied == 0,
        "{observed} observed, {applied} applied"
    );
    let (potential, modes): (i64, String) = db
        .query_row(
            "SELECT sum(tokens_saved_potential), group_concat(DISTINCT mode) FROM exchanges",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert!(potential > 0, "potential savings recorded");
    // /metrics counts the exchanges that reported usage (the streamed ones
    // asked for none, and observe mode does not ask for it).
    let reported: i64 = db
        .query_row(
            "SELECT sum(tokens_saved_potential) FROM exchanges WHERE input_tokens IS NOT NULL",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let kind = |k: &str| format!("compactor_input_tokens_total{{kind=\"{k}\"}}");
    assert_eq!(metric(&h, &kind("potential_saved")).await, reported as f64);
    assert_eq!(
        metric(&h, &kind("received")).await,
        metric(&h, &kind("uncompacted")).await,
        "nothing saved for real"
    );
    assert_eq!(modes, "observe");
    // The admin API reports it, in total and for the conversation.
    let report = h.get_json("/admin/api/savings").await;
    assert_eq!(
        report["total"]["tokens_saved_potential"],
        json!(reported),
        "{report}"
    );
    assert_eq!(report["total"]["tokens_saved"], json!(0));
    let id = report["conversations"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let shown = h.get_json(&format!("/admin/api/conversations/{id}")).await;
    assert_eq!(shown["savings"]["tokens_saved_potential"], json!(reported));
    assert!(shown["compactions"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["observed"] == true));
    let saved: i64 = db
        .query_row("SELECT sum(tokens_saved) FROM exchanges", [], |r| r.get(0))
        .unwrap();
    assert_eq!(saved, 0, "nothing was saved for real");
    let summary_size: String = db
        .query_row(
            "SELECT reason FROM compactions WHERE rung = 'summary' LIMIT 1",
            [],
            |r| r.get(0),
        )
        .unwrap_or_default();
    assert!(
        summary_size.is_empty() || summary_size.contains("estimated without a summarizer call"),
        "{summary_size}"
    );
}

/// Auto mode, grown until a compaction applies; the conversation so far.
async fn compacted_conversation(h: &Harness) -> Conversation {
    let mut conv = Conversation::new();
    for i in 0..40 {
        let body = conv.next(i, false);
        let (status, headers, _) = chat(h, &body, &[]).await;
        assert_eq!(status, 200);
        conv.answered();
        if headers.get("x-compactor-compacted").is_some() {
            return conv;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never compacted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_turns_compaction_off_for_one_request_and_the_upstream_never_sees_how() {
    let h = Harness::start_with(small_window).await;
    let mut conv = compacted_conversation(&h).await;
    // The header: forwarded untouched, the header itself stripped.
    let body = conv.next(100, false);
    let (status, headers, _) = chat(&h, &body, &[("x-compactor-mode", "off")]).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_none());
    let got = h.fake.last().unwrap();
    assert_eq!(&got.body[..], &body[..], "the client's bytes");
    assert!(got.headers.get("x-compactor-mode").is_none());
    conv.answered();
    // The metadata key: taken out, the rest of the request as sent.
    let mut v: Value = serde_json::from_slice(&conv.next(101, false)).unwrap();
    v["metadata"] = json!({"compactor_mode": "off"});
    let (status, headers, _) = chat(&h, &serde_json::to_vec(&v).unwrap(), &[]).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-compacted").is_none());
    let got = h.fake.last().unwrap().json();
    v.as_object_mut().unwrap().remove("metadata");
    assert_eq!(
        got, v,
        "the metadata the client added for the proxy is gone"
    );
    conv.answered();
    // The next request without either is compacted again.
    let body = conv.next(102, false);
    let (_, headers, _) = chat(&h, &body, &[]).await;
    assert!(headers.get("x-compactor-compacted").is_some());
    let mode: String = h
        .db()
        .query_row(
            "SELECT mode FROM exchanges ORDER BY id DESC LIMIT 1 OFFSET 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(mode, "off", "recorded as served");
    let kind = |k: &str| format!("compactor_input_tokens_total{{kind=\"{k}\"}}");
    let (received, uncompacted) = (
        metric(&h, &kind("received")).await,
        metric(&h, &kind("uncompacted")).await,
    );
    let saved: i64 = h
        .db()
        .query_row(
            "SELECT sum(tokens_saved) FROM exchanges WHERE input_tokens IS NOT NULL",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(saved > 0);
    assert_eq!(uncompacted - received, saved as f64);
    let report = h.get_json("/admin/api/savings").await;
    let total = &report["total"];
    assert_eq!(total["tokens_saved"], json!(saved), "{report}");
    let net = total["net_tokens_saved"].as_i64().unwrap();
    let summarizer = total["summarizer_input_tokens"].as_i64().unwrap()
        + total["summarizer_output_tokens"].as_i64().unwrap();
    assert_eq!(
        net,
        saved - summarizer,
        "the summarizer's cost is subtracted"
    );
    assert_eq!(report["tenants"].as_object().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compact_now_compacts_this_request_and_bad_values_are_refused() {
    let h = Harness::start_with(|c| {
        small_window(c);
        c.compaction.background = false;
    })
    .await;
    let mut conv = Conversation::new();
    for i in 0..4 {
        let (status, headers, _) = chat(&h, &conv.next(i, false), &[]).await;
        assert_eq!(status, 200);
        assert!(headers.get("x-compactor-compacted").is_none());
        conv.answered();
    }
    let (status, headers, _) =
        chat(&h, &conv.next(4, false), &[("x-compactor-compact", "now")]).await;
    assert_eq!(status, 200);
    assert!(
        headers.get("x-compactor-compacted").is_some(),
        "compacted at once"
    );
    assert!(h
        .fake
        .last()
        .unwrap()
        .headers
        .get("x-compactor-compact")
        .is_none());
    let reason: String = h
        .db()
        .query_row("SELECT reason FROM compactions", [], |r| r.get(0))
        .unwrap();
    assert!(
        reason.starts_with("requested: x-compactor-compact"),
        "{reason}"
    );
    let before = h.fake.count();
    let (status, _, body) = chat(
        &h,
        &conv.next(5, false),
        &[("x-compactor-mode", "sometimes")],
    )
    .await;
    assert_eq!(status, 400);
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["error"]["code"], "invalid_value", "{err}");
    assert_eq!(err["error"]["param"], "x-compactor-mode", "{err}");
    assert_eq!(h.fake.count(), before, "nothing went upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_can_forbid_client_control() {
    let h = Harness::start_with(|c| {
        small_window(c);
        c.server.client_control = false;
    })
    .await;
    let mut conv = compacted_conversation(&h).await;
    let (status, headers, _) =
        chat(&h, &conv.next(100, false), &[("x-compactor-mode", "off")]).await;
    assert_eq!(status, 200);
    assert!(
        headers.get("x-compactor-compacted").is_some(),
        "the header is ignored"
    );
    assert!(h
        .fake
        .last()
        .unwrap()
        .headers
        .get("x-compactor-mode")
        .is_none());
}

/// With `observe_summaries = true` observe mode pays for the summary it
/// would have sent: the summarizer is called and the would-be compaction is
/// recorded with its summary, and still every client request goes upstream
/// as the client sent it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_summaries_calls_the_summarizer_and_still_forwards_the_clients_bytes() {
    let h = Harness::start_with(|c| {
        small_window(c);
        c.compaction.mode = compactor::config::Mode::Observe;
        c.compaction.observe_summaries = true;
    })
    .await;
    let mut conv = Conversation::new();
    let mut sent = Vec::new();
    for i in 0..24 {
        let body = conv.next(i, false);
        let (status, headers, _) = chat(&h, &body, &[]).await;
        assert_eq!(status, 200);
        assert!(headers.get("x-compactor-compacted").is_none());
        sent.push(body);
        conv.answered();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let received = h.fake.received();
    let (summaries, client): (Vec<_>, Vec<_>) = received.iter().partition(|r| is_summary_call(r));
    assert!(!summaries.is_empty(), "the summarizer was called");
    assert_eq!(client.len(), sent.len());
    for (i, (got, want)) in client.iter().zip(&sent).enumerate() {
        assert!(
            got.body[..] == want[..],
            "request {i} was changed on its way upstream"
        );
    }
    let db = h.db();
    let (observed, with_summary, applied): (i64, i64, i64) = db
        .query_row(
            "SELECT count(*) FILTER (WHERE observed = 1),
                    count(*) FILTER (WHERE observed = 1 AND summary IS NOT NULL AND summary_calls > 0),
                    count(*) FILTER (WHERE observed = 0)
             FROM compactions",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert!(
        observed >= 1 && with_summary >= 1 && applied == 0,
        "{observed} observed, {with_summary} with a summary, {applied} applied"
    );
}
