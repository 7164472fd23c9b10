//! The network and operator side of hardening: paths that would leave the
//! upstream's base path, connections that send nothing, the shutdown's
//! records, and a proxy whose upstream is itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use compactor::fake_upstream::{chat_stream_events, Reply};
use serde_json::{json, Value};
use support::{client, within, Harness, STEP};
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
    let (forwarder, target, forwarded) = loop_forwarder().await;
    let h = Harness::start_with(|c| c.upstream.base_url = format!("{forwarder}/v1")).await;
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

/// Gemini's endpoints live under `/v1beta/`, outside `/v1/`: a Gemini
/// request that comes back to the proxy there is caught as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gemini_request_that_comes_back_to_the_proxy_gets_508() {
    let (forwarder, target, forwarded) = loop_forwarder().await;
    let h = Harness::start_with(|c| c.upstream.base_url = format!("{forwarder}/v1beta")).await;
    *target.lock().unwrap() = Some(h.addr);
    let resp = within(
        client()
            .post(format!("http://{}/v1beta/models/m:generateContent", h.addr))
            .header("x-goog-api-key", KEY)
            .json(&json!({"contents": [{"role": "user", "parts": [{"text": "loop?"}]}]}))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 508);
    let trips = forwarded.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(trips, 1, "{trips} connections round the loop");
}

/// A TCP forwarder to the address put in its target once known (the
/// proxy's own): an upstream that points back at the proxy under a
/// spelling the start-up check cannot know. Its root URL, its target, and
/// how many connections it forwarded.
async fn loop_forwarder() -> (
    String,
    Arc<Mutex<Option<SocketAddr>>>,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    let forwarder = within(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .await
        .unwrap();
    let root = format!("http://{}", forwarder.local_addr().unwrap());
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
    (root, target, forwarded)
}

/// A stream still going when the shutdown grace period ends is cut, and
/// its exchange is in the store, partial, with what was relayed; over
/// HTTP/1.1 and over HTTP/2 (where each stream runs in a task of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_at_the_end_of_the_grace_period_is_recorded_partial() {
    for http2 in [false, true] {
        stream_cut_at_shutdown(http2).await;
    }
}

/// A streamed chat answer of 100 events, 100 ms apart: longer than the
/// tests' grace period.
fn long_stream() -> Reply {
    let pieces: Vec<String> = (0..100).map(|i| format!("w{i} ")).collect();
    let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
    Reply::Sse {
        chunks: chat_stream_events(&refs, Some((9, 100)))
            .into_iter()
            .map(Into::into)
            .collect(),
        gap: Duration::from_millis(100),
        reset_after: None,
    }
}

/// Reads the rest of `resp` in a task, until it ends or breaks off.
fn read_on(mut resp: reqwest::Response) -> tokio::task::JoinHandle<Vec<u8>> {
    tokio::spawn(async move {
        let mut all = Vec::new();
        while let Ok(Some(c)) = resp.chunk().await {
            all.extend_from_slice(&c);
        }
        all
    })
}

/// What [`read_on`] got ends before the stream's last event.
async fn assert_cut(rest: tokio::task::JoinHandle<Vec<u8>>) {
    let relayed = String::from_utf8_lossy(&within(rest).await.unwrap()).into_owned();
    assert!(!relayed.contains("[DONE]"), "the stream was cut: {relayed}");
}

async fn stream_cut_at_shutdown(http2: bool) {
    let mut h = Harness::start_with(|c| c.server.shutdown_grace_secs = 1).await;
    h.fake.push(long_stream());
    let c = if http2 {
        reqwest::Client::builder()
            .http2_prior_knowledge()
            .build()
            .unwrap()
    } else {
        client()
    };
    let mut resp = within(
        c.post(format!("{}/chat/completions", h.url()))
            .json(&json!({"model": "m", "stream": true,
                "messages": [{"role": "user", "content": "count"}]}))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.version() == http::Version::HTTP_2, http2);
    let first = within(resp.chunk()).await.unwrap().unwrap();
    assert!(!first.is_empty());
    let rest = read_on(resp);
    let started = Instant::now();
    h.stop().await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_cut(rest).await;
    let db =
        rusqlite::Connection::open_with_flags(&h.db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    let (partial, error, content): (i64, String, String) = db
        .query_row(
            "SELECT e.partial, e.error, i.body FROM exchanges e JOIN items i ON i.hash = substr(e.response_items, 1, 32)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap_or_else(|e| panic!("the cut exchange is recorded (http2: {http2}): {e}"));
    assert_eq!(partial, 1);
    assert!(error.contains("shut down"), "{error}");
    assert!(
        content.contains("w0"),
        "what was relayed is kept: {content}"
    );
}

/// The HTTP/2 connection preface a client sends first.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame: with the preface, an HTTP/2 connection that
/// then sends nothing.
const H2_SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];

/// Opens a connection that sends only `first`, then nothing.
async fn idle_socket(addr: SocketAddr, first: &[u8]) -> TcpStream {
    let mut s = within(TcpStream::connect(addr)).await.unwrap();
    if !first.is_empty() {
        within(s.write_all(first)).await.unwrap();
    }
    s
}

/// Reads until the server closes `s`; how long that took.
async fn closed_after(mut s: TcpStream, started: Instant) -> Duration {
    let mut sink = Vec::new();
    let _ = within(s.read_to_end(&mut sink)).await;
    started.elapsed()
}

/// What a connection sends before going quiet, for the idle tests.
fn quiet_openings() -> Vec<Vec<u8>> {
    vec![
        Vec::new(),
        H2_PREFACE[..10].to_vec(),
        [H2_PREFACE, H2_SETTINGS].concat(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_send_nothing_or_sit_idle_are_closed_after_the_header_timeout() {
    let h = Harness::start_with(|c| c.server.header_read_timeout_secs = 1).await;
    let started = Instant::now();
    let mut sockets = Vec::new();
    for opening in quiet_openings() {
        sockets.push(idle_socket(h.addr, &opening).await);
    }
    // An HTTP/1.1 keep-alive connection after one answer.
    let mut kept = idle_socket(h.addr, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await;
    let mut head = [0u8; 12];
    within(kept.read_exact(&mut head)).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    sockets.push(kept);
    for s in sockets {
        let waited = closed_after(s, started).await;
        assert!(
            waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
            "closed after {waited:?}"
        );
    }
    // An HTTP/2 connection that made a request and sits idle after its
    // answer is told to go away (GOAWAY) and closed too.
    let started = Instant::now();
    let mut s = idle_socket(h.addr, &[H2_PREFACE, H2_SETTINGS, H2_GET_HEALTHZ].concat()).await;
    let mut seen = Vec::new();
    let _ = within(s.read_to_end(&mut seen)).await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "closed after {waited:?}"
    );
    let seen = String::from_utf8_lossy(&seen);
    assert!(
        seen.contains(r#"{"status":"ok"}"#),
        "answered first: {seen:?}"
    );
}

/// A HEADERS frame (END_STREAM | END_HEADERS, stream 1) for `GET /healthz`,
/// HPACK-coded: `:method GET`, `:scheme http` from the static table, then
/// `:path` as a literal.
const H2_GET_HEALTHZ: &[u8] = &[
    0, 0, 12, 1, 5, 0, 0, 0, 1, 0x82, 0x86, 0x44, 8, b'/', b'h', b'e', b'a', b'l', b't', b'h', b'z',
];

/// The real binary under the open-file limit the shell command `ulimit`
/// sets (its hard and soft limit: `-n`, only its soft one: `-Sn`), with
/// `server` as its `[server]` table; its address and the lines it logs
/// (JSON).
fn serve_under_ulimit(ulimit: &str, server: &str) -> (support::Binary, SocketAddr, Log) {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("proxy.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\n{server}[upstream]\nbase_url = \"http://127.0.0.1:9/v1\"\n[store]\npath = \"{}\"\n",
            dir.path().join("c.db").display()
        ),
    )
    .unwrap();
    let port = support::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut child = std::process::Command::new("sh")
        .args(["-c", &format!("{ulimit} && exec \"$0\" \"$@\"")])
        .arg(env!("CARGO_BIN_EXE_compactor"))
        .args([
            "serve",
            "--log-format",
            "json",
            "--listen",
            &listen,
            "--config",
        ])
        .arg(&config)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start compactor");
    let stderr = child.stderr.take().unwrap();
    let child = support::Binary(child);
    let log: Log = Arc::default();
    let (tx, rx) = std::sync::mpsc::channel();
    let lines = log.clone();
    std::thread::spawn(move || {
        let _dir = dir;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("compactor listening") {
                let _ = tx.send(());
            }
            lines.lock().unwrap().push(line);
        }
    });
    rx.recv_timeout(STEP).expect("compactor started");
    (child, listen.parse().unwrap(), log)
}

/// The bound on client connections the binary logged as it began to
/// accept them.
fn logged_bound(log: &Log) -> u64 {
    let started = Instant::now();
    loop {
        let found = log.lock().unwrap().iter().find_map(|l| {
            let line: Value = serde_json::from_str(l).ok()?;
            (line["message"] == "accepting connections")
                .then(|| line["max_connections"].as_u64())
                .flatten()
        });
        if let Some(n) = found {
            return n;
        }
        assert!(started.elapsed() < STEP, "no bound logged");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What a binary logged, line by line.
type Log = Arc<Mutex<Vec<String>>>;

/// A runtime for the tests that drive the binary from a plain `#[test]`.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Under an open-file limit of 256, 300 connections that send nothing do not
/// take the proxy down: `/healthz` keeps answering, the idle ones are
/// closed after the header timeout, and the log does not fill with failed
/// accepts.
#[test]
fn many_idle_sockets_under_a_low_fd_limit_do_not_stop_the_proxy() {
    const IDLE: usize = 300;
    let (_child, addr, log_of) =
        serve_under_ulimit("ulimit -n 256", "header_read_timeout_secs = 1\n");
    let log = log_of.clone();
    runtime().block_on(async {
        let openings = quiet_openings();
        let started = Instant::now();
        let mut idle = Vec::new();
        for i in 0..IDLE {
            idle.push(idle_socket(addr, &openings[i % openings.len()]).await);
        }
        let health = within(
            client()
                .get(format!("http://{addr}/healthz"))
                .timeout(STEP)
                .send(),
        )
        .await
        .expect("/healthz answers");
        assert_eq!(health.status(), 200);
        let answered = started.elapsed();
        for s in idle {
            closed_after(s, started).await;
        }
        let all_closed = started.elapsed();
        let health = within(client().get(format!("http://{addr}/healthz")).send())
            .await
            .unwrap();
        assert_eq!(health.status(), 200);
        eprintln!("healthz answered after {answered:?}; all {IDLE} idle sockets closed after {all_closed:?}");
    });
    let log = log.lock().unwrap();
    let failed = log.iter().filter(|l| l.contains("accept failed")).count();
    assert!(failed <= 1, "the log fills with failed accepts: {failed}");
    drop(log);
    assert_eq!(
        logged_bound(&log_of),
        96,
        "(256 - 64) / 2: what the limit leaves"
    );
}

/// A soft open-file limit under a higher hard one is raised as far as
/// `server.max_connections` needs, so it does not lower the bound.
#[test]
fn a_low_soft_fd_limit_is_raised_for_max_connections() {
    let (_child, addr, log) = serve_under_ulimit("ulimit -Sn 256", "max_connections = 200\n");
    runtime().block_on(async {
        let health = within(client().get(format!("http://{addr}/healthz")).send())
            .await
            .unwrap();
        assert_eq!(health.status(), 200);
    });
    assert_eq!(logged_bound(&log), 200);
}

/// The real binary, stopped by SIGTERM while it streams an answer longer
/// than its grace period: it exits, and the store holds the exchange as
/// partial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_records_the_stream_it_cuts_at_shutdown() {
    let fake = within(compactor::fake_upstream::FakeUpstream::start())
        .await
        .unwrap();
    fake.push(long_stream());
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let config = dir.path().join("proxy.toml");
    // No window discovery: its `GET /v1/models` would take the scripted
    // stream meant for the chat request.
    std::fs::write(
        &config,
        format!(
            "[server]\nshutdown_grace_secs = 1\n[upstream]\nbase_url = \"{}\"\ndiscover_windows = false\n[store]\npath = \"{}\"\n",
            fake.url(),
            db.display()
        ),
    )
    .unwrap();
    let port = support::free_port();
    let args = [
        std::ffi::OsString::from("--config"),
        config.into_os_string(),
    ];
    let mut child = within(tokio::task::spawn_blocking(move || {
        let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        support::spawn_binary(port, &args)
    }))
    .await
    .unwrap();
    let mut resp = within(
        client()
            .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .json(&json!({"model": "m", "stream": true,
                "messages": [{"role": "user", "content": "count"}]}))
            .send(),
    )
    .await
    .unwrap();
    let first = within(resp.chunk()).await.unwrap().unwrap();
    assert!(!first.is_empty());
    // The client reads on, as a real one does.
    let rest = read_on(resp);
    let term = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = within(async {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(status.success(), "{status:?}");
    assert_cut(rest).await;
    let conn =
        rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    let (partial, error): (i64, String) = conn
        .query_row("SELECT partial, error FROM exchanges", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .expect("the cut exchange is recorded");
    assert_eq!(partial, 1);
    assert!(error.contains("shut down"), "{error}");
}
