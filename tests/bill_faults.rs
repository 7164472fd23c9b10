//! Faults of the bill's machinery, through real sockets: a client that
//! changes its own tools in the middle of a compacted conversation, and a
//! wall clock that moved backwards under the records (a restart reading
//! times from the store that are later than now).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

#[path = "support/agent_loop.rs"]
mod agent_loop;

use std::time::{Duration, Instant};

use agent_loop::{Loop, Shape};
use compactor::fake_upstream::Reply;
use serde_json::{json, Value};
use support::{compactions, filler, small_window, wait_compactions, Harness};

const DAY_MS: i64 = 86_400_000;

/// One chat turn of the conversation the client names `key` (see
/// [`support::chat_turn`]).
async fn chat_turn(
    h: &Harness,
    key: &str,
    history: &mut Vec<Value>,
    text: String,
) -> (String, bool) {
    let url = format!("{}/chat/completions", h.url());
    support::chat_turn(
        &url,
        "sk-clock-back-0001",
        Some(key),
        "tiny-clock",
        history,
        text,
    )
    .await
}

/// Stops the proxy, moves every time its store holds a day ahead (the
/// records of a clock that has since been set back a day), and starts it
/// again on that store.
async fn restart_a_day_behind(h: Harness) -> Harness {
    h.restart_with(|db, _| {
        let conn = rusqlite::Connection::open(db).unwrap();
        conn.execute("UPDATE compactions SET created_ms = created_ms + ?1", [DAY_MS])
            .unwrap();
        for sql in [
            "UPDATE exchanges SET started_ms = started_ms + ?1",
            "UPDATE conversations SET created_ms = created_ms + ?1, last_seen_ms = last_seen_ms + ?1",
        ] {
            assert!(conn.execute(sql, [DAY_MS]).unwrap() > 0, "{sql}");
        }
    })
    .await
}

/// A compaction stored under a clock a day ahead, read back after a
/// restart, is not taken as one stored after every request of the next
/// day: a request of its conversation that it does not cover and that
/// crosses the trigger gets its compaction computed. (Taken as newer than
/// the request, its savings were subtracted from the request's usage, and
/// the conversation went on uncompacted to the hard limit.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_stamped_in_the_future_does_not_hold_the_next_one_back() {
    if support::sqlite_only("edits the harness's SQLite file between two runs") {
        return;
    }
    let h = Harness::start_with(small_window).await;
    let key = "clock-back-compacted";
    let mut history = vec![json!({"role": "system", "content": "Agent."})];
    let mut compacted = false;
    for i in 0..40 {
        (_, compacted) = chat_turn(&h, key, &mut history, filler(i)).await;
        if compacted {
            break;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(compacted, "compacted before the restart");
    let h = restart_a_day_behind(h).await;
    let before = compactions(&h);
    // The client compacted by itself meanwhile: its new history starts
    // from its own summary, which the stored compaction does not cover,
    // and crosses the trigger again.
    let mut history = vec![
        json!({"role": "system", "content": "Agent."}),
        json!({"role": "user", "content": "Summary of the earlier steps: modules 0 to 9 explained."}),
        json!({"role": "assistant", "content": "Going on."}),
    ];
    for i in 0..5 {
        history.push(json!({"role": "user", "content": filler(100 + i)}));
        history.push(
            json!({"role": "assistant", "content": format!("Module {} explained.", 100 + i)}),
        );
    }
    let trigger = 2025;
    h.fake
        .push(Reply::chat("Module 105 next.", trigger + 200, 9));
    let (_, compacted) = chat_turn(&h, key, &mut history, filler(105)).await;
    assert!(!compacted, "the stored compaction does not cover it");
    wait_compactions(&h, before + 1).await;
}

/// A conversation past the cold threshold whose records a restart reads
/// stamped a day ahead waits its idle time as the process measures it:
/// no compaction right away (an idle time taken from the store's stamps
/// would be negative, or, wrapped around, huge), one once it has been
/// idle for most of the cache's lifetime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_conversation_stamped_in_the_future_waits_its_time() {
    if support::sqlite_only("edits the harness's SQLite file between two runs") {
        return;
    }
    const TTL: Duration = Duration::from_secs(2);
    // A 6000-token window: the trigger at 4350, the cold threshold at 1450.
    let h = Harness::start_with(|c| {
        c.models.push(compactor::config::ModelConfig {
            pattern: "loop-*".into(),
            context_window: 6000,
            max_output_tokens: Some(200),
            ..Default::default()
        });
        c.compaction.cache_ttl_secs = TTL.as_secs_f64();
        c.compaction.cold_ratio = 0.25;
    })
    .await;
    let mut l = Loop::new(
        Shape::Chat,
        "loop-clock",
        "sk-clock-idle-000000001",
        5,
        1900,
    );
    assert!((1800..4000).contains(&l.prompt_tokens()));
    l.step(&h, l.shell_reply()).await;
    let h = restart_a_day_behind(h).await;
    assert_eq!(compactions(&h), 0);
    l.round(300);
    l.step(&h, l.shell_reply()).await;
    let answered = Instant::now();
    tokio::time::sleep(TTL / 2).await;
    assert_eq!(compactions(&h), 0, "nothing before it is idle");
    wait_compactions(&h, 1).await;
    assert!(answered.elapsed() >= TTL.mul_f64(0.8));
    let reasons: Vec<String> = support::column(&*h.sql(), "SELECT reason FROM compactions");
    assert!(reasons[0].starts_with("cold:"), "{reasons:?}");
}
