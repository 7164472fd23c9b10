//! Property tests of the history invariants, over generated agent histories
//! (chat and Responses shapes, parallel tool calls, large outputs) compacted
//! 1…N times as the conversation grows:
//!
//! - every tool output has its call earlier in the list (no call of the
//!   compacted part leaves an output behind);
//! - leading system/developer items are unchanged;
//! - the latest user message is present verbatim;
//! - the tail after the cut is verbatim;
//! - the rewritten request is never larger than the original;
//! - a stored compaction is found again by the request that extends it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

mod support;

use compactor::compaction::fit::{self, FitInput};
use compactor::compaction::items::{call_ids, is_system, latest_user, leading_system, output_id};
use compactor::compaction::{rewrite, summary, Compaction, Rung};
use compactor::wire::{chain_hashes, item_hash, ItemHash};
use proptest::prelude::*;
use serde_json::{json, Value};
use support::ladder::{count, params};

#[derive(Debug, Clone)]
enum Step {
    /// An assistant text answer.
    Text(usize),
    /// Parallel tool calls with output sizes; outputs in this order.
    Tools(Vec<usize>, bool),
    /// A reasoning item (Responses only).
    Reasoning,
}

#[derive(Debug, Clone)]
struct Turn {
    user_len: usize,
    steps: Vec<Step>,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (1usize..200).prop_map(Step::Text),
        (
            prop::collection::vec(prop_oneof![1usize..300, 2_000usize..20_000], 1..4),
            any::<bool>()
        )
            .prop_map(|(sizes, rev)| Step::Tools(sizes, rev)),
        Just(Step::Reasoning),
    ]
}

fn turn() -> impl Strategy<Value = Turn> {
    (1usize..400, prop::collection::vec(step(), 0..5))
        .prop_map(|(user_len, steps)| Turn { user_len, steps })
}

struct Gen {
    responses: bool,
    next_id: usize,
}

impl Gen {
    fn push_turn(&mut self, items: &mut Vec<Value>, t: &Turn, cut_short: bool) {
        let n = self.next_id;
        self.next_id += 1;
        let text = format!("user {n}: {}", "u".repeat(t.user_len));
        items.push(if self.responses {
            json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        } else {
            json!({"role": "user", "content": text})
        });
        for (si, s) in t.steps.iter().enumerate() {
            let last = si + 1 == t.steps.len();
            match s {
                Step::Text(len) => items.push(if self.responses {
                    json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a".repeat(*len)}]})
                } else {
                    json!({"role": "assistant", "content": "a".repeat(*len)})
                }),
                Step::Reasoning if self.responses => {
                    items.push(json!({"type": "reasoning", "summary": [], "encrypted_content": format!("gAAA{n}{si}")}))
                }
                Step::Reasoning => {}
                Step::Tools(sizes, rev) => {
                    let ids: Vec<String> = (0..sizes.len()).map(|k| format!("call_{n}_{si}_{k}")).collect();
                    if self.responses {
                        for (k, id) in ids.iter().enumerate() {
                            items.push(json!({"type": "function_call", "call_id": id, "name": "shell",
                                              "arguments": format!("{{\"cmd\":\"cat f{k}.txt\"}}")}));
                        }
                    } else {
                        let calls: Vec<Value> = ids
                            .iter()
                            .map(|id| json!({"id": id, "type": "function", "function": {"name": "shell", "arguments": "{\"cmd\":\"ls\"}"}}))
                            .collect();
                        items.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
                    }
                    // The very last batch of a cut-short turn may still wait for outputs.
                    if cut_short && last {
                        return;
                    }
                    let mut order: Vec<usize> = (0..sizes.len()).collect();
                    if *rev {
                        order.reverse();
                    }
                    for k in order {
                        let out = format!("output of {}: {}", ids[k], "o".repeat(sizes[k]));
                        items.push(if self.responses {
                            json!({"type": "function_call_output", "call_id": ids[k], "output": out})
                        } else {
                            json!({"role": "tool", "tool_call_id": ids[k], "content": out})
                        });
                    }
                }
            }
        }
    }
}

fn check_invariants(
    original: &[Value],
    sent: &[Value],
    c: &Compaction,
) -> Result<(), TestCaseError> {
    // Every output answers a call earlier in the list.
    let mut seen: HashSet<&str> = HashSet::new();
    for (i, item) in sent.iter().enumerate() {
        if let Some(id) = output_id(item) {
            prop_assert!(seen.contains(id), "output {id} at {i} has no earlier call");
        }
        seen.extend(call_ids(item));
    }
    // A call whose output was sent must have that output after it, exactly
    // once; calls whose outputs were compacted away are gone too.
    let mut outputs: HashMap<&str, usize> = HashMap::new();
    for item in sent {
        if let Some(id) = output_id(item) {
            *outputs.entry(id).or_default() += 1;
        }
    }
    let original_outputs: HashSet<&str> = original.iter().filter_map(output_id).collect();
    for item in sent {
        for id in call_ids(item) {
            if original_outputs.contains(id) {
                prop_assert_eq!(
                    outputs.get(id).copied(),
                    Some(1),
                    "call {} lost or duplicated its output",
                    id
                );
            }
        }
    }
    // Leading system items unchanged.
    let lead = original.iter().take_while(|i| is_system(i)).count();
    prop_assert_eq!(&sent[..lead], &original[..lead]);
    // Latest user message verbatim.
    if let Some(u) = latest_user(original) {
        prop_assert!(sent.contains(&original[u]), "latest user message missing");
    }
    // Tail verbatim.
    prop_assert_eq!(
        &sent[sent.len() - (original.len() - c.covered_len)..],
        &original[c.covered_len..]
    );
    // Never larger.
    let before: u64 = original.iter().map(count).sum();
    let after: u64 = sent.iter().map(count).sum();
    prop_assert!(after <= before, "rewritten {after} > original {before}");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn compaction_keeps_the_invariants_when_applied_again_and_again(
        responses in any::<bool>(),
        systems in 0usize..3,
        rounds in prop::collection::vec((prop::collection::vec(turn(), 1..5), any::<bool>()), 1..6),
    ) {
        let p = params();
        let mut g = Gen { responses, next_id: 0 };
        let mut items: Vec<Value> = (0..systems)
            .map(|i| if responses { json!({"type": "message", "role": "developer", "content": format!("dev {i}")}) }
                     else { json!({"role": "system", "content": format!("sys {i}")}) })
            .collect();
        let mut base: Option<Arc<Compaction>> = None;
        let mut compactions = 0;
        for (turns, cut_short) in rounds {
            // The client resends everything it had, plus what happened since;
            // a turn left waiting for tool outputs is completed next round.
            if items.last().is_some_and(|i| !call_ids(i).is_empty()) {
                let pending: Vec<String> = call_ids(items.last().unwrap()).iter().map(|s| s.to_string()).collect();
                for id in pending {
                    items.push(if responses { json!({"type": "function_call_output", "call_id": id, "output": "late"}) }
                               else { json!({"role": "tool", "tool_call_id": id, "content": "late"}) });
                }
            }
            for (k, t) in turns.iter().enumerate() {
                g.push_turn(&mut items, t, cut_short && k + 1 == turns.len());
            }
            let chains = chain_hashes(&items.iter().map(item_hash).collect::<Vec<_>>());
            // The previous compaction still covers a prefix of the grown history.
            if let Some(b) = &base {
                let by_chain: HashMap<ItemHash, Arc<Compaction>> = [(b.covered_chain, b.clone())].into();
                prop_assert!(rewrite::find(&chains, &by_chain).is_some(), "extended request no longer matches");
            }
            if let Some(c) = support::ladder::compact(&items, base.as_ref(), &p, |r| r) {
                let sent = rewrite::rewrite(&items, &c);
                check_invariants(&items, &sent, &c)?;
                if let Some(b) = &base {
                    prop_assert!(c.covered_len >= b.covered_len, "a later compaction covers at least as much");
                }
                compactions += 1;
                base = Some(Arc::new(c));
            } else if let Some(b) = &base {
                // Nothing new to compact: the previous one still applies cleanly.
                let sent = rewrite::rewrite(&items, b);
                check_invariants(&items, &sent, b)?;
            }
        }
        let _ = compactions;
    }
}

/// A generated history, with `systems` leading items.
fn history(responses: bool, systems: usize, turns: &[Turn], cut_short: bool) -> Vec<Value> {
    let mut g = Gen {
        responses,
        next_id: 0,
    };
    let mut items: Vec<Value> = (0..systems)
        .map(|i| {
            if responses {
                json!({"type": "message", "role": "developer", "content": format!("dev {i}")})
            } else {
                json!({"role": "system", "content": format!("sys {i}")})
            }
        })
        .collect();
    for (k, t) in turns.iter().enumerate() {
        g.push_turn(&mut items, t, cut_short && k + 1 == turns.len());
    }
    items
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Reactive compaction: for any history and any limit at or above its
    /// irreducible core, the escalation's result fits the limit and keeps
    /// every invariant; below the core it says so instead.
    #[test]
    fn a_reactive_compaction_fits_any_limit_at_or_above_the_core(
        responses in any::<bool>(),
        systems in 0usize..3,
        turns in prop::collection::vec(turn(), 1..8),
        cut_short in any::<bool>(),
        share in 0.0f64..=1.0,
        whole in any::<bool>(),
    ) {
        let p = params();
        let items = history(responses, systems, &turns, cut_short);
        let tokens: Vec<u64> = items.iter().map(count).collect();
        let hashes: Vec<ItemHash> = items.iter().map(item_hash).collect();
        let total: u64 = tokens.iter().sum();
        let lead = leading_system(&items);
        let widest = summary::extract_facts(&items[lead..], None);
        let floor = fit::summary_floor(&widest, items.len(), &count);
        let input = |limit| FitInput {
            view: &items,
            tokens: &tokens,
            hashes: &hashes,
            base: None,
            limit,
            whole,
            summary_floor: floor,
            kept: 0,
        };
        let core = match fit::plan(&input(0), &p, &count) {
            Err(e) => e.core,
            Ok(plan) => return Err(TestCaseError::fail(format!("fits 0: {plan:?}"))),
        };
        if core >= total {
            // Too short for a summary to be smaller: the engine's breaker
            // keeps such a request as it is.
            return Ok(());
        }
        let limit = core + ((total - core) as f64 * share) as u64;
        let plan = match fit::plan(&input(limit), &p, &count) {
            Ok(plan) => plan,
            Err(e) => {
                // Only a history with nothing to cut has no core below it all.
                prop_assert!(e.core == total, "{e} (total {total})");
                return Ok(());
            }
        };
        let part = &items[plan.prepared.lead..plan.prepared.cut];
        let facts = summary::extract_facts(part, None);
        let text = fit::fitted_summary(&facts, None, plan.prepared.covered_len, p.summary_max_bytes, plan.summary_budget, &count);
        let a = fit::apply(&input(limit), &plan, &p, text, &count);
        prop_assert!(a.after <= limit, "{} > {limit} ({:?})", a.after, plan.step);
        let chains = chain_hashes(&hashes);
        let c = Compaction {
            id: "cmp_fit".into(),
            tokens_before: total,
            tokens_after: a.after,
            created_ms: 0,
            ..Compaction::made_now(
                "t",
                "c",
                (a.covered_len, chains[a.covered_len - 1]),
                a.replacement.clone(),
                Rung::Fallback,
                "test".into(),
            )
        };
        let sent = rewrite::rewrite(&items, &c);
        prop_assert_eq!(sent.iter().map(count).sum::<u64>(), a.after);
        check_invariants(&items, &sent, &c)?;
    }
}

/// The generator does reach repeated compaction, and every rung: a fixed
/// long session compacted as it grows.
#[test]
fn a_long_session_compacts_repeatedly_through_every_rung() {
    let p = params();
    for responses in [false, true] {
        let mut g = Gen {
            responses,
            next_id: 0,
        };
        let mut items = vec![json!({"role": "system", "content": "sys"})];
        let mut base: Option<Arc<Compaction>> = None;
        let mut rungs = Vec::new();
        for round in 0..12 {
            let big = if round % 3 == 0 { 12_000 } else { 600 };
            let t = Turn {
                user_len: 50,
                steps: vec![Step::Tools(vec![big, 300], round % 2 == 0), Step::Text(80)],
            };
            g.push_turn(&mut items, &t, false);
            g.push_turn(
                &mut items,
                &Turn {
                    user_len: 30,
                    steps: vec![Step::Text(400); 6],
                },
                false,
            );
            if let Some(c) = support::ladder::compact(&items, base.as_ref(), &p, |r| r) {
                let sent = rewrite::rewrite(&items, &c);
                check_invariants(&items, &sent, &c).unwrap();
                rungs.push(c.rung);
                base = Some(Arc::new(c));
            }
        }
        assert!(rungs.len() >= 3, "{rungs:?}");
        assert!(rungs.contains(&Rung::Fallback), "{rungs:?}");
        assert!(
            rungs
                .iter()
                .any(|r| matches!(r, Rung::Truncate | Rung::Prune)),
            "{rungs:?}"
        );
    }
}
