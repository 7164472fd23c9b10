//! Compaction when the cache is cold anyway, through real sockets: a
//! conversation past the cold threshold (`compaction.cold_ratio`) and under
//! the trigger that stays idle for most of its cache's lifetime
//! (`compaction.cache_ttl_secs`) gets a compaction computed in the
//! background; it applies when the conversation comes back after the
//! cache expired, and not when it comes back sooner (its prefix is still a
//! cache read then). Chat Completions and Anthropic Messages.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

#[path = "support/agent_loop.rs"]
mod agent_loop;

use agent_loop::{Loop, Shape};
use compactor::config::{Config, ModelConfig};
use std::time::{Duration, Instant};
use support::{compactions, wait_compactions, Harness};

const MODEL: &str = "loop-test";

/// The cache's lifetime as the proxy is told it: the compaction is
/// computed 80% into it.
const TTL: Duration = Duration::from_secs(2);

/// A 6000-token window: the hard limit (less 200 for the answer) at 5800,
/// the trigger (0.75 of it) at 4350, the cold threshold (0.25) at 1450.
fn settings(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "loop-*".into(),
        context_window: 6000,
        max_output_tokens: Some(200),
        trigger_ratio: None,
        ..Default::default()
    });
    c.compaction.cache_ttl_secs = TTL.as_secs_f64();
    c.compaction.cold_ratio = 0.25;
}

fn compacted(headers: &http::HeaderMap) -> bool {
    headers.get("x-compactor-compacted").is_some()
}

/// Sends the loop's request with the shell call scripted; asserts a 200.
async fn step(h: &Harness, l: &Loop) -> http::HeaderMap {
    l.step(h, l.shell_reply()).await
}

fn upstream_shorter(h: &Harness, l: &Loop) -> bool {
    l.upstream_shorter(h)
}

/// Between the cold threshold and the trigger, in a tool loop.
fn mid_loop(shape: Shape, key: &str) -> Loop {
    let l = Loop::new(shape, MODEL, key, 5, 1900);
    let tokens = l.prompt_tokens();
    assert!((1800..4000).contains(&tokens), "{shape:?}: {tokens} tokens");
    l
}

async fn back_after_the_cache_expired_gets_the_compaction(shape: Shape) {
    let h = Harness::start_with(settings).await;
    let mut l = mid_loop(shape, &format!("sk-idle-{shape:?}-0000000001"));
    let headers = step(&h, &l).await;
    let answered = Instant::now();
    assert!(!compacted(&headers));
    // Under the trigger: nothing is computed while the conversation goes on.
    tokio::time::sleep(TTL / 2).await;
    assert_eq!(compactions(&h), 0, "{shape:?}: none before it is idle");
    // Idle for most of the lifetime: computed in the background.
    wait_compactions(&h, 1).await;
    assert!(answered.elapsed() >= TTL.mul_f64(0.8), "{shape:?}");
    // Back after the cache expired: the compaction applies.
    tokio::time::sleep(TTL + Duration::from_millis(300)).await;
    l.round(300);
    let headers = step(&h, &l).await;
    assert!(
        compacted(&headers),
        "{shape:?}: applied on the cold request"
    );
    assert!(upstream_shorter(&h, &l), "{shape:?}");
    let m = &h.state.metrics;
    assert_eq!(
        (m.triggers("cold"), m.triggers("boundary")),
        (1, 1),
        "{shape:?}"
    );
    // And to every later request that extends it.
    l.round(300);
    let headers = step(&h, &l).await;
    assert!(compacted(&headers), "{shape:?}: applied ever after");
    let scraped = h.scrape().await;
    let line = "compactor_compaction_triggers_total{trigger=\"cold\"} 1";
    assert!(scraped.contains(line), "{line} in\n{scraped}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_after_the_cache_expired_the_compaction_applies() {
    for shape in [Shape::Chat, Shape::Messages] {
        back_after_the_cache_expired_gets_the_compaction(shape).await;
    }
}

/// Back before the cache expired, the conversation goes on as it was: its
/// prefix is a cache read, and a compaction now would write a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_while_the_cache_is_warm_goes_on_uncompacted() {
    let h = Harness::start_with(settings).await;
    let mut l = mid_loop(Shape::Messages, "sk-idle-warm-0000000001");
    step(&h, &l).await;
    let answered = Instant::now();
    wait_compactions(&h, 1).await;
    assert!(
        answered.elapsed() < TTL,
        "the test came back too late to check a warm cache"
    );
    l.round(300);
    let headers = step(&h, &l).await;
    assert!(!compacted(&headers), "a warm cache is not rewritten");
    assert!(!upstream_shorter(&h, &l));
    assert_eq!(h.state.metrics.triggers("boundary"), 0);
}

/// A conversation under the cold threshold, or with the setting at 0, gets
/// nothing however long it is idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_cold_threshold_or_switched_off_nothing_is_computed() {
    let h = Harness::start_with(settings).await;
    let small = Loop::new(Shape::Chat, MODEL, "sk-idle-small-000000001", 1, 400);
    assert!(small.prompt_tokens() < 1450);
    step(&h, &small).await;
    let off = Harness::start_with(|c| {
        settings(c);
        c.compaction.cache_ttl_secs = 0.0;
    })
    .await;
    let l = mid_loop(Shape::Chat, "sk-idle-off-00000000001");
    step(&off, &l).await;
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(compactions(&h), 0, "under the cold threshold");
    assert_eq!(compactions(&off), 0, "switched off");
}

/// A Messages conversation whose breakpoints ask for an hour keeps its
/// cache that long: a pause past the setting's lifetime computes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breakpoints_that_ask_for_an_hour_keep_it_an_hour() {
    let h = Harness::start_with(settings).await;
    let mut hour = mid_loop(Shape::Messages, "sk-idle-hour-0000000001");
    let last = hour.items.last_mut().expect("a message");
    last["content"][0]["cache_control"] = serde_json::json!({"type": "ephemeral", "ttl": "1h"});
    step(&h, &hour).await;
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(
        compactions(&h),
        0,
        "an hour's cache is not cold after {TTL:?}"
    );
    // The same conversation with a 5-minute breakpoint gets one.
    let five = mid_loop(Shape::Messages, "sk-idle-five-0000000001");
    step(&h, &five).await;
    wait_compactions(&h, 1).await;
}

/// The setting is checked: a negative lifetime, a cold threshold past the
/// trigger.
#[test]
fn bad_settings_are_refused() {
    for bad in [
        "[compaction]\ncache_ttl_secs = -1\n",
        "[compaction]\ncold_ratio = 0.9\ntrigger_ratio = 0.75\n",
        "[compaction]\ncold_ratio = 0\n",
    ] {
        assert!(Config::from_toml(bad).is_err(), "{bad}");
    }
    let c = Config::from_toml("[compaction]\ncache_ttl_secs = 3600\n").expect("valid");
    assert_eq!(c.compaction.cache_ttl_secs, 3600.0);
}
