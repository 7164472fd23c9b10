//! The network and operator side of hardening: paths that would leave the
//! upstream's base path, and a proxy whose upstream is itself.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use compactor::fake_upstream::Reply;
use serde_json::{json, Value};
use support::{client, within, Harness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "sk-test-SECRET-hardening-77";

/// Sends `request` as is on a fresh connection (no client normalizes the
/// path on the way, as `curl --path-as-is` does not) and reads the answer
/// until the server closes.
async fn raw(addr: SocketAddr, request: &str) -> String {
    let mut s = within(TcpStream::connect(addr)).await.unwrap();
    within(s.write_all(request.as_bytes())).await.unwrap();
    let mut answer = Vec::new();
    within(s.read_to_end(&mut answer)).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// Status line and JSON body of a raw answer.
fn status_and_error(answer: &str) -> (u16, Value) {
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {answer}"));
    let body = answer.find("\r\n\r\n").map_or("", |i| &answer[i + 4..]);
    let body = serde_json::from_str(body).unwrap_or(Value::Null);
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_that_leave_the_base_path_or_respell_an_endpoint_get_400_and_go_nowhere() {
    let h = Harness::start().await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    for (method, path) in [
        ("GET", "/v1/%2e%2e/internal/admin"),
        ("GET", "/v1/../../etc/passwd"),
        ("GET", "/v1/%2E%2E/%2e%2E/etc/passwd"),
        ("GET", "/v1/.%2e/internal"),
        ("GET", "/v1/models/../../internal"),
        ("GET", "/v1/models\\..\\..\\internal"),
        ("GET", "/v1/models%5c..%5c..%5cinternal"),
        ("GET", "/v1/..%2f..%2finternal"),
        ("GET", "/v1/./models"),
        ("POST", "/v1/chat/completions/"),
        ("POST", "/v1//chat/completions"),
        ("POST", "/v1/chat/%63ompletions"),
        ("POST", "/v1/Chat/Completions"),
        ("POST", "/v1/responses/"),
        ("POST", "/v1//responses/compact"),
    ] {
        let sent = if method == "POST" { body.as_str() } else { "" };
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{sent}",
            sent.len(),
        );
        let answer = raw(h.addr, &request).await;
        let (status, error) = status_and_error(&answer);
        assert_eq!(status, 400, "{method} {path}: {answer}");
        assert_eq!(error["error"]["code"], "invalid_path", "{path}: {answer}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{answer}");
        assert!(!answer.contains(KEY), "{answer}");
    }
    assert_eq!(h.fake.count(), 0, "nothing reached the upstream");
    let exchanges: i64 = h
        .db()
        .query_row("SELECT count(*) FROM exchanges", [], |r| r.get(0))
        .unwrap();
    assert_eq!(exchanges, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordinary_passthrough_still_reaches_the_upstream_as_sent() {
    let h = Harness::start().await;
    let c = client();
    for (path, query) in [
        ("/v1/models", None),
        ("/v1/models/gpt-4o-mini", None),
        ("/v1/files/file-abc/content", None),
        ("/v1/files", Some("purpose=batch&after=file-1%202")),
        ("/v1/responses/resp_123/input_items", Some("limit=2")),
    ] {
        h.fake
            .push(Reply::json(200, json!({"object": "list", "data": []})));
        let url = format!(
            "http://{}{path}{}",
            h.addr,
            query.map(|q| format!("?{q}")).unwrap_or_default()
        );
        let resp = within(c.get(&url).bearer_auth(KEY).send()).await.unwrap();
        assert_eq!(resp.status(), 200, "{url}");
        let got = h.fake.last().expect("forwarded");
        assert_eq!(got.path, path);
        assert_eq!(got.query.as_deref(), query);
        assert_eq!(got.headers["authorization"], format!("Bearer {KEY}"));
    }
    h.fake
        .push(Reply::json(200, json!({"object": "list", "data": []})));
    let resp = within(
        c.post(format!("{}/embeddings", h.url()))
            .json(&json!({"model": "e", "input": "x"}))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(h.fake.last().unwrap().path, "/v1/embeddings");
}

/// An upstream that points back at the proxy, under a spelling the
/// start-up check cannot know (here a forwarder on another port): the
/// request that comes back carries the proxy's own hop marker and gets a
/// 508, which reaches the client, instead of going round until the
/// descriptors run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_comes_back_to_the_proxy_gets_508_instead_of_recursing() {
    let forwarder = within(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .await
        .unwrap();
    let forwarder_url = format!("http://{}/v1", forwarder.local_addr().unwrap());
    let target: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    let forwarded = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (to, count) = (target.clone(), forwarded.clone());
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = forwarder.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let Some(addr) = *to.lock().unwrap() else {
                continue;
            };
            tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(addr).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    let h = Harness::start_with(|c| c.upstream.base_url = forwarder_url).await;
    *target.lock().unwrap() = Some(h.addr);

    let c = client();
    let resp = within(
        c.post(format!("{}/chat/completions", h.url()))
            .bearer_auth(KEY)
            .json(&json!({"model": "m", "messages": [{"role": "user", "content": "loop?"}]}))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 508);
    let body: Value = within(resp.json()).await.unwrap();
    assert_eq!(body["error"]["code"], "loop_detected", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("upstream.base_url"),
        "{body}"
    );
    let resp = within(c.get(format!("{}/models", h.url())).send())
        .await
        .unwrap();
    assert_eq!(resp.status(), 508);
    // One trip round the loop per request, no more (the second may reuse
    // the first's pooled connection).
    let trips = forwarded.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (1..=2).contains(&trips),
        "{trips} connections round the loop"
    );
    let health = within(c.get(format!("http://{}/healthz", h.addr)).send())
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
}
