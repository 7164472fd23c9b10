//! The store against hostile input and unlucky operators: items with no
//! canonical form, credentials in upstream errors, a corrupted journal,
//! a second server on the same store under another name.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::config::Config;
use compactor::fake_upstream::Reply;
use compactor::store::rows::{item_body, request_item_hashes};
use serde_json::json;
use support::{captured_logs, column, post_raw, within, Harness};

fn conversation_of(headers: &http::HeaderMap) -> String {
    headers
        .get("x-compactor-conversation")
        .and_then(|v| v.to_str().ok())
        .expect("a conversation header")
        .to_string()
}

/// Items that parse to nothing the hash can use (a lone surrogate, nesting
/// past the parser's limit) used to hash as `null`: unrelated requests
/// then joined one conversation, and the store kept the first one's
/// content for all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_without_a_canonical_form_stay_apart_and_as_given() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let deep = |leaf: &str| format!("{}\"{leaf}\"{}", "[".repeat(300), "]".repeat(300));
    let items = [
        r#"{"role":"user","content":"\ud800 first request"}"#.to_string(),
        r#"{"role":"user","content":"\ud800 an unrelated one"}"#.to_string(),
        format!(r#"{{"role":"user","content":{}}}"#, deep("deep one")),
        format!(r#"{{"role":"user","content":{}}}"#, deep("deep two")),
    ];
    let mut seen = Vec::new();
    for item in &items {
        let body = format!(r#"{{"model":"m","messages":[{item}]}}"#);
        let (status, headers, _) = post_raw(&url, "k", body.into_bytes()).await;
        assert_eq!(status, 200);
        seen.push(conversation_of(&headers));
    }
    let distinct: std::collections::HashSet<_> = seen.iter().collect();
    assert_eq!(
        distinct.len(),
        items.len(),
        "one conversation each: {seen:?}"
    );

    let db = h.sql();
    let ids: Vec<i64> = column(&*db, "SELECT id FROM exchanges ORDER BY id");
    assert_eq!(ids.len(), items.len());
    for (id, item) in ids.iter().zip(&items) {
        let hashes = request_item_hashes(&*db, *id).unwrap();
        assert_eq!(hashes.len(), 1);
        let stored = item_body(&*db, &hashes[0]).unwrap();
        assert_eq!(stored.as_deref(), Some(item.as_str()), "its own bytes");
    }
}

/// An upstream that quotes the key it refused: with a lowercase scheme,
/// `api-key` or `x-api-key`, the key used to be stored in the exchange's
/// error and shown by `conversations export`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_quoted_by_the_upstream_are_never_stored() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let cases = [
        ("authorization", "bearer sk-lowercase-scheme-0123456789"),
        ("authorization", "BEARER sk-upper-scheme-0123456789"),
        ("api-key", "azure-style-key-0123456789abcdef"),
        ("x-api-key", "anthropic-style-key-0123456789"),
    ];
    let client = support::client();
    for (header, value) in cases {
        let key = value.rsplit(' ').next().unwrap();
        h.fake.push(Reply::json(
            401,
            json!({"error": {"message": format!("Incorrect API key provided: {key}. You sent `{header}: {value}`."),
                             "type": "invalid_request_error", "code": "invalid_api_key"}}),
        ));
        let resp = within(
            client
                .post(&url)
                .header(header, value)
                .json(&json!({"model": "m", "messages": [{"role": "user", "content": header}]}))
                .send(),
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 401);
        let conversation = conversation_of(resp.headers());
        within(resp.bytes()).await.unwrap();

        let db = h.sql();
        let errors: Vec<String> =
            column(&*db, "SELECT error FROM exchanges WHERE error IS NOT NULL");
        assert!(!errors.is_empty());
        for e in &errors {
            assert!(!e.contains(key), "{header}: stored {e}");
        }
        let export = compactor::store::query::export(&*db, &Config::default(), &conversation)
            .expect("export");
        let shown = serde_json::to_string(&export).unwrap();
        assert!(shown.contains("[REDACTED]"), "{shown}");
        assert!(!shown.contains(key), "{header}: exported {shown}");
    }
}

/// The server's own key (`upstream.api_key_env`) quoted in an upstream
/// error: not relayed to the client, who never had it, nor stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_own_key_is_not_relayed_or_stored() {
    const VAR: &str = "COMPACTOR_HARDENING_STORE_TEST_KEY";
    const KEY: &str = "server-side-secret-abcdef0123";
    // Only this test reads the variable.
    std::env::set_var(VAR, KEY);
    let h = Harness::start_with(|c| c.upstream.api_key_env = VAR.into()).await;
    h.fake.push(Reply::json(
        401,
        json!({"error": {"message": format!("Incorrect API key provided: {KEY}"),
                         "type": "invalid_request_error", "code": "invalid_api_key"}}),
    ));
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let url = format!("{}/chat/completions", h.url());
    let (status, _, answer) =
        post_raw(&url, "client-key", serde_json::to_vec(&body).unwrap()).await;
    assert_eq!(status, 401);
    let answer = String::from_utf8_lossy(&answer);
    assert!(!answer.contains(KEY), "relayed: {answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).expect("still JSON");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let errors: Vec<String> = column(&*h.sql(), "SELECT error FROM exchanges");
    assert_eq!(errors.len(), 1, "one exchange: {errors:?}");
    let error = &errors[0];
    assert!(!error.contains(KEY), "stored: {error}");
}

/// An exchange as the server journals it, with one new item of its own.
fn journaled(id: i64) -> compactor::store::ExchangeRecord {
    let item = json!({"role": "user", "content": format!("journaled exchange number {id}")});
    let hash = compactor::wire::item_hash(&item);
    compactor::store::ExchangeRecord {
        id,
        conversation: format!("conv_journaled_{id}"),
        new_conversation: true,
        chained_by_id: false,
        branched_from: None,
        explicit_key: None,
        tenant: "t".into(),
        api: compactor::wire::Api::Chat,
        model: "m".into(),
        prefix: None,
        suffix_items: vec![hash],
        request_len: 1,
        params: [1; 32],
        response_items: Vec::new(),
        new_items: vec![(hash, item.to_string())],
        stored_items: Default::default(),
        claimed_at: 0,
        journaled: false,
        response_id: None,
        usage: None,
        status: 200,
        streamed: false,
        partial: false,
        error: None,
        started_ms: id,
        latency_ms: 1.0,
        ttfb_ms: None,
        chain_request: Some(hash),
        chain_full: None,
        chain_echoed: None,
        compaction: None,
        window: None,
        client_ids: Default::default(),
        client: None,
        preview: None,
        savings: Default::default(),
    }
}

/// Journals `ids` as a server killed before their import leaves them;
/// returns the journal's path and its length after each record.
fn killed_with_journaled(db: &std::path::Path, ids: &[i64]) -> (std::path::PathBuf, Vec<usize>) {
    use compactor::store::journal::Staged;
    compactor::store::sqlite::SqliteBackend::open(db).expect("a store");
    let (journal, left) = compactor::store::Journal::open(db).expect("journal");
    assert!(left.is_empty());
    let log = std::path::PathBuf::from(format!("{}-exchanges", db.display()));
    let mut ends = Vec::new();
    for &id in ids {
        let Ok(Staged::At(seq)) = journal.stage(journaled(id), |_, _| {}) else {
            panic!("staged");
        };
        journal.write_staged(seq).expect("written");
        ends.push(std::fs::metadata(&log).unwrap().len() as usize);
    }
    (log, ends)
}

/// `compactor conversations list --json` on `db`: the conversation ids
/// and what it said on stderr.
fn listed(db: &std::path::Path) -> (Vec<String>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_compactor"))
        .args(["conversations", "list", "--json", "--db"])
        .arg(db)
        .env_remove("COMPACTOR_CONFIG")
        .env_remove("COMPACTOR_DB")
        .output()
        .expect("run compactor");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let mut ids: Vec<String> = v["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    (ids, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// One damaged frame in the middle of the journal used to end its reading
/// there: every later exchange was dropped (the journal truncated to 0
/// bytes, "a write cut short"), and a flipped bit inside an item body was
/// imported under a hash that no longer matched.
#[test]
fn a_damaged_journal_frame_costs_only_its_own_exchange() {
    if support::sqlite_only("the journal beside a SQLite file") {
        return;
    }
    let conv = |ids: &[i64]| -> Vec<String> {
        ids.iter()
            .map(|id| format!("conv_journaled_{id}"))
            .collect()
    };
    // A bit flipped inside the second exchange's item body.
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("flipped.db");
    let (log, ends) = killed_with_journaled(&db, &[1, 2, 3]);
    let mut bytes = std::fs::read(&log).unwrap();
    let body = b"journaled exchange number 2";
    let at = bytes.windows(body.len()).position(|w| w == body).unwrap();
    assert!(ends[0] < at && at < ends[1]);
    bytes[at] ^= 0x01;
    std::fs::write(&log, &bytes).unwrap();
    let (ids, said) = listed(&db);
    assert_eq!(ids, conv(&[1, 3]));
    assert!(said.contains("could not be read"), "{said}");
    let quarantine = format!("{}-exchanges.quarantine", db.display());
    let kept = std::fs::read(&quarantine).expect("a quarantine file");
    let damaged = &bytes[ends[0]..ends[1]];
    assert!(
        kept.windows(damaged.len()).any(|w| w == damaged),
        "the frame is kept"
    );
    // Every stored body is what its hash says.
    let conn = rusqlite::Connection::open(&db).unwrap();
    let items: Vec<(Vec<u8>, String)> = {
        let mut stmt = conn.prepare("SELECT hash, body FROM items").unwrap();
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    };
    assert!(!items.is_empty());
    for (hash, body) in items {
        let value: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(hash, compactor::wire::item_hash(&value).to_vec(), "{body}");
    }
    // Said again by the next look, not only once.
    let (_, said) = listed(&db);
    assert!(said.contains(&quarantine), "{said}");

    // Garbage between the first and second frames: nothing is lost.
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("garbage.db");
    let (log, ends) = killed_with_journaled(&db, &[1, 2, 3]);
    let mut bytes = std::fs::read(&log).unwrap();
    bytes.splice(ends[0]..ends[0], *b"\x07garbage, not a frame\xff");
    std::fs::write(&log, &bytes).unwrap();
    let (ids, said) = listed(&db);
    assert_eq!(ids, conv(&[1, 2, 3]));
    assert!(said.contains("could not be read"), "{said}");
}

/// Runs `compactor serve` on `db` expecting it to refuse to start: its
/// exit code and stderr (a start that does not end in time fails).
fn refused_serve(upstream: &str, db: &std::path::Path) -> (Option<i32>, String) {
    use std::io::Read;
    // Port 0: a server refused its store is never reached, and a port
    // picked ahead could be taken meanwhile (the refusal would then be
    // "cannot listen", not the store's).
    let listen = "127.0.0.1:0";
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_compactor"))
        .args(["serve", "--listen", listen, "--upstream", upstream, "--db"])
        .arg(db)
        .env_remove("COMPACTOR_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start compactor");
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if started.elapsed() > support::STEP {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut said = String::new();
    let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut said));
    let status =
        status.unwrap_or_else(|| panic!("{} started and kept serving: {said}", db.display()));
    (status.code(), said)
}

/// A second server on the same store, reached through a symlink, a hard
/// link (as a bind mount of the file would be), `..` or a symlinked
/// directory, used to start: two servers then shared one database with
/// journals of their own, and acknowledged exchanges were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_per_store_however_its_path_is_spelled() {
    if support::sqlite_only("the lock of a SQLite file, under its names") {
        return;
    }
    let fake = within(compactor::fake_upstream::FakeUpstream::start())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let db = real.join("store.db");
    let port = support::free_port();
    let _first = support::spawn_binary(
        port,
        &[
            "--upstream".as_ref(),
            fake.url().as_ref(),
            "--db".as_ref(),
            db.as_os_str(),
        ],
    );
    let symlink = dir.path().join("link.db");
    std::os::unix::fs::symlink(&db, &symlink).unwrap();
    let hard_link = dir.path().join("hard.db");
    std::fs::hard_link(&db, &hard_link).unwrap();
    let linked_dir = dir.path().join("linked");
    std::os::unix::fs::symlink(&real, &linked_dir).unwrap();
    let spellings = [
        symlink,
        hard_link,
        dir.path().join("sub/../real/store.db"),
        linked_dir.join("store.db"),
    ];
    for spelled in &spellings {
        let (code, said) = tokio::task::block_in_place(|| refused_serve(&fake.url(), spelled));
        assert_ne!(code, Some(0), "{}: {said}", spelled.display());
        assert!(
            said.contains("another process serves the store"),
            "{}: {said}",
            spelled.display()
        );
    }
    // Refused before it opened the database: SQLite names a WAL after the
    // name it was given, so a server that opened the hard link for writing
    // before it took the lock left one of its own, and two WALs of one
    // database can leave it malformed.
    for side in ["hard.db-wal", "hard.db-shm"] {
        let side = dir.path().join(side);
        assert!(!side.exists(), "{} was made", side.display());
    }
    // The first server serves on, and records what it acknowledges.
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    for i in 0..3 {
        let body =
            json!({"model": "m", "messages": [{"role": "user", "content": format!("turn {i}")}]});
        let (status, _, _) = post_raw(&url, "k", serde_json::to_vec(&body).unwrap()).await;
        assert_eq!(status, 200);
    }
}

/// A store named by a relative path (`--db d/store.db`): the server locked
/// its lock file under the given and the canonical name through two
/// descriptors, the second blocked on the first, and it refused to start
/// as if another process served the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_named_by_a_relative_path_is_served_and_still_one_per_store() {
    if support::sqlite_only("the lock of a SQLite file named by a relative path") {
        return;
    }
    let fake = within(compactor::fake_upstream::FakeUpstream::start())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("d")).unwrap();
    let port = support::free_port();
    let _server = tokio::task::block_in_place(|| {
        support::spawn_binary_in(
            Some(dir.path()),
            port,
            &[
                "--upstream".as_ref(),
                fake.url().as_ref(),
                "--db".as_ref(),
                "d/store.db".as_ref(),
            ],
        )
    });
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]});
    let (status, _, _) = post_raw(&url, "k", serde_json::to_vec(&body).unwrap()).await;
    assert_eq!(status, 200);
    let absolute = dir.path().join("d/store.db");
    let (code, said) = tokio::task::block_in_place(|| refused_serve(&fake.url(), &absolute));
    assert_ne!(code, Some(0), "{said}");
    assert!(said.contains("another process serves the store"), "{said}");
}

/// A chat of `tiny-model` whose history grows by a long user message a
/// turn (the answers are left out: the fake's are short).
struct Growing {
    history: Vec<serde_json::Value>,
}

impl Growing {
    fn new() -> Growing {
        Growing {
            history: vec![json!({"role": "system", "content": "You are a careful coding agent."})],
        }
    }

    /// The body of turn `i`.
    fn turn(&mut self, i: usize) -> Vec<u8> {
        self.history.push(json!({"role": "user", "content": format!("Step {i}: explain src/module_{i}.rs. {}", "lorem ipsum ".repeat(20))}));
        serde_json::to_vec(&json!({"model": "tiny-model", "messages": self.history})).unwrap()
    }

    /// Sends turns 0..10 (compaction is due, and foreground compaction
    /// waits for a request that overflows or asks): the conversation id.
    async fn grown(&mut self, h: &Harness, key: &str) -> String {
        let url = format!("{}/chat/completions", h.url());
        let mut conversation = String::new();
        for i in 0..10 {
            let (status, headers, _) = post_raw(&url, key, self.turn(i)).await;
            assert_eq!(status, 200);
            conversation = conversation_of(&headers);
        }
        conversation
    }
}

/// A summarizer call the upstream refuses, quoting the client's key: the
/// log line said the first 300 bytes of its answer as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_summarizer_call_logs_no_key() {
    const KEY: &str = "sk-summarizer-quoted-0123456789";
    captured_logs();
    let h = Harness::start_with(support::small_window_foreground).await;
    let url = format!("{}/chat/completions", h.url());
    let mut chat = Growing::new();
    let conversation = chat.grown(&h, KEY).await;
    let refused = json!({"error": {"message": format!("Incorrect API key provided: {KEY}."),
                                   "type": "invalid_request_error", "code": "invalid_api_key"}});
    h.fake.push(Reply::json(401, refused.clone()));
    h.fake.push(Reply::json(401, refused));
    let admin = format!(
        "http://{}/admin/api/conversations/{conversation}/compact",
        h.addr
    );
    let resp = within(support::client().post(admin).send()).await.unwrap();
    assert_eq!(resp.status(), 202);
    let (status, _, _) = post_raw(&url, KEY, chat.turn(10)).await;
    assert_eq!(status, 200);
    let logs = captured_logs();
    assert!(logs.contains("summary call failed"), "{logs}");
    assert!(!logs.contains(KEY), "{logs}");
}

/// A manual compaction applies to the next request the proxy serves. On
/// PostgreSQL it is a row announced by NOTIFY, and the process asked knew
/// of it only once its own announcement came back on its listening
/// connection: a request sent right after the 202 could go uncompacted
/// (and take the reply scripted for the summarizer). The listening
/// connection is cut first here, so that announcement is surely late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_compaction_applies_to_the_very_next_request() {
    let h = Harness::start_with(support::small_window_foreground).await;
    let mut chat = Growing::new();
    let conversation = chat.grown(&h, "k").await;
    if h.state.config.store.is_postgres() {
        let cut = column::<i64>(
            &*h.sql(),
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE application_name = 'compactor-listen' AND datname = current_database()) t",
        );
        assert_eq!(cut, [1], "the proxy's listening connection");
    }
    let (status, v) = h
        .post_admin(&format!("/admin/api/conversations/{conversation}/compact"))
        .await;
    assert_eq!(status, 202, "{v}");
    if h.state.config.store.is_postgres() {
        assert!(h.state.reads.manual_heard(&conversation), "known at once");
    }
    let (status, headers, _) =
        post_raw(&format!("{}/chat/completions", h.url()), "k", chat.turn(10)).await;
    assert_eq!(status, 200);
    assert!(
        headers.contains_key("x-compactor-compacted"),
        "the next request is compacted: {headers:?}"
    );
}

/// A client that authenticates with `x-api-key` alone used to be the
/// anonymous tenant: two such clients sending the same history shared one
/// conversation (and its compactions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_known_by_x_api_key_alone_are_tenants_of_their_own() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let body =
        json!({"model": "m", "messages": [{"role": "user", "content": "the same question"}]});
    let mut seen = Vec::new();
    for key in ["tenant-one-key-0123", "tenant-two-key-4567"] {
        let resp = within(
            support::client()
                .post(&url)
                .header("x-api-key", key)
                .json(&body)
                .send(),
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 200);
        seen.push(conversation_of(resp.headers()));
        within(resp.bytes()).await.unwrap();
    }
    assert_ne!(seen[0], seen[1]);
}

/// What the journal's import checks holds for what the proxy records: every
/// stored body hashes to its key. Real clients' requests of both endpoints
/// (the fuzz corpus), streamed and not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stored_body_hashes_to_its_key() {
    let h = Harness::start().await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/requests");
    let mut sent = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let endpoint = if name.starts_with("chat-") {
            "/chat/completions"
        } else if name.starts_with("gemini-") {
            "/models/gemini-2.5-pro:generateContent"
        } else {
            "/responses"
        };
        let body = std::fs::read(&path).unwrap();
        let (status, _, _) = post_raw(&format!("{}{endpoint}", h.url()), "k", body).await;
        assert_eq!(status, 200, "{name}");
        sent += 1;
    }
    assert!(sent >= 10);
    let items: Vec<(Vec<u8>, String)> = h
        .sql()
        .rows("SELECT hash, body FROM items", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0).unwrap(), r.get(1).unwrap()))
        .collect();
    assert!(items.len() > sent);
    for (hash, body) in items {
        let key = compactor::wire::hash::text_item_hash(body.as_bytes());
        assert_eq!(hash, key.to_vec(), "{body:.200}");
    }
}
