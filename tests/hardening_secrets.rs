//! Secrets the proxy is given never leave it: passwords in the URLs it is
//! configured with are masked wherever the program shows a URL, and the
//! client's `x-compactor-*` headers (the admin token among them) stay with
//! the proxy.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use compactor::fake_upstream::{FakeUpstream, Reply};
use serde_json::json;
use support::{client, free_port, within, Harness, STEP};

const UP_SECRET: &str = "up-s3cret-7f3a";
const PG_SECRET: &str = "pg-s3cret-91c2";
const SSL_SECRET: &str = "ssl-s3cret-44d0";

fn compactor(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_compactor"));
    for var in [
        "COMPACTOR_CONFIG",
        "COMPACTOR_LISTEN",
        "COMPACTOR_UPSTREAM",
        "COMPACTOR_DB",
        "COMPACTOR_DATABASE_URL",
        "PGPASSWORD",
        "OPENAI_API_KEY",
    ] {
        c.env_remove(var);
    }
    c.args(args);
    c
}

/// Runs `cmd` off the async threads; stdout and stderr together.
async fn output(mut cmd: Command) -> (Option<i32>, String) {
    let out = within(tokio::task::spawn_blocking(move || cmd.output()))
        .await
        .expect("join")
        .expect("run compactor");
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn assert_masked(what: &str, out: &str) {
    for secret in [UP_SECRET, PG_SECRET, SSL_SECRET] {
        assert!(!out.contains(secret), "{what} shows {secret}: {out}");
    }
}

/// A PostgreSQL URL whose password is given as query parameters, which the
/// userinfo-only masking showed in clear.
fn pg_url() -> String {
    format!("postgres://app@127.0.0.1:1/records?password={PG_SECRET}&sslpassword={SSL_SECRET}&application_name=c")
}

fn upstream_with_password(base: &str) -> String {
    base.replacen("http://", &format!("http://alice:{UP_SECRET}@"), 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_masks_passwords_in_the_upstream_and_database_urls() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = upstream_with_password("http://127.0.0.1:9/v1");
    let (code, out) = output(compactor(&[
        "serve",
        "--check-config",
        "--upstream",
        &upstream,
        "--database-url",
        &pg_url(),
        "--db",
        dir.path().join("c.db").to_str().unwrap(),
    ]))
    .await;
    // The database is unreachable: the check fails, naming it masked.
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("cannot reach the database"), "{out}");
    assert!(out.contains("password=***"), "{out}");
    assert!(out.contains("alice:***@"), "{out}");
    assert_masked("--check-config", &out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_masks_the_database_password_when_it_cannot_open_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let mut cmd = compactor(&[
        "serve",
        "--listen",
        &listen,
        "--upstream",
        "http://127.0.0.1:9/v1",
        "--database-url",
        // Without `sslpassword`, which the PostgreSQL client refuses before
        // it connects.
        &format!("postgres://app@127.0.0.1:1/records?password={PG_SECRET}"),
    ]);
    cmd.env("HOME", dir.path()).env("RUST_LOG", "info");
    let (code, out) = output(cmd).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("127.0.0.1:1/records"), "names it: {out}");
    assert_masked("serve's start-up error", &out);
}

/// A URL the PostgreSQL client refuses before it connects (it takes no
/// `sslpassword` without TLS) is a start-up error, masked, not a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_database_url_the_client_cannot_take_without_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let mut cmd = compactor(&[
        "serve",
        "--listen",
        &listen,
        "--upstream",
        "http://127.0.0.1:9/v1",
        "--database-url",
        &format!("postgres://app@127.0.0.1:1/records?sslpassword={PG_SECRET}"),
    ]);
    cmd.env("HOME", dir.path()).env("RUST_LOG", "info");
    let (code, out) = output(cmd).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(
        !out.contains("panicked"),
        "a start-up error, not a panic: {out}"
    );
    assert!(out.contains("127.0.0.1:1/records"), "names it: {out}");
    assert_masked("serve's start-up error", &out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_banner_masks_a_password_in_the_upstream_url() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = upstream_with_password("http://127.0.0.1:9/v1?api_key=k&x=1");
    let listen = format!("127.0.0.1:{}", free_port());
    let db = dir.path().join("c.db");
    let mut child = support::Binary(
        compactor(&[
            "serve",
            "--listen",
            &listen,
            "--upstream",
            &upstream,
            "--db",
        ])
        .arg(&db)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start compactor"),
    );
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("compactor listening") {
                let _ = tx.send(line);
            }
        }
    });
    let banner = within(tokio::task::spawn_blocking(move || rx.recv_timeout(STEP)))
        .await
        .expect("join")
        .expect("the banner");
    assert!(banner.contains("alice:***@127.0.0.1:9"), "{banner}");
    assert!(banner.contains("api_key=***"), "{banner}");
    assert!(banner.contains("x=1"), "other parameters stay: {banner}");
    assert!(!banner.contains("=k&"), "{banner}");
    assert_masked("the banner", &banner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_masks_a_password_in_the_upstream_url() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    fake.push(Reply::json(
        200,
        json!({"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model"}]}),
    ));
    let dir = tempfile::tempdir().unwrap();
    let upstream = upstream_with_password(&fake.url());
    let (_, out) = output(compactor(&[
        "doctor",
        "--upstream",
        &upstream,
        "--db",
        dir.path().join("c.db").to_str().unwrap(),
    ]))
    .await;
    assert!(out.contains("alice:***@"), "{out}");
    assert_masked("doctor", &out);
}

/// Every `x-compactor-*` header a client sends, on the parsed endpoints and
/// on passthrough, stays with the proxy; only the proxy's own hop header
/// goes on (it is how a request that comes back is recognised).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_x_compactor_headers_never_reach_the_upstream() {
    let h = Harness::start().await;
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let responses = json!({"model": "m", "input": "hi"});
    let sends = [
        ("POST", "/chat/completions", Some(chat)),
        ("POST", "/responses", Some(responses)),
        ("GET", "/models", None),
        (
            "POST",
            "/embeddings",
            Some(json!({"model": "e", "input": "x"})),
        ),
    ];
    for (method, path, body) in sends {
        let before = h.fake.received().len();
        let mut req = client()
            .request(method.parse().unwrap(), format!("{}{path}", h.url()))
            .header("authorization", "Bearer sk-client")
            .header("x-compactor-admin-token", "admin-tok-SECRET")
            .header("x-compactor-something-new", "later-SECRET")
            .header("x-compactor-hop", "an-earlier-proxy");
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = within(req.send()).await.expect("send");
        assert_eq!(resp.status(), 200, "{method} {path}");
        within(resp.bytes()).await.expect("body");
        let received = h.fake.received();
        assert_eq!(
            received.len(),
            before + 1,
            "{method} {path} reached it once"
        );
        let got = received.last().expect("the upstream was reached");
        let names: Vec<&str> = got.headers.keys().map(|k| k.as_str()).collect();
        assert!(
            names
                .iter()
                .all(|n| !n.starts_with("x-compactor-") || *n == "x-compactor-hop"),
            "{method} {path}: {names:?}"
        );
        let hop = got.headers.get("x-compactor-hop").expect("hop header");
        assert!(
            hop.to_str().unwrap().starts_with("an-earlier-proxy, "),
            "{hop:?}"
        );
        assert_eq!(
            got.headers.get("authorization").unwrap(),
            "Bearer sk-client",
            "the client's own key still goes"
        );
    }
}

/// The windows the upstream tells are stored by upstream: by its URL as
/// shown, so a password in `upstream.base_url` never reaches the records;
/// and a restart still finds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_told_window_is_stored_without_the_upstream_password() {
    let h = Harness::start_with(|c| {
        c.upstream.discover_windows = true;
        c.upstream.base_url = upstream_with_password(&c.upstream.base_url);
    })
    .await;
    h.fake.push(Reply::json(
        200,
        json!({"object": "list", "data": [{"id": "m-told", "object": "model", "max_model_len": 4096}]}),
    ));
    let body = json!({"model": "m-told", "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, _) =
        support::post(&format!("{}/chat/completions", h.url()), "sk-c", &body).await;
    assert_eq!(status, 200);
    h.wait_exchanges(1).await;
    let stored: Vec<String> = support::column(&*h.sql(), "SELECT upstream FROM windows");
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert!(stored[0].contains("alice:***@"), "{stored:?}");
    assert_masked("the windows table", &stored[0]);
    let h = h.restart().await;
    assert_eq!(
        h.state.model_limits("m-told").context_window,
        4096,
        "found again"
    );
}
