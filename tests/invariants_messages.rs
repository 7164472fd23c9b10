//! Property tests of the history invariants for Anthropic Messages, over
//! generated agent loops (thinking on, parallel `tool_use` blocks answered
//! by one user message of `tool_result` blocks, mid-conversation `system`
//! messages, a moving `cache_control` breakpoint) compacted 1…N times as the
//! conversation grows. Every thinking block is signed as the API signs it,
//! against everything before it *as the API saw it*, so a request the proxy
//! rewrote is judged as the API would judge it. Each compacted request:
//!
//! - passes the rules the API documents (the fake upstream's
//!   `anthropic::check`): the first message the user's, every `tool_use`
//!   answered first in the very next user message and no `tool_result`
//!   without its call, at most four breakpoints, no thinking block whose
//!   signature does not match its prefix (unless the request lets the API
//!   drop it), the open tool loop's last assistant message opened by its
//!   thinking block;
//! - answers every call it keeps exactly once;
//! - keeps the latest user message and the tail's text as sent;
//! - keeps every system message as sent, in order;
//! - is never larger than the client's request.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;

mod support;

use compactor::compaction::items::{is_summary, latest_user, output_ids};
use compactor::compaction::{rewrite, Compaction, Params};
use compactor::fake_upstream::anthropic;
use compactor::wire::{chain_hashes, item_hash, messages, ItemHash};
use proptest::prelude::*;
use serde_json::{json, Value};
use support::ladder::{count, params};

#[derive(Debug, Clone)]
enum Step {
    /// An assistant text answer (ends the turn's tool loop).
    Text(usize),
    /// Parallel tool calls with output sizes.
    Tools(Vec<usize>),
}

#[derive(Debug, Clone)]
struct Turn {
    user_len: usize,
    /// A `role: "system"` message after the user's (Claude Code sends them).
    system_after: bool,
    steps: Vec<Step>,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (1usize..200).prop_map(Step::Text),
        prop::collection::vec(
            prop_oneof![
                4 => 1usize..300,
                4 => 2_000usize..20_000,
                // A file read larger than the window (64 KB here) alone.
                1 => 70_000usize..120_000,
            ],
            1..4
        )
        .prop_map(Step::Tools),
    ]
}

fn turn() -> impl Strategy<Value = Turn> {
    (
        1usize..400,
        any::<bool>(),
        prop::collection::vec(step(), 0..5),
    )
        .prop_map(|(user_len, system_after, steps)| Turn {
            user_len,
            system_after,
            steps,
        })
}

fn tools() -> Value {
    json!([{"name": "Bash", "description": "run", "input_schema": {"type": "object"},
            "cache_control": {"type": "ephemeral"}}])
}

fn system() -> Value {
    json!([{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}])
}

/// The body of a request with `msgs`, as a client sends it.
fn body(msgs: &[Value]) -> Value {
    json!({"model": "claude-x", "max_tokens": 500, "system": system(), "tools": tools(),
           "thinking": {"type": "adaptive"}, "messages": msgs})
}

/// The conversation as the client holds it, and as the API last saw it
/// (what the model's thinking is bound to).
struct Gen {
    next_id: usize,
}

impl Gen {
    /// An assistant message opened by a thinking block signed against
    /// `seen` (the messages the API received before it).
    fn assistant(&self, seen: &[Value], mut blocks: Vec<Value>) -> Value {
        blocks.insert(
            0,
            json!({"type": "thinking", "thinking": "think", "signature": ""}),
        );
        let mut with = seen.to_vec();
        with.push(json!({"role": "assistant", "content": blocks.clone()}));
        blocks[0]["signature"] = json!(anthropic::signature(&body(&with), seen.len(), 0));
        json!({"role": "assistant", "content": blocks})
    }

    /// Appends a turn; the model's messages are signed against `sent`, the
    /// request the API received for them, extended as the turn goes on.
    fn push_turn(
        &mut self,
        items: &mut Vec<Value>,
        sent: &mut Vec<Value>,
        t: &Turn,
        cut_short: bool,
    ) {
        let n = self.next_id;
        self.next_id += 1;
        let push = |items: &mut Vec<Value>, sent: &mut Vec<Value>, m: Value| {
            items.push(m.clone());
            sent.push(m);
        };
        push(
            items,
            sent,
            json!({"role": "user", "content": format!("user {n}: {}", "u".repeat(t.user_len))}),
        );
        if t.system_after {
            push(
                items,
                sent,
                json!({"role": "system", "content": format!("reminder {n}")}),
            );
        }
        for (si, s) in t.steps.iter().enumerate() {
            let last = si + 1 == t.steps.len();
            match s {
                Step::Text(len) => {
                    let a = self.assistant(
                        sent,
                        vec![json!({"type": "text", "text": "a".repeat(*len)})],
                    );
                    push(items, sent, a);
                }
                Step::Tools(sizes) => {
                    let ids: Vec<String> = (0..sizes.len())
                        .map(|k| format!("toolu_{n}_{si}_{k}"))
                        .collect();
                    let uses = ids
                        .iter()
                        .map(|id| json!({"type": "tool_use", "id": id, "name": "Bash", "input": {"command": "ls"}}))
                        .collect();
                    let a = self.assistant(sent, uses);
                    push(items, sent, a);
                    if cut_short && last {
                        return;
                    }
                    let results: Vec<Value> = ids
                        .iter()
                        .zip(sizes)
                        .map(|(id, size)| json!({"type": "tool_result", "tool_use_id": id,
                                                 "content": format!("output of {id}: {}", "o".repeat(*size))}))
                        .collect();
                    push(items, sent, json!({"role": "user", "content": results}));
                }
            }
        }
    }
}

/// Tokens the compacted items must fit: the window less the answer's room
/// (see [`params`]) and what the system and tools take.
const LIMIT: u64 = 16_000 - 1_000 - 100;

/// One compaction as the engine computes it for this API, escalating until
/// the request fits [`LIMIT`] (a tail over it truncated into the
/// replacement).
fn compact(items: &[Value], base: Option<&Arc<Compaction>>, p: &Params) -> Option<Compaction> {
    support::ladder::compact_within(items, base, p, LIMIT, |r, whole| {
        messages::finish_replacement_after(r, 0, whole, is_summary)
    })
}

/// What goes upstream for `items` with `c` applied, as the proxy sends it:
/// the body, and its headers.
fn sent_request(items: &[Value], c: &Compaction) -> (Value, http::HeaderMap) {
    let mut view = rewrite::rewrite(items, c);
    let outside = messages::breakpoints(&system()) + messages::breakpoints(&tools());
    let drop = messages::finish_view(&mut view, c.replacement.len(), outside);
    let mut b = body(&view);
    let mut headers = http::HeaderMap::new();
    if drop {
        messages::with_block_binding(&mut b);
        headers.insert(
            "anthropic-beta",
            messages::with_binding_beta(None).parse().unwrap(),
        );
    }
    (b, headers)
}

fn without_cache_control(v: &Value) -> Value {
    let mut v = v.clone();
    anthropic::strip_cache_control(&mut v);
    v
}

fn check(items: &[Value], c: &Compaction) -> Result<Vec<Value>, TestCaseError> {
    let (b, headers) = sent_request(items, c);
    if let Some(anthropic_refusal) = anthropic::check(&b, &headers, None) {
        return Err(TestCaseError::fail(format!(
            "the API would refuse it: {anthropic_refusal:?}\n{b}"
        )));
    }
    let sent = b["messages"].as_array().unwrap().clone();
    // Every kept call answered exactly once.
    let mut answers: HashMap<String, usize> = HashMap::new();
    for m in &sent {
        for id in output_ids(m) {
            *answers.entry(id.to_string()).or_default() += 1;
        }
    }
    for m in &sent {
        for id in messages::tool_use_ids(m) {
            if items.iter().any(|i| output_ids(i).contains(&id)) {
                prop_assert_eq!(
                    answers.get(id).copied(),
                    Some(1),
                    "call {} answered once",
                    id
                );
            }
        }
    }
    // The latest user message is there, as sent (breakpoints aside).
    if let Some(u) = latest_user(items) {
        let want = without_cache_control(&items[u]);
        prop_assert!(
            sent.iter().any(|m| without_cache_control(m) == want),
            "latest user message missing"
        );
    }
    // Every system message as the client sent it (breakpoints aside), in
    // its order: none is summarized away.
    let systems = |list: &[Value]| -> Vec<Value> {
        list.iter()
            .filter(|m| m["role"] == "system")
            .map(without_cache_control)
            .collect()
    };
    prop_assert_eq!(systems(&sent), systems(items), "system messages kept");
    // Never larger.
    let before: u64 = items.iter().map(count).sum();
    let after: u64 = sent.iter().map(count).sum();
    prop_assert!(after <= before, "rewritten {after} > original {before}");
    Ok(sent)
}

/// Answers the calls the last message left waiting, if any, with one user
/// message of `tool_result` blocks saying `content`.
fn answer_waiting_calls(items: &mut Vec<Value>, sent: &mut Vec<Value>, content: &str) {
    let Some(last) = items.last() else { return };
    let results: Vec<Value> = messages::tool_use_ids(last)
        .into_iter()
        .map(|id| json!({"type": "tool_result", "tool_use_id": id, "content": content}))
        .collect();
    if results.is_empty() {
        return;
    }
    let m = json!({"role": "user", "content": results});
    items.push(m.clone());
    sent.push(m);
}

/// Plays `rounds` (turns added, the last call of a round maybe left
/// waiting), compacting after each round as the engine would, and checks
/// every compacted request.
fn play(rounds: Vec<(Vec<Turn>, bool)>) -> Result<(), TestCaseError> {
    let p = params();
    let mut g = Gen { next_id: 0 };
    let mut items: Vec<Value> = Vec::new();
    // What the API received last: the model's next blocks are bound to it.
    let mut sent: Vec<Value> = Vec::new();
    let mut base: Option<Arc<Compaction>> = None;
    for (turns, cut_short) in rounds {
        // A call left waiting last round is answered first.
        answer_waiting_calls(&mut items, &mut sent, "late");
        for (k, t) in turns.iter().enumerate() {
            g.push_turn(&mut items, &mut sent, t, cut_short && k + 1 == turns.len());
        }
        let chains = chain_hashes(&items.iter().map(item_hash).collect::<Vec<_>>());
        if let Some(b) = &base {
            let by_chain: HashMap<ItemHash, Arc<Compaction>> =
                [(b.covered_chain, b.clone())].into();
            prop_assert!(
                rewrite::find(&chains, &by_chain).is_some(),
                "extended request no longer matches"
            );
        }
        let fresh = compact(&items, base.as_ref(), &p);
        let made = fresh.is_some();
        let applied = match fresh {
            Some(c) => {
                if let Some(b) = &base {
                    prop_assert!(c.covered_len >= b.covered_len);
                }
                Some(Arc::new(c))
            }
            None => base.clone(),
        };
        if let Some(c) = &applied {
            // The API saw the compacted request: what the model writes
            // next is bound to it.
            sent = check(&items, c)?;
            if made {
                let tokens: u64 = sent.iter().map(count).sum();
                prop_assert!(tokens <= LIMIT, "compacted to {tokens} > {LIMIT}");
            }
        }
        base = applied;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_compacted_messages_request_is_one_the_api_accepts_again_and_again(
        rounds in prop::collection::vec((prop::collection::vec(turn(), 1..5), any::<bool>()), 1..6),
    ) {
        play(rounds)?;
    }
}

/// A case the generator found: a compaction that saved fewer tokens than
/// finishing its replacement for the wire adds (the opening user message,
/// the summary's text block, a breakpoint) must be discarded, not sent
/// larger than the client's request.
#[test]
fn a_compaction_that_finishing_would_make_larger_is_not_applied() {
    let turn = |user_len, system_after, steps| Turn {
        user_len,
        system_after,
        steps,
    };
    let rounds = vec![(
        vec![
            turn(213, false, vec![Step::Text(1), Step::Tools(vec![34])]),
            turn(
                1,
                true,
                vec![
                    Step::Text(24),
                    Step::Text(168),
                    Step::Tools(vec![3744, 19971]),
                ],
            ),
        ],
        false,
    )];
    if let Err(e) = play(rounds) {
        panic!("{e}");
    }
}

/// The generator reaches repeated compaction inside open tool loops with
/// thinking kept, for a fixed long loop.
#[test]
fn a_long_thinking_loop_compacts_repeatedly_and_every_request_is_accepted() {
    let p = params();
    let mut g = Gen { next_id: 0 };
    let mut items = Vec::new();
    let mut sent = Vec::new();
    let mut base: Option<Arc<Compaction>> = None;
    let mut compacted = 0;
    let mut dropped = 0;
    for round in 0..12 {
        let t = Turn {
            user_len: 50,
            system_after: round % 3 == 0,
            steps: vec![Step::Tools(vec![3_000, 400]), Step::Tools(vec![800])],
        };
        g.push_turn(&mut items, &mut sent, &t, true);
        answer_waiting_calls(&mut items, &mut sent, "done");
        if let Some(c) = compact(&items, base.as_ref(), &p) {
            compacted += 1;
            base = Some(Arc::new(c));
        }
        if let Some(c) = &base {
            let (b, _) = sent_request(&items, c);
            dropped += usize::from(b["thinking"].get("block_binding").is_some());
            sent = check(&items, c).unwrap();
        }
    }
    assert!(compacted >= 3, "{compacted}");
    assert!(
        dropped >= 1,
        "a request inside the loop kept its thinking: {dropped}"
    );
}
