//! Soft and hard triggers, through real sockets: a background compaction
//! computed after an exchange crossed the threshold applies on the next
//! request that extends its covered prefix (it ends at a safe cut), inside
//! a tool loop too, so the conversation restarts small soon after the
//! trigger rather than at the hard limit; the model's own request
//! (`compactor_compact`) waits for the turn boundary, and a request over
//! the hard limit is compacted at once. Once applied, a compaction applies
//! to every later request that extends it. Chat Completions,
//! Responses and Anthropic Messages; the compactions counted by trigger.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

#[path = "support/agent_loop.rs"]
mod agent_loop;

use agent_loop::{Loop, Shape, SHAPES};
use compactor::config::{Config, ModelConfig};
use std::time::Duration;
use support::{compactions, wait_compactions, Harness};

const MODEL: &str = "loop-test";

/// A 6000-token window: the trigger (0.75 of the hard limit) at 4350 reported tokens, the
/// hard limit (less 200 for the answer) at 5800.
fn window(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "loop-*".into(),
        context_window: 6000,
        max_output_tokens: Some(200),
        trigger_ratio: None,
        ..Default::default()
    });
}

fn compacted(headers: &http::HeaderMap) -> bool {
    headers.get("x-compactor-compacted").is_some()
}

/// Sends the loop's request with `reply` scripted; asserts a 200.
async fn step(h: &Harness, l: &Loop, reply: compactor::fake_upstream::Reply) -> http::HeaderMap {
    l.step(h, reply).await
}

/// Whether the upstream got the client's latest request smaller than the
/// client sent it (a compaction replaced a prefix: pruned or summarized).
fn upstream_shorter(h: &Harness, l: &Loop) -> bool {
    l.upstream_shorter(h)
}

/// A history of about 4800 tokens (past the trigger, under the hard limit),
/// in the middle of a tool loop.
fn long_loop(shape: Shape, key: &str) -> Loop {
    Loop::new(shape, MODEL, key, 10, 1900)
}

async fn a_tool_loop_gets_the_threshold_compaction_on_its_next_request(shape: Shape) {
    let h = Harness::start_with(window).await;
    let mut l = long_loop(shape, &format!("sk-trigger-{shape:?}-000001"));
    // The exchange that crosses the threshold: the model calls a tool.
    let headers = step(&h, &l, l.shell_reply()).await;
    assert!(!compacted(&headers));
    wait_compactions(&h, 1).await;
    let m = &h.state.metrics;
    // The next request of the same tool loop (a tool result, no new user
    // message, under the hard limit) gets it: the conversation restarts
    // small now, not when the turn ends or the window is full.
    l.round(300);
    assert!(l.prompt_tokens() < 5800, "{shape:?}: under the hard limit");
    // The compacted requests report what the upstream got: far below the
    // trigger.
    l.reported = Some(2000);
    let headers = step(&h, &l, l.shell_reply()).await;
    assert!(compacted(&headers), "{shape:?}: compacted inside the loop");
    assert!(upstream_shorter(&h, &l));
    // The rest of the loop and the next user message keep it.
    l.round(300);
    let headers = step(&h, &l, l.text_reply("The tests pass now.")).await;
    assert!(compacted(&headers), "{shape:?}: applied ever after");
    assert!(upstream_shorter(&h, &l));
    l.assistant("The tests pass now.");
    l.user("Now add a test for the port setting.");
    let headers = step(&h, &l, l.shell_reply()).await;
    assert!(compacted(&headers), "{shape:?}: and at the boundary");
    assert!(upstream_shorter(&h, &l));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(compactions(&h), 1, "{shape:?}: no second compaction");
    assert_eq!(
        (
            m.triggers("threshold"),
            m.triggers("boundary"),
            m.triggers("hard")
        ),
        (1, 1, 0),
        "{shape:?}"
    );
    let scraped = h.scrape().await;
    for (trigger, n) in [("threshold", 1), ("boundary", 1), ("hard", 0), ("agent", 0)] {
        let line = format!("compactor_compaction_triggers_total{{trigger=\"{trigger}\"}} {n}");
        assert!(scraped.contains(&line), "{line} in\n{scraped}");
    }
    for trigger in ["reactive", "manual", "provider"] {
        assert!(scraped.contains(&format!(
            "compactor_compaction_triggers_total{{trigger=\"{trigger}\"}} 0"
        )));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_a_tool_loop_gets_the_threshold_compaction_on_its_next_request() {
    a_tool_loop_gets_the_threshold_compaction_on_its_next_request(Shape::Chat).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_a_tool_loop_gets_the_threshold_compaction_on_its_next_request() {
    a_tool_loop_gets_the_threshold_compaction_on_its_next_request(Shape::Responses).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_a_tool_loop_gets_the_threshold_compaction_on_its_next_request() {
    a_tool_loop_gets_the_threshold_compaction_on_its_next_request(Shape::Messages).await;
}

/// A request of the loop over the hard limit as the client sent it (a tool
/// printed a lot) gets the waiting compaction at once, inside the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mid_loop_request_over_the_hard_limit_is_compacted_at_once() {
    for (i, shape) in SHAPES.into_iter().enumerate() {
        let h = Harness::start_with(window).await;
        let mut l = long_loop(shape, &format!("sk-hard-{i}-0000000001"));
        step(&h, &l, l.shell_reply()).await;
        wait_compactions(&h, 1).await;
        l.round(10_000);
        assert!(
            l.prompt_tokens() > 5800,
            "{shape:?}: over the hard limit as sent"
        );
        // What the compacted request the upstream gets reports, below the
        // trigger.
        l.reported = Some(4000);
        let headers = step(&h, &l, l.shell_reply()).await;
        assert!(compacted(&headers), "{shape:?}: compacted inside the turn");
        assert!(upstream_shorter(&h, &l));
        // Counted once, as the hard limit's or, when the upstream's last
        // report puts the request under it, as a first application.
        let m = &h.state.metrics;
        assert_eq!(m.triggers("boundary") + m.triggers("hard"), 1, "{shape:?}");
        // Applied once, it stays: the next request of the loop has it too.
        l.round(300);
        let headers = step(&h, &l, l.text_reply("Done.")).await;
        assert!(compacted(&headers), "{shape:?}");
    }
}

/// In manual mode nothing compacts on its own: past the threshold no
/// background compaction is computed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_mode_computes_no_threshold_compaction() {
    let h = Harness::start_with(|c| {
        window(c);
        c.compaction.mode = compactor::config::Mode::Manual;
    })
    .await;
    let mut l = long_loop(Shape::Chat, "sk-manual-0000000001");
    step(&h, &l, l.shell_reply()).await;
    l.round(300);
    l.assistant("ok");
    l.user("go on");
    let headers = step(&h, &l, l.text_reply("Going on.")).await;
    assert!(!compacted(&headers));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(compactions(&h), 0, "no threshold compaction in manual mode");
    assert_eq!(h.state.metrics.triggers("threshold"), 0);
}

/// A compaction after the upstream's "too long" counts as `reactive`, one
/// asked for through the admin API as `manual`; both cut where they must,
/// inside the turn too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reactive_and_manual_compactions_are_counted() {
    let h = Harness::start_with(window).await;
    let mut l = Loop::new(Shape::Chat, MODEL, "sk-counted-00000001", 8, 1900);
    let prompt = l.prompt_tokens();
    h.fake.push(compactor::fake_upstream::Reply::json(
        400,
        serde_json::json!({"error": {"message": format!(
            "This model's maximum context length is {} tokens. However, your messages resulted in {prompt} tokens.",
            prompt * 3 / 5),
            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
    ));
    // The retried, compacted request's usage: under the trigger, so that
    // only the reactive and the manual compaction count.
    l.reported = Some(prompt / 5);
    let headers = step(&h, &l, l.shell_reply()).await;
    assert!(compacted(&headers), "compacted and retried");
    let m = &h.state.metrics;
    assert_eq!((m.triggers("reactive"), m.triggers("manual")), (1, 0));
    let conversation = headers["x-compactor-conversation"]
        .to_str()
        .unwrap()
        .to_string();
    let (status, _) = h
        .post_admin(&format!("/admin/api/conversations/{conversation}/compact"))
        .await;
    assert_eq!(status, 202);
    l.round(300);
    let headers = step(&h, &l, l.text_reply("ok")).await;
    assert!(compacted(&headers));
    assert_eq!((m.triggers("reactive"), m.triggers("manual")), (1, 1));
    assert_eq!(m.triggers("threshold"), 0);
}

/// A compaction that waited while the turn grew can leave a request over
/// the hard limit even once applied: the request is then compacted afresh
/// from it, rather than sent for the upstream to refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_compaction_too_small_for_a_grown_turn_is_compacted_further() {
    let h = Harness::start_with(window).await;
    let mut l = long_loop(Shape::Chat, "sk-grown-0000000001");
    step(&h, &l, l.shell_reply()).await;
    wait_compactions(&h, 1).await;
    // A tool printed more than the compaction frees.
    l.round(20_000);
    l.reported = Some(4000);
    let headers = step(&h, &l, l.shell_reply()).await;
    assert!(compacted(&headers));
    let sent = l.upstream(&h).pop().unwrap();
    assert!(
        sent.body.len() / 4 < 6000,
        "it fits the window: {} bytes",
        sent.body.len()
    );
    assert_eq!(compactions(&h), 2, "compacted afresh from the waiting one");
    assert!(h.state.metrics.triggers("hard") >= 1);
}

/// A Messages client that sizes its next request inside a turn while a
/// compaction waits for its first application is told the compacted size,
/// the size that request then goes with: a client told the uncompacted
/// size might compact on its own first (Claude Code does, near its window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_tokens_counts_a_waiting_compaction_as_applied() {
    let h = Harness::start_with(window).await;
    let mut l = long_loop(Shape::Messages, "sk-trigger-count-000001");
    let headers = step(&h, &l, l.shell_reply()).await;
    assert!(!compacted(&headers));
    wait_compactions(&h, 1).await;
    // Recorded first, then indexed where requests find it: wait for both.
    support::within(async {
        while h.state.compactions.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    l.round(300);
    // Counted: with the waiting compaction.
    let resp = support::within(
        support::client()
            .post(format!("{}/messages/count_tokens", h.url()))
            .header("x-api-key", &l.key)
            .header("anthropic-version", "2023-06-01")
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&l.body()).unwrap())
            .send(),
    )
    .await
    .expect("count_tokens");
    assert_eq!(resp.status(), 200);
    let counted: serde_json::Value =
        serde_json::from_slice(&support::within(resp.bytes()).await.unwrap()).unwrap();
    let upstream = h
        .fake
        .received()
        .into_iter()
        .rfind(|r| r.path == "/v1/messages/count_tokens")
        .expect("counted upstream");
    let size = |items: &[serde_json::Value]| serde_json::to_vec(items).unwrap().len();
    assert!(
        size(&l.items_of(&upstream)) < size(&l.items),
        "counted as the compaction will send it"
    );
    assert!(counted["input_tokens"].as_u64().unwrap() < l.prompt_tokens());
    // Sent: with it, as counted.
    let headers = step(&h, &l, l.shell_reply()).await;
    assert!(compacted(&headers), "sent as counted");
    assert!(upstream_shorter(&h, &l));
}

/// The trigger is a share of the effective limit (the window less the
/// answer's budget), not of the window: with a large answer budget and a
/// high ratio (Claude Code's 32k of a 200k window, `trigger_ratio` 0.9) it
/// still fires in the background before a request stops fitting. Here 0.9
/// of a 6000 window would be 5400, past the 3000 a 3000-token answer
/// leaves; 0.9 of 3000 is 2700.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_trigger_fires_in_the_background_before_the_hard_limit() {
    for (i, shape) in SHAPES.into_iter().enumerate() {
        let h = Harness::start_with(|c| {
            c.compaction.trigger_ratio = 0.9;
            c.models.push(ModelConfig {
                pattern: "loop-*".into(),
                context_window: 6000,
                max_output_tokens: Some(3000),
                ..Default::default()
            });
        })
        .await;
        let mut l = Loop::new(shape, MODEL, &format!("sk-effective-{i}-000001"), 5, 1700);
        // Under the hard limit as sent, past 0.9 of it as reported.
        while l.prompt_tokens() < 2760 {
            l.round(100);
        }
        assert!(l.prompt_tokens() < 3000, "{shape:?}: {}", l.prompt_tokens());
        let headers = step(&h, &l, l.shell_reply()).await;
        assert!(!compacted(&headers), "{shape:?}");
        wait_compactions(&h, 1).await;
        let m = &h.state.metrics;
        // Its trigger is counted just after it joins the index.
        support::within(async {
            while m.triggers("threshold") + m.triggers("hard") == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert_eq!(
            (m.triggers("threshold"), m.triggers("hard")),
            (1, 0),
            "{shape:?}: a background compaction, not a synchronous one"
        );
    }
}

/// A compaction that cannot bring a conversation under its trigger (its
/// system prompt alone is most of the trigger) is not followed by another
/// one at every request: the next requests, grown by little, start no
/// threshold compaction and say so (`compactor_compaction_storms_avoided_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_that_bought_no_room_is_not_repeated_every_request() {
    let h = Harness::start_with(window).await;
    let mut l = Loop::new(Shape::Chat, MODEL, "sk-storm-000000000001", 6, 600);
    // About 4,300 tokens of system prompt: with it, no compaction gets the
    // conversation below the 4,350-token trigger.
    l.items[0] = serde_json::json!({"role": "system", "content":
        "Follow the house style for every file you touch. ".repeat(345)});
    assert!(
        l.prompt_tokens() > 4350 && l.prompt_tokens() < 5800,
        "{}",
        l.prompt_tokens()
    );
    step(&h, &l, l.shell_reply()).await;
    wait_compactions(&h, 1).await;
    let after: i64 = h
        .db()
        .query_row("SELECT tokens_after FROM compactions", [], |r| r.get(0))
        .unwrap();
    assert!(
        after >= 3915,
        "the compaction left {after} tokens, under 0.9 of the trigger: no storm to test"
    );
    // Each next request is the compacted one, grown by a short tool round,
    // and the upstream reports it over the trigger still.
    for i in 0..4u64 {
        l.round(200);
        l.reported = Some(4400 + 60 * i);
        let headers = step(&h, &l, l.shell_reply()).await;
        assert!(compacted(&headers), "the stored compaction applies");
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(compactions(&h), 1, "no compaction after each request");
    assert_eq!(h.state.metrics.storms().storms_avoided(), 4);
    let scraped = h.scrape().await;
    assert!(
        scraped.contains("compactor_compaction_storms_avoided_total 4"),
        "{scraped}"
    );
}

/// A request sent again whole moments after it was answered, once the
/// compaction that answer started is stored (its client lost the answer,
/// or asks for another): the same conversation, with the compaction
/// applied. It became a new conversation when its exchange had been
/// remembered before the repeat came, and stayed in it when it had not.
async fn a_repeat_after_the_compaction_stays_in_its_conversation(shape: Shape) {
    let h = Harness::start_with(window).await;
    let l = long_loop(shape, &format!("sk-repeat-{shape:?}-000001"));
    step(&h, &l, l.shell_reply()).await;
    wait_compactions(&h, 1).await;
    // Recorded before it is indexed: the repeat comes once it is found.
    support::within(async {
        while h.state.compactions.is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let headers = step(&h, &l, l.shell_reply()).await;
    h.wait_exchanges(2).await;
    let seen: Vec<String> = support::column(
        &*h.sql(),
        "SELECT conversation_id FROM exchanges ORDER BY id",
    );
    assert_eq!(seen.len(), 2, "{shape:?}: {seen:?}");
    assert_eq!(seen[0], seen[1], "{shape:?}: the same conversation");
    assert!(compacted(&headers), "{shape:?}: with its compaction");
    assert!(upstream_shorter(&h, &l), "{shape:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_a_repeat_after_the_compaction_stays_in_its_conversation() {
    a_repeat_after_the_compaction_stays_in_its_conversation(Shape::Chat).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_a_repeat_after_the_compaction_stays_in_its_conversation() {
    a_repeat_after_the_compaction_stays_in_its_conversation(Shape::Responses).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_a_repeat_after_the_compaction_stays_in_its_conversation() {
    a_repeat_after_the_compaction_stays_in_its_conversation(Shape::Messages).await;
}
