//! The shared store's faults, through a proxy on a real PostgreSQL: a
//! client's text PostgreSQL refuses (U+0000) fails no one, and a stalled
//! database (its connections held by a relay the test pauses) refuses
//! requests at once, before they go upstream, then recovers on its own.
//!
//! A real PostgreSQL tier: `#[ignore]`d like the other real tiers (run with
//! `--include-ignored`; `scripts/test` installs PostgreSQL), each test on a
//! throwaway cluster of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use compactor::fake_upstream::Reply;
use serde_json::{json, Value};
use support::postgres::PgCluster;
use support::{post, within, Harness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MODEL: &str = "tiny-test";

/// One number a query over the database answers.
async fn count(url: &str, sql: &str) -> i64 {
    support::pg_rows(url, sql).await[0].get(0)
}

/// Chat requests the upstream received.
fn chat_calls(h: &Harness) -> usize {
    h.fake
        .received()
        .iter()
        .filter(|r| r.path.ends_with("/chat/completions"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_client_sending_nul_in_its_text_is_served_recorded_and_fails_no_other_tenant() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let h = Harness::start_with(|c| c.store.url = url.clone()).await;
    let endpoint = format!("{}/chat/completions", h.url());
    // U+0000 in every text of the body the client chooses: its model, its
    // prompt_cache_key (the conversation's key) and its message (the
    // conversation's preview).
    let odd = json!({
        "model": "tiny\u{0}model",
        "prompt_cache_key": "cache\u{0}key",
        "messages": [{"role": "user", "content": "hello\u{0}world"}],
    });
    // Rounds of requests at once: the odd client beside three tenants.
    let mut answers = Vec::new();
    for round in 0..4 {
        let mut sent = vec![tokio::spawn({
            let (endpoint, odd) = (endpoint.clone(), odd.clone());
            async move { post(&endpoint, "sk-nul-client", &odd).await.0 }
        })];
        for tenant in 0..3 {
            let endpoint = endpoint.clone();
            let body = json!({"model": MODEL,
                "messages": [{"role": "user", "content": format!("round {round} of {tenant}")}]});
            sent.push(tokio::spawn(async move {
                post(&endpoint, &format!("sk-tenant-{tenant}"), &body)
                    .await
                    .0
            }));
        }
        for s in sent {
            answers.push(within(s).await.expect("the request"));
        }
    }
    assert_eq!(answers, vec![200; 16], "every client, the odd one too");
    assert_eq!(
        count(&url, "SELECT count(*) FROM exchanges WHERE status = 200").await,
        16
    );
    // Stored, and read back through the views as the client sent it.
    let views = h.sql();
    let got: Vec<String> = support::column(
        &*views,
        "SELECT e.model || '|' || e.prompt_cache_key || '|' || c.explicit_key || '|' || c.preview
         FROM exchanges e JOIN conversations c ON c.id = e.conversation_id
         WHERE e.model LIKE 'tiny%model'",
    );
    let expected = "tiny\u{0}model|cache\u{0}key|session-id:cache\u{0}key|hello\u{0}world";
    assert_eq!(got, vec![expected.to_string(); 4]);
    let conversations: Vec<String> = support::column(
        &*views,
        "SELECT DISTINCT conversation_id FROM exchanges WHERE model LIKE 'tiny%model'",
    );
    assert_eq!(conversations.len(), 1, "one conversation, by its key");
}

/// A `prompt_cache_key` of 12 KB (past what PostgreSQL's index takes in a
/// row) names one conversation, served and recorded like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_cache_key_of_any_length_is_served_recorded_and_one_conversation() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let h = Harness::start_with(|c| c.store.url = url.clone()).await;
    let endpoint = format!("{}/chat/completions", h.url());
    // Text that does not compress (PostgreSQL compresses an index row
    // before it measures it).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let key: String = (0..12_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'!' + (x % 90) as u8)
        })
        .collect();
    let mut statuses = Vec::new();
    for turn in 0..3 {
        let body = json!({"model": MODEL, "prompt_cache_key": key,
            "messages": [{"role": "user", "content": format!("turn {turn}")}]});
        statuses.push(post(&endpoint, "sk-long-key", &body).await.0);
    }
    assert_eq!(statuses, vec![200; 3]);
    assert_eq!(
        count(&url, "SELECT count(*) FROM exchanges WHERE status = 200").await,
        3
    );
    let views = h.sql();
    let conversations: Vec<String> =
        support::column(&*views, "SELECT DISTINCT conversation_id FROM exchanges");
    assert_eq!(conversations.len(), 1, "one conversation, by its key");
}

/// A TCP relay to PostgreSQL that the test pauses: while paused, every
/// byte either way is held, as by a database that stopped answering (its
/// host frozen, its disk stuck) while its connections stay open.
struct Relay {
    port: u16,
    paused: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Relay {
    /// The database at `url` reached through the relay.
    fn url_for(&self, url: &str) -> String {
        let name = url.rsplit('/').next().expect("a database name");
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    async fn start(target: u16) -> Relay {
        let listener = within(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .await
            .expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        let paused = Arc::new(tokio::sync::watch::channel(false).0);
        let held = paused.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let (from_client, to_client) = client.into_split();
                let (from_server, to_server) = server.into_split();
                tokio::spawn(pipe(from_client, to_server, held.subscribe()));
                tokio::spawn(pipe(from_server, to_client, held.subscribe()));
            }
        });
        Relay { port, paused }
    }

    fn pause(&self, paused: bool) {
        self.paused.send_replace(paused);
    }
}

/// Copies `from` to `to`, each chunk held while the relay is paused.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: tokio::sync::watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf).await {
        if paused.wait_for(|p| !p).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits until the proxy says it is ready.
async fn until_ready(h: &Harness) {
    within(async {
        while readyz(h).await != 200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

/// Waits until the count `sql` asks `url` for is at least `n`.
async fn until_count(url: &str, sql: &str, n: i64) {
    within(async {
        while count(url, sql).await < n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// A proxy whose store is the database at `url`, reached through `relay`,
/// its commits giving up after a second (and the connect bound, 5 s).
async fn proxy_behind(relay: &Relay, url: &str, local_journal: bool) -> Harness {
    let via_relay = relay.url_for(url);
    Harness::start_with(|c| {
        c.store.url = via_relay.clone();
        c.store.local_journal = local_journal;
        c.store.statement_timeout_ms = 1_000;
    })
    .await
}

async fn readyz(h: &Harness) -> u16 {
    within(
        support::client()
            .get(format!("http://{}/readyz", h.addr))
            .send(),
    )
    .await
    .expect("readyz")
    .status()
    .as_u16()
}

/// A stall (the oldest pending commit older than `store.stall_after_ms`):
/// the parsed requests that come meanwhile are refused at once and all
/// together, before they go upstream, with `Retry-After`; passthrough keeps
/// flowing; `/readyz` fails; the answer whose commit was pending is served
/// once it commits; the first successful commit clears the stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_stalled_database_refuses_requests_at_once_before_they_go_upstream_then_recovers() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let relay = Relay::start(pg.port).await;
    let via_relay = relay.url_for(&url);
    let stall_after = Duration::from_millis(500);
    let h = Harness::start_with(|c| {
        c.store.url = via_relay.clone();
        c.store.stall_after_ms = stall_after.as_millis() as u64;
        // Far past the test's own bounds: what ends the wait here is the
        // stall, not a timeout.
        c.store.statement_timeout_ms = 120_000;
    })
    .await;
    let endpoint = format!("{}/chat/completions", h.url());
    let body =
        |text: &str| json!({"model": MODEL, "messages": [{"role": "user", "content": text}]});
    let (status, _, _) = post(&endpoint, "sk-stall", &body("before")).await;
    assert_eq!(status, 200);

    // An answer on its way when the database stops: the upstream holds it
    // until the relay is paused, then its commit waits.
    h.fake.push(Reply::Delay(
        Duration::from_millis(300),
        Box::new(Reply::chat("held", 10, 2)),
    ));
    let pending = tokio::spawn({
        let (endpoint, body) = (endpoint.clone(), body("in flight"));
        async move { post(&endpoint, "sk-stall", &body).await.0 }
    });
    within(async {
        while chat_calls(&h) < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    relay.pause(true);
    tokio::time::sleep(stall_after * 2).await;
    assert!(!pending.is_finished(), "its commit waits for the database");

    // Stalled: requests are refused together, promptly, none upstream.
    let upstream_before = chat_calls(&h);
    let started = Instant::now();
    let refused: Vec<_> = (0..8)
        .map(|i| {
            let (endpoint, body) = (endpoint.clone(), body(&format!("stalled {i}")));
            tokio::spawn(async move { post(&endpoint, &format!("sk-other-{i}"), &body).await })
        })
        .collect();
    for r in refused {
        let (status, headers, bytes) = within(r).await.expect("the request");
        assert_eq!(status, 503);
        assert_eq!(
            headers.get("retry-after").map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        let err: Value = serde_json::from_slice(&bytes).expect("a JSON error");
        assert_eq!(err["error"]["code"], "store_unavailable", "{err}");
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "refused at once, not in turn: {took:?}"
    );
    assert_eq!(chat_calls(&h), upstream_before, "nothing went upstream");
    assert_eq!(readyz(&h).await, 503, "not ready while stalled");
    // Passthrough does not need the database.
    let models = within(support::client().get(format!("{}/models", h.url())).send())
        .await
        .expect("passthrough");
    assert_eq!(models.status().as_u16(), 200);

    // The database answers again: the held answer commits and is served,
    // and that commit clears the stall.
    relay.pause(false);
    assert_eq!(within(pending).await.expect("the request"), 200);
    until_ready(&h).await;
    let (status, _, _) = post(&endpoint, "sk-stall", &body("after")).await;
    assert_eq!(status, 200);
    assert_eq!(
        count(&url, "SELECT count(*) FROM exchanges WHERE status = 200").await,
        3,
        "before, in flight and after: every answer served is recorded"
    );
}

/// A commit that times out after its pipeline went to the database may
/// still land there afterwards. Its client was told the answer was
/// withheld (503), so the record says so too, whenever the late commit
/// lands: never an exchange recorded as answered that its client never got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn an_answer_whose_commit_timed_out_is_recorded_as_withheld_though_the_commit_lands_later() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let relay = Relay::start(pg.port).await;
    let h = proxy_behind(&relay, &url, false).await;
    let endpoint = format!("{}/chat/completions", h.url());
    let body =
        |text: &str| json!({"model": MODEL, "messages": [{"role": "user", "content": text}]});
    let (status, _, _) = post(&endpoint, "sk-late", &body("before")).await;
    assert_eq!(status, 200);

    // The answer's commit is sent while the database holds every byte.
    h.fake.push(Reply::Delay(
        Duration::from_millis(300),
        Box::new(Reply::chat("late", 10, 2)),
    ));
    let pending = tokio::spawn({
        let (endpoint, body) = (endpoint.clone(), body("in flight"));
        async move { post(&endpoint, "sk-late", &body).await.0 }
    });
    within(async {
        while chat_calls(&h) < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    relay.pause(true);
    assert_eq!(within(pending).await.expect("the request"), 503, "withheld");

    // The held pipeline reaches the database and may commit after all
    // (unless the relay dropped it with the connection the proxy gave up
    // on); either way the next batch records the exchange as withheld.
    relay.pause(false);
    until_ready(&h).await;
    let (status, _, _) = post(&endpoint, "sk-late", &body("after")).await;
    assert_eq!(status, 200);
    until_count(&url, "SELECT count(*) FROM exchanges", 3).await;
    assert_eq!(
        count(&url, "SELECT count(*) FROM exchanges WHERE status = 200").await,
        2,
        "only the answers the client got are recorded as answered"
    );
    let withheld = format!(
        "SELECT count(*) FROM exchanges WHERE status = 503 AND partial AND error = '{}'
                                         AND response_id IS NULL",
        compactor::store::postgres::WITHHELD
    );
    assert_eq!(count(&url, &withheld).await, 1);
}

/// With `store.local_journal` an answer whose commit timed out was
/// answered all the same (it was journaled first): its exchange is written
/// again until the database takes it, as served, never as withheld.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn with_a_local_journal_a_commit_that_timed_out_is_written_again_as_served() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let relay = Relay::start(pg.port).await;
    let h = proxy_behind(&relay, &url, true).await;
    let endpoint = format!("{}/chat/completions", h.url());
    // One conversation, which the replica has seen whole: its next request
    // reads nothing of the database.
    let mut session = Session::default();
    session.turn(&endpoint, 0).await;
    relay.pause(true);
    // Answered once journaled.
    session.turn(&endpoint, 1).await;
    // Its commit gives up (a second, and the connect bound) and is tried
    // again while the database is out of reach.
    tokio::time::sleep(Duration::from_secs(3)).await;
    relay.pause(false);
    until_count(&url, "SELECT count(*) FROM exchanges", 2).await;
    until_ready(&h).await;
    session.turn(&endpoint, 2).await;
    within(h.state.store.flush()).await.expect("flush");
    assert_eq!(
        count(&url, "SELECT count(*) FROM exchanges WHERE status = 200").await,
        3,
        "every answer the client got is recorded as answered"
    );
    assert_eq!(count(&url, "SELECT count(*) FROM exchanges").await, 3);
}

/// One text a query over the database answers.
async fn text(url: &str, sql: &str) -> String {
    let (client, conn) = within(tokio_postgres::connect(url, tokio_postgres::NoTls))
        .await
        .expect("connect to the test database");
    let driver = tokio::spawn(conn);
    let s: String = within(client.query_one(sql, &[])).await.expect(sql).get(0);
    drop(client);
    let _ = within(driver).await;
    s
}

/// Item hashes the exchanges refer to (by their request after its prefix,
/// their answer or their parameters) that are not in the store.
const MISSING_ITEMS: &str = "
    SELECT count(*) FROM exchanges e CROSS JOIN LATERAL (
        SELECT substring(e.suffix_items FROM i * 32 + 1 FOR 32) AS hash
          FROM generate_series(0, length(e.suffix_items) / 32 - 1) i
        UNION ALL
        SELECT substring(e.response_items FROM i * 32 + 1 FOR 32)
          FROM generate_series(0, length(e.response_items) / 32 - 1) i
        UNION ALL
        SELECT e.params) referred
    WHERE NOT EXISTS (SELECT 1 FROM items WHERE items.hash = referred.hash)";

/// A replica leaves out the bodies of the items it believes stored. When
/// another process deletes the only conversation that referred to them
/// and prunes them while such a record is still on its way (here withheld:
/// its commit timed out while the database held every byte of this
/// replica's), the record, written again once the database answers, goes
/// with every body it left out: the exchange reads back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_record_whose_items_were_pruned_before_it_committed_brings_their_bodies() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let relay = Relay::start(pg.port).await;
    let via_relay = relay.url_for(&url);
    let statement_timeout = Duration::from_millis(1_000);
    let h = Harness::start_with(|c| {
        c.store.url = via_relay.clone();
        // A commit gives up after this and the connect bound (5 s).
        c.store.statement_timeout_ms = statement_timeout.as_millis() as u64;
    })
    .await;
    let endpoint = format!("{}/chat/completions", h.url());
    let shared = "words two tenants happen to send alike";
    let body =
        |text: &str| json!({"model": MODEL, "messages": [{"role": "user", "content": text}]});

    // One tenant's conversation stores the message and the parameters.
    let (status, _, _) = post(&endpoint, "sk-gone", &body(shared)).await;
    assert_eq!(status, 200);
    let gone = text(&url, "SELECT id FROM conversations").await;

    // Another tenant sends them too: believed stored, they go by their
    // hashes alone, in a commit that the database holds until it times out.
    h.fake.push(Reply::Delay(
        Duration::from_millis(300),
        Box::new(Reply::chat("late", 10, 2)),
    ));
    let pending = tokio::spawn({
        let (endpoint, body) = (endpoint.clone(), body(shared));
        async move { post(&endpoint, "sk-kept", &body).await.0 }
    });
    within(async {
        while chat_calls(&h) < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    relay.pause(true);
    assert_eq!(within(pending).await.expect("the request"), 503, "withheld");

    // Meanwhile another process (the CLI, say) deletes the first
    // conversation: nothing committed refers to its items any more, and
    // they go; the replica hears of it only once the database answers.
    let direct = compactor::store::postgres::Options {
        url: url.clone(),
        password: None,
        pool_size: 2,
        statement_timeout,
        stall_after: Duration::from_secs(2),
        claim_lapse: Duration::from_secs(120),
        synchronous_commit: None,
    };
    let removed = within(tokio::task::spawn_blocking(move || {
        let conn = compactor::store::postgres::connect(&direct).expect("a connection");
        compactor::store::retention::delete_and_prune(&conn, &[gone]).expect("the deletion")
    }))
    .await
    .expect("the deletion's thread");
    assert_eq!(removed.conversations, 1, "{removed:?}");
    assert!(
        removed.items >= 2,
        "the message and the parameters went: {removed:?}"
    );

    // The database answers again: the withheld exchange is written with
    // the next batch (another tenant's, sharing none of its items).
    relay.pause(false);
    until_ready(&h).await;
    let unrelated = json!({
        "model": MODEL,
        "temperature": 0.5,
        "messages": [{"role": "user", "content": "nothing in common"}],
    });
    let (status, _, _) = post(&endpoint, "sk-other", &unrelated).await;
    assert_eq!(status, 200);
    let withheld = format!(
        "SELECT count(*) FROM exchanges WHERE status = 503 AND error = '{}'",
        compactor::store::postgres::WITHHELD
    );
    until_count(&url, &withheld, 1).await;
    assert_eq!(count(&url, "SELECT count(*) FROM exchanges").await, 2);
    assert_eq!(
        count(&url, MISSING_ITEMS).await,
        0,
        "every item an exchange refers to is stored"
    );
}

/// With `store.local_journal`, an answer goes out once journaled, before
/// its commit: answers whose commits cannot reach the database (its link
/// paused) reach their clients all the same, and a `kill -9` of the proxy
/// then loses none of them: the process started again on the same files
/// commits them before it serves, and the conversation goes on as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn with_a_local_journal_answers_go_before_their_commit_and_a_kill_9_loses_none() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let relay = Relay::start(pg.port).await;
    let fake = within(compactor::fake_upstream::FakeUpstream::start())
        .await
        .expect("fake upstream");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("proxy.toml");
    std::fs::write(
        &config,
        format!(
            "[upstream]\nbase_url = \"{}\"\ndiscover_windows = false\n\
             [store]\nurl = \"{}\"\npath = \"{}\"\nlocal_journal = true\n\
             stall_after_ms = 60000\nstatement_timeout_ms = 60000\n",
            fake.url(),
            relay.url_for(&url),
            dir.path().join("compactor.db").display(),
        ),
    )
    .expect("write the config");
    let start = || {
        let port = support::free_port();
        let proxy = support::spawn_binary(port, &["--config".as_ref(), config.as_os_str()]);
        (
            proxy,
            format!("http://127.0.0.1:{port}/v1/chat/completions"),
        )
    };
    let mut session = Session::default();
    let (mut proxy, chat) = start();
    for i in 0..2 {
        session.turn(&chat, i).await;
    }
    let committed = "SELECT count(*) FROM exchanges WHERE status = 200";
    until_count(&url, committed, 2).await;
    // The database out of reach: the answers come all the same.
    relay.pause(true);
    let held = Instant::now();
    for i in 2..5 {
        session.turn(&chat, i).await;
    }
    assert!(
        held.elapsed() < Duration::from_secs(10),
        "answered without waiting for the commits: {:?}",
        held.elapsed()
    );
    assert_eq!(
        count(&url, committed).await,
        2,
        "none of them committed yet"
    );
    proxy.kill().expect("kill -9");
    proxy.wait().expect("reaped");
    relay.pause(false);
    // Started again: what the journal holds is committed first.
    let (_proxy, chat) = start();
    assert_eq!(
        count(&url, committed).await,
        5,
        "every acknowledged exchange is recorded"
    );
    session.turn(&chat, 5).await;
    assert_eq!(
        session.conversations.len(),
        1,
        "one conversation: {:?}",
        session.conversations
    );
}

/// A client's chat session: its history, and the conversations the proxy
/// said its turns were.
#[derive(Default)]
struct Session {
    history: Vec<Value>,
    conversations: std::collections::BTreeSet<String>,
}

impl Session {
    /// Turn `i` through the proxy at `url`, which must answer it.
    async fn turn(&mut self, url: &str, i: usize) {
        let text = format!("step {i}: look at src/m{i}.rs and say what it does");
        self.history.push(json!({"role": "user", "content": text}));
        let body = json!({"model": MODEL, "messages": self.history});
        let (status, headers, body) = post(url, "sk-journal-test-0000000000000000", &body).await;
        assert_eq!(status, 200, "turn {i}: {}", String::from_utf8_lossy(&body));
        let v: Value = serde_json::from_slice(&body).expect("a JSON answer");
        self.history.push(v["choices"][0]["message"].clone());
        let conversation = headers
            .get("x-compactor-conversation")
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        self.conversations.insert(conversation.to_string());
    }
}
