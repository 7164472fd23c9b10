//! Records: conversation grouping, tenants, content-addressed items, and
//! durability of the real binary under `kill -9`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::store::rows::request_item_hashes;
use compactor::wire::item_hash;
use serde_json::{json, Value};
use support::{column, number, post, within, Harness, TestStore};

fn conv(headers: &http::HeaderMap) -> String {
    headers
        .get("x-compactor-conversation")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string()
}

/// Sends `history`, appends the assistant's answer as the client would, and
/// returns the conversation id.
async fn turn(url: &str, key: &str, history: &mut Vec<Value>, user: &str) -> String {
    history.push(json!({"role": "user", "content": user}));
    let (status, headers, body) =
        post(url, key, &json!({"model": "gpt-4o", "messages": history})).await;
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_slice(&body).unwrap();
    // Clients resend the answer in their own shape, not byte-identically.
    let text = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    history.push(json!({"role": "assistant", "content": text}));
    conv(&headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_extending_histories_group_and_others_do_not() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let mut a = vec![json!({"role": "system", "content": "You are a coding agent."})];
    let mut b = a.clone();
    let a1 = turn(&url, "k1", &mut a, "fix the bug in parser.rs").await;
    let a2 = turn(&url, "k1", &mut a, "now add a test").await;
    let b1 = turn(&url, "k1", &mut b, "write a poem").await;
    let a3 = turn(&url, "k1", &mut a, "run it").await;
    let b2 = turn(&url, "k1", &mut b, "shorter").await;
    assert_eq!(a1, a2);
    assert_eq!(a2, a3);
    assert_eq!(b1, b2);
    assert_ne!(a1, b1, "sharing only the system prompt does not group");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_that_each_begin_count_to_five_are_three_conversations() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let mut seen: Vec<String> = Vec::new();
    for session in 0..3 {
        // The fake answers alike, so each session's second request also
        // repeats the earlier sessions' second requests.
        let mut history = Vec::new();
        let first = turn(&url, "k1", &mut history, "Count to five.").await;
        let second = turn(&url, "k1", &mut history, "Now count back.").await;
        assert_eq!(first, second, "session {session} is one conversation");
        assert!(!seen.contains(&first), "session {session} joined {seen:?}");
        seen.push(first);
    }
    let per_conversation: Vec<i64> = column(
        &*h.sql(),
        "SELECT count(*) FROM exchanges GROUP BY conversation_id",
    );
    assert_eq!(per_conversation, [2, 2, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_ids_group_unrelated_requests() {
    let h = Harness::start().await;
    let client = support::client();
    let mut ids = Vec::new();
    for text in ["first", "entirely different", "third"] {
        let body = json!({"model": "gpt-5", "input": text});
        let resp = within(
            client
                .post(format!("{}/responses", h.url()))
                .header("authorization", "Bearer k")
                .header("session-id", "019a-session")
                .json(&body)
                .send(),
        )
        .await
        .unwrap();
        ids.push(conv(resp.headers()));
        within(resp.bytes()).await.unwrap();
    }
    // Codex sends the same id as `prompt_cache_key` in the body.
    let (_, headers, _) = post(
        &format!("{}/responses", h.url()),
        "k",
        &json!({"model": "gpt-5", "input": "fourth", "prompt_cache_key": "019a-session"}),
    )
    .await;
    ids.push(conv(&headers));
    assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
    let rows = h
        .sql()
        .rows(
            "SELECT explicit_key, (SELECT count(*) FROM exchanges) FROM conversations",
            &[],
        )
        .unwrap();
    assert_eq!(rows.len(), 1, "one conversation: {rows:?}");
    let key: String = rows[0].get(0).unwrap();
    assert_eq!(key, "session-id:019a-session");
    assert_eq!(rows[0].get::<i64>(1).unwrap(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_histories_under_two_keys_are_two_tenants() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let mut a = vec![json!({"role": "system", "content": "same"})];
    let mut b = a.clone();
    let a1 = turn(&url, "sk-alice-aaaaaaaaaaaa", &mut a, "same question").await;
    let b1 = turn(&url, "sk-bob-bbbbbbbbbbbbbb", &mut b, "same question").await;
    let a2 = turn(&url, "sk-alice-aaaaaaaaaaaa", &mut a, "next").await;
    let b2 = turn(&url, "sk-bob-bbbbbbbbbbbbbb", &mut b, "next").await;
    assert_ne!(a1, b1);
    assert_eq!(a1, a2);
    assert_eq!(b1, b2);
    // The same explicit id under two keys is two conversations as well.
    let session = |key: &'static str| {
        let url = format!("{}/responses", h.url());
        async move {
            let resp = within(
                support::client()
                    .post(url)
                    .header("authorization", format!("Bearer {key}"))
                    .header("session-id", "shared-id")
                    .json(&json!({"model": "gpt-5", "input": "hi"}))
                    .send(),
            )
            .await
            .unwrap();
            conv(resp.headers())
        }
    };
    assert_ne!(
        session("sk-alice-aaaaaaaaaaaa").await,
        session("sk-bob-bbbbbbbbbbbbbb").await
    );
    let tenants = number(&*h.sql(), "SELECT count(DISTINCT tenant) FROM exchanges");
    assert_eq!(tenants, 2);
    // Gemini: a key in `x-goog-api-key` or in `?key=` names its tenant the
    // same way; the same contents under two keys are two conversations.
    let gemini = |key: &'static str, in_query: bool| {
        let path = "/v1beta/models/gemini-2.5-flash:generateContent";
        let mut req = support::client()
            .post(format!("http://{}{path}", h.addr))
            .json(&json!({"contents": [{"role": "user", "parts": [{"text": "same"}]}]}));
        req = if in_query {
            req.query(&[("key", key)])
        } else {
            req.header("x-goog-api-key", key)
        };
        async move { conv(within(req.send()).await.unwrap().headers()) }
    };
    let (alice, bob) = ("AIza-alice-aaaaaaaaaaaa", "AIza-bob-bbbbbbbbbbbbbb");
    assert_ne!(gemini(alice, false).await, gemini(bob, false).await);
    assert_ne!(gemini(alice, true).await, gemini(bob, true).await);
    let tenants = number(&*h.sql(), "SELECT count(DISTINCT tenant) FROM exchanges");
    assert_eq!(
        tenants, 4,
        "a key is one tenant, in the header or the query"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_keys_never_reach_the_store() {
    let h = Harness::start().await;
    let key = "sk-proj-RAWKEY-must-not-be-stored-7f3a";
    let url = format!("{}/chat/completions", h.url());
    let mut hist = vec![];
    // What is recorded is found where the key is looked for.
    const RECORDED: &str = "hello, recorded word for word 5d1e";
    turn(&url, key, &mut hist, RECORDED).await;
    let (status, _, _) = post(
        &format!("{}/responses", h.url()),
        key,
        &json!({"input": "x", "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    // An upstream that quotes the key it refused: the client gets that
    // answer, the store does not keep the key.
    h.fake.push(compactor::fake_upstream::Reply::json(
        401,
        json!({"error": {"message": format!("Incorrect API key provided: {key}."),
                         "type": "invalid_request_error", "code": "invalid_api_key"}}),
    ));
    let (status, _, body) = post(
        &format!("{}/responses", h.url()),
        key,
        &json!({"input": "y"}),
    )
    .await;
    assert_eq!(status, 401);
    assert!(
        String::from_utf8_lossy(&body).contains(key),
        "relayed verbatim to its owner"
    );
    // Look in the store's files, as bytes.
    let contains = |bytes: &[u8], s: &[u8]| bytes.windows(s.len()).any(|w| w == s);
    let (mut found, mut recorded) = (Vec::new(), false);
    for path in store_files(&h) {
        let bytes = std::fs::read(&path).unwrap();
        recorded |= contains(&bytes, RECORDED.as_bytes());
        if contains(&bytes, key.as_bytes()) || contains(&bytes, b"RAWKEY") {
            found.push(path);
        }
    }
    assert!(
        recorded,
        "the first request's message is in the files looked at"
    );
    assert!(found.is_empty(), "raw key found in {found:?}");
    let n = number(&*h.sql(), "SELECT count(*) FROM exchanges");
    assert_eq!(n, 3, "the exchanges themselves were recorded");
}

/// The files that hold `h`'s records: the SQLite database with its WAL and
/// journal, or PostgreSQL's write-ahead log (where a commit is written
/// first) and its database's own files.
fn store_files(h: &Harness) -> Vec<std::path::PathBuf> {
    let files = |dir: &std::path::Path| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .collect()
    };
    if !h.state.config.store.is_postgres() {
        return files(h.dir.path());
    }
    let row = h
        .sql()
        .first(
            "SELECT current_setting('data_directory'),
                    (SELECT oid::bigint FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .unwrap()
        .expect("a row");
    let data = std::path::PathBuf::from(row.get::<String>(0).unwrap());
    let database = row.get::<i64>(1).unwrap().to_string();
    let mut all = files(&data.join("pg_wal"));
    all.extend(files(&data.join("base").join(database)));
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_history_is_stored_once_and_reconstructs_exactly() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let mut hist = vec![json!({"role": "system", "content": "sys"})];
    const TURNS: usize = 30;
    for i in 0..TURNS {
        turn(
            &url,
            "k",
            &mut hist,
            &format!("step {i}: {}", "detail ".repeat(50)),
        )
        .await;
    }
    let db = h.sql();
    let items = number(&*db, "SELECT count(*) FROM items");
    // Per turn: the user message, the answer as the upstream sent it and as
    // the client resent it; plus the system message and the parameters.
    assert!(
        items as usize <= 3 * TURNS + 2,
        "items = {items}: storage must be linear"
    );
    let suffix_hashes = number(&*db, "SELECT sum(length(suffix_items)) / 32 FROM exchanges");
    assert!(
        suffix_hashes as usize <= 3 * TURNS + 1,
        "suffixes = {suffix_hashes}: each turn stores only what is new"
    );
    // The last request's items come back exactly from the prefix references.
    let last_id = number(&*db, "SELECT max(id) FROM exchanges");
    let sent: Vec<_> = hist[..hist.len() - 1].iter().map(item_hash).collect();
    assert_eq!(request_item_hashes(&*db, last_id).unwrap(), sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_exchanges_survive_kill_9() {
    // tests/postgres.rs kills a replica of a PostgreSQL store.
    if support::sqlite_only("kill -9 of the binary, then the journal beside its SQLite file") {
        return;
    }
    let fake = within(compactor::fake_upstream::FakeUpstream::start())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kill9.db");
    let port = support::free_port();
    let mut child = support::spawn_binary(
        port,
        &[
            "--upstream".as_ref(),
            fake.url().as_ref(),
            "--db".as_ref(),
            db.as_os_str(),
        ],
    );
    let base = format!("http://127.0.0.1:{port}/v1");
    let (s1, _, _) = post(
        &format!("{base}/chat/completions"),
        "k",
        &json!({"model": "m", "messages": [{"role": "user", "content": "one"}]}),
    )
    .await;
    let (s2, _, b2) = post(
        &format!("{base}/chat/completions"),
        "k",
        &json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "two"}]}),
    )
    .await;
    let (s3, _, _) = post(
        &format!("{base}/responses"),
        "k",
        &json!({"model": "m", "input": "three", "stream": true}),
    )
    .await;
    assert_eq!((s1, s2, s3), (200, 200, 200));
    assert!(String::from_utf8_lossy(&b2).ends_with("data: [DONE]\n\n"));
    // Right after the last answer: SIGKILL, no chance to flush anything.
    child.kill().unwrap();
    child.wait().unwrap();
    // What the next start (or a reader) does first: import the journal.
    compactor::store::sqlite::import_orphaned(&db).unwrap();
    let conn = rusqlite::Connection::open(&db).unwrap();
    let rows: Vec<(String, i64, Option<i64>)> = conn
        .prepare("SELECT endpoint, streamed, output_tokens FROM exchanges ORDER BY id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        rows,
        vec![
            ("/chat/completions".into(), 0, Some(7)),
            ("/chat/completions".into(), 1, Some(7)),
            ("/responses".into(), 1, Some(7)),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_on_the_same_store_keeps_grouping() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let mut hist = vec![];
    let before = turn(&url, "k", &mut hist, "remember me").await;
    let h2 = h.restart().await;
    let after = turn(
        &format!("{}/chat/completions", h2.url()),
        "k",
        &mut hist,
        "again",
    )
    .await;
    assert_eq!(before, after);
}

/// A store and a config for the real binary in front of a fake upstream:
/// (fake, dir, store, config path, port); `extra` goes under `[store]`.
async fn binary_setup(
    extra: &str,
) -> (
    compactor::fake_upstream::FakeUpstream,
    tempfile::TempDir,
    TestStore,
    std::path::PathBuf,
    u16,
) {
    let fake = within(compactor::fake_upstream::FakeUpstream::start())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = TestStore::new(dir.path().join("c.db"));
    let config = dir.path().join("proxy.toml");
    let port = support::free_port();
    write_config(&config, &fake, &store, port, extra);
    (fake, dir, store, config, port)
}

fn write_config(
    config: &std::path::Path,
    fake: &compactor::fake_upstream::FakeUpstream,
    store: &TestStore,
    port: u16,
    extra: &str,
) {
    std::fs::write(
        config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[upstream]\nbase_url = {:?}\ndiscover_windows = false\n[store]\n{}{extra}",
            fake.url(),
            store.toml()
        ),
    )
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_and_prune_while_the_binary_serves_and_after_it_stopped() {
    let (_fake, _dir, store, config, port) = binary_setup("").await;
    let config_arg = config.display().to_string();
    let proxy = support::spawn_binary(port, &["--config".as_ref(), config.as_os_str()]);
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    // The same history under two keys (two tenants), and one of its own.
    let secret = "a conversation to be forgotten, word for word";
    let mut a = Vec::new();
    let gone = turn(&url, "k1", &mut a, secret).await;
    turn(&url, "k1", &mut a, "and a second turn").await;
    let mut b = Vec::new();
    let kept = turn(&url, "k2", &mut b, secret).await;
    let mut c = Vec::new();
    let old = turn(&url, "k1", &mut c, "an older one").await;

    let cli = |args: &[&str]| {
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.extend(["--config".to_string(), config_arg.clone()]);
        async move {
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            support::cli(&all, &[]).await
        }
    };
    let (code, out, err) = cli(&["conversations", "delete", &gone]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("removed 1 conversation, 2 exchanges, 0 compactions, "),
        "{out}"
    );
    // It keeps serving; the deleted conversation is gone, and the same
    // history sent again starts a new one.
    let mut again = Vec::new();
    let next = turn(&url, "k1", &mut again, secret).await;
    assert_ne!(next, gone);
    let (code, _, err) = cli(&["conversations", "show", &gone]).await;
    assert_eq!(code, 1);
    assert!(err.contains("no conversation"), "{err}");
    // The other tenant's identical conversation reads back whole.
    let (code, out, err) = cli(&["conversations", "export", &kept]).await;
    assert_eq!(code, 0, "{err}");
    let export: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(export["original_items"][0]["content"], secret, "{export}");
    assert_eq!(export["original_items"].as_array().unwrap().len(), 2);

    // Nothing is that old; then everything is (while it serves).
    let (code, out, err) = cli(&["prune", "--older-than", "30d"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("removed 0 conversations"), "{out}");
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let (code, out, err) = cli(&["prune", "--older-than", "0s"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("removed 3 conversations"), "{out}");
    let (status, _, _) = post(
        &url,
        "k1",
        &json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "still here"}]}),
    )
    .await;
    assert_eq!(status, 200, "serving after the prune");
    drop(proxy);

    // No proxy: the store itself is changed.
    let (code, out, err) = cli(&["conversations", "list", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let list: Value = serde_json::from_str(&out).unwrap();
    let left: Vec<&str> = list["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(left.len(), 1, "the one sent after the prune: {left:?}");
    assert!(![gone.as_str(), kept.as_str(), old.as_str()].contains(&left[0]));
    let (code, out, err) = cli(&["conversations", "delete", left[0]]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("removed 1 conversation, 1 exchange"),
        "{out}"
    );
    let conn = store.sql();
    let count = |table: &str| number(&*conn, &format!("SELECT count(*) FROM {table}"));
    assert_eq!(
        (count("conversations"), count("exchanges"), count("items")),
        (0, 0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_running_binary_applies_retain_days() {
    let (fake, _dir, store, config, port) = binary_setup("").await;
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let (old, recent) = {
        let _proxy = support::spawn_binary(port, &["--config".as_ref(), config.as_os_str()]);
        let old = turn(&url, "k", &mut Vec::new(), "from long ago").await;
        let recent = turn(&url, "k", &mut Vec::new(), "from today").await;
        (old, recent)
    };
    // As if last seen three days ago (a SQLite file's journal first: the
    // binary was killed).
    if !store.is_postgres() {
        compactor::store::sqlite::import_orphaned(&store.path).unwrap();
    }
    let conn = store.sql();
    let changed = conn
        .execute(
            "UPDATE conversations SET last_seen_ms = last_seen_ms - 3 * 86400000 WHERE id = ?1",
            &[(&old).into()],
        )
        .unwrap();
    assert_eq!(changed, 1);
    write_config(&config, &fake, &store, port, "retain_days = 2\n");
    let _proxy = support::spawn_binary(port, &["--config".as_ref(), config.as_os_str()]);
    let ids = || -> Vec<String> { column(&*conn, "SELECT id FROM conversations") };
    within(async {
        while ids().contains(&old) {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(ids(), [recent]);
}
