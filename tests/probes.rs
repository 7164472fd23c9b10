//! The probes bench's questions and grade (`cargo bench --bench probes`
//! asks them of a real llama-server): every question is one the session's
//! own history answers, and the grade takes the exact expected string,
//! never anything near it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../benches/continuity/sessions.rs"]
mod sessions;

#[path = "../benches/probes/questions.rs"]
mod questions;

use questions::{flatten, probes, Expect, Probe, ProbeKind};
use serde_json::json;

/// The flattened history's text, as the model reads it.
fn text(messages: &[serde_json::Value]) -> String {
    flatten(messages)
        .iter()
        .filter_map(|m| m["content"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_question_is_answered_by_its_sessions_history() {
    let trail = sessions::trail::trail_sessions(0.1);
    let planted = sessions::sessions(0.1);
    for s in trail.iter().chain(&planted) {
        let list = probes(s);
        let history = text(&s.messages);
        for p in &list {
            match &p.expect {
                Expect::Text(t) => assert!(history.contains(t.as_str()), "{}: {t}", s.name),
                Expect::Code { code, strip } => {
                    assert!(history.contains(strip.as_str()), "{}: {strip}", s.name);
                    assert!(history.contains(&code.to_string()), "{}: {code}", s.name);
                }
            }
            let expected = &p.choices[0];
            assert!(p.choice_right(expected), "{}: {expected}", s.name);
            let mut distinct = p.choices.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(
                distinct.len(),
                p.choices.len(),
                "{}: {:?}",
                s.name,
                p.choices
            );
            assert!(p.choices.len() >= 3, "{}: {:?}", s.name, p.choices);
        }
        let count = |k: ProbeKind| list.iter().filter(|p| p.kind == k).count();
        if s.name.starts_with("trail") {
            assert_eq!(count(ProbeKind::Files), 2, "{}", s.name);
            assert_eq!(count(ProbeKind::Rules), 2, "{}", s.name);
        } else {
            assert_eq!(count(ProbeKind::NextStep), 1, "{}", s.name);
        }
    }
    // Failures are asked where the output stated an exit code: in every
    // vocabulary but aider's (whose runs the user reports without one).
    let failures = |s: &sessions::Session| {
        probes(s)
            .iter()
            .filter(|p| p.kind == ProbeKind::Failures)
            .count()
    };
    assert!(trail
        .iter()
        .filter(|s| !s.name.contains("aider"))
        .all(|s| failures(s) >= 2));
}

#[test]
fn the_grade_takes_the_exact_answer_only() {
    let code = Probe {
        kind: ProbeKind::Failures,
        question: "What exit code did the command `./scripts/migrate_H9.sh --dry-run` end with? Answer with the number only.".into(),
        expect: Expect::Code {
            code: 127,
            strip: "./scripts/migrate_H9.sh --dry-run".into(),
        },
        choices: vec!["127".into(), "0".into(), "1".into(), "2".into()],
    };
    assert!(code.right("`./scripts/migrate_H9.sh --dry-run` exited with 127."));
    assert!(code.right("127\n\n127"));
    assert!(!code.right("It exited with code 1 (127 lines)"));
    assert!(!code.right("exit 1127"));
    assert!(!code.right(""));
    let path = Probe {
        kind: ProbeKind::Files,
        question: "Which source file did you delete? Answer with the path only.".into(),
        expect: Expect::Text("config/payouts_P1.toml".into()),
        choices: vec!["config/payouts_P1.toml".into(), "docs/a.md".into()],
    };
    assert!(path.right("**`config/payouts_P1.toml`**"));
    assert!(path.right("The file is CONFIG/payouts_p1.toml."));
    assert!(!path.right("config/payouts.toml"));
    assert!(path.choice_right(" config/payouts_P1.toml\n"));
    assert!(!path.choice_right("docs/a.md"));
}

#[test]
fn a_choice_lists_every_alternative_and_holds_the_answer_to_them() {
    let p = Probe {
        kind: ProbeKind::Rules,
        question: "Which directory must you never touch? Answer with the path only.".into(),
        expect: Expect::Text("infra/terraform_P1/".into()),
        choices: vec![
            "infra/terraform_P1/".into(),
            "config/".into(),
            "docs/".into(),
        ],
    };
    let mut firsts = std::collections::BTreeSet::new();
    for seed in 0..8 {
        let (question, grammar) = p.as_choice(seed);
        assert!(question.starts_with("Which directory must you never touch? Answer with one of: "));
        for c in &p.choices {
            assert!(question.contains(c.as_str()), "{question}");
            assert!(grammar.contains(&format!("{c:?}")), "{grammar}");
        }
        assert!(grammar.starts_with("root ::= "), "{grammar}");
        let listed = question.rsplit(": ").next().unwrap_or("");
        firsts.insert(listed.split(", ").next().unwrap_or("").to_string());
    }
    // The order changes with the seed: the expected answer is not always first.
    assert!(firsts.len() > 1, "{firsts:?}");
}

#[test]
fn a_tool_call_is_written_out_for_the_model() {
    let flat = flatten(&[
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "bash", "arguments": "{\"command\":\"rm src/env_P1.rs\"}"}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "<returncode>0</returncode>"}),
        json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
    ]);
    assert_eq!(
        flat[0],
        json!({"role": "assistant", "content": "[called bash {\"command\":\"rm src/env_P1.rs\"}]"})
    );
    assert_eq!(
        flat[1],
        json!({"role": "user", "content": "[tool output]\n<returncode>0</returncode>"})
    );
    assert_eq!(flat[2], json!({"role": "user", "content": "a\nb"}));
}
