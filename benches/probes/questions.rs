//! The probes: questions a session's history answers, derived from the facts
//! the continuity sessions plant, and their model-free grade.
//!
//! Four kinds, a few questions each per session:
//!
//! - files: which file the session deleted, which config file it created
//!   (graded by the full path in the answer);
//! - failures: the exit code of each failing command whose output stated
//!   one (graded by the first number in the answer, the command's own text
//!   taken out first: `migrate_H9.sh` is not a 9);
//! - next step: what the agent said it would do next (graded by the
//!   fixture path it named);
//! - rules: which directory must never be touched, and the third standing
//!   rule's flag or tool (graded by the path or the word).
//!
//! Answers are normalized first (lower case, quotes, backticks and
//! asterisks as spaces, runs of blanks as one): what counts is the exact
//! expected string within the answer, never a model's opinion of it.

#![allow(dead_code)]

use serde_json::{json, Value};

use super::sessions::{content_text, Kind, Session};

/// What a probe asks about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProbeKind {
    Files,
    Failures,
    NextStep,
    Rules,
}

impl ProbeKind {
    pub const ALL: [ProbeKind; 4] = [
        ProbeKind::Files,
        ProbeKind::Failures,
        ProbeKind::NextStep,
        ProbeKind::Rules,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ProbeKind::Files => "files changed",
            ProbeKind::Failures => "what failed (exit)",
            ProbeKind::NextStep => "next step",
            ProbeKind::Rules => "rule that applies",
        }
    }
}

/// What a right answer holds.
#[derive(Debug, Clone)]
pub enum Expect {
    /// This text, normalized, within the normalized answer.
    Text(String),
    /// This number first among the answer's numbers, once `strip` (the
    /// command asked about) is taken out of it.
    Code { code: i64, strip: String },
}

/// One question and its expected answer.
#[derive(Debug, Clone)]
pub struct Probe {
    pub kind: ProbeKind,
    pub question: String,
    pub expect: Expect,
    /// The answer and its alternatives, for the question asked as a
    /// choice: the expected one first (the question shuffles them).
    pub choices: Vec<String>,
}

impl Probe {
    /// The question asked as a choice among [`Probe::choices`], in an
    /// order that changes with `seed`, and the grammar that holds the answer
    /// to one of them (llama.cpp's GBNF).
    pub fn as_choice(&self, seed: usize) -> (String, String) {
        // Shuffled by a hash of each choice and the seed: where the
        // expected one stands changes with the seed, not with its kind.
        let mut order = self.choices.clone();
        order.sort_by_key(|c| {
            c.bytes()
                .fold(0xcbf2_9ce4_8422_2325_u64 ^ seed as u64, |h, b| {
                    (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
                })
        });
        let question = self
            .question
            .split(" Answer with")
            .next()
            .unwrap_or(&self.question);
        let listed = order.join(", ");
        let grammar = order
            .iter()
            .map(|c| format!("{c:?}"))
            .collect::<Vec<_>>()
            .join(" | ");
        (
            format!("{question} Answer with one of: {listed}."),
            format!("root ::= {grammar}"),
        )
    }

    /// The expected answer as [`Probe::choices`] holds it.
    pub fn choice_right(&self, answer: &str) -> bool {
        self.choices.first().is_some_and(|c| c == answer.trim())
    }

    /// Whether `answer` holds what the session does.
    pub fn right(&self, answer: &str) -> bool {
        match &self.expect {
            Expect::Text(t) => normalize(answer).contains(&normalize(t)),
            Expect::Code { code, strip } => {
                first_number(&answer.replace(strip.as_str(), "")).is_some_and(|n| n == *code)
            }
        }
    }
}

/// Lower case, quotes, backticks and asterisks as blanks, blanks collapsed.
pub fn normalize(s: &str) -> String {
    let spaced: String = s
        .to_lowercase()
        .chars()
        .map(|c| if "`'\"*".contains(c) { ' ' } else { c })
        .collect();
    spaced.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The first word of `s` made of digits only (words split at anything but
/// letters, digits and `_`, so `H9` and `migrate_9` are not numbers).
fn first_number(s: &str) -> Option<i64> {
    s.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .find(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_digit()))
        .and_then(|w| w.parse().ok())
}

/// The probes of a trail session (files, failures, rules) or of one of the
/// six planted-fact sessions (next step), from the facts it planted.
pub fn probes(session: &Session) -> Vec<Probe> {
    let mut out = Vec::new();
    let answer = "Answer with the path only.";
    let files: Vec<&str> = session
        .facts
        .iter()
        .filter(|f| f.kind == Kind::FileChanged)
        .map(|f| f.needle.as_str())
        .collect();
    // The expected answer first, then the others (each once).
    let with = |first: &str, others: &[&str]| {
        let mut v = vec![first.to_string()];
        for o in others {
            if !v.iter().any(|c| c == o) {
                v.push(o.to_string());
            }
        }
        v
    };
    let dir_of = |p: &str| p.rsplit_once('/').map(|(d, _)| format!("{d}/"));
    let dirs: Vec<String> = files.iter().filter_map(|f| dir_of(f)).collect();
    for f in &session.facts {
        let n = &f.needle;
        match f.kind {
            Kind::FileChanged if n.contains("/env_") => out.push(Probe {
                kind: ProbeKind::Files,
                question: format!("Which source file did you delete? {answer}"),
                expect: Expect::Text(n.clone()),
                choices: with(n, &files),
            }),
            Kind::FileChanged if n.starts_with("config/") => out.push(Probe {
                kind: ProbeKind::Files,
                question: format!("Which .toml config file did you create? {answer}"),
                expect: Expect::Text(n.clone()),
                choices: with(n, &files),
            }),
            Kind::Command => {
                let Some((cmd, status)) = n.split_once(" → ") else {
                    continue;
                };
                let Some(code) = first_number(status).filter(|c| *c != 0) else {
                    continue;
                };
                out.push(Probe {
                    kind: ProbeKind::Failures,
                    question: format!(
                        "What exit code did the command `{cmd}` end with? Answer with the number only."
                    ),
                    expect: Expect::Code {
                        code,
                        strip: cmd.to_string(),
                    },
                    choices: with(&code.to_string(), &["0", "1", "2", "127"]),
                });
            }
            Kind::Rule => {
                if let Some(rest) = n.strip_prefix("Never touch ") {
                    let dir = rest.split(',').next().unwrap_or(rest);
                    out.push(Probe {
                        kind: ProbeKind::Rules,
                        question: format!(
                            "Which directory did the user say you must never touch? {answer}"
                        ),
                        expect: Expect::Text(dir.to_string()),
                        choices: with(dir, &dirs.iter().map(String::as_str).collect::<Vec<_>>()),
                    });
                } else if let Some(rest) = n.strip_prefix("Always use the ") {
                    let flag = rest.split(' ').next().unwrap_or(rest);
                    out.push(Probe {
                        kind: ProbeKind::Rules,
                        question: "Which feature flag did the user say new code paths must always use? Answer with the flag's name only.".into(),
                        expect: Expect::Text(flag.to_string()),
                        choices: {
                            let (topic, tag) = flag.split_once('_').unwrap_or((flag, ""));
                            let others = [format!("{topic}_legacy"), format!("{tag}_{topic}"), format!("retry_{tag}")];
                            with(flag, &others.iter().map(String::as_str).collect::<Vec<_>>())
                        },
                    });
                } else if n.starts_with("Use pnpm") {
                    out.push(Probe {
                        kind: ProbeKind::Rules,
                        question: "Which package manager did the user say to use in this repository instead of npm? Answer with its name only.".into(),
                        expect: Expect::Text("pnpm".into()),
                        choices: with("pnpm", &["npm", "yarn", "bun"]),
                    });
                }
            }
            Kind::NextStep => {
                let path = n.trim_start_matches("regenerate ");
                // The session's other paths: the file it edited, the one
                // its error names, and a fixture it never mentioned.
                let topic = path
                    .trim_start_matches("tests/fixtures/")
                    .split('_')
                    .next()
                    .unwrap_or("");
                let edited = session
                    .facts
                    .iter()
                    .find(|f| f.kind == Kind::FilePath)
                    .map_or(String::new(), |f| f.needle.clone());
                let others = [
                    edited,
                    format!("crates/{topic}/src/csv.rs"),
                    format!("tests/fixtures/{topic}_legacy.csv"),
                ];
                out.push(Probe {
                    kind: ProbeKind::NextStep,
                    question: "Which fixture file did you say your next step is to regenerate? Answer with its path only.".into(),
                    expect: Expect::Text(path.to_string()),
                    choices: with(path, &others.iter().map(String::as_str).collect::<Vec<_>>()),
                });
            }
            _ => {}
        }
    }
    out
}

/// A Chat Completions history as text messages, the same way for the full
/// and the compacted one: the model's chat template renders an assistant
/// tool call as an empty turn, so each call is written out in the
/// assistant's text (`[called NAME ARGS]`), and content parts are joined.
pub fn flatten(messages: &[Value]) -> Vec<Value> {
    messages
        .iter()
        .map(|m| {
            let role = m["role"].as_str().unwrap_or("user");
            let mut text = content_text(&m["content"]);
            for c in m["tool_calls"].as_array().into_iter().flatten() {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&format!(
                    "[called {} {}]",
                    c["function"]["name"].as_str().unwrap_or(""),
                    c["function"]["arguments"].as_str().unwrap_or("")
                ));
            }
            match role {
                "tool" => json!({"role": "user", "content": format!("[tool output]\n{text}")}),
                "system" | "assistant" | "user" => json!({"role": role, "content": text}),
                _ => json!({"role": "user", "content": text}),
            }
        })
        .collect()
}
