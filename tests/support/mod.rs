//! Shared test plumbing: a proxy on an ephemeral port in front of the fake
//! upstream, a temporary store, and a timeout around every await.
//!
//! The store is a SQLite file, or with `COMPACTOR_TEST_STORE=postgres` a
//! fresh database of a throwaway PostgreSQL cluster: the tests that look
//! into it do so through [`Harness::sql`], which reads either.

#![allow(dead_code)]

pub mod ladder;
pub mod postgres;
pub mod real_cli;
pub mod responses;
pub mod websocket;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use compactor::app::AppState;
use compactor::compaction::summary::SUMMARIZER_MARKER;
use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::{FakeUpstream, Received, Reply};
use compactor::server;
use compactor::store::sql::Sql;
use postgres::PgCluster;
use serde_json::Value;
use tokio::sync::oneshot;

/// Upper bound for any single await in a test.
pub const STEP: Duration = Duration::from_secs(20);

/// Awaits `f` or fails the test after [`STEP`].
pub async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(STEP, f)
        .await
        .expect("test step timed out")
}

/// A session on the PostgreSQL database at `url`, for a test to look at or
/// change what the store wrote, and its connection's task.
async fn pg_session(url: &str) -> (tokio_postgres::Client, tokio::task::JoinHandle<()>) {
    let (client, conn) = within(tokio_postgres::connect(url, tokio_postgres::NoTls))
        .await
        .expect("connect to the test database");
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    (client, driver)
}

/// The rows `sql` returns on the PostgreSQL database at `url`.
pub async fn pg_rows(url: &str, sql: &str) -> Vec<tokio_postgres::Row> {
    let (client, driver) = pg_session(url).await;
    let rows = within(client.query(sql, &[])).await.expect(sql);
    drop(client);
    let _ = within(driver).await;
    rows
}

/// Runs `sql` (statements separated by `;`) on the PostgreSQL database at
/// `url`.
pub async fn pg_execute(url: &str, sql: &str) {
    let (client, driver) = pg_session(url).await;
    within(client.batch_execute(sql)).await.expect(sql);
    drop(client);
    let _ = within(driver).await;
}

/// The variable that picks the store the tests run on: `postgres`, or
/// `sqlite` (the default, also when unset).
pub const STORE_ENV: &str = "COMPACTOR_TEST_STORE";

/// Whether the tests' stores are on PostgreSQL ([`STORE_ENV`]).
pub fn on_postgres() -> bool {
    match std::env::var(STORE_ENV).as_deref() {
        Err(_) | Ok("" | "sqlite") => false,
        Ok("postgres") => true,
        Ok(other) => panic!("{STORE_ENV}={other}: expected sqlite or postgres"),
    }
}

/// What the proxies of this test binary log, for tests that look at it
/// (the first call starts the capture).
pub fn captured_logs() -> String {
    use std::sync::OnceLock;
    static LOGS: OnceLock<&'static Mutex<Vec<u8>>> = OnceLock::new();
    struct Writer(&'static Mutex<Vec<u8>>);
    impl std::io::Write for Writer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let logs = LOGS.get_or_init(|| {
        let logs: &'static Mutex<Vec<u8>> = Box::leak(Box::default());
        let _ = tracing_subscriber::fmt()
            .with_writer(move || Writer(logs))
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .try_init();
        logs
    });
    String::from_utf8_lossy(&logs.lock().unwrap()).into_owned()
}

/// For a test about SQLite itself (its file, journal or lock): true, after
/// saying so, when the stores are on PostgreSQL, and the test returns.
pub fn sqlite_only(why: &str) -> bool {
    let skip = on_postgres();
    if skip {
        eprintln!("skipped on {STORE_ENV}=postgres: {why}");
    }
    skip
}

/// This process's PostgreSQL cluster, started by the first store that needs
/// it. A `static` is never dropped, so it holds the cluster weakly: the
/// stores hold it, and the last one dropped stops it (a later store starts
/// another), so that no cluster outlives the test process.
fn cluster() -> Arc<PgCluster> {
    static CLUSTER: Mutex<Weak<PgCluster>> = Mutex::new(Weak::new());
    let mut shared = CLUSTER.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(cluster) = shared.upgrade() {
        return cluster;
    }
    // Asked for explicitly: a cluster that cannot start fails the test
    // rather than letting it pass on no store at all.
    let cluster = Arc::new(PgCluster::start().unwrap_or_else(|| {
        panic!("{STORE_ENV}=postgres, but no PostgreSQL cluster can be started (said above)")
    }));
    *shared = Arc::downgrade(&cluster);
    cluster
}

/// Where a test's records go: the SQLite file `path`, or a fresh database
/// of this process's cluster under [`STORE_ENV`]`=postgres`.
pub struct TestStore {
    pub path: PathBuf,
    /// The database's URL; empty for SQLite.
    pub url: String,
    /// Keeps the cluster running while the store is in use.
    cluster: Option<Arc<PgCluster>>,
}

impl TestStore {
    /// A new, empty store; `path` is its SQLite file (and the file the
    /// proxy is configured with on PostgreSQL too, where nothing uses it).
    pub fn new(path: PathBuf) -> TestStore {
        let cluster = on_postgres().then(cluster);
        let url = cluster.as_ref().map(|c| c.database()).unwrap_or_default();
        TestStore { path, url, cluster }
    }

    /// Whether it is a PostgreSQL database.
    pub fn is_postgres(&self) -> bool {
        !self.url.is_empty()
    }

    /// Points `[store]` at it.
    pub fn configure(&self, c: &mut compactor::config::StoreConfig) {
        c.path = self.path.display().to_string();
        c.url = self.url.clone();
    }

    /// Its `[store]` keys, as lines of a config file.
    pub fn toml(&self) -> String {
        let mut keys = format!("path = {:?}\n", self.path.display().to_string());
        if !self.url.is_empty() {
            keys += &format!("url = {:?}\n", self.url);
        }
        keys
    }

    /// A connection to it, for a test to read or change the records of a
    /// proxy that is not running (or has nothing left to write).
    pub fn sql(&self) -> Box<dyn Sql> {
        let mut c = compactor::config::StoreConfig::default();
        self.configure(&mut c);
        inspect(&c)
    }
}

/// A connection to the store `c` configures, through which the views read:
/// the same statements answer on either backend.
pub fn inspect(c: &compactor::config::StoreConfig) -> Box<dyn Sql> {
    if c.is_postgres() {
        let opts = compactor::store::postgres::Options::from_config(c);
        Box::new(compactor::store::postgres::connect(&opts).expect("connect to the store"))
    } else {
        Box::new(
            rusqlite::Connection::open_with_flags(
                &c.path,
                rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE,
            )
            .expect("open the store"),
        )
    }
}

/// The one number `sql` answers (e.g. a `count(*)`), from `conn`.
pub fn number(conn: &dyn Sql, sql: &str) -> i64 {
    conn.first(sql, &[])
        .expect(sql)
        .and_then(|row| row.get::<Option<i64>>(0).expect(sql))
        .unwrap_or(0)
}

/// The first column of every row `sql` gives, from `conn`.
pub fn column<T: compactor::store::sql::FromCell>(conn: &dyn Sql, sql: &str) -> Vec<T> {
    let rows = conn.rows(sql, &[]).expect(sql);
    rows.iter().map(|r| r.get(0).expect(sql)).collect()
}

/// A running proxy with its fake upstream and store.
pub struct Harness {
    pub addr: SocketAddr,
    pub fake: FakeUpstream,
    pub state: Arc<AppState>,
    pub db: PathBuf,
    pub dir: tempfile::TempDir,
    shutdown: Option<oneshot::Sender<()>>,
    pub server: Option<tokio::task::JoinHandle<()>>,
    /// The PostgreSQL cluster its store is in, kept running while it is.
    cluster: Option<Arc<PgCluster>>,
}

impl Harness {
    /// Proxy + fake upstream with default settings.
    pub async fn start() -> Harness {
        Self::start_with(|_| {}).await
    }

    /// Proxy + fake upstream, with a chance to adjust the config.
    pub async fn start_with(adjust: impl FnOnce(&mut Config)) -> Harness {
        let fake = within(FakeUpstream::start()).await.expect("fake upstream");
        let dir = tempfile::tempdir().expect("tempdir");
        let store = TestStore::new(dir.path().join("compactor.db"));
        let mut config = Config::default();
        config.upstream.base_url = fake.url();
        store.configure(&mut config.store);
        config.server.shutdown_grace_secs = 5;
        // Asking the fake for a model's window would take a scripted reply
        // meant for the test's own request; the tests of discovery turn it on.
        config.upstream.discover_windows = false;
        adjust(&mut config);
        let mut h = Self::start_on(fake, dir, store.path, config).await;
        h.cluster = store.cluster;
        h
    }

    /// A proxy over an existing fake and config (e.g. to restart on a store).
    pub async fn start_on(
        fake: FakeUpstream,
        dir: tempfile::TempDir,
        db: PathBuf,
        config: Config,
    ) -> Harness {
        // `RUST_LOG=info cargo test …` shows the proxy's logs.
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .try_init();
        }
        // Load the tokenizer first (seconds in a debug build), so the first
        // exchanges' compaction decisions are not all delayed to the same moment.
        within(tokio::task::spawn_blocking(|| {
            compactor::tokens::TokenCounter::default().count_text("warm up")
        }))
        .await
        .expect("tokenizer");
        let state = AppState::open(config).expect("open state");
        let listener = within(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        let st = state.clone();
        let server = tokio::spawn(async move {
            server::run(listener, st, async {
                let _ = rx.await;
            })
            .await
        });
        Harness {
            addr,
            fake,
            state,
            db,
            dir,
            shutdown: Some(tx),
            server: Some(server),
            cluster: None,
        }
    }

    /// Stops the proxy and starts another on the same store and config.
    pub async fn restart(self) -> Harness {
        self.restart_with(|_, _| {}).await
    }

    /// Stops the proxy, lets `between` change its store's file (SQLite)
    /// and its config, and starts another on them.
    pub async fn restart_with(
        mut self,
        between: impl FnOnce(&std::path::Path, &mut Config),
    ) -> Harness {
        self.stop().await;
        let Harness {
            fake,
            state,
            db,
            dir,
            cluster,
            ..
        } = self;
        let mut config = state.config.clone();
        // The store is one process's until its state is gone.
        drop(state);
        between(&db, &mut config);
        let mut h = Self::start_on(fake, dir, db, config).await;
        h.cluster = cluster;
        h
    }

    /// Base URL clients use (with `/v1`).
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Signals shutdown and waits for the server to drain.
    pub async fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(s) = self.server.take() {
            within(s).await.expect("server task");
        }
    }

    /// The proxy's `/metrics` text.
    pub async fn scrape(&self) -> String {
        within(async {
            client()
                .get(format!("http://{}/metrics", self.addr))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        })
        .await
    }

    /// The JSON a GET of the proxy's own `path` (e.g. `/admin/api/windows`) answers.
    pub async fn get_json(&self, path: &str) -> Value {
        within(async {
            client()
                .get(format!("http://{}{path}", self.addr))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap()
        })
        .await
    }

    /// A `POST` of the proxy's own `path` (the admin API): the status and
    /// the JSON answer (`null` if it is not JSON).
    pub async fn post_admin(&self, path: &str) -> (u16, Value) {
        let resp = within(client().post(format!("http://{}{path}", self.addr)).send())
            .await
            .expect("admin request");
        let status = resp.status().as_u16();
        let body = within(resp.bytes()).await.expect("admin answer");
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    /// A read-only connection to the SQLite store, after everything
    /// recorded so far went from the journal into the database.
    pub fn db(&self) -> rusqlite::Connection {
        assert!(
            !self.state.config.store.is_postgres(),
            "this test reads the store as a SQLite file: use Harness::sql on PostgreSQL"
        );
        self.state.store.flush_blocking().expect("flush the store");
        rusqlite::Connection::open_with_flags(&self.db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("open db")
    }

    /// A connection to the store, whichever backend it is on, after
    /// everything recorded so far is in the database.
    pub fn sql(&self) -> Box<dyn Sql> {
        self.state.store.flush_blocking().expect("flush the store");
        inspect(&self.state.config.store)
    }

    /// Waits until the store holds `n` exchanges (records of streams cut
    /// short are written after the client has gone).
    pub async fn wait_exchanges(&self, n: i64) {
        within(async {
            loop {
                let count = number(&*self.sql(), "SELECT count(*) FROM exchanges");
                if count >= n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
    }
}

/// A client that never pools, follows nothing, and does not decompress.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
}

/// Scripts the fake to stream `events` (`gap` before each) and starts a
/// streamed chat request through the proxy; the response, before its body.
pub async fn stream_chat(
    h: &Harness,
    events: Vec<String>,
    gap: Duration,
    include_usage: bool,
) -> reqwest::Response {
    h.fake.push(Reply::Sse {
        chunks: events.into_iter().map(Into::into).collect(),
        gap,
        reset_after: None,
    });
    let req = serde_json::json!({"model": "m", "stream": true,
        "stream_options": {"include_usage": include_usage},
        "messages": [{"role": "user", "content": "count"}]});
    within(
        client()
            .post(format!("{}/chat/completions", h.url()))
            .json(&req)
            .send(),
    )
    .await
    .unwrap()
}

/// POSTs JSON bytes with a bearer key; returns status, headers and body.
pub async fn post(
    url: &str,
    key: &str,
    body: &serde_json::Value,
) -> (u16, http::HeaderMap, bytes::Bytes) {
    post_raw(url, key, serde_json::to_vec(body).unwrap()).await
}

/// One chat turn of a conversation: `text` and the answer appended to
/// `history`, sent to `url` under `key` for `model`, named by the client
/// (`x-compactor-conversation`) when `conversation` is given; the
/// conversation id, and whether the request went upstream compacted.
pub async fn chat_turn(
    url: &str,
    key: &str,
    conversation: Option<&str>,
    model: &str,
    history: &mut Vec<serde_json::Value>,
    text: String,
) -> (String, bool) {
    history.push(serde_json::json!({"role": "user", "content": text}));
    let mut req = client()
        .post(url)
        .header("authorization", format!("Bearer {key}"))
        .json(&serde_json::json!({"model": model, "messages": history}));
    if let Some(c) = conversation {
        req = req.header("x-compactor-conversation", c);
    }
    let resp = within(req.send()).await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = within(resp.bytes()).await.expect("body");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    history.push(v["choices"][0]["message"].clone());
    let id = headers["x-compactor-conversation"]
        .to_str()
        .unwrap()
        .to_string();
    (id, headers.contains_key("x-compactor-compacted"))
}

/// A user message of about 130 tokens, `i` its own.
pub fn filler(i: usize) -> String {
    format!(
        "Step {i}: please look at src/module_{i}.rs and explain it. {}",
        "lorem ipsum dolor ".repeat(25)
    )
}

/// POSTs raw bytes with a bearer key.
pub async fn post_raw(url: &str, key: &str, body: Vec<u8>) -> (u16, http::HeaderMap, bytes::Bytes) {
    let resp = within(
        client()
            .post(url)
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(body)
            .send(),
    )
    .await
    .expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = within(resp.bytes()).await.expect("body");
    (status, headers, body)
}

/// A 3000-token window for `tiny*` models: compaction triggers past 2025
/// reported tokens (the fake reports a token per 4 bytes of request).
pub fn small_window(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "tiny*".into(),
        context_window: 3000,
        max_output_tokens: Some(300),
        trigger_ratio: None,
        ..Default::default()
    });
}

/// [`small_window`] without background compaction: conversations compact
/// only on overflow, on request, or past the hard limit.
pub fn small_window_foreground(c: &mut Config) {
    small_window(c);
    c.compaction.background = false;
}

/// Whether the upstream request is the proxy's own summarizer call.
pub fn is_summary_call(r: &Received) -> bool {
    let v = r.json();
    let marked = |m: &Value| {
        m["content"]
            .as_str()
            .is_some_and(|s| s.contains(SUMMARIZER_MARKER))
    };
    let messages = v["messages"].as_array().cloned().unwrap_or_default();
    // Today's call carries the marker in its system message; one repeating
    // the conversation's request, in the user message it appends.
    messages.first().is_some_and(marked)
        || messages.last().is_some_and(marked)
        || compactor::fake_upstream::anthropic::is_summarizer_request(&v)
}

/// Sends `body` to the proxy's `/v1/messages` with `key` and the
/// `anthropic-beta` header `beta`; the response, before its body.
pub async fn post_messages(h: &Harness, key: &str, beta: &str, body: &Value) -> reqwest::Response {
    let request = client()
        .post(format!("{}/messages", h.url()))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .header("anthropic-beta", beta)
        .json(body);
    within(request.send()).await.expect("proxy")
}

/// The bodies of the proxy's summary calls the fake upstream received,
/// oldest first.
pub fn summary_calls(h: &Harness) -> Vec<Value> {
    h.fake
        .received()
        .iter()
        .filter(|r| is_summary_call(r))
        .map(|r| r.json())
        .collect()
}

/// The bodies of the requests the fake upstream received that are not
/// summarizer calls, oldest first.
pub fn client_calls(h: &Harness) -> Vec<Value> {
    h.fake
        .received()
        .iter()
        .filter(|r| !is_summary_call(r))
        .map(|r| r.json())
        .collect()
}

/// What the upstream received for the client's latest request.
pub fn last_client_request(h: &Harness) -> Received {
    h.fake
        .received()
        .into_iter()
        .rev()
        .find(|r| !is_summary_call(r))
        .expect("a client call")
}

/// An object's keys, in order.
pub fn keys(v: &Value) -> Vec<&str> {
    v.as_object()
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default()
}

/// The body of [`last_client_request`], as JSON.
pub fn last_client_call(h: &Harness) -> Value {
    last_client_request(h).json()
}

/// Every text the store holds, for a search: the bytes of the files in
/// its directory (a PostgreSQL store keeps its rows elsewhere).
pub fn store_text(h: &Harness) -> String {
    let _ = h.sql();
    let mut all = Vec::new();
    for entry in std::fs::read_dir(h.dir.path()).unwrap() {
        all.extend(std::fs::read(entry.unwrap().path()).unwrap_or_default());
    }
    String::from_utf8_lossy(&all).into_owned()
}

/// How many compactions the store holds.
pub fn compactions(h: &Harness) -> i64 {
    number(&*h.sql(), "SELECT count(*) FROM compactions")
}

/// Waits until the store holds `n` compactions.
pub async fn wait_compactions(h: &Harness, n: i64) {
    within(async {
        while compactions(h) < n {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    })
    .await
}

/// A port of 127.0.0.1 where nothing listens while the socket returned
/// lives: bound by a socket that does not listen, so a connection to it is
/// refused, and no other test can take the port meanwhile (a port found
/// free and let go may be another test's server by the time it is used).
pub fn dead_port() -> (u16, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("bind");
    let port = socket.local_addr().expect("addr").port();
    (port, socket)
}

/// A port that was free a moment ago (for the real binary, which binds it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A child process killed when dropped, so a failing test leaves no proxy
/// running behind it.
pub struct Binary(pub std::process::Child);

impl std::ops::Deref for Binary {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Binary {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The real `compactor serve` binary, started with `args`, once it has
/// logged that it listens; its base URL is `http://127.0.0.1:{port}/v1`.
pub fn spawn_binary(port: u16, args: &[&std::ffi::OsStr]) -> Binary {
    spawn_binary_in(None, port, args)
}

/// [`spawn_binary`], run in the directory `cwd` when one is given (for
/// relative paths among `args`).
pub fn spawn_binary_in(
    cwd: Option<&std::path::Path>,
    port: u16,
    args: &[&std::ffi::OsStr],
) -> Binary {
    use std::io::{BufRead, BufReader};
    let listen = format!("127.0.0.1:{port}");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_compactor"));
    if let Some(dir) = cwd {
        command.current_dir(dir);
    }
    let mut child = command
        .args(["serve", "--listen", &listen])
        .args(args)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start compactor");
    let stderr = child.stderr.take().expect("stderr");
    // Started, or what it printed before it stopped.
    let (tx, rx) = std::sync::mpsc::channel::<Result<(), Vec<String>>>();
    std::thread::spawn(move || {
        let mut before = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("compactor listening") {
                let _ = tx.send(Ok(()));
                before.clear();
            } else if before.len() < 50 {
                before.push(line);
            }
        }
        let _ = tx.send(Err(before));
    });
    let child = Binary(child);
    match rx.recv_timeout(STEP) {
        Ok(Ok(())) => {}
        Ok(Err(printed)) => panic!("compactor stopped at start:\n{}", printed.join("\n")),
        Err(e) => panic!("compactor did not start: {e}"),
    }
    child
}

/// Reads one HTTP/1.1 request (head and a `content-length` body) off `s`;
/// `None` if the connection ends first.
pub async fn read_request(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return Some(buf.drain(..end + 4 + len).collect());
            }
        }
        let mut chunk = [0u8; 16384];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// An upstream on a raw socket: each connection is handed to `serve` with
/// its number (from 0); returns its base URL and the count of requests
/// read.
pub async fn raw_upstream<F, Fut>(serve: F) -> (String, Arc<AtomicUsize>)
where
    F: Fn(usize, tokio::net::TcpStream, Arc<AtomicUsize>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = within(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .await
        .unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let requests = Arc::new(AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        for n in 0.. {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(serve(n, stream, counted.clone()));
        }
    });
    (url, requests)
}

/// Runs the real `compactor ARGS` off the async threads (a proxy it talks
/// to may run on them), with none of the caller's settings but `env`;
/// returns exit code, stdout, stderr.
pub async fn cli(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_compactor"));
    cmd.args(args)
        .env_remove("COMPACTOR_CONFIG")
        .env_remove("COMPACTOR_DB")
        .env_remove("COMPACTOR_LISTEN");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = within(tokio::task::spawn_blocking(move || cmd.output()))
        .await
        .expect("join")
        .expect("run compactor");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
