//! The PostgreSQL store's write path, through its writer's backend: a
//! batch is one transaction sent as one pipeline, so a commit costs one
//! round trip however many records it holds; every column lands where it
//! belongs; the rules that let replicas write the same conversation hold
//! (newest last-seen wins, ids filled in, a key not taken from the
//! conversation that holds it, items once); a failed batch leaves nothing;
//! text holding U+0000 is stored losslessly, and a record the database
//! refuses fails alone, not the batch it came in.
//!
//! A real PostgreSQL tier: `#[ignore]`d like the other real tiers (run with
//! `--include-ignored`; `scripts/test` installs PostgreSQL).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use compactor::compaction::{Compaction, Rung};
use compactor::store::postgres::{Options, Postgres, PostgresBackend, PostgresReads};
use compactor::store::{Backend, ExchangeRecord, PrefixRef, Reads, Record, RecordedWindow};
use compactor::windows::{Source, Told};
use serde_json::{json, Value};
use support::postgres::PgCluster;
use support::within;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long the relay holds each answer back: a database one round trip
/// of this away, long enough to dwarf the work a commit does here.
const LATENCY: Duration = Duration::from_millis(100);

/// Round trips a commit may take in [`LATENCY`]s, the one it needs plus
/// slack for a loaded machine (the per-statement path took one per
/// statement, five for a single exchange).
const ROUND_TRIPS_ALLOWED: u32 = 3;

fn options(url: &str, pool_size: usize) -> Options {
    Options {
        url: url.to_string(),
        password: None,
        pool_size,
        statement_timeout: Duration::from_secs(20),
        stall_after: Duration::from_secs(2),
        claim_lapse: Duration::from_secs(120),
        synchronous_commit: None,
    }
}

/// A throwaway cluster, a database on it, and a runtime for the test's
/// own connections; `None` where PostgreSQL cannot run.
fn database() -> Option<(PgCluster, String, tokio::runtime::Runtime)> {
    let cluster = PgCluster::start()?;
    let url = cluster.database();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    Some((cluster, url, rt))
}

/// A new database on `cluster` with the schema, and its writer's backend
/// (`pool_size` 1: every batch on the same session).
fn backend(url: &str) -> (std::sync::Arc<Postgres>, PostgresBackend) {
    let pg = Postgres::open(&options(url, 1)).expect("open the database");
    let backend = PostgresBackend::new(pg.clone());
    (pg, backend)
}

/// An exchange with every column set, in conversation `conversation`.
fn exchange(id: i64, conversation: &str, started_ms: i64) -> ExchangeRecord {
    let item = json!({"role": "user", "content": format!("message {id}")});
    let hash = compactor::wire::item_hash(&item);
    ExchangeRecord {
        id,
        conversation: conversation.to_string(),
        new_conversation: true,
        chained_by_id: false,
        branched_from: Some("conv_left".into()),
        explicit_key: None,
        tenant: "tenant-a".into(),
        api: compactor::wire::Api::Responses,
        model: format!("model-{started_ms}"),
        prefix: Some(PrefixRef {
            exchange: 7,
            len: 3,
            full: true,
        }),
        suffix_items: vec![hash, [2; 32]],
        request_len: 5,
        params: [1; 32],
        response_items: vec![[3; 32]],
        new_items: vec![(hash, item.to_string())],
        stored_items: Default::default(),
        claimed_at: 0,
        journaled: false,
        response_id: Some(format!("resp_{id}")),
        usage: Some(compactor::wire::Usage {
            input_tokens: 120,
            output_tokens: 30,
            cached_tokens: Some(100),
            cache_write_tokens: Some(15),
            cache_write_1h_tokens: Some(5),
        }),
        status: 200,
        streamed: true,
        partial: false,
        error: Some("late".into()),
        started_ms,
        latency_ms: 12.5,
        ttfb_ms: Some(3.25),
        chain_request: Some([4; 32]),
        chain_full: Some([5; 32]),
        chain_echoed: None,
        compaction: Some("cmp_applied".into()),
        window: Some(RecordedWindow {
            tokens: 8192,
            source: Source::Learned,
        }),
        client_ids: compactor::wire::ClientIds {
            header: Some(format!("header-{started_ms}")),
            session: None,
            cache_key: Some("cache-key".into()),
        },
        client: Some("codex".into()),
        preview: Some(format!("preview-{started_ms}")),
        savings: compactor::store::ExchangeSavings {
            mode: compactor::config::Mode::Observe,
            tokens_saved: 11,
            tokens_saved_potential: 22,
            observed_compaction: Some("cmp_observed".into()),
            recall_rounds: 2,
            recall_input_tokens: 33,
            recall_output_tokens: 44,
        },
    }
}

fn compaction(id: &str) -> Compaction {
    Compaction {
        id: id.into(),
        tenant: "tenant-a".into(),
        conversation: "conv_a".into(),
        covered_len: 4,
        covered_chain: [6; 32],
        replacement: vec![json!({"role": "user", "content": "summary"})],
        rung: Rung::Fallback,
        reason: "manual".into(),
        tokens_before: 1000,
        tokens_after: 200,
        items_removed: 3,
        items_kept: 1,
        summary: Some("summary".into()),
        facts: Some(serde_json::from_value(json!({"task": "fix it"})).expect("facts")),
        base: Some("cmp_base".into()),
        summary_calls: 1,
        summary_tokens: 50,
        summary_output_tokens: 10,
        summary_cache: compactor::compaction::SummaryCache {
            read: 30,
            write: 12,
            write_1h: 4,
        },
        tokens_saved: 800,
        observed: false,
        audit: Some(
            serde_json::from_value(json!({
                "facts": [
                    {"kind": "task", "fact": "fix it", "state": "present"},
                    {"kind": "failure", "fact": "KeyError: 'session'", "state": "repaired"},
                    {"kind": "constraint", "fact": "Never rename it.", "state": "forgotten"}],
                "removed": ["item:0123456789abcdef"], "removed_count": 3}))
            .expect("audit"),
        ),
        duration_ms: 9,
        created_ms: 1_000,
        made: Default::default(),
    }
}

fn window(model: &str, tokens: u64) -> Told {
    Told {
        upstream: "http://upstream".into(),
        model: model.into(),
        window: tokens,
        source: Source::Learned,
        updated_ms: tokens as i64,
    }
}

fn ex(rec: ExchangeRecord) -> Record {
    Record::Exchange(Box::new(rec))
}

/// One JSON value per row of `sql`, which selects one `jsonb` column as
/// text.
fn rows(rt: &tokio::runtime::Runtime, url: &str, sql: &str) -> Vec<Value> {
    rt.block_on(support::pg_rows(url, sql))
        .iter()
        .map(|r| serde_json::from_str(r.get::<_, &str>(0)).expect("json"))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    let digits: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("\\x{digits}")
}

/// Forwards each connection to `target`, each chunk of the database's
/// answers held back [`LATENCY`] from when it arrived (in order, as a
/// slow link would).
async fn slow_link(target: u16) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the relay");
    let port = listener.local_addr().expect("relay address").port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(relay(client, target));
        }
    });
    port
}

async fn relay(client: tokio::net::TcpStream, target: u16) {
    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let up = tokio::io::copy(&mut from_client, &mut to_server);
    let read = async move {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n @ 1..) = from_server.read(&mut buf).await {
            if tx
                .send((Instant::now() + LATENCY, buf[..n].to_vec()))
                .is_err()
            {
                break;
            }
        }
    };
    let write = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due.into()).await;
            if to_client.write_all(&bytes).await.is_err() {
                break;
            }
        }
    };
    let _ = tokio::join!(up, read, write);
}

#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn a_commit_is_one_round_trip_however_many_records_it_holds() {
    let Some((cluster, url, rt)) = database() else {
        return;
    };
    let name = url.rsplit('/').next().expect("a database name").to_string();
    let relay = rt.block_on(within(slow_link(cluster.port)));
    let (_pg, mut backend) = backend(&format!("postgres://postgres@127.0.0.1:{relay}/{name}"));
    // The session's statements are prepared by its first batch.
    backend
        .write(&[ex(exchange(1, "conv_warm", 1))])
        .expect("the first batch");
    let one = vec![ex(exchange(2, "conv_one", 2))];
    let mut many: Vec<Record> = (0..40)
        .map(|i| ex(exchange(100 + i, &format!("conv_many_{}", i % 20), 100 + i)))
        .collect();
    many.push(Record::Compaction(Box::new(compaction("cmp_many"))));
    many.push(Record::Window(window("m", 4096)));
    let bound = LATENCY * ROUND_TRIPS_ALLOWED;
    for (what, batch) in [("one exchange", one), ("40 exchanges", many)] {
        let started = Instant::now();
        backend.write(&batch).expect("the batch commits");
        let took = started.elapsed();
        assert!(
            took < bound,
            "a commit of {what} took {took:?}, over {ROUND_TRIPS_ALLOWED} round trips of {LATENCY:?}"
        );
    }
    let counted = rows(
        &rt,
        &url,
        "SELECT to_jsonb(ARRAY[(SELECT count(*) FROM exchanges),
                               (SELECT count(*) FROM conversations),
                               (SELECT count(*) FROM compactions)])::text",
    );
    assert_eq!(counted, vec![json!([42, 22, 1])]);
}

#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn every_column_is_written_and_replicas_writing_one_conversation_keep_its_rules() {
    let Some((_cluster, url, rt)) = database() else {
        return;
    };
    // Two replicas: a backend each, on one database.
    let (pg, mut a) = backend(&url);
    let (_, mut b) = backend(&url);

    // Replica A: two exchanges of conv_a (with its key), a compaction, and
    // the same model's window told twice (the later stays).
    let mut first = exchange(10, "conv_a", 1_000);
    first.explicit_key = Some("x-compactor-conversation:k".into());
    let mut second = exchange(11, "conv_a", 2_000);
    second.client = None;
    let batch = vec![
        ex(first.clone()),
        ex(second),
        Record::Compaction(Box::new(compaction("cmp_a"))),
        Record::Window(window("m", 1_000)),
        Record::Window(window("other", 3_000)),
        Record::Window(window("m", 2_000)),
    ];
    a.write(&batch).expect("replica A's batch");
    // The same batch again (a retried import): nothing doubles.
    a.write(&batch).expect("the same batch again");

    // Replica B commits an older exchange of conv_a after A's, sent with
    // other ids; then another conversation asking for conv_a's key. Its
    // item is the one A stored.
    let mut older = exchange(12, "conv_a", 500);
    older.client = None;
    older.client_ids.cache_key = None;
    older.new_items = first.new_items.clone();
    let mut thief = exchange(13, "conv_b", 3_000);
    thief.explicit_key = first.explicit_key.clone();
    b.write(&[ex(older), ex(thief)]).expect("replica B's batch");

    let exchanges = rows(
        &rt,
        &url,
        "SELECT (to_jsonb(e) - 'id' - 'conversation_id' - 'started_ms' - 'model'
                - 'conversation_header')::text
         FROM exchanges e ORDER BY id",
    );
    assert_eq!(exchanges.len(), 4, "{exchanges:?}");
    let suffix = [first.suffix_items[0], [2; 32]].concat();
    let expected = json!({
        "tenant": "tenant-a", "endpoint": "/responses",
        "prefix_exchange": 7, "prefix_len": 3, "prefix_full": true,
        "suffix_items": hex(&suffix), "request_len": 5, "params": hex(&[1; 32]),
        "response_items": hex(&[3; 32]), "response_id": "resp_10",
        "input_tokens": 120, "output_tokens": 30, "cached_tokens": 100,
        "status": 200, "streamed": true, "partial": false, "error": "late",
        "latency_ms": 12.5, "ttfb_ms": 3.25,
        "chain_request": hex(&[4; 32]), "chain_full": hex(&[5; 32]),
        "compaction_id": "cmp_applied", "context_window": 8192, "window_source": "learned",
        "client": "codex", "session_id": null, "prompt_cache_key": "cache-key",
        "mode": "observe", "tokens_saved": 11, "tokens_saved_potential": 22,
        "observed_compaction": "cmp_observed", "recall_rounds": 2,
        "recall_input_tokens": 33, "recall_output_tokens": 44,
        "branched_from": "conv_left",
        "cache_write_tokens": 15, "cache_write_1h_tokens": 5,
    });
    assert_eq!(exchanges[0], expected);
    let ids = rows(
        &rt,
        &url,
        "SELECT to_jsonb(ARRAY[id::text, conversation_id, started_ms::text, model,
                               conversation_header])::text
         FROM exchanges ORDER BY id",
    );
    assert_eq!(
        ids,
        vec![
            json!(["10", "conv_a", "1000", "model-1000", "header-1000"]),
            json!(["11", "conv_a", "2000", "model-2000", "header-2000"]),
            json!(["12", "conv_a", "500", "model-500", "header-500"]),
            json!(["13", "conv_b", "3000", "model-3000", "header-3000"]),
        ]
    );

    // conv_a: created as of its earliest exchange, with its preview; last
    // seen, model and ids as of its newest, whichever committed last (a
    // missing one kept from the other); its key; conv_b without the key
    // conv_a holds.
    let conversations = rows(
        &rt,
        &url,
        "SELECT to_jsonb(c)::text FROM conversations c ORDER BY id",
    );
    assert_eq!(
        conversations,
        vec![
            json!({
                "id": "conv_a", "tenant": "tenant-a",
                "explicit_key": "x-compactor-conversation:k",
                "created_ms": 500, "last_seen_ms": 2000, "model": "model-2000",
                "preview": "preview-500", "client": "codex",
                "conversation_header": "header-2000", "session_id": null,
                "prompt_cache_key": "cache-key",
            }),
            json!({
                "id": "conv_b", "tenant": "tenant-a", "explicit_key": null,
                "created_ms": 3000, "last_seen_ms": 3000, "model": "model-3000",
                "preview": "preview-3000", "client": "codex",
                "conversation_header": "header-3000", "session_id": null,
                "prompt_cache_key": "cache-key",
            }),
        ]
    );

    // The item both replicas sent is stored once; each other once too.
    let items = rows(
        &rt,
        &url,
        "SELECT to_jsonb(ARRAY[count(*), count(DISTINCT hash)])::text FROM items",
    );
    assert_eq!(items, vec![json!([3, 3])]);

    // The compaction reads back as written, every field.
    let reads = PostgresReads::new(pg);
    let stored = reads.compaction("cmp_a").expect("the compaction");
    assert_eq!(
        serde_json::to_value(&stored).expect("json"),
        serde_json::to_value(compaction("cmp_a")).expect("json")
    );
    let windows = rows(
        &rt,
        &url,
        r#"SELECT to_jsonb(ARRAY[model, "window"::text])::text FROM windows ORDER BY model"#,
    );
    assert_eq!(
        windows,
        vec![json!(["m", "2000"]), json!(["other", "3000"])]
    );
}

/// The two exchanges of a conversation that [`one_merge_rule`] writes in
/// two batches: the earlier with its preview, client and cache key, the
/// later with another model, header and a session id but no client or
/// cache key.
fn earlier_and_later(conversation: &str, first_id: i64) -> [Record; 2] {
    let mut earlier = exchange(first_id, conversation, 1_000);
    earlier.prefix = None;
    let mut later = exchange(first_id + 1, conversation, 2_000);
    later.prefix = None;
    later.client = None;
    later.client_ids.session = Some("session-2000".into());
    later.client_ids.cache_key = None;
    [ex(earlier), ex(later)]
}

/// Writes conv_ordered's exchanges in their order and conv_reversed's the
/// other way round, one batch each, and conv_together's the other way round
/// in one batch; reads the conversations back.
fn one_merge_rule(
    backend: &mut dyn Backend,
    views: impl FnOnce() -> Box<dyn compactor::store::sql::Sql>,
) -> Vec<compactor::store::sql::Row> {
    let [earlier, later] = earlier_and_later("conv_ordered", 1);
    backend.write(&[earlier]).expect("the earlier batch");
    backend.write(&[later]).expect("the later batch");
    let [earlier, later] = earlier_and_later("conv_reversed", 3);
    backend.write(&[later]).expect("the later batch first");
    backend.write(&[earlier]).expect("the earlier batch last");
    let [earlier, later] = earlier_and_later("conv_together", 5);
    backend.write(&[later, earlier]).expect("one batch");
    views()
        .rows(
            "SELECT id, created_ms, last_seen_ms, model, preview, client,
                    conversation_header, session_id, prompt_cache_key
             FROM conversations ORDER BY id",
            &[],
        )
        .expect("the conversations")
}

#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn a_conversation_takes_its_batches_by_one_rule_in_either_order_on_both_backends() {
    let Some((_cluster, url, _rt)) = database() else {
        return;
    };
    let (pg, mut postgres) = backend(&url);
    let on_postgres = one_merge_rule(&mut postgres, || {
        Box::new(compactor::store::postgres::PgSql::connect(&pg).expect("a connection"))
    });
    let dir = tempfile::tempdir().expect("a directory");
    let path = dir.path().join("s.db");
    let mut sqlite = compactor::store::sqlite::SqliteBackend::open(&path).expect("a store");
    let on_sqlite = one_merge_rule(&mut sqlite, || {
        Box::new(compactor::store::sqlite::open_read_only(&path).expect("a connection"))
    });

    // Created as of the earlier exchange, with its preview; last seen,
    // model and ids as of the later; the client and cache key the later
    // did not send kept from the earlier: whichever batch committed last,
    // and in whichever order a batch holds them.
    use compactor::store::sql::{Cell, Row};
    let text = |s: &str| Cell::Text(s.into());
    let row = |id: &str| {
        Row(vec![
            text(id),
            Cell::Int(1_000),
            Cell::Int(2_000),
            text("model-2000"),
            text("preview-1000"),
            text("codex"),
            text("header-2000"),
            text("session-2000"),
            text("cache-key"),
        ])
    };
    let expected = vec![
        row("conv_ordered"),
        row("conv_reversed"),
        row("conv_together"),
    ];
    assert_eq!(on_sqlite, expected, "on SQLite");
    assert_eq!(on_postgres, expected, "on PostgreSQL");
}

/// An explicit key past what PostgreSQL's unique index can hold (2,704
/// bytes a row), incompressible: a value the database refuses whatever the
/// text rule.
fn oversized_key() -> String {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let key: String = (0..12_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'!' + (x % 90) as u8)
        })
        .collect();
    format!("session-id:{key}")
}

#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn a_batch_the_database_refuses_leaves_nothing_and_the_next_one_commits() {
    let Some((_cluster, url, rt)) = database() else {
        return;
    };
    let (_pg, mut backend) = backend(&url);
    // The conversation's statement fails, after the items' have run in the
    // same transaction.
    let mut refused = exchange(20, "conv_refused", 1);
    refused.explicit_key = Some(oversized_key());
    let err = backend
        .write(&[ex(refused), Record::Window(window("m", 1))])
        .expect_err("a key past the index's row size is refused");
    assert!(err.to_string().contains("postgres"), "{err}");
    assert!(err.is_refusal(), "a value the database refuses: {err}");
    // The same session (the pool holds one) commits the next batch, and
    // nothing of the refused one came with it.
    backend
        .write(&[ex(exchange(21, "conv_next", 2))])
        .expect("the next batch");
    let stored = rows(
        &rt,
        &url,
        "SELECT to_jsonb(ARRAY[(SELECT string_agg(id, ',') FROM conversations),
                               (SELECT string_agg(id::text, ',') FROM exchanges),
                               (SELECT count(*)::text FROM windows),
                               (SELECT count(*)::text FROM items)])::text",
    );
    assert_eq!(stored, vec![json!(["conv_next", "21", "0", "1"])]);
}

/// PostgreSQL's text refuses U+0000: a client's NUL in any text it sends
/// (its message, `model`, `prompt_cache_key`, session id, an item's body)
/// is stored, in the batch that carries another tenant's record, and reads
/// back as it came through every path that reads it.
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn text_holding_nul_is_stored_beside_other_tenants_records_and_reads_back_as_sent() {
    let Some((_cluster, url, rt)) = database() else {
        return;
    };
    let (pg, mut backend) = backend(&url);
    let nul = |s: &str| format!("{s}\0after\u{FDD0}mark");
    let mut odd = exchange(30, "conv_nul", 1_000);
    odd.tenant = "tenant-nul".into();
    odd.model = nul("model");
    odd.explicit_key = Some(nul("session-id:key"));
    odd.client_ids.cache_key = Some(nul("cache"));
    odd.client_ids.session = Some(nul("session"));
    odd.preview = Some(nul("first message"));
    odd.error = Some(nul("error"));
    let body = nul("raw body");
    odd.new_items = vec![([9; 32], body.clone())];
    let mut summary = compaction("cmp_nul");
    summary.summary = Some(nul("summary"));
    summary.reason = nul("reason");
    let other = exchange(31, "conv_other", 2_000);
    backend
        .write(&[
            ex(odd.clone()),
            ex(other),
            Record::Compaction(Box::new(summary.clone())),
            Record::Window(window(&nul("window model"), 5)),
        ])
        .expect("the batch commits");

    // Nothing stored holds a NUL; the other tenant's exchange is there.
    let counted = rows(
        &rt,
        &url,
        "SELECT to_jsonb(ARRAY[(SELECT count(*) FROM exchanges),
                               (SELECT count(*) FROM exchanges WHERE tenant = 'tenant-a')])::text",
    );
    assert_eq!(counted, vec![json!([1 + 1, 1])]);

    // The views read every text as the client sent it.
    let views = compactor::store::postgres::PgSql::connect(&pg).expect("a connection");
    use compactor::store::sql::Sql;
    let texts: Vec<String> = views
        .rows(
            "SELECT e.model, c.explicit_key, e.prompt_cache_key, e.session_id, c.preview,
                    e.error
             FROM exchanges e JOIN conversations c ON c.id = e.conversation_id
             WHERE e.id = 30",
            &[],
        )
        .expect("the row")
        .into_iter()
        .flat_map(|r| (0..6).map(move |i| r.get::<String>(i).expect("a text")))
        .collect();
    assert_eq!(
        texts,
        [
            odd.model.clone(),
            odd.explicit_key.clone().unwrap_or_default(),
            nul("cache"),
            nul("session"),
            nul("first message"),
            nul("error"),
        ]
    );
    let bodies: Vec<String> = views
        .rows(
            "SELECT body FROM items WHERE hash = ?1",
            &[[9u8; 32][..].into()],
        )
        .expect("the item")
        .iter()
        .map(|r| r.get::<String>(0).expect("a body"))
        .collect();
    assert_eq!(bodies, vec![body]);
    // Looked up by what the client sent, NUL included.
    let found: Vec<String> = views
        .rows(
            "SELECT id FROM conversations WHERE prompt_cache_key = ?1",
            &[nul("cache").as_str().into()],
        )
        .expect("the lookup")
        .iter()
        .map(|r| r.get::<String>(0).expect("an id"))
        .collect();
    assert_eq!(found, vec!["conv_nul".to_string()]);
    drop(views);

    // The request path's reads too.
    let reads = PostgresReads::new(pg.clone());
    let key = odd.explicit_key.as_deref().unwrap_or_default();
    assert_eq!(
        reads.conversation_of_key("tenant-nul", key).as_deref(),
        Some("conv_nul")
    );
    let stored = reads.compaction("cmp_nul").expect("the compaction");
    assert_eq!(stored.summary, summary.summary);
    assert_eq!(stored.reason, summary.reason);
    // And what a replica loads at start-up.
    let snapshot = backend
        .load(compactor::store::Limits {
            exchanges: 10,
            keys: 10,
        })
        .expect("the snapshot");
    assert!(
        snapshot
            .keys
            .iter()
            .any(|(_, k, c)| k == key && c == "conv_nul"),
        "{:?}",
        snapshot.keys
    );
    assert!(snapshot
        .windows
        .iter()
        .any(|w| w.model == nul("window model")));
}

/// A record the database refuses (here a key past its index's row size)
/// fails alone: the records committed in the same batch, other tenants'
/// among them, are stored and their writers told so.
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn a_record_the_database_refuses_fails_alone_and_its_batch_mates_commit() {
    let Some((cluster, url, rt)) = database() else {
        return;
    };
    let name = url.rsplit('/').next().expect("a database name").to_string();
    let relay = rt.block_on(within(slow_link(cluster.port)));
    let slow = format!("postgres://postgres@127.0.0.1:{relay}/{name}");
    let pg = Postgres::open(&options(&slow, 2)).expect("open the database");
    let (store, _) = compactor::store::Store::start_shared(
        Box::new(PostgresBackend::new(pg.clone())),
        pg,
        None,
        compactor::store::Limits {
            exchanges: 10,
            keys: 10,
        },
        Duration::ZERO,
    )
    .expect("the store");
    rt.block_on(within(async {
        // A first commit holds the writer one slow round trip; the three
        // records queued meanwhile go in the next batch together.
        let first = tokio::spawn({
            let store = store.clone();
            async move { store.record(exchange(40, "conv_first", 1)).await }
        });
        tokio::time::sleep(LATENCY / 4).await;
        let mut bad = exchange(41, "conv_bad", 2);
        bad.tenant = "tenant-bad".into();
        bad.explicit_key = Some(oversized_key());
        let spawn = |rec: ExchangeRecord| {
            let store = store.clone();
            tokio::spawn(async move { store.record(rec).await })
        };
        let (before, bad, after) = (
            spawn(exchange(42, "conv_before", 3)),
            spawn(bad),
            spawn(exchange(43, "conv_after", 4)),
        );
        assert!(first.await.expect("the task").is_ok());
        let bad = bad.await.expect("the task");
        assert!(bad.is_err(), "the refused record is not acknowledged");
        assert!(before.await.expect("the task").is_ok(), "{bad:?}");
        assert!(after.await.expect("the task").is_ok(), "{bad:?}");
        // The writer is not taken for failing: the next record commits.
        store
            .record(exchange(44, "conv_next", 5))
            .await
            .expect("the next record");
    }));
    let stored = rows(
        &rt,
        &url,
        "SELECT to_jsonb(ARRAY[(SELECT string_agg(id::text, ',' ORDER BY id) FROM exchanges),
                               (SELECT string_agg(id, ',' ORDER BY id) FROM conversations)])::text",
    );
    assert_eq!(
        stored,
        vec![json!([
            "40,42,43,44",
            "conv_after,conv_before,conv_first,conv_next"
        ])]
    );
}

/// The unreferenced-item scan reads every exchange: on a shared store one
/// process at a time makes it. While another holds its lock, a deletion
/// takes its conversation and skips the scan; the next scan takes the
/// items both deletions left.
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn the_unreferenced_item_scan_runs_in_one_process_at_a_time() {
    let Some((_cluster, url, rt)) = database() else {
        return;
    };
    let (pg, mut backend) = backend(&url);
    backend
        .write(&[ex(exchange(50, "conv_x", 1)), ex(exchange(51, "conv_y", 2))])
        .expect("the batch");
    let reads = PostgresReads::new(pg);
    use compactor::store::Queries;
    let items = || rows(&rt, &url, "SELECT to_jsonb(count(*))::text FROM items");
    assert_eq!(items(), vec![json!(2)]);

    // Another process scans (holds the lock).
    let (holder, driver) = rt.block_on(async {
        let (client, conn) = within(tokio_postgres::connect(&url, tokio_postgres::NoTls))
            .await
            .expect("connect");
        let driver = tokio::spawn(conn);
        within(client.execute(
            "SELECT pg_advisory_lock($1)",
            &[&compactor::store::retention::PRUNE_LOCK],
        ))
        .await
        .expect("the lock");
        (client, driver)
    });
    let removed = reads
        .delete_conversations(&["conv_x".to_string()])
        .expect("the deletion");
    assert_eq!(
        (removed.conversations, removed.items),
        (1, 0),
        "{removed:?}"
    );
    assert_eq!(items(), vec![json!(2)], "the scan was left to the other");
    // Released before the session ends (its end is seen by the server a
    // moment after the socket closes).
    rt.block_on(async {
        within(holder.execute(
            "SELECT pg_advisory_unlock($1)",
            &[&compactor::store::retention::PRUNE_LOCK],
        ))
        .await
        .expect("the unlock");
        drop(holder);
        let _ = within(driver).await;
    });

    let removed = reads
        .delete_conversations(&["conv_y".to_string()])
        .expect("the deletion");
    assert_eq!(
        (removed.conversations, removed.items),
        (1, 2),
        "{removed:?}"
    );
    assert_eq!(items(), vec![json!(0)]);
}

/// An item the scan found unreferenced may be taken up again before it
/// is deleted: a writer found it stored and left it as it was, in a
/// transaction under way while the scan read. The deletion waits for that
/// transaction (its lock on the items) and keeps the item its exchange
/// refers to.
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn an_item_taken_up_again_while_the_scan_ran_is_not_deleted() {
    let Some((_cluster, url, rt)) = database() else {
        return;
    };
    let (_pg, mut backend) = backend(&url);
    let first = exchange(60, "conv_x", 1);
    let item = first.new_items[0].0;
    backend.write(&[ex(first)]).expect("the batch");
    // A deletion's scan waits the commit bound (this and 5 s) and 2 s.
    let quick = Options {
        statement_timeout: Duration::from_secs(3),
        ..options(&url, 1)
    };
    let reads = PostgresReads::new(Postgres::open(&quick).expect("open the database"));

    // Another replica's writer: the item found stored, an exchange of its
    // own referring to it, not committed yet.
    let (writer, driver) = rt.block_on(async {
        let (client, conn) = within(tokio_postgres::connect(&url, tokio_postgres::NoTls))
            .await
            .expect("connect");
        let driver = tokio::spawn(conn);
        within(client.batch_execute("BEGIN")).await.expect("begin");
        within(client.execute(
            "INSERT INTO items (hash, body) VALUES ($1, 'x') ON CONFLICT DO NOTHING",
            &[&item.as_slice()],
        ))
        .await
        .expect("the item");
        within(client.batch_execute(
            "INSERT INTO conversations (id, tenant, created_ms, last_seen_ms)
             VALUES ('conv_y', 'tenant-a', 2, 2)",
        ))
        .await
        .expect("the conversation");
        within(client.execute(
            "INSERT INTO exchanges (id, conversation_id, tenant, endpoint, model, suffix_items,
                                    request_len, params, response_items, status, streamed,
                                    partial, started_ms, latency_ms)
             VALUES (61, 'conv_y', 'tenant-a', 'responses', 'm', $1, 1, $1, ''::bytea, 200,
                     FALSE, FALSE, 2, 1.0)",
            &[&item.as_slice()],
        ))
        .await
        .expect("the exchange");
        (client, driver)
    });
    let deletion = std::thread::spawn(move || {
        use compactor::store::Queries;
        reads.delete_conversations(&["conv_x".to_string()])
    });
    // The deletion scans (the exchange above is not committed), then waits
    // for the writer's lock; then the writer commits.
    let waiting = "SELECT to_jsonb(count(*))::text FROM pg_locks
                   WHERE relation = 'items'::regclass AND NOT granted";
    let deadline = Instant::now() + support::STEP;
    while rows(&rt, &url, waiting) == vec![json!(0)] && !deletion.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the deletion neither waited nor ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    rt.block_on(async {
        within(writer.batch_execute("COMMIT"))
            .await
            .expect("commit");
        drop(writer);
        let _ = within(driver).await;
    });
    let removed = deletion
        .join()
        .expect("the deletion's thread")
        .expect("the deletion");
    assert_eq!(removed.conversations, 1, "{removed:?}");
    let stored = format!(
        "SELECT to_jsonb(count(*))::text FROM items WHERE hash = decode('{}', 'hex')",
        item.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    assert_eq!(
        rows(&rt, &url, &stored),
        vec![json!(1)],
        "the item the writer's exchange refers to stays: {removed:?}"
    );
    assert_eq!(removed.items, 0, "{removed:?}");
}

/// `store.synchronous_commit` is what the proxy's sessions commit with
/// (what of an acknowledged exchange survives a crash of the database's
/// host), the database's default untouched otherwise.
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn the_sessions_commit_with_the_synchronous_commit_set() {
    let Some((_cluster, url, _rt)) = database() else {
        return;
    };
    let _schema = backend(&url);
    use compactor::store::sql::Sql;
    for setting in ["off", "local", "on"] {
        let config = compactor::config::StoreConfig {
            url: url.clone(),
            synchronous_commit: setting.into(),
            ..Default::default()
        };
        let conn = compactor::store::postgres::connect(&Options::from_config(&config))
            .expect("a connection");
        let shown = conn
            .first("SHOW synchronous_commit", &[])
            .expect("shown")
            .map(|r| r.get::<String>(0).expect("a text"));
        assert_eq!(shown.as_deref(), Some(setting));
    }
}

/// A database holding the compaction `cmp_old`, taken back to an older
/// schema by the SQL `back`, then opened by this build: its reads and its
/// writer's backend.
fn with_old_compaction(
    url: &str,
    rt: &tokio::runtime::Runtime,
    back: &str,
) -> (PostgresReads, PostgresBackend) {
    let (pg, mut old) = backend(url);
    old.write(&[Record::Compaction(Box::new(compaction("cmp_old")))])
        .expect("write");
    drop((pg, old));
    rt.block_on(support::pg_execute(url, back));
    let (pg, b) = backend(url);
    (PostgresReads::new(pg), b)
}

/// A database of the schema before compactions kept their audit (version
/// 5: the column and the migration that adds it taken away again): opened
/// by this build, it is migrated, its compaction reads back without an
/// audit, and a new one keeps its own.
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn a_database_of_the_schema_before_audits_is_migrated() {
    let Some((_cluster, url, rt)) = database() else {
        return;
    };
    let (reads, mut b) = with_old_compaction(
        &url,
        &rt,
        "ALTER TABLE compactions DROP COLUMN audit;
         DROP TRIGGER compactions_announced ON compactions;
         DROP FUNCTION compactor_announce_compaction();
         ALTER TABLE exchanges DROP COLUMN branched_from;
         ALTER TABLE exchanges DROP COLUMN cache_write_tokens, DROP COLUMN cache_write_1h_tokens;
         ALTER TABLE compactions DROP COLUMN summary_cached_tokens,
             DROP COLUMN summary_cache_write_tokens, DROP COLUMN summary_cache_write_1h_tokens;
         DELETE FROM schema_migrations WHERE version >= 6;",
    );
    let stored = reads.compaction("cmp_old").expect("the old compaction");
    assert_eq!(stored.audit, None);
    assert_eq!(stored.summary.as_deref(), Some("summary"));
    b.write(&[Record::Compaction(Box::new(compaction("cmp_new")))])
        .expect("write");
    let stored = reads.compaction("cmp_new").expect("the new compaction");
    assert_eq!(stored.audit, compaction("cmp_new").audit);
    assert!(stored.audit.is_some());
}

/// A database of the schema before exchanges kept their cache writes
/// (version 9: the columns and their migration taken away again): opened
/// by this build, it is migrated; an exchange recorded before has none,
/// one recorded after keeps what its upstream reported.
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn a_database_of_the_schema_before_cache_writes_is_migrated() {
    let Some((_cluster, url, rt)) = database() else {
        return;
    };
    let (pg, mut old) = backend(&url);
    old.write(&[ex(exchange(1, "c-old", 1))]).expect("write");
    drop((pg, old));
    rt.block_on(support::pg_execute(
        &url,
        "ALTER TABLE exchanges DROP COLUMN cache_write_tokens, DROP COLUMN cache_write_1h_tokens;
         ALTER TABLE compactions DROP COLUMN summary_cached_tokens,
             DROP COLUMN summary_cache_write_tokens, DROP COLUMN summary_cache_write_1h_tokens;
         DELETE FROM schema_migrations WHERE version >= 10;",
    ));
    let (_pg, mut b) = backend(&url);
    let version = rt.block_on(support::pg_rows(
        &url,
        "SELECT max(version) FROM schema_migrations",
    ));
    assert_eq!(version[0].get::<_, i32>(0), 11);
    b.write(&[ex(exchange(2, "c-new", 2))]).expect("write");
    let got = rt.block_on(support::pg_rows(
        &url,
        "SELECT id, cache_write_tokens, cache_write_1h_tokens FROM exchanges ORDER BY id",
    ));
    let got: Vec<(i64, Option<i64>, Option<i64>)> =
        got.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    assert_eq!(got, vec![(1, None, None), (2, Some(15), Some(5))]);
}

/// A database of the schema before compactions kept their summary calls'
/// cache figures (version 10: the columns and their migration taken away
/// again): opened by this build, it is migrated; a compaction recorded
/// before reads back with none (priced uncached), one recorded after with
/// what its summary calls reported.
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn a_database_of_the_schema_before_summary_cache_figures_is_migrated() {
    let Some((_cluster, url, rt)) = database() else {
        return;
    };
    let (reads, mut b) = with_old_compaction(
        &url,
        &rt,
        "ALTER TABLE compactions DROP COLUMN summary_cached_tokens,
             DROP COLUMN summary_cache_write_tokens, DROP COLUMN summary_cache_write_1h_tokens;
         DELETE FROM schema_migrations WHERE version >= 11;",
    );
    let stored = reads.compaction("cmp_old").expect("the old compaction");
    assert_eq!(stored.summary_cache, Default::default());
    assert_eq!(stored.summary_tokens, 50);
    b.write(&[Record::Compaction(Box::new(compaction("cmp_new")))])
        .expect("write");
    let stored = reads.compaction("cmp_new").expect("the new compaction");
    assert_eq!(stored.summary_cache, compaction("cmp_new").summary_cache);
    assert_eq!(stored.summary_cache.read, 30);
}

/// Two replicas committing the same conversations and the same new items
/// at the same moments, each batch listing them in its own order: the
/// rows are written in one order whatever the batch's, so one commit waits
/// for the other instead of the database ending one as a deadlock (which
/// a replica takes for a database down: its requests refused meanwhile).
#[test]
#[ignore = "needs PostgreSQL (scripts/test installs it)"]
fn replicas_committing_the_same_rows_in_other_orders_never_deadlock() {
    let Some((_cluster, url, _rt)) = database() else {
        return;
    };
    // The schema first, once.
    drop(backend(&url));
    let batch = |replica: i64, round: i64| -> Vec<Record> {
        let conversations = if replica == 0 {
            ["c-a", "c-b"]
        } else {
            ["c-b", "c-a"]
        };
        let shared = [0, 1].map(|k| {
            let item = json!({"role": "user", "content": format!("round {round}, item {k}")});
            (compactor::wire::item_hash(&item), item.to_string())
        });
        (0..2)
            .map(|n| {
                let mut e = exchange(
                    1_000_000 * (replica + 1) + 2 * round + n,
                    conversations[n as usize],
                    round,
                );
                e.new_items = if replica == 0 {
                    shared.to_vec()
                } else {
                    shared.iter().rev().cloned().collect()
                };
                ex(e)
            })
            .collect()
    };
    let rounds = 150;
    let start = std::sync::Arc::new(std::sync::Barrier::new(2));
    let writers: Vec<_> = (0..2)
        .map(|replica| {
            let (url, start) = (url.clone(), start.clone());
            std::thread::spawn(move || {
                let (_pg, mut backend) = backend(&url);
                let mut failed = Vec::new();
                for round in 0..rounds {
                    start.wait();
                    if let Err(e) = backend.write(&batch(replica, round)) {
                        failed.push(format!("round {round}: {e}"));
                    }
                }
                failed
            })
        })
        .collect();
    let failed: Vec<String> = writers
        .into_iter()
        .flat_map(|w| w.join().expect("a writer"))
        .collect();
    assert!(
        failed.is_empty(),
        "{} commits failed: {failed:?}",
        failed.len()
    );
}
