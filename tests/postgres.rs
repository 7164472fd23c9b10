//! Replicas sharing one PostgreSQL store: a conversation whose requests
//! land on different processes stays one conversation, its compactions are
//! computed once and applied by every replica, `previous_response_id`
//! chains cross replicas, tenants stay apart, a manual compaction asked of
//! one replica is applied once by whichever serves the next request, and a
//! replica's `kill -9` loses no acknowledged exchange.
//!
//! A real PostgreSQL tier: `#[ignore]`d like the other real tiers (run with
//! `--include-ignored`; `scripts/test` installs PostgreSQL), each test on a
//! throwaway cluster of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use compactor::fake_upstream::FakeUpstream;
use serde_json::{json, Value};
use support::postgres::PgCluster;
use support::{is_summary_call, post, small_window, within, Harness};

const KEY: &str = "sk-replica-tests";
const MODEL: &str = "tiny-test";

/// One number a query over the database answers.
async fn count(url: &str, sql: &str) -> i64 {
    support::pg_rows(url, sql).await[0].get(0)
}

/// Two in-process replicas on `url`, sharing one fake upstream.
async fn replicas(url: &str, adjust: fn(&mut compactor::config::Config)) -> (Harness, Harness) {
    let url = url.to_string();
    let a = Harness::start_with(|c| {
        adjust(c);
        c.store.url = url;
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    // A path of its own: a local journal is kept beside it.
    let db = dir.path().join("replica-b.db");
    let mut config = a.state.config.clone();
    config.store.path = db.display().to_string();
    let b = Harness::start_on(a.fake.clone(), dir, db, config).await;
    (a, b)
}

/// A chat session that sends its whole history each turn, to any replica.
struct Chat {
    key: String,
    history: Vec<Value>,
    /// Sends each answer back as it came (as the SDKs do), not only its
    /// role and text.
    verbatim: bool,
}

/// What one turn got back.
struct Turn {
    status: u16,
    conversation: String,
    compacted: Option<String>,
    /// The body the upstream received for it.
    sent: Value,
}

impl Chat {
    fn new(key: &str) -> Chat {
        Chat {
            key: key.into(),
            history: vec![json!({"role": "system", "content": "You are a careful coding agent."})],
            verbatim: false,
        }
    }

    async fn turn(&mut self, via: &Harness, text: &str) -> Turn {
        self.turn_at(&via.url(), &via.fake, text).await
    }

    /// A turn through the proxy at `base` (`http://…/v1`) in front of `fake`.
    async fn turn_at(&mut self, base: &str, fake: &FakeUpstream, text: &str) -> Turn {
        self.history.push(json!({"role": "user", "content": text}));
        let request = json!({"model": MODEL, "messages": self.history});
        let url = format!("{base}/chat/completions");
        let (status, headers, body) = post(&url, &self.key, &request).await;
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status == 200 {
            let content = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default();
            self.history.push(match self.verbatim {
                true => v["choices"][0]["message"].clone(),
                false => json!({"role": "assistant", "content": content}),
            });
        }
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|h| h.to_str().ok())
                .map(String::from)
        };
        let sent = fake
            .received()
            .into_iter()
            .rev()
            .find(|r| !is_summary_call(r))
            .map(|r| r.json())
            .unwrap_or(Value::Null);
        Turn {
            status,
            conversation: header("x-compactor-conversation").unwrap_or_default(),
            compacted: header("x-compactor-compacted"),
            sent,
        }
    }
}

fn filler(i: usize) -> String {
    format!(
        "Step {i}: please look at src/module_{i}.rs and explain it. {}",
        "lorem ipsum dolor ".repeat(25)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_session_alternating_between_two_replicas_is_one_conversation_compacted_once() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, small_window).await;
    // A summary takes longer than a turn: the next turn, on the other
    // replica, goes uncompacted (it fits) and its answer is past the
    // trigger too, while the first replica still computes.
    a.fake.set_summary_delay(Some(Duration::from_millis(400)));
    let mut chat = Chat::new(KEY);
    let mut turns = Vec::new();
    for i in 0..36 {
        let via = if i % 2 == 0 { &a } else { &b };
        let turn = chat.turn(via, &filler(i)).await;
        assert_eq!(turn.status, 200, "turn {i}");
        turns.push((i % 2, turn));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let conversation = &turns[0].1.conversation;
    assert!(conversation.starts_with("conv_"));
    for (i, (_, t)) in turns.iter().enumerate() {
        assert_eq!(&t.conversation, conversation, "turn {i}: one conversation");
    }
    // A compaction the last turns started is stored meanwhile; then each
    // summary call made belongs to a stored compaction (none computed
    // twice, none thrown away).
    let summary_calls = || {
        a.fake
            .received()
            .iter()
            .filter(|r| is_summary_call(r))
            .count() as i64
    };
    let recorded = || {
        count(
            &url,
            "SELECT COALESCE(SUM(summary_calls), 0)::bigint FROM compactions",
        )
    };
    within(async {
        while recorded().await != summary_calls() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let stored = count(&url, "SELECT count(*) FROM compactions").await;
    assert!(stored >= 2, "the session compacted several times: {stored}");
    // Computed once: no two compactions start from the same base (a
    // replica that computed one the other had would).
    let bases = count(
        &url,
        "SELECT count(DISTINCT COALESCE(base_id, '')) FROM compactions",
    )
    .await;
    assert_eq!(
        bases, stored,
        "one compaction per round, not one per replica"
    );
    // Every compaction but the last was applied by both replicas, and the
    // part it replaces went out byte-identically from either.
    let mut applied: std::collections::BTreeMap<&str, Vec<(usize, &Value)>> = Default::default();
    for (replica, t) in &turns {
        if let Some(id) = &t.compacted {
            applied.entry(id).or_default().push((*replica, &t.sent));
        }
    }
    assert!(
        applied.len() as i64 >= stored - 1,
        "every stored compaction was applied (but one stored after the last turn): {} of {stored}",
        applied.len()
    );
    let last = turns.iter().rev().find_map(|(_, t)| t.compacted.as_deref());
    for (id, uses) in &applied {
        let by = |r: usize| {
            uses.iter()
                .find(|(replica, _)| *replica == r)
                .map(|(_, s)| *s)
        };
        if Some(*id) == last && (by(0).is_none() || by(1).is_none()) {
            continue;
        }
        let (on_a, on_b) = (by(0), by(1));
        let (Some(on_a), Some(on_b)) = (on_a, on_b) else {
            panic!("{id} applied by one replica only");
        };
        // System prompt and summary: the replacement, as one replica stored it.
        let head = |sent: &Value| json!([sent["messages"][0], sent["messages"][1]]).to_string();
        assert_eq!(
            head(on_a),
            head(on_b),
            "{id}: the same bytes from either replica"
        );
    }
    let exchanges = count(&url, "SELECT count(*) FROM exchanges").await;
    assert_eq!(exchanges, 36, "every exchange recorded once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_previous_response_id_chain_crosses_replicas() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, |_| {}).await;
    let first = json!({"model": "gpt-5", "instructions": "be brief", "input": "turn one"});
    let (status, h1, body) = post(&format!("{}/responses", a.url()), KEY, &first).await;
    assert_eq!(status, 200);
    let first: Value = serde_json::from_slice(&body).unwrap();
    let id1 = first["id"].as_str().unwrap().to_string();
    // The second link on the other replica, which never saw the first.
    let second = json!({"model": "gpt-5", "input": "turn two", "previous_response_id": id1});
    let (status, h2, body) = post(&format!("{}/responses", b.url()), KEY, &second).await;
    assert_eq!(status, 200);
    let sent = support::last_client_call(&b);
    assert!(
        sent.get("previous_response_id").is_none(),
        "expanded: {sent}"
    );
    let input = sent["input"].as_array().unwrap();
    assert_eq!(input[0], json!({"role": "user", "content": "turn one"}));
    assert_eq!(input[1], first["output"][0]);
    assert_eq!(input[2], json!({"role": "user", "content": "turn two"}));
    let second: Value = serde_json::from_slice(&body).unwrap();
    let id2 = second["id"].as_str().unwrap().to_string();
    // And back on the first.
    let third = json!({"model": "gpt-5", "input": "turn three", "previous_response_id": id2});
    let (status, h3, _) = post(&format!("{}/responses", a.url()), KEY, &third).await;
    assert_eq!(status, 200);
    assert_eq!(
        support::last_client_call(&a)["input"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
    let conv = |h: &http::HeaderMap| h.get("x-compactor-conversation").cloned();
    assert_eq!(conv(&h1), conv(&h2), "one conversation across replicas");
    assert_eq!(conv(&h2), conv(&h3));
    // Another tenant cannot continue it, on either replica.
    let intruder = json!({"model": "gpt-5", "input": "x", "previous_response_id": id1});
    post(&format!("{}/responses", b.url()), "sk-intruder", &intruder).await;
    assert_eq!(support::last_client_call(&b)["previous_response_id"], id1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn byte_identical_histories_under_two_keys_stay_two_tenants_across_replicas() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, small_window).await;
    let (mut one, mut two) = (Chat::new("sk-tenant-one"), Chat::new("sk-tenant-two"));
    let (mut seen_one, mut seen_two) = (Vec::new(), Vec::new());
    for i in 0..24 {
        // The same history, each key on the replica the other just used.
        let (x, y) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let t1 = one.turn(x, &filler(i)).await;
        let t2 = two.turn(y, &filler(i)).await;
        assert_eq!((t1.status, t2.status), (200, 200), "turn {i}");
        seen_one.push(t1);
        seen_two.push(t2);
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let conversations = |turns: &[Turn]| {
        let mut c: Vec<String> = turns.iter().map(|t| t.conversation.clone()).collect();
        c.dedup();
        c
    };
    let (c1, c2) = (conversations(&seen_one), conversations(&seen_two));
    assert_eq!(c1.len(), 1, "one conversation per key: {c1:?}");
    assert_eq!(c2.len(), 1, "one conversation per key: {c2:?}");
    assert_ne!(c1, c2, "byte-identical histories, two tenants");
    let compacted = |turns: &[Turn]| -> std::collections::BTreeSet<String> {
        turns.iter().filter_map(|t| t.compacted.clone()).collect()
    };
    let (k1, k2) = (compacted(&seen_one), compacted(&seen_two));
    assert!(!k1.is_empty() && !k2.is_empty(), "both compacted");
    assert!(
        k1.is_disjoint(&k2),
        "no compaction crosses tenants: {k1:?} {k2:?}"
    );
    let tenants = count(&url, "SELECT count(DISTINCT tenant) FROM conversations").await;
    assert_eq!(tenants, 2);
    let mixed = count(
        &url,
        "SELECT count(*) FROM compactions c JOIN conversations v ON v.id = c.conversation_id
         WHERE v.tenant <> c.tenant",
    )
    .await;
    assert_eq!(mixed, 0);
}

/// A config file for the real binary on `url`, in front of `fake`, with
/// the small window of [`small_window`].
fn binary_config(dir: &std::path::Path, fake: &FakeUpstream, url: &str) -> std::path::PathBuf {
    let config = dir.join("proxy.toml");
    std::fs::write(
        &config,
        format!(
            "[upstream]\nbase_url = \"{}\"\ndiscover_windows = false\n[store]\nurl = \"{url}\"\n\
             [[models]]\nmatch = \"tiny*\"\ncontext_window = 3000\nmax_output_tokens = 300\n",
            fake.url(),
        ),
    )
    .expect("write the config");
    config
}

/// Starts two `compactor serve` processes on `config` at the same moment.
fn two_binaries(config: &std::path::Path) -> [(support::Binary, u16); 2] {
    let start = || {
        let config = config.to_path_buf();
        std::thread::spawn(move || {
            let port = support::free_port();
            (
                support::spawn_binary(port, &["--config".as_ref(), config.as_os_str()]),
                port,
            )
        })
    };
    let (x, y) = (start(), start());
    [
        x.join().expect("first replica"),
        y.join().expect("second replica"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn replicas_started_together_share_one_schema_and_a_kill_9_loses_no_acknowledged_exchange() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let fake = within(FakeUpstream::start()).await.expect("fake upstream");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = binary_config(dir.path(), &fake, &url);
    let check = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_compactor"))
            .args(["serve", "--check-config", "--config"])
            .arg(&config)
            .output()
            .expect("compactor --check-config");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let before = check();
    assert!(before.contains("schema at version 0 of 11"), "{before}");
    // Both on an empty database at once: one applies the migrations, the
    // other waits for its lock and finds them; one salt.
    let [(mut doomed, p1), (_survivor, p2)] = two_binaries(&config);
    assert_eq!(
        count(&url, "SELECT count(*) FROM schema_migrations").await,
        11,
        "each migration applied once"
    );
    assert_eq!(
        count(&url, "SELECT count(*) FROM meta WHERE key = 'tenant_salt'").await,
        1
    );
    let after = check();
    assert!(after.contains("schema current (version 11)"), "{after}");
    let base = |port: u16| format!("http://127.0.0.1:{port}/v1");
    let mut chat = Chat::new(KEY);
    let mut acknowledged = 0;
    let mut conversations = std::collections::BTreeSet::new();
    for i in 0..24 {
        // Alternating, until the first replica is killed halfway.
        let port = if i % 2 == 0 && i < 12 { p1 } else { p2 };
        let turn = chat.turn_at(&base(port), &fake, &filler(i)).await;
        assert_eq!(turn.status, 200, "turn {i}");
        acknowledged += 1;
        conversations.insert(turn.conversation);
        if i == 11 {
            // Right after its answer reached the client.
            doomed.kill().expect("kill -9");
            doomed.wait().expect("reaped");
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert_eq!(
        conversations.len(),
        1,
        "the session went on as one: {conversations:?}"
    );
    let recorded = count(&url, "SELECT count(*) FROM exchanges WHERE status = 200").await;
    assert_eq!(
        recorded, acknowledged,
        "every acknowledged exchange is recorded"
    );
    let compactions = count(&url, "SELECT count(*) FROM compactions").await;
    assert!(compactions >= 1, "the session compacted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn metrics_report_the_pool_and_the_commit_latency() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let h = Harness::start_with(|c| c.store.url = url.clone()).await;
    let mut chat = Chat::new(KEY);
    for i in 0..3 {
        assert_eq!(chat.turn(&h, &filler(i)).await.status, 200);
    }
    let text = h.scrape().await;
    let value = |name: &str| metric(&text, name);
    assert!(value("compactor_db_pool_connections") >= 1.0);
    assert!(value("compactor_db_pool_idle") >= 0.0);
    assert_eq!(value("compactor_db_pool_waiting"), 0.0);
    assert!(
        value("compactor_store_commit_seconds_count") >= 3.0,
        "a commit per exchange at least"
    );
}

/// The number a Prometheus text exposition gives `name`.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// With `store.local_journal` the exchanges journaled within
/// `store.commit_delay_ms` of the first go in one commit: a session's turns
/// after its first (which is committed before its answer goes) are answered
/// before any of them is committed, and committed together once the delay
/// has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn with_a_local_journal_the_exchanges_of_one_commit_delay_go_in_one_commit() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let h = Harness::start_with(|c| {
        c.store.url = url.clone();
        c.store.local_journal = true;
        c.store.commit_delay_ms = 3_000;
    })
    .await;
    let exchanges = || count(&url, "SELECT count(*) FROM exchanges");
    let mut chat = Chat::new(KEY);
    assert_eq!(chat.turn(&h, &filler(0)).await.status, 200);
    assert_eq!(
        exchanges().await,
        1,
        "a first exchange commits before its answer"
    );
    let commits = metric(&h.scrape().await, "compactor_store_commit_seconds_count");
    let started = std::time::Instant::now();
    for i in 1..5 {
        assert_eq!(chat.turn(&h, &filler(i)).await.status, 200);
    }
    let answered = started.elapsed();
    let waiting = exchanges().await;
    if started.elapsed() < Duration::from_millis(2_500) {
        assert_eq!(
            waiting, 1,
            "four answers in {answered:?}, none committed yet"
        );
    }
    within(async {
        while exchanges().await < 5 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let after = metric(&h.scrape().await, "compactor_store_commit_seconds_count");
    assert_eq!(after - commits, 1.0, "one commit for the four exchanges");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn with_the_database_unreachable_requests_get_503_and_nothing_unrecorded_is_answered() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let h = Harness::start_with(|c| {
        c.store.url = url.clone();
        c.store.statement_timeout_ms = 2_000;
    })
    .await;
    let ready = |h: &Harness| {
        let url = format!("http://{}/readyz", h.addr);
        async move {
            within(support::client().get(url).send())
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let mut chat = Chat::new(KEY);
    assert_eq!(chat.turn(&h, "before").await.status, 200);
    let mut answered = 1;
    pg.stop();
    // The answer to the first request cannot be committed: withheld.
    let first = chat.turn(&h, "while down").await;
    assert_eq!(first.status, 503);
    chat.history.pop();
    // Then requests are refused before they go upstream.
    let upstream_before = h.fake.count();
    let url_chat = format!("{}/chat/completions", h.url());
    let (status, _, body) = post(
        &url_chat,
        KEY,
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "still down"}]}),
    )
    .await;
    assert_eq!(status, 503);
    let err: Value = serde_json::from_slice(&body).expect("JSON error");
    assert_eq!(err["error"]["code"], "store_unavailable", "{err}");
    assert_eq!(err["error"]["type"], "server_error");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("database"));
    assert_eq!(h.fake.count(), upstream_before, "nothing went upstream");
    // A stream is refused the same way.
    let (status, _, _) = post(
        &url_chat,
        KEY,
        &json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "s"}]}),
    )
    .await;
    assert_eq!(status, 503);
    assert_eq!(ready(&h).await, 503, "not ready while the database is down");
    pg.restart();
    within(async {
        while ready(&h).await != 200 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let after = chat.turn(&h, "after").await;
    assert_eq!(after.status, 200, "served again once the database is back");
    answered += 1;
    let recorded = count(&url, "SELECT count(*) FROM exchanges WHERE status = 200").await;
    assert_eq!(
        recorded, answered,
        "every answer the client got is recorded"
    );
}

/// The views read the shared database from any replica and from the CLI:
/// the list, timeline, export and savings of a conversation served by both
/// replicas; then a deletion through the CLI takes the conversation, its
/// records and the items only it referred to, and leaves another tenant's
/// conversation whole; `prune` takes what is older than the age given.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn the_views_and_deletions_work_on_the_shared_database_from_any_replica_and_the_cli() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, small_window).await;
    let mut chat = Chat::new(KEY);
    let mut conversation = String::new();
    // An odd count: the last turn is on the replica that started first,
    // whose exchange ids are the lower block.
    for i in 0..15 {
        let turn = chat
            .turn(if i % 2 == 0 { &a } else { &b }, &filler(i))
            .await;
        assert_eq!(turn.status, 200, "turn {i}");
        conversation = turn.conversation;
    }
    let mut other = Chat::new("sk-another-tenant");
    let mut kept = String::new();
    for i in 0..2 {
        kept = other
            .turn(&a, &format!("another tenant's turn {i}"))
            .await
            .conversation;
    }
    // A compaction the last turns started is stored when its job ends.
    within(async {
        while a.state.compactions.jobs_under_way() + b.state.compactions.jobs_under_way() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    for h in [&a, &b] {
        within(h.state.store.flush()).await.expect("flush");
    }
    let compactions = count(&url, "SELECT count(*) FROM compactions").await;

    // The admin API of the replica that served half of it sees all of it.
    let list = b.get_json("/admin/api/conversations").await;
    let row = list["conversations"]
        .as_array()
        .expect("a list")
        .iter()
        .find(|c| c["id"] == conversation.as_str())
        .unwrap_or_else(|| panic!("{conversation} listed: {list}"))
        .clone();
    assert_eq!(row["exchanges"], 15, "{row}");
    assert_eq!(row["compactions"], compactions, "{row}");
    let show = b
        .get_json(&format!("/admin/api/conversations/{conversation}"))
        .await;
    let timeline = show["exchanges"].as_array().expect("exchanges");
    assert_eq!(timeline.len(), 15, "{show}");
    // In the order they happened, though the replicas' ids interleave.
    let started: Vec<i64> = timeline
        .iter()
        .map(|e| e["started_ms"].as_i64().expect("started_ms"))
        .collect();
    assert!(started.windows(2).all(|w| w[0] <= w[1]), "{started:?}");
    assert_eq!(
        show["compactions"].as_array().map(Vec::len),
        Some(compactions as usize)
    );
    let export = a
        .get_json(&format!("/admin/api/conversations/{conversation}/export"))
        .await;
    // The history reads back as the client holds it (the answer as the
    // upstream gave it, which says `refusal: null` too).
    let items = export["original_items"].as_array().expect("items");
    assert_eq!(items.len(), chat.history.len());
    let (last, earlier) = items.split_last().expect("items");
    assert!(
        earlier == &chat.history[..earlier.len()],
        "the history reads back"
    );
    assert_eq!(last["content"], chat.history[earlier.len()]["content"]);
    let savings = b.get_json("/admin/api/savings").await;
    assert_eq!(savings["total"]["exchanges"], 17, "{savings}");

    // The CLI reads the same database, by an abbreviation of the id.
    let env = [("COMPACTOR_DATABASE_URL", url.as_str())];
    let (code, out, err) = support::cli(&["conversations", "list", "--json"], &env).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&conversation) && out.contains(&kept), "{out}");
    let short = &conversation[..conversation.len().min(12)];
    let (code, out, err) = support::cli(&["conversations", "show", short, "--json"], &env).await;
    assert_eq!(code, 0, "{err}");
    let shown: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(shown["conversation"]["id"], conversation.as_str());

    let kept_before = a
        .get_json(&format!("/admin/api/conversations/{kept}/export"))
        .await;
    let (code, out, err) =
        support::cli(&["conversations", "delete", &conversation, "--json"], &env).await;
    assert_eq!(code, 0, "{out}{err}");
    let removed: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(removed["removed"]["conversations"], 1, "{out}");
    assert_eq!(removed["removed"]["exchanges"], 15, "{out}");
    assert!(removed["removed"]["items"].as_u64() > Some(0), "{out}");
    let left = |table: &str| {
        format!("SELECT count(*) FROM {table} WHERE conversation_id = '{conversation}'")
    };
    assert_eq!(count(&url, &left("exchanges")).await, 0);
    assert_eq!(count(&url, &left("compactions")).await, 0);
    // What stays is whole: the other tenant's conversation reads back the
    // same, so no item it needs went.
    let kept_after = b
        .get_json(&format!("/admin/api/conversations/{kept}/export"))
        .await;
    assert_eq!(kept_after["original_items"], kept_before["original_items"]);
    assert_eq!(
        kept_after["original_items"].as_array().map(Vec::len),
        Some(5)
    );

    // The replicas heard of the deletion: the client resending the deleted
    // history starts a new conversation on either, and its record reads
    // back whole, so no replica took a deleted item for stored.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, via) in [&a, &b].into_iter().enumerate() {
        let turn = chat.turn(via, &format!("after the deletion {i}")).await;
        assert_eq!(turn.status, 200);
        assert_ne!(
            turn.conversation, conversation,
            "a deleted conversation goes on"
        );
        within(via.state.store.flush()).await.expect("flush");
        let export = via
            .get_json(&format!(
                "/admin/api/conversations/{}/export",
                turn.conversation
            ))
            .await;
        let items = export["original_items"].as_array().expect("items");
        assert_eq!(items.len(), chat.history.len(), "replica {i}");
        assert!(
            items.iter().all(|item| item["content"].is_string()),
            "replica {i}: every item reads back: {:?}",
            items
                .iter()
                .enumerate()
                .filter(|(_, item)| !item["content"].is_string())
                .map(|(n, item)| format!("{n}: {item}"))
                .collect::<Vec<_>>()
        );
    }

    let (code, out, err) = support::cli(&["prune", "--older-than", "0s", "--json"], &env).await;
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        count(&url, "SELECT count(*) FROM conversations").await,
        0,
        "{out}"
    );
    assert_eq!(count(&url, "SELECT count(*) FROM items").await, 0, "{out}");
}

/// Summarizer calls the fake upstream received.
fn summary_calls(fake: &FakeUpstream) -> usize {
    fake.received()
        .iter()
        .filter(|r| is_summary_call(r))
        .count()
}

/// Turns of `chat` through `replicas` in turn, none compacted (the window
/// is not reached): the conversation's id.
async fn grown(chat: &mut Chat, replicas: &[&Harness]) -> String {
    let mut id = String::new();
    for i in 0..8 {
        let turn = chat.turn(replicas[i % replicas.len()], &filler(i)).await;
        assert_eq!((turn.status, turn.compacted), (200, None), "turn {i}");
        id = turn.conversation;
    }
    id
}

/// Waits until `h` has heard (or, if not `heard`, no longer) of a pending
/// manual compaction of `conversation`: the announcement reaches each
/// replica a moment after the request's commit.
async fn until_heard(h: &Harness, conversation: &str, heard: bool) {
    within(async {
        while h.state.reads.manual_heard(conversation) != heard {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_manual_compaction_asked_of_one_replica_is_applied_once_by_whichever_serves_next() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    // Compactions only on request (or overflow): each one here is manual.
    let (a, b) = replicas(&url, support::small_window_foreground).await;
    let mut chat = Chat::new(KEY);
    let id = grown(&mut chat, &[&a, &b]).await;
    let path = format!("/admin/api/conversations/{id}/compact");
    let (status, v) = b.post_admin(&path).await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["already_pending"], false, "{v}");
    let (_, v) = b.post_admin(&path).await;
    assert_eq!(v["already_pending"], true, "asked once: {v}");
    let pending = "SELECT count(*) FROM manual_compactions";
    assert_eq!(count(&url, pending).await, 1);
    // The replica that was not asked knows, without a read per request.
    until_heard(&a, &id, true).await;
    assert!(a.state.compactions.manual_pending(&id).expect("pending"));

    let before = summary_calls(&a.fake);
    let on_a = chat.turn(&a, "Go on.").await;
    assert_eq!(on_a.status, 200);
    let compacted = on_a
        .compacted
        .expect("the next request, on the other replica, is compacted");
    assert_eq!(summary_calls(&a.fake), before + 1, "one summarizer call");
    assert_eq!(count(&url, pending).await, 0, "taken");
    assert_eq!(
        count(
            &url,
            "SELECT count(*) FROM compactions WHERE starts_with(reason, 'manual')"
        )
        .await,
        1
    );
    // The replica that was asked hears it was taken, and does not compact
    // again: the next request there gets the stored compaction.
    until_heard(&b, &id, false).await;
    assert!(!b.state.compactions.manual_pending(&id).expect("pending"));
    let on_b = chat.turn(&b, "And now?").await;
    assert_eq!(on_b.status, 200);
    assert_eq!(on_b.compacted.as_deref(), Some(compacted.as_str()));
    assert_eq!(summary_calls(&a.fake), before + 1, "no second summary");

    // Asked again, then the next request sent to both at once: of the two
    // replicas racing for it, one compacts.
    let (status, _) = a.post_admin(&path).await;
    assert_eq!(status, 202);
    until_heard(&a, &id, true).await;
    until_heard(&b, &id, true).await;
    let mut twin = Chat {
        key: chat.key.clone(),
        history: chat.history.clone(),
        verbatim: false,
    };
    let (x, y) = tokio::join!(chat.turn(&a, "Race."), twin.turn(&b, "Race."));
    assert_eq!((x.status, y.status), (200, 200));
    assert_eq!(summary_calls(&a.fake), before + 2, "compacted once");
    assert_eq!(
        count(&url, "SELECT count(*) FROM compactions").await,
        2,
        "one new compaction"
    );
    assert_eq!(count(&url, pending).await, 0);
    until_heard(&a, &id, false).await;
    until_heard(&b, &id, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_manual_compaction_pending_while_no_replica_runs_applies_on_the_next_to_start() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let config = |c: &mut compactor::config::Config| {
        support::small_window_foreground(c);
        c.store.url = url.clone();
    };
    let mut first = Harness::start_with(config).await;
    let mut chat = Chat::new(KEY);
    let id = grown(&mut chat, &[&first]).await;
    let (status, v) = first
        .post_admin(&format!("/admin/api/conversations/{id}/compact"))
        .await;
    assert_eq!(status, 202, "{v}");
    // The replica asked stops before the conversation's next request.
    first.stop().await;
    drop(first);
    let pending = "SELECT count(*) FROM manual_compactions";
    assert_eq!(count(&url, pending).await, 1, "the request outlives it");

    // A replica started afterwards reads it before it serves a request.
    let second = Harness::start_with(config).await;
    assert!(second.state.reads.manual_heard(&id), "read at start-up");
    let turn = chat.turn(&second, "Go on.").await;
    assert_eq!(turn.status, 200);
    assert_eq!(turn.conversation, id, "the same conversation");
    assert!(turn.compacted.is_some(), "compacted as asked");
    assert_eq!(summary_calls(&second.fake), 1);
    assert_eq!(count(&url, pending).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_replica_whose_listening_connection_drops_listens_again_and_reads_what_it_missed() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let h = Harness::start_with(|c| {
        support::small_window_foreground(c);
        c.store.url = url.clone();
    })
    .await;
    let mut chat = Chat::new(KEY);
    let id = grown(&mut chat, &[&h]).await;
    // Asked for without an announcement (as if while this replica was cut
    // off), then its listening connection is cut: only reading the rows
    // again once it listens anew can tell it.
    let asked = format!(
        "WITH added AS (INSERT INTO manual_compactions (conversation_id, tenant, requested_ms)
                        SELECT id, tenant, 0 FROM conversations WHERE id = '{id}'
                        RETURNING 1)
         SELECT count(*) FROM added"
    );
    assert_eq!(count(&url, &asked).await, 1);
    assert!(!h.state.reads.manual_heard(&id), "not announced");
    let cut = count(
        &url,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE application_name = 'compactor-listen'",
    )
    .await;
    assert_eq!(cut, 1, "one listening connection per replica");
    until_heard(&h, &id, true).await;
    let turn = chat.turn(&h, "Go on.").await;
    assert_eq!(turn.status, 200);
    assert!(turn.compacted.is_some(), "compacted as asked");
    assert_eq!(summary_calls(&h.fake), 1);
}

/// `compactor compact ID` asked of one replica reports the outcome when
/// another replica served the next request and compacted it: the stored
/// compaction stands for the attempt the asked replica never saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn compact_asked_of_one_replica_reports_what_the_other_compacted() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, support::small_window_foreground).await;
    let mut chat = Chat::new(KEY);
    let id = grown(&mut chat, &[&a, &b]).await;
    let listen = b.addr.to_string();
    let env = [("COMPACTOR_DATABASE_URL", url.clone())];
    let asked = tokio::spawn(async move {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        support::cli(&["compact", &id, "--listen", &listen, "--wait", "30"], &env).await
    });
    within(async {
        while count(&url, "SELECT count(*) FROM manual_compactions").await == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let on_a = chat.turn(&a, "Go on.").await;
    let compacted = on_a.compacted.expect("compacted on the other replica");
    let (code, out, err) = within(asked).await.expect("join");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("compacted: ") && out.contains(&compacted),
        "the outcome, from the replica that was asked: {out}"
    );
}

/// A view's connection whose statement failed inside a transaction leaves
/// the pool: the next view, on the pool's one connection, starts clean
/// instead of inside the aborted transaction.
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn a_views_connection_that_failed_mid_transaction_is_not_reused() {
    use compactor::store::postgres::PgSql;
    use compactor::store::postgres::{Options, Postgres};
    use compactor::store::sql::Sql;
    let Some(pg) = PgCluster::start() else { return };
    let mut config = compactor::config::StoreConfig {
        url: pg.database(),
        ..Default::default()
    };
    config.pool_size = 1;
    let store = Postgres::open(&Options::from_config(&config)).expect("open");
    {
        let conn = PgSql::connect(&store).expect("a connection");
        conn.execute("BEGIN", &[]).expect("begin");
        assert!(conn.rows("SELECT 1 / 0", &[]).is_err(), "division by zero");
    }
    let conn = PgSql::connect(&store).expect("the pool's connection");
    let row = conn
        .first("SELECT 1::bigint", &[])
        .expect("not inside the aborted transaction")
        .expect("a row");
    assert_eq!(row.get::<i64>(0).expect("a number"), 1);
}

/// `compactor compact` asked of one replica while another served the next
/// request and found nothing to compact: the attempt, which stored no
/// compaction, is kept in the database, and the replica asked reports it
/// rather than waiting for an outcome it would never see.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn compact_asked_of_one_replica_reports_the_attempt_the_other_could_not_make() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, support::small_window_foreground).await;
    let mut chat = Chat::new(KEY);
    let id = chat.turn(&a, "Hello.").await.conversation;
    let listen = b.addr.to_string();
    let env = [("COMPACTOR_DATABASE_URL", url.clone())];
    let asked = tokio::spawn(async move {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        support::cli(&["compact", &id, "--listen", &listen, "--wait", "30"], &env).await
    });
    within(async {
        while count(&url, "SELECT count(*) FROM manual_compactions").await == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let on_a = chat.turn(&a, "Go on.").await;
    assert_eq!(on_a.status, 200);
    assert!(on_a.compacted.is_none(), "nothing to compact");
    let started = std::time::Instant::now();
    let (code, out, err) = within(asked).await.expect("join");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(": failed: "),
        "the outcome, from the replica that was asked: {out}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "told, not left waiting"
    );
}

/// Round trips `h`'s request path made to the database so far
/// (`compactor_store_reads_total`).
async fn reads(h: &Harness) -> u64 {
    let text = h.scrape().await;
    text.lines()
        .find_map(|l| l.strip_prefix("compactor_store_reads_total ")?.parse().ok())
        .unwrap_or_else(|| panic!("no compactor_store_reads_total in {text}"))
}

/// A turn of `chat` through `h`, with the round trips it made to the
/// database.
async fn counted_turn(chat: &mut Chat, h: &Harness, text: &str) -> (Turn, u64) {
    let before = reads(h).await;
    let turn = chat.turn(h, text).await;
    assert_eq!(turn.status, 200);
    (turn, reads(h).await - before)
}

/// Turns of `chat` through `replicas` in turn until one is compacted (past
/// the hard limit, at once): which replica compacted, and that turn.
async fn until_compacted(chat: &mut Chat, replicas: &[&Harness]) -> (usize, Turn) {
    for i in 0..40 {
        let by = i % replicas.len();
        let turn = chat.turn(replicas[by], &filler(i)).await;
        assert_eq!(turn.status, 200, "turn {i}");
        if turn.compacted.is_some() {
            return (by, turn);
        }
    }
    panic!("never compacted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_conversation_new_to_a_replica_is_read_in_one_round_trip_and_then_not_at_all() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, support::small_window_foreground).await;
    let mut chat = Chat {
        verbatim: true,
        ..Chat::new(KEY)
    };
    let (_, compacted) = until_compacted(&mut chat, &[&a]).await;
    let compaction = compacted.compacted.clone();
    // New to the other replica: its recorded prefix and the compaction that
    // covers it, both read before it goes upstream, in one round trip.
    let (turn, made) = counted_turn(&mut chat, &b, "Go on.").await;
    assert_eq!(made, 1, "one round trip for both lookups");
    assert_eq!(
        turn.conversation, compacted.conversation,
        "found its prefix"
    );
    assert_eq!(turn.compacted, compaction, "found its compaction");
    // Seen whole now (all but the new message), its newest compaction
    // known: nothing is read.
    let (turn, made) = counted_turn(&mut chat, &b, "And then?").await;
    assert_eq!(made, 0, "a conversation seen whole reads nothing");
    assert_eq!(
        (turn.conversation.as_str(), turn.compacted.as_deref()),
        (compacted.conversation.as_str(), compaction.as_deref())
    );
    // The first replica missed two turns: their prefix is read (one round
    // trip), then nothing again.
    let (turn, made) = counted_turn(&mut chat, &a, "Once more.").await;
    assert_eq!(
        (made, turn.compacted.as_deref()),
        (1, compaction.as_deref())
    );
    assert_eq!(turn.conversation, compacted.conversation);
    let (_, made) = counted_turn(&mut chat, &a, "Last one.").await;
    assert_eq!(made, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_session_sending_back_only_the_answers_text_reads_nothing_from_the_replica_that_served_it(
) {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, _b) = replicas(&url, |_| {}).await;
    // The fake answers with `"refusal": null`; the client sends back role
    // and text only, as most do.
    let mut chat = Chat::new(KEY);
    let (first, made) = counted_turn(&mut chat, &a, "Read src/lib.rs.").await;
    assert_eq!(made, 1, "new to the replica: asked once");
    for text in ["Now src/main.rs.", "And the tests."] {
        let (turn, made) = counted_turn(&mut chat, &a, text).await;
        assert_eq!(turn.conversation, first.conversation);
        assert_eq!(made, 0, "{text}: the previous turn was served here");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_compaction_one_replica_stores_is_announced_to_the_other_which_applies_it() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, support::small_window_foreground).await;
    let replicas = [&a, &b];
    let mut chat = Chat {
        verbatim: true,
        ..Chat::new(KEY)
    };
    // Both replicas serve the conversation, so each knows its compactions
    // (none yet); then one compacts it.
    let (by, compacted) = until_compacted(&mut chat, &replicas).await;
    let other = replicas[1 - by];
    within(async {
        while other.state.compactions.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // Heard: the other replica reads only the turn it missed (one round
    // trip) and applies the compaction it heard of.
    let (turn, made) = counted_turn(&mut chat, other, "Go on.").await;
    assert_eq!(made, 1);
    assert_eq!(turn.conversation, compacted.conversation);
    assert_eq!(turn.compacted, compacted.compacted);
    let stored = count(&url, "SELECT count(*) FROM compactions").await;
    assert_eq!(stored, 1, "compacted once");
}

/// Every session the database at `url` opens from now on logs the plan of
/// each statement it runs (with what each node did, if `analyze`).
async fn log_plans(url: &str, analyze: bool) {
    let name = url.rsplit('/').next().unwrap_or_default();
    support::pg_execute(
        url,
        &format!(
            "ALTER DATABASE {name} SET session_preload_libraries = 'auto_explain';
             ALTER DATABASE {name} SET auto_explain.log_min_duration = 0;
             ALTER DATABASE {name} SET auto_explain.log_analyze = {analyze}"
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_long_conversation_new_to_a_replica_is_looked_up_by_index_however_big_the_table() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    log_plans(&url, false).await;
    let (a, _b) = replicas(&url, |_| {}).await;
    // The tenant's history: a conversation, and 2 000 exchanges more, then
    // 100 000, the statistics up to date each time (a small table tempts
    // the planner to hash every row's prefix; a big one, to walk them).
    let (first, _) = counted_turn(&mut Chat::new(KEY), &a, "Hello.").await;
    support::pg_execute(
        &url,
        &format!(
            "INSERT INTO conversations (id, tenant, created_ms, last_seen_ms, model)
                 SELECT 'filler', tenant, 0, 0, 'm' FROM conversations WHERE id = '{}'",
            first.conversation
        ),
    )
    .await;
    for (run, fillers) in [(1, 1..=2_000), (2, 2_001..=100_000)] {
        support::pg_execute(
            &url,
            &format!(
                "INSERT INTO exchanges (id, conversation_id, tenant, endpoint, model, suffix_items,
                                        request_len, params, response_items, status, streamed,
                                        partial, started_ms, latency_ms, chain_request,
                                        chain_full, prefix_exchange)
                     SELECT -g, 'filler', c.tenant, 'chat', 'm', ''::bytea, 2, ''::bytea,
                            ''::bytea, 200, FALSE, FALSE, 0, 1.0, sha256(('r' || g)::bytea),
                            sha256(('f' || g)::bytea), NULLIF(1 - g, 0)
                     FROM generate_series({}, {}) g, conversations c WHERE c.id = 'filler';
                 ANALYZE exchanges",
                fillers.start(),
                fillers.end()
            ),
        )
        .await;
        // A client that kept its history elsewhere: 400 messages, every
        // one of whose prefixes the replica asks the database about.
        let mut chat = Chat::new(KEY);
        for i in 0..200 {
            chat.history
                .push(json!({"role": "user", "content": format!("Run {run}, step {i}: go on.")}));
            chat.history
                .push(json!({"role": "assistant", "content": format!("Done with step {i}.")}));
        }
        let logged = pg.log().len();
        let (_, made) = counted_turn(&mut chat, &a, "Where were we?").await;
        assert_eq!(made, 1, "new to the replica: asked once");
        // The plan it was looked up by: probes of the chain indexes, not a
        // walk of the whole table (by its primary key, or in order) nor a
        // hash of every row's prefix.
        let log = pg.log().split_off(logged);
        let plan = log
            .split("LOG:  duration:")
            .find(|entry| entry.contains("chain_request = ANY"))
            .unwrap_or_else(|| panic!("no look-up's plan logged in {log}"));
        assert!(plan.contains("exchanges_chain_request"), "{plan}");
        for whole in ["exchanges_pkey", "Seq Scan on exchanges"] {
            assert!(
                !plan.contains(whole),
                "at {} rows the look-up reads every row: {plan}",
                fillers.end()
            );
        }
    }
}

/// A turn of `chat` through `h`, with the plan its look-up of a prefix ran
/// by (logged by `auto_explain`, with what each node did) and how many of
/// that plan's two reads of `exchanges` were never run; `round_trips`, the
/// reads the turn makes.
async fn look_up_plan(
    pg: &PgCluster,
    chat: &mut Chat,
    h: &Harness,
    text: &str,
    round_trips: u64,
) -> (Turn, usize, String) {
    let logged = pg.log().len();
    let (turn, made) = counted_turn(chat, h, text).await;
    assert_eq!(made, round_trips, "{text}: round trips");
    let log = pg.log().split_off(logged);
    let plan = log
        .split("LOG:  duration:")
        .find(|entry| entry.contains("WITH near"))
        .unwrap_or_else(|| panic!("{text}: no look-up's plan logged in {log}"))
        .to_string();
    let reads: Vec<&str> = plan
        .lines()
        .filter(|l| l.contains("Scan") && l.contains(" on exchanges e"))
        .collect();
    assert_eq!(reads.len(), 2, "{text}: near and earlier chains: {plan}");
    let skipped = reads
        .iter()
        .filter(|l| l.contains("never executed"))
        .count();
    (turn, skipped, plan)
}

/// A turn of a long conversation extends a prefix already recorded, so the
/// look-up probes the request's last chains, and the earlier ones (every
/// earlier exchange of the conversation would match) only when those
/// match nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_replica_probes_a_request_s_earlier_chains_only_when_its_last_ones_match_nothing() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    log_plans(&url, true).await;
    let (a, b) = replicas(&url, |_| {}).await;
    let mut chat = Chat::new(KEY);
    let steps = |chat: &mut Chat, from: usize, to: usize| {
        for i in from..to {
            chat.history
                .push(json!({"role": "user", "content": format!("Step {i}: go on.")}));
            chat.history
                .push(json!({"role": "assistant", "content": format!("Done with step {i}.")}));
        }
    };
    // New to every replica: no chain matches, both are probed.
    steps(&mut chat, 0, 100);
    let (first, skipped, plan) = look_up_plan(&pg, &mut chat, &a, "Where were we?", 1).await;
    assert_eq!(
        skipped, 0,
        "nothing near: the earlier chains are probed: {plan}"
    );
    // The next turn, new to the other replica, ends in the prefix the first
    // recorded: the earlier chains are not probed.
    let (turn, skipped, plan) = look_up_plan(&pg, &mut chat, &b, "Go on.", 1).await;
    assert_eq!(turn.conversation, first.conversation);
    assert_eq!(skipped, 1, "a near chain matched: {plan}");
    // Far past what was recorded, at a replica that served none of it (one
    // that did would go on from its own answer, probing no chain unless
    // the conversation branched): the earlier chains find it.
    steps(&mut chat, 100, 120);
    let (c, _d) = replicas(&url, |_| {}).await;
    let (turn, skipped, plan) = look_up_plan(&pg, &mut chat, &c, "And now?", 1).await;
    assert_eq!(turn.conversation, first.conversation);
    assert_eq!(
        skipped, 0,
        "nothing near: the earlier chains are probed: {plan}"
    );
}

/// Behind a round-robin balancer a replica serves every other turn of a
/// session: its request goes on from the answer the replica gave two turns
/// back, one of its conversation's tips in memory. Its look-up then probes
/// no chain unless an exchange recorded that it left that conversation (a
/// branch, committed before its answer went), since any longer prefix
/// would name the same conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_replica_going_on_from_its_own_answer_probes_no_chain_until_the_conversation_branched() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    log_plans(&url, true).await;
    let (a, b) = replicas(&url, |_| {}).await;
    let mut chat = Chat::new(KEY);
    let (first, _) = counted_turn(&mut chat, &b, "Step 1.").await;
    let (second, _) = counted_turn(&mut chat, &a, "Step 2.").await;
    assert_eq!(second.conversation, first.conversation);
    // From b's own answer, past a's turn: asked whether the conversation
    // branched, in one round trip, and no chain probed.
    let logged = pg.log().len();
    let (third, made) = counted_turn(&mut chat, &b, "Step 3.").await;
    assert_eq!(third.conversation, first.conversation);
    assert_eq!(made, 1, "one round trip");
    let log = pg.log().split_off(logged);
    assert!(
        log.contains("branched_from = q.conversation"),
        "probed: {log}"
    );
    assert!(
        !log.contains("WITH near"),
        "went on from its tip, unbranched: no chain probed: {log}"
    );
    // The session's second turn edited, at a: a branch of the conversation.
    let mut edited = Chat::new(KEY);
    edited.history = chat.history[..2].to_vec();
    let fork = edited.turn(&a, "Step 2, otherwise.").await;
    assert_eq!(fork.status, 200);
    assert_ne!(fork.conversation, first.conversation, "an edit branches");
    let left = count(
        &url,
        &format!(
            "SELECT COUNT(*) FROM exchanges WHERE branched_from = '{}'",
            first.conversation
        ),
    )
    .await;
    assert_eq!(left, 1, "the branch says what it left");
    // a's next turn of the first line goes on from its tip, but the
    // conversation branched: asked that, then the chains are probed (the
    // near ones match), a round trip each.
    let (fourth, skipped, plan) = look_up_plan(&pg, &mut chat, &a, "Step 4.", 2).await;
    assert_eq!(fourth.conversation, first.conversation);
    assert_eq!(skipped, 1, "branched: probed: {plan}");
}

/// Requests that go on from a replica's own answers while a probe is under
/// way ask whether their conversations branched in one round trip (one
/// statement for every probe that came meanwhile), and each still gets its
/// own answer: a branched session among them is looked up and stays in its
/// conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn concurrent_requests_going_on_from_a_replica_s_own_answers_share_their_branch_probes() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, |_| {}).await;
    let sessions = 24;
    let mut chats: Vec<Chat> = (0..sessions).map(|_| Chat::new(KEY)).collect();
    let mut first = Vec::new();
    for (i, chat) in chats.iter_mut().enumerate() {
        let turn = chat.turn(&b, &format!("Session {i}, step 1.")).await;
        assert_eq!(turn.status, 200);
        first.push(turn.conversation);
        assert_eq!(
            chat.turn(&a, &format!("Session {i}, step 2.")).await.status,
            200
        );
    }
    // Session 0's second turn edited at a: its conversation branched.
    let mut edited = Chat::new(KEY);
    edited.history = chats[0].history[..2].to_vec();
    let fork = edited.turn(&a, "Session 0, step 2, otherwise.").await;
    assert_ne!(fork.conversation, first[0], "an edit branches");
    // The first probe waits on a lock held half a second, so that every
    // request reaches its probe while one is under way, however slowly the
    // requests come.
    let (locker, driver) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let driver = tokio::spawn(driver);
    within(locker.batch_execute("BEGIN; LOCK TABLE exchanges IN ACCESS EXCLUSIVE MODE"))
        .await
        .expect("lock");
    let before = reads(&b).await;
    let release = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        locker.batch_execute("COMMIT").await.expect("unlock");
    };
    let turns = futures_util::future::join_all(chats.iter_mut().enumerate().map(|(i, chat)| {
        let b = &b;
        async move { chat.turn(b, &format!("Session {i}, step 3.")).await }
    }));
    let (turns, ()) = within(async { tokio::join!(turns, release) }).await;
    drop(locker);
    let _ = within(driver).await;
    let made = reads(&b).await - before;
    for (i, turn) in turns.iter().enumerate() {
        assert_eq!(turn.status, 200, "session {i}");
        assert_eq!(turn.conversation, first[i], "session {i} stays together");
    }
    // The probe that waited, one for all that came meanwhile (however they
    // were split, a few), and the branched session's chains.
    assert!(
        made <= 4,
        "{made} round trips for {sessions} requests at once"
    );
}

/// A replica's look-ups of a request's chains and its branch probes run by
/// the plan their connection keeps, not one made again at every call: a
/// plan made for one call's values looked cheaper than the kept one (the
/// tenant's share of the rows, a null conversation folded away, the count
/// of an array), so the plan cache made a new one each time, which cost the
/// database as much as the statement's run, and ten times as much for the
/// probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_replica_s_look_ups_and_probes_are_not_planned_at_every_call() {
    let Some(pg) = PgCluster::start_profiled(false, true) else {
        return;
    };
    let url = pg.database();
    let (a, b) = replicas(&url, |_| {}).await;
    // Another tenant's history, analyzed: this tenant's share of the rows
    // then differs from the average one, as in any store of many tenants.
    pg.fill(&url, 20_000).expect("fill");
    pg.reset_statements(&url).expect("pg_stat_statements");
    // Each session's second turn is new to b: a look-up of its chains; its
    // third and fourth go on from their replica's own answer two turns
    // back: a probe each.
    for s in 0..30 {
        let mut chat = Chat::new(KEY);
        for i in 0..4 {
            let via = if i % 2 == 0 { &a } else { &b };
            let turn = chat.turn(via, &format!("Session {s}, step {i}.")).await;
            assert_eq!(turn.status, 200, "session {s}, turn {i}");
        }
    }
    for (what, start) in [("look-up", "WITH near%"), ("probe", "SELECT q.i%")] {
        let row = support::pg_rows(
            &url,
            &format!(
                "SELECT COALESCE(sum(calls), 0)::bigint, COALESCE(sum(plans), 0)::bigint
                 FROM pg_stat_statements WHERE query LIKE '{start}'"
            ),
        )
        .await;
        let (calls, plans): (i64, i64) = (row[0].get(0), row[0].get(1));
        assert!(calls >= 25, "{what}: {calls} calls");
        // A connection's first five calls are planned for their values.
        assert!(
            plans * 2 < calls,
            "{what}: planned {plans} times in {calls} calls"
        );
    }
}

/// A store created empty is analyzed by the replica that filled it, once it
/// has committed a thousand exchanges, rather than when autovacuum first
/// gets to it: until then the plans its connections keep are those of an
/// empty table (sequential scans of `exchanges`, slower with every row).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_store_created_empty_is_analyzed_once_a_replica_has_filled_it() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let a = Harness::start_with(|c| c.store.url = url.clone()).await;
    // Not autovacuum: the replica.
    support::pg_execute(
        &url,
        "ALTER TABLE exchanges SET (autovacuum_enabled = false)",
    )
    .await;
    let known = || async {
        let rows = support::pg_rows(
            &url,
            "SELECT reltuples::float8 FROM pg_class WHERE relname = 'exchanges'",
        )
        .await;
        rows[0].get::<_, f64>(0)
    };
    assert!(known().await < 1.0, "a new store's statistics are empty");
    // 40 sessions of 26 turns at once: 1,040 exchanges.
    let mut chats: Vec<Chat> = (0..40).map(|_| Chat::new(KEY)).collect();
    // Each turn's request is under a timeout of its own.
    futures_util::future::join_all(chats.iter_mut().enumerate().map(|(s, chat)| {
        let a = &a;
        async move {
            for i in 0..26 {
                let turn = chat.turn(a, &format!("Session {s}, step {i}.")).await;
                assert_eq!(turn.status, 200, "session {s}, turn {i}");
            }
        }
    }))
    .await;
    within(a.state.store.flush()).await.expect("flush");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while known().await < 500.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "still the statistics of an empty store: {}",
            known().await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// With `store.local_journal` an answer goes once journaled, before its
/// commit. A session whose next turn reaches the other replica the moment
/// its first was answered still stays one conversation: a conversation's
/// first exchange is committed before its answer goes, so the other
/// replica finds it (its later exchanges only need the replica that
/// serves the next turn to find one of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn with_local_journals_a_session_alternating_without_pause_stays_one_conversation() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, |c| c.store.local_journal = true).await;
    let sessions = 60;
    for s in 0..sessions {
        let mut chat = Chat::new(KEY);
        let mut seen = Vec::new();
        for i in 0..6 {
            let via = if i % 2 == 0 { &a } else { &b };
            let turn = chat
                .turn(via, &format!("Session {s}, step {i}: go on."))
                .await;
            assert_eq!(turn.status, 200, "session {s}, turn {i}");
            seen.push(turn.conversation);
        }
        assert!(
            seen.iter().all(|c| c == &seen[0]),
            "session {s} forked: {seen:?}"
        );
    }
    for h in [&a, &b] {
        within(h.state.store.flush()).await.expect("flush");
    }
    let stored = count(&url, "SELECT COUNT(*) FROM conversations").await;
    assert_eq!(stored, sessions, "one stored conversation per session");
}

/// With `store.local_journal`, a client that chains its turns by
/// `previous_response_id`, each sent the moment the one before was
/// answered and each to the other replica, has every turn expanded into
/// its whole history and kept in one conversation: an exchange asked for
/// by id is committed before its answer goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn with_local_journals_a_previous_response_id_chain_alternating_without_pause_is_expanded() {
    let Some(pg) = PgCluster::start() else { return };
    let url = pg.database();
    let (a, b) = replicas(&url, |c| c.store.local_journal = true).await;
    for s in 0..60 {
        let mut previous: Option<String> = None;
        let mut seen = Vec::new();
        for i in 0..4 {
            let via = if i % 2 == 0 { &a } else { &b };
            let text = format!("chain {s}, turn {i}");
            let mut body = json!({"model": "gpt-5", "input": [{"role": "user", "content": text}]});
            if let Some(p) = &previous {
                body["previous_response_id"] = json!(p);
            }
            let (status, headers, answer) =
                post(&format!("{}/responses", via.url()), KEY, &body).await;
            assert_eq!(status, 200, "chain {s}, turn {i}");
            let sent = support::last_client_call(via);
            assert!(
                sent.get("previous_response_id").is_none(),
                "chain {s}, turn {i} not expanded: {sent}"
            );
            assert_eq!(
                sent["input"].as_array().map(Vec::len),
                Some(2 * i + 1),
                "chain {s}, turn {i}: the whole history"
            );
            let answer: Value = serde_json::from_slice(&answer).expect("json");
            previous = answer["id"].as_str().map(String::from);
            seen.push(headers.get("x-compactor-conversation").cloned());
        }
        assert!(
            seen.iter().all(|c| c == &seen[0]),
            "chain {s} forked: {seen:?}"
        );
    }
}

/// What a client does next in [`play`].
#[derive(Clone, Copy, Debug)]
enum Step {
    /// A new message after the answer.
    Next,
    /// The last message replaced by another (a branch from the answer
    /// before it).
    Edit,
    /// The last two turns dropped, and a new message (a branch from
    /// further back).
    Back,
}

/// A session's steps, drawn from `seed`.
fn script(seed: u64, n: usize) -> Vec<Step> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut draw = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|i| match (i, draw() % 10) {
            (0..=2, _) | (_, 0..=5) => Step::Next,
            (_, 6..=8) => Step::Edit,
            _ => Step::Back,
        })
        .collect()
}

/// Plays `steps` as one session of tenant `key`, each turn through one of
/// `via` (drawn from `seed`): the conversation each turn was identified as.
async fn play(steps: &[Step], via: &[&Harness], key: &str, seed: u64) -> Vec<String> {
    let mut chat = Chat::new(key);
    let mut pick = seed;
    let mut seen = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        pick = pick.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let h = via[(pick >> 33) as usize % via.len()];
        let turns = (chat.history.len() - 1) / 2;
        let text = match step {
            Step::Edit if turns > 0 => {
                chat.history.truncate(chat.history.len() - 2);
                format!("Instead, step {i}: read src/other_{i}.rs.")
            }
            Step::Back if turns > 1 => {
                chat.history.truncate(chat.history.len() - 4);
                format!("Back up, step {i}: read src/back_{i}.rs.")
            }
            _ => format!("Step {i}: read src/module_{i}.rs."),
        };
        // Each answer its own, as a model's are.
        let answer = format!("Answer {i} of session {seed}.");
        h.fake
            .push(compactor::fake_upstream::Reply::chat(&answer, 40, 8));
        let turn = chat.turn(h, &text).await;
        assert_eq!(turn.status, 200, "step {i} ({step:?})");
        seen.push(turn.conversation);
    }
    seen
}

/// Which turns share a conversation: each turn's conversation numbered by
/// its first turn.
fn partition(conversations: &[String]) -> Vec<usize> {
    let mut first: Vec<&String> = Vec::new();
    conversations
        .iter()
        .map(|c| match first.iter().position(|f| *f == c) {
            Some(n) => n,
            None => {
                first.push(c);
                first.len() - 1
            }
        })
        .collect()
}

/// A session spread over two replicas, through edits and back-ups: a plain
/// next turn stays in the conversation of the turn before, as on one
/// replica (a replica that served the session two turns back learns from
/// the database that another branched it since); and every record's
/// prefix and suffix make up the request it was sent, its items stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
async fn a_session_spread_over_two_replicas_through_branches_keeps_its_next_turns_together() {
    let Some(pg) = PgCluster::start() else { return };
    let (shared, alone) = (pg.database(), pg.database());
    let (a, b) = replicas(&shared, |_| {}).await;
    let one = Harness::start_with(|c| c.store.url = alone.clone()).await;
    for seed in 1..=24u64 {
        let steps = script(seed, 16);
        let key = format!("sk-session-{seed}-0000000000000000");
        let spread = play(&steps, &[&a, &b], &key, seed).await;
        let single = play(&steps, &[&one], &key, seed).await;
        // The turns a plain next turn did not keep together with the one
        // before.
        let apart = |seen: &[String]| -> Vec<usize> {
            (1..steps.len())
                .filter(|&i| matches!(steps[i], Step::Next) && seen[i] != seen[i - 1])
                .collect()
        };
        assert_eq!(
            (apart(&spread), apart(&single)),
            (vec![], vec![]),
            "seed {seed}, steps {steps:?}: over two replicas {:?}, on one {:?}",
            partition(&spread),
            partition(&single)
        );
    }
    for h in [&a, &b, &one] {
        within(h.state.store.flush()).await.expect("flush");
    }
    for url in [&shared, &alone] {
        let extending = count(
            url,
            "SELECT count(*) FROM exchanges WHERE prefix_exchange IS NOT NULL",
        )
        .await;
        assert!(extending > 100, "records extend others: {extending}");
        let broken = count(
            url,
            "SELECT count(*) FROM exchanges e LEFT JOIN exchanges p ON p.id = e.prefix_exchange
             WHERE e.prefix_len + length(e.suffix_items) / 32 <> e.request_len
                OR (e.prefix_exchange IS NULL) <> (e.prefix_len = 0)
                OR e.prefix_len <> CASE WHEN e.prefix_full
                                        THEN p.request_len + length(p.response_items) / 32
                                        ELSE p.request_len END",
        )
        .await;
        assert_eq!(
            broken, 0,
            "records whose prefix and suffix miss their request"
        );
        let missing = count(
            url,
            "SELECT count(*) FROM exchanges e, generate_series(0, length(e.suffix_items) / 32 - 1) i
             WHERE NOT EXISTS (SELECT 1 FROM items
                               WHERE hash = substring(e.suffix_items FROM i * 32 + 1 FOR 32))",
        )
        .await;
        assert_eq!(missing, 0, "items recorded without their bodies");
    }
}
