//! The net bill through real sockets: the cache figures an upstream
//! reports recorded per exchange, priced, and shown on the admin API, in
//! `compactor conversations show` and on `/metrics`; an upstream without
//! cache fields and a model without prices; the holdout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use compactor::fake_upstream::Reply;
use serde_json::{json, Value};
use support::{cli, client, compactions, filler, post, small_window, within, Harness};

const KEY: &str = "sk-bill-tests";
const SONNET: &str = "claude-sonnet-4-5-20250929";

async fn metric(h: &Harness, series: &str) -> f64 {
    let text = h.scrape().await;
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

fn close(got: &Value, want: f64) -> bool {
    got.as_f64().is_some_and(|g| (g - want).abs() < 1e-9)
}

/// A Messages request as the anthropic SDKs send it.
async fn messages_call(h: &Harness, body: &Value) -> (u16, http::HeaderMap, Value) {
    let req = client()
        .post(format!("{}/messages", h.url()))
        .header("x-api-key", KEY)
        .header("anthropic-version", "2023-06-01")
        .json(body);
    let resp = within(req.send()).await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = within(resp.bytes()).await.expect("body");
    (
        status,
        headers,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// The same store for the CLI, with `extra` (TOML tables) too.
fn config_file(h: &Harness, extra: &str) -> String {
    let path = h.dir.path().join("proxy.toml");
    let url = match h.state.config.store.url.as_str() {
        "" => String::new(),
        url => format!("url = {url:?}\n"),
    };
    let text = format!(
        "[store]\npath = {:?}\n{url}\n{extra}\n[[models]]\nmatch = \"tiny*\"\ncontext_window = 3000\nmax_output_tokens = 300\n",
        h.db.display().to_string()
    );
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_cache_figures_are_recorded_priced_and_shown() {
    let h = Harness::start().await;
    // Three turns as Anthropic reports them: the first writes its prompt
    // (part of it for an hour), the next read it and write what is new.
    let turns: [(u64, u64, u64, u64); 3] = [
        // (uncached input, read, written, of those for an hour)
        (12, 0, 4_000, 1_000),
        (8, 4_000, 600, 0),
        (5, 4_600, 700, 200),
    ];
    let mut history = vec![];
    let mut id = String::new();
    for (n, (input, read, written, hour)) in turns.into_iter().enumerate() {
        h.fake.push(Reply::json(
            200,
            json!({"id": format!("msg_{n}"), "type": "message", "role": "assistant",
                   "model": SONNET, "content": [{"type": "text", "text": format!("answer {n}")}],
                   "stop_reason": "end_turn",
                   "usage": {"input_tokens": input, "cache_read_input_tokens": read,
                             "cache_creation_input_tokens": written,
                             "cache_creation": {"ephemeral_5m_input_tokens": written - hour,
                                                "ephemeral_1h_input_tokens": hour},
                             "output_tokens": 50}}),
        ));
        history.push(json!({"role": "user", "content": format!("question {n}")}));
        let body = json!({"model": SONNET, "max_tokens": 100, "messages": history});
        let (status, headers, answer) = messages_call(&h, &body).await;
        assert_eq!(status, 200, "{answer}");
        history.push(json!({"role": "assistant", "content": answer["content"]}));
        id = headers["x-compactor-conversation"].to_str().unwrap().into();
    }
    h.wait_exchanges(3).await;
    // Recorded as reported, on either store.
    let rows = h
        .sql()
        .rows(
            "SELECT input_tokens, cached_tokens, cache_write_tokens, cache_write_1h_tokens
             FROM exchanges ORDER BY id",
            &[],
        )
        .unwrap();
    let got: Vec<(i64, i64, i64, i64)> = rows
        .iter()
        .map(|r| {
            (
                r.get(0).unwrap(),
                r.get(1).unwrap(),
                r.get(2).unwrap(),
                r.get(3).unwrap(),
            )
        })
        .collect();
    let want: Vec<(i64, i64, i64, i64)> = turns
        .iter()
        .map(|&(i, r, w, o)| ((i + r + w) as i64, r as i64, w as i64, o as i64))
        .collect();
    assert_eq!(got, want);

    // Sonnet's list prices: input 3, 5-minute write 3.75, 1-hour write 6,
    // read 0.30, output 15 per million tokens. Nothing compacted: the
    // uncompacted bill is the same.
    let paid: f64 = turns
        .iter()
        .map(|&(i, r, w, o)| {
            (i as f64 * 3.0 + r as f64 * 0.3 + (w - o) as f64 * 3.75 + o as f64 * 6.0 + 50.0 * 15.0)
                / 1e6
        })
        .sum();
    let report = h.get_json("/admin/api/savings").await;
    let c = &report["conversations"][0];
    assert_eq!(c["id"], id.as_str());
    assert!(close(&c["cost"], paid), "{c}");
    assert!(close(&c["cost_uncompacted"], paid), "{c}");
    assert!(close(&c["money_saved"], 0.0), "{c}");
    assert_eq!(c["cache_write_tokens"], 5_300);
    assert_eq!(c["cache_write_1h_tokens"], 1_200);
    assert_eq!(c["exchanges_without_cache_fields"], 0);
    assert_eq!(report["total"]["unpriced_models"], json!([]));
    assert_eq!(report["prices_as_of"], compactor::prices::AS_OF);
    let shown = h.get_json(&format!("/admin/api/conversations/{id}")).await;
    assert!(close(&shown["savings"]["cost"], paid), "{shown}");
    assert_eq!(shown["exchanges"][0]["cache_write_1h_tokens"], 1_000);

    // The CLI shows the bill, each exchange's cache figures.
    let config = config_file(&h, "");
    let (code, out, err) = cli(&["conversations", "show", &id, "--config", &config], &[]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("  bill        paid ${paid:.4} (summaries $0.0000), ${paid:.4} without compaction: $0.0000 saved")),
        "{out}"
    );
    assert!(
        out.contains("8,600 read, 5,300 written (1,200 for an hour)"),
        "{out}"
    );
    assert!(out.contains("4,000/600"), "{out}");
    assert!(!out.contains("no cache fields"), "{out}");

    // And /metrics counts the same dollars.
    let paid_metric = metric(&h, "compactor_bill_dollars_total{kind=\"paid\"}").await;
    assert!((paid_metric - paid).abs() < 1e-9, "{paid_metric} {paid}");
    let written = metric(&h, "compactor_input_tokens_total{kind=\"cache_written\"}").await;
    assert_eq!(written, 5_300.0);
    assert_eq!(metric(&h, "compactor_bill_unpriced_calls_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_cache_fields_and_no_price_give_tokens_and_say_so() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let mut history = vec![json!({"role": "user", "content": "hello"})];
    for n in 0..2 {
        // An older server: usage without any cache detail.
        h.fake.push(Reply::json(
            200,
            json!({"id": "c", "object": "chat.completion", "model": "local-model",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 100 + n, "completion_tokens": 5, "total_tokens": 105 + n}}),
        ));
        let (status, _, body) = post(
            &url,
            KEY,
            &json!({"model": "local-model", "messages": history}),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        history.push(json!({"role": "assistant", "content": "hi"}));
        history.push(json!({"role": "user", "content": "more"}));
    }
    h.wait_exchanges(2).await;
    let report = h.get_json("/admin/api/savings").await;
    let t = &report["total"];
    assert_eq!(t["input_tokens"], 201, "{t}");
    assert_eq!(
        (t["cost"].clone(), t["money_saved"].clone()),
        (Value::Null, Value::Null)
    );
    assert_eq!(t["unpriced_models"], json!(["local-model"]));
    assert_eq!(t["exchanges_without_cache_fields"], 2);
    let id = report["conversations"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (code, out, err) = cli(
        &[
            "conversations",
            "show",
            &id,
            "--config",
            &config_file(&h, ""),
        ],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("no dollars: no price known for local-model"),
        "{out}"
    );
    assert!(
        out.contains(
            "the upstream reported no cache fields for 2 of 2 exchanges: taken as uncached"
        ),
        "{out}"
    );
    assert!(!out.contains('$'), "no dollar invented: {out}");
    assert_eq!(metric(&h, "compactor_bill_unpriced_calls_total").await, 2.0);
    assert_eq!(
        metric(&h, "compactor_bill_dollars_total{kind=\"paid\"}").await,
        0.0
    );
}

/// The savings report once every client request the fake answered is
/// recorded.
async fn savings_once_recorded(h: &Harness) -> Value {
    let n = h
        .fake
        .received()
        .iter()
        .filter(|r| !support::is_summary_call(r))
        .count();
    h.wait_exchanges(n as i64).await;
    h.get_json("/admin/api/savings").await
}

/// A priced small-window model whose conversations compact.
fn priced_small_window(c: &mut compactor::config::Config) {
    small_window(c);
    c.models[0].input_price_per_mtok = Some(2.0);
    c.models[0].cached_input_price_per_mtok = Some(0.2);
    c.models[0].output_price_per_mtok = Some(8.0);
}

/// Half the new conversations held out, of the priced small-window model.
async fn holdout_harness() -> Harness {
    Harness::start_with(|c| {
        priced_small_window(c);
        c.compaction.holdout_ratio = 0.5;
    })
    .await
}

/// One chat turn on the priced small-window model (see
/// [`support::chat_turn`]).
async fn chat_turn(url: &str, history: &mut Vec<Value>, text: String) -> (String, bool) {
    support::chat_turn(url, KEY, None, "tiny-bill", history, text).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_conversation_is_billed_against_its_uncompacted_self() {
    let h = Harness::start_with(priced_small_window).await;
    h.fake.simulate_prompt_cache();
    let url = format!("{}/chat/completions", h.url());
    let mut history = vec![json!({"role": "system", "content": "You are a careful agent."})];
    let mut compacted = 0;
    for i in 0..40 {
        compacted += chat_turn(&url, &mut history, filler(i)).await.1 as usize;
        if compacted >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(compacted >= 3, "compacted {compacted} times");
    assert!(compactions(&h) >= 1);
    let report = savings_once_recorded(&h).await;
    let t = &report["total"];
    let (cost, uncompacted, saved) = (
        t["cost"].as_f64().unwrap(),
        t["cost_uncompacted"].as_f64().unwrap(),
        t["money_saved"].as_f64().unwrap(),
    );
    assert!((uncompacted - cost - saved).abs() < 1e-12, "{t}");
    assert!(
        t["cost_summaries"].as_f64().unwrap() > 0.0,
        "the summaries are paid for: {t}"
    );
    assert!(t["exchanges_compacted"].as_u64().unwrap() >= 3, "{t}");
    // The uncompacted requests would have read the whole previous request
    // from the cache: more reads than the compacted ones had.
    assert!(
        t["cache_reuse_uncompacted"].as_f64() > t["cache_reuse"].as_f64(),
        "{t}"
    );
    // (Whether it paid is the figure's to say: with cache reads at a
    // tenth of the input price, compacting a window this small often
    // costs more, and the saving is then negative.)
    // /metrics counts the same bill as it goes.
    let paid = metric(&h, "compactor_bill_dollars_total{kind=\"paid\"}").await;
    let without = metric(&h, "compactor_bill_dollars_total{kind=\"uncompacted\"}").await;
    assert!((paid - cost).abs() < 1e-9, "{paid} {cost}");
    assert!(
        (without - uncompacted).abs() < 1e-9,
        "{without} {uncompacted}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_out_conversations_run_uncompacted_and_are_compared() {
    let h = holdout_harness().await;
    let url = format!("{}/chat/completions", h.url());
    let mut ids = vec![];
    for conv in 0..6 {
        let mut history = vec![json!({"role": "system", "content": format!("Agent {conv}.")})];
        let mut compacted = false;
        let mut id = String::new();
        for i in 0..40 {
            // A compacted one has shown it; a held-out one has gone well
            // past where it would have compacted.
            if compacted || (i >= 24 && h.state.config.held_out(&id)) {
                break;
            }
            let (conversation, turn_compacted) = chat_turn(&url, &mut history, filler(i)).await;
            (id, compacted) = (conversation, compacted || turn_compacted);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Held out or not is the id's; a held-out one never compacts.
        let held = h.state.config.held_out(&id);
        assert!(!(held && compacted), "{id} held out but compacted");
        assert!(held || compacted, "{id} compacts");
        ids.push((id, held));
    }
    let report = savings_once_recorded(&h).await;
    let holdout = &report["holdout"];
    assert_eq!(holdout["ratio"], 0.5);
    let held = ids.iter().filter(|(_, held)| *held).count();
    assert_eq!(
        holdout["held_out"]["conversations"], held as u64,
        "{holdout}"
    );
    assert_eq!(
        holdout["compacted"]["conversations"],
        (ids.len() - held) as u64,
        "{holdout}"
    );
    for (id, held) in &ids {
        let modes: Vec<String> = support::column(
            &*h.sql(),
            &format!("SELECT DISTINCT mode FROM exchanges WHERE conversation_id = '{id}'"),
        );
        let want = if *held { "observe" } else { "auto" };
        assert_eq!(modes, vec![want.to_string()], "{id}");
        let row = report["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id.as_str())
            .unwrap();
        assert_eq!(row["held_out"], *held);
        let shown = h.get_json(&format!("/admin/api/conversations/{id}")).await;
        assert_eq!(shown["held_out"], *held);
    }
    // And the CLI says so.
    if let Some((id, _)) = ids.iter().find(|(_, held)| *held) {
        let (code, out, err) = cli(
            &[
                "conversations",
                "show",
                id,
                "--config",
                &config_file(&h, "[compaction]\nholdout_ratio = 0.5"),
            ],
            &[],
        )
        .await;
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("  holdout     held out of compaction"),
            "{out}"
        );
    }
    let turns = |g: &str| holdout[g]["turns"].as_u64().unwrap();
    assert_eq!(
        turns("held_out") + turns("compacted"),
        report["total"]["exchanges"].as_u64().unwrap()
    );
    for g in ["held_out", "compacted"] {
        if holdout[g]["turns"].as_u64().unwrap() > 0 {
            assert!(
                holdout[g]["cost_per_turn"].as_f64().unwrap() > 0.0,
                "{holdout}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holdout_counts_the_upstreams_too_long_answers_on_both_sides() {
    let h = holdout_harness().await;
    let url = format!("{}/chat/completions", h.url());
    // Conversations of five turns until one of each side is open.
    let mut open: Vec<(String, Vec<Value>)> = vec![];
    let mut requests = 0;
    for conv in 0..24 {
        let mut history = vec![json!({"role": "system", "content": format!("Agent {conv}.")})];
        let mut id = String::new();
        for i in 0..5 {
            id = chat_turn(&url, &mut history, filler(i)).await.0;
            requests += 1;
        }
        let held = h.state.config.held_out(&id);
        if !open.iter().any(|(o, _)| h.state.config.held_out(o) == held) {
            open.push((id, history));
        }
        if open.len() == 2 {
            break;
        }
    }
    assert_eq!(open.len(), 2, "one conversation of each side");
    // The upstream says "too long" to the next request of each.
    for (id, history) in &mut open {
        h.fake.push(Reply::context_length_exceeded());
        history.push(json!({"role": "user", "content": "And now?"}));
        let (status, headers, body) = post(
            &url,
            KEY,
            &json!({"model": "tiny-bill", "messages": history}),
        )
        .await;
        requests += 1;
        if h.state.config.held_out(id) {
            // Held out: nothing compacts, the refusal reaches the client.
            assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
        } else {
            // Compacted on the refusal, and sent again.
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            assert!(headers.contains_key("x-compactor-compacted"));
        }
    }
    // One exchange per client request (a retry is the same exchange).
    h.wait_exchanges(requests).await;
    let report = h.get_json("/admin/api/savings").await;
    let holdout = &report["holdout"];
    for side in ["held_out", "compacted"] {
        assert_eq!(holdout[side]["too_long"], 1, "{side}: {holdout}");
    }
    assert_eq!(holdout["held_out"]["errors"], 1, "{holdout}");
    assert_eq!(holdout["compacted"]["errors"], 0, "{holdout}");
}

/// The fake's simulated Anthropic cache bills each call as the provider
/// would (its own ledger): the proxy's bill of what was paid for the
/// exchanges, compacted ones included, is that ledger at list prices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_was_paid_is_what_a_simulated_anthropic_cache_billed() {
    let h = Harness::start_with(|c| {
        // A small window for the model, its prices from the built-in list.
        c.models.push(compactor::config::ModelConfig {
            pattern: "claude-sonnet-4-5*".into(),
            context_window: 9000,
            max_output_tokens: Some(1024),
            ..Default::default()
        });
    })
    .await;
    h.fake
        .simulate_cache(compactor::fake_upstream::cache::Settings::default());
    let breakpoint = |ttl: Option<&str>| match ttl {
        Some(t) => json!({"type": "ephemeral", "ttl": t}),
        None => json!({"type": "ephemeral"}),
    };
    let system = json!([{"type": "text", "text": "You are a careful agent. ".repeat(200),
                         "cache_control": breakpoint(Some("1h"))}]);
    let mut history: Vec<Value> = vec![];
    let mut compacted = 0;
    for i in 0..30 {
        let text = [filler(i), filler(i + 100), filler(i + 200), filler(i + 300)].join("\n");
        history.push(json!({"role": "user", "content": [{"type": "text", "text": text}]}));
        // The newest message carries the moving breakpoint, as Claude Code's.
        let mut messages = history.clone();
        messages.last_mut().unwrap()["content"][0]["cache_control"] = breakpoint(None);
        let body = json!({"model": SONNET, "max_tokens": 200, "system": system,
                          "messages": messages});
        let (status, headers, answer) = messages_call(&h, &body).await;
        assert_eq!(status, 200, "{answer}");
        history.push(json!({"role": "assistant", "content": answer["content"]}));
        compacted += headers.contains_key("x-compactor-compacted") as usize;
        if compacted >= 2 {
            break;
        }
        // Once, an idle gap past the cache's five minutes.
        if i == 3 {
            h.fake.advance_clock(Duration::from_secs(6 * 60));
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(compacted >= 2, "compacted {compacted} times");
    let ledger = h.fake.take_bill();
    let exchanges: Vec<_> = ledger.iter().filter(|b| !b.summarizer).collect();
    h.wait_exchanges(exchanges.len() as i64).await;
    assert!(
        exchanges.iter().any(|b| b.usage.write_1h > 0)
            && exchanges.iter().any(|b| b.usage.read > 0),
        "the ledger has hour-long writes and reads: {exchanges:?}"
    );
    // Sonnet's list prices per million tokens.
    let price = |b: &&compactor::fake_upstream::cache::Billed| {
        let u = &b.usage;
        (u.input as f64 * 3.0
            + u.read as f64 * 0.3
            + u.write_5m as f64 * 3.75
            + u.write_1h as f64 * 6.0
            + b.output as f64 * 15.0)
            / 1e6
    };
    let billed: f64 = exchanges.iter().map(price).sum();
    let report = h.get_json("/admin/api/savings").await;
    let t = &report["total"];
    let summaries = t["cost_summaries"].as_f64().unwrap();
    let paid = t["cost"].as_f64().unwrap() - summaries;
    assert!(
        (paid - billed).abs() < 1e-9,
        "the proxy's {paid} against the ledger's {billed}: {t}"
    );
    // The summary calls too, their history read from the cache.
    let calls: Vec<_> = ledger.iter().filter(|b| b.summarizer).collect();
    assert!(
        calls.iter().any(|b| b.usage.read > 0),
        "a summary call read the cache: {calls:?}"
    );
    let billed: f64 = calls.iter().map(price).sum();
    assert!(
        (summaries - billed).abs() < 1e-9,
        "the proxy's summaries {summaries} against the ledger's {billed}: {t}"
    );
    let read: u64 = calls.iter().map(|b| b.usage.read).sum();
    assert_eq!(t["summarizer_cached_tokens"], read, "{t}");
    assert_eq!(t["exchanges_without_cache_fields"], 0, "{t}");
    assert!(t["exchanges_compacted"].as_u64().unwrap() >= 2, "{t}");
}

/// A conversation a compaction already applies to stays compacted when
/// the holdout is turned on: held out, its next request would go whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_compacted_before_the_holdout_stays_compacted() {
    if support::sqlite_only("restarts on the harness's SQLite file with another config") {
        return;
    }
    let h = Harness::start_with(priced_small_window).await;
    let url = format!("{}/chat/completions", h.url());
    let mut history = vec![json!({"role": "system", "content": "Agent."})];
    let mut id = String::new();
    for i in 0..40 {
        let compacted;
        (id, compacted) = chat_turn(&url, &mut history, filler(i)).await;
        if compacted {
            break;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(compactions(&h) >= 1, "compacted");
    // The same store, now holding every new conversation out.
    let h = h
        .restart_with(|_, config| config.compaction.holdout_ratio = 1.0)
        .await;
    assert!(h.state.config.held_out(&id));
    let url = format!("{}/chat/completions", h.url());
    let (again, compacted) = chat_turn(&url, &mut history, "And the next step?".into()).await;
    assert_eq!(again, id);
    assert!(compacted, "still compacted");
    // A new conversation is held out.
    let (_, headers, _) = post(
        &url,
        KEY,
        &json!({"model": "tiny-bill", "messages": [{"role": "user", "content": "hello"}]}),
    )
    .await;
    let new = headers["x-compactor-conversation"]
        .to_str()
        .unwrap()
        .to_string();
    h.wait_exchanges(
        h.fake
            .received()
            .iter()
            .filter(|r| !support::is_summary_call(r))
            .count() as i64,
    )
    .await;
    let modes: Vec<String> = support::column(
        &*h.sql(),
        &format!("SELECT mode FROM exchanges WHERE conversation_id = '{new}'"),
    );
    assert_eq!(modes, vec!["observe".to_string()]);
}
