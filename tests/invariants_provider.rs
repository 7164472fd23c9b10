//! Property test, through real sockets: a Responses conversation mixing
//! every kind of compaction — the provider's own (the client asks for it
//! with `context_management`; the fake mints its opaque item), the proxy's
//! (threshold, hard limit, the upstream's "too long"), the model's
//! (`compactor_compact`), and the rebuild after the provider's items
//! expire — keeps, in every request that went upstream:
//!
//! - the pairing: every tool call answered, no output without its call;
//! - the planted facts (the task and a constraint of the first turns),
//!   verbatim or in the proxy's summary; before a provider item they are
//!   carried by it (the fake's item stands for what precedes it);
//!
//! and the client gets every answer (200): an expired item's refusal never
//! reaches it.
//! The kinds are counted over all cases: each must have happened.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashSet;

use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::provider::Settings;
use compactor::fake_upstream::{Received, Reply};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use serde_json::{json, Value};
use support::responses::output_text;
use support::*;

const TASK: &str = "step 0: build the planted_module crate";
const PLANTED: &str = "Never edit vendor/zlib_planted.c by hand.";
const SUMMARY: &str = "## TASK\nbuild the modules";
/// The most a turn's tool outputs hold together (the fake counts bytes / 4
/// against its 3,300-token window).
const MAX_BATCH_BYTES: usize = 10_000;

#[derive(Debug, Clone)]
enum Op {
    /// A user turn: parallel tool calls with outputs of these sizes, then a
    /// text answer; `provider`: the requests ask the provider to compact.
    Turn { outputs: Vec<usize>, provider: bool },
    /// A turn in which the model first calls `compactor_compact`.
    Agent { provider: bool },
    /// The provider's items expire.
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![6 => 200usize..1_500, 1 => 5_000usize..9_000];
    prop_oneof![
        8 => (prop::collection::vec(size, 1..3), prop::bool::weighted(0.6))
            // A turn's own batch stays under the window: the newest user
            // message and the pending tool batch are never cut, so a
            // larger one fails with or without the proxy.
            .prop_filter("a batch larger than the window", |(outputs, _)| {
                outputs.iter().sum::<usize>() <= MAX_BATCH_BYTES
            })
            .prop_map(|(outputs, provider)| Op::Turn { outputs, provider }),
        2 => any::<bool>().prop_map(|provider| Op::Agent { provider }),
        1 => Just(Op::Expire),
    ]
}

/// A 4000-token window (the proxy's trigger past 3000, its hard limit
/// 3700); the fake refuses past 3300 what it reads: between the two, the
/// upstream's "too long" compacts.
fn config(c: &mut Config) {
    c.models.push(ModelConfig {
        pattern: "prov*".into(),
        context_window: 4000,
        max_output_tokens: Some(300),
        trigger_ratio: None,
        ..Default::default()
    });
    c.compaction.agent_tool = true;
}

fn answer(output: Vec<Value>) -> Reply {
    Reply::json(
        200,
        json!({"id": compactor::fake_upstream::next_response_id(), "object": "response",
            "status": "completed", "model": "prov", "output": output,
            "usage": {"input_tokens": 1, "output_tokens": 12, "total_tokens": 13}}),
    )
}

fn call(id: &str, name: &str, args: Value) -> Value {
    json!({"type": "function_call", "id": format!("fc_{id}"), "call_id": id, "name": name,
           "arguments": args.to_string(), "status": "completed"})
}

fn text(t: &str) -> Value {
    json!({"type": "message", "id": "msg_t", "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": t, "annotations": []}]})
}

struct Session {
    input: Vec<Value>,
    minted: Vec<String>,
    n: usize,
    requests: usize,
}

impl Session {
    fn user(&mut self, t: String) {
        self.input.push(json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": t}]}));
    }

    async fn send(&mut self, h: &Harness, provider: bool) -> Vec<Value> {
        let mut body = json!({"model": "prov-mini", "instructions": "You are a build agent.",
            "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
            "input": self.input});
        if provider {
            body["context_management"] = json!([{"type": "compaction", "compact_threshold": 1500}]);
        }
        let (status, _, bytes) = post(
            &format!("{}/responses", h.url()),
            "sk-inv-provider-01",
            &body,
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        self.requests += 1;
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        let output = v["output"].as_array().cloned().unwrap_or_default();
        for item in &output {
            if item["type"] == "compaction" {
                self.minted.push(item.to_string());
            }
            assert!(
                item["name"] != "compactor_compact",
                "the client never sees the proxy's tool: {item}"
            );
        }
        self.input.extend(output.iter().cloned());
        output
    }

    /// Answers the calls of `output` (outputs of `sizes`, then 300 bytes)
    /// and sends until a text answer, at most a few rounds.
    async fn finish_turn(
        &mut self,
        h: &Harness,
        mut output: Vec<Value>,
        sizes: &[usize],
        provider: bool,
    ) {
        for _ in 0..3 {
            let calls: Vec<String> = output
                .iter()
                .filter(|i| i["type"] == "function_call")
                .filter_map(|i| i["call_id"].as_str().map(str::to_owned))
                .collect();
            if calls.is_empty() {
                return;
            }
            for (k, id) in calls.iter().enumerate() {
                let size = sizes.get(k).copied().unwrap_or(300);
                self.input
                    .push(json!({"type": "function_call_output", "call_id": id,
                    "output": output_text(self.n, size)}));
            }
            h.fake
                .push(answer(vec![text(&format!("turn {} done", self.n))]));
            output = self.send(h, provider).await;
        }
    }

    async fn run(&mut self, h: &Harness, op: &Op) {
        let n = self.n;
        self.n += 1;
        let words = match n {
            0 => TASK.to_string(),
            1 => format!("step 1: go on\n{PLANTED}"),
            _ => format!("step {n}: build module {n}"),
        };
        match op {
            Op::Expire => {
                h.wait_exchanges(self.requests as i64).await;
                h.fake.expire_provider_items();
                self.n -= 1;
            }
            Op::Turn { outputs, provider } => {
                self.user(words);
                let calls: Vec<Value> = (0..outputs.len())
                    .map(|k| call(&format!("call_{n}_{k}"), "shell", json!({"cmd": "make"})))
                    .collect();
                h.fake.push(answer(calls));
                let out = self.send(h, *provider).await;
                self.finish_turn(h, out, outputs, *provider).await;
            }
            Op::Agent { provider } => {
                self.user(words);
                h.fake.push(answer(vec![call(
                    &format!("call_{n}_compact"),
                    "compactor_compact",
                    json!({"reason": "the logs fill the context", "keep": "the port is 8123"}),
                )]));
                h.fake.push(answer(vec![call(
                    &format!("call_{n}_0"),
                    "shell",
                    json!({"cmd": "ls"}),
                )]));
                let out = self.send(h, *provider).await;
                self.finish_turn(h, out, &[400], *provider).await;
            }
        }
    }
}

/// The pairing of a Responses input: every call answered after it, every
/// output after its call.
fn pairing_holds(input: &[Value]) -> Result<(), String> {
    let mut called = HashSet::new();
    let mut answered = HashSet::new();
    for item in input {
        let id = item["call_id"].as_str().unwrap_or_default().to_string();
        match item["type"].as_str() {
            Some("function_call") => {
                called.insert(id);
            }
            Some("function_call_output") => {
                if !called.contains(&id) {
                    return Err(format!("output without its call: {id}"));
                }
                answered.insert(id);
            }
            _ => {}
        }
    }
    match called.difference(&answered).next() {
        Some(id) => Err(format!("call without its output: {id}")),
        None => Ok(()),
    }
}

#[derive(Debug, Default)]
struct Kinds {
    provider: usize,
    threshold: u64,
    hard: u64,
    reactive: u64,
    agent: u64,
    rebuilt: usize,
}

async fn case(ops: &[Op], kinds: &mut Kinds) {
    let h = Harness::start_with(config).await;
    h.fake.set_provider_compaction(Some(Settings {
        min_threshold: 100,
        responses_window: Some(3300),
    }));
    h.fake.set_summary_reply(Some(SUMMARY.into()));
    let mut s = Session {
        input: Vec::new(),
        minted: Vec::new(),
        n: 0,
        requests: 0,
    };
    // The task and the constraint first, then the generated turns.
    let first = Op::Turn {
        outputs: vec![300],
        provider: false,
    };
    s.run(&h, &first).await;
    s.run(&h, &first).await;
    for op in ops {
        s.run(&h, op).await;
    }
    let sent: Vec<Received> = h
        .fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/responses" && !is_summary_call(r))
        .collect();
    let planted_from = sent
        .iter()
        .position(|r| String::from_utf8_lossy(&r.body).contains(PLANTED))
        .expect("the constraint went upstream");
    for (i, r) in sent.iter().enumerate() {
        let body = r.json();
        let input = body["input"].as_array().cloned().unwrap_or_default();
        if let Err(e) = pairing_holds(&input) {
            panic!("request {i} of {ops:?}: {e}");
        }
        let text = String::from_utf8_lossy(&r.body);
        assert!(text.contains(TASK), "request {i} of {ops:?} lost the task");
        assert!(
            i < planted_from || text.contains(PLANTED),
            "request {i} of {ops:?} lost the constraint: {text}"
        );
    }
    let _ = h.state.store.flush().await;
    let reasons: Vec<String> = column(&*h.sql(), "SELECT reason FROM compactions");
    let m = &h.state.metrics;
    kinds.provider += h.fake.provider_compactions();
    kinds.threshold += m.triggers("threshold");
    kinds.hard += m.triggers("hard");
    kinds.reactive += m.triggers("reactive");
    kinds.agent += m.triggers("agent");
    kinds.rebuilt += reasons.iter().filter(|r| r.starts_with("rebuild:")).count();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_compactions_keep_pairing_and_facts() {
    let mut runner = TestRunner::new(ProptestConfig {
        cases: compactor::fuzz_cases(8),
        ..ProptestConfig::default()
    });
    let strategy = prop::collection::vec(op(), 10..22);
    let mut kinds = Kinds::default();
    for _ in 0..runner.config().cases {
        let ops = strategy.new_tree(&mut runner).expect("a case").current();
        case(&ops, &mut kinds).await;
    }
    eprintln!("compactions over all cases: {kinds:?}");
    assert!(kinds.provider > 0, "{kinds:?}");
    assert!(kinds.threshold + kinds.hard > 0, "{kinds:?}");
    assert!(kinds.reactive > 0, "{kinds:?}");
    assert!(kinds.agent > 0, "{kinds:?}");
    assert!(kinds.rebuilt > 0, "{kinds:?}");
}
