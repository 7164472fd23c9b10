//! Probes: does a model still answer what the session holds, from the
//! compacted history as from the full one?
//!
//! `COMPACTOR_LLAMA_URL=http://127.0.0.1:PORT/v1 cargo bench --bench probes`
//! against a real llama-server (`scripts/llama-server.sh start PORT 8192`:
//! the full histories take up to ~6,000 of its tokens). Skipped, saying so,
//! when the variable is unset or the server does not answer.
//!
//! Part 1, probes. The continuity bench's trail sessions (files, commands
//! with their exit status, standing rules, in eight agents' vocabularies)
//! and its planted-fact sessions (the next step), made small, go through
//! the real proxy against the fake upstream, which records the compacted
//! request, with a summarizer that writes nothing useful (so what survives
//! is what the proxy keeps): at a window of the session's own size and at
//! 4,000 tokens, each row named by the rung the proxy used. Then the
//! llama-server answers a few questions per kind (see
//! `probes/questions.rs`) from that compacted history and from the full
//! one, each over several sampling seeds, asked open and as a choice among
//! the session's own alternatives (held to them by a grammar). The grade
//! is deterministic: the expected path, exit code, flag or word within the
//! answer, or equal to it. Printed per kind and rung: right answers from
//! the full history, from the compacted one, their ratio, and its spread
//! over the seeds.
//!
//! Part 2, the summary call's cache (see `probes/summary_cache.rs`):
//! latency and `cached_tokens` of the summary call that repeats the
//! request the upstream last saw, against today's transcript calls (forced
//! by a `summarizer_model` other than the conversation's, which cannot
//! share its cache; llama-server ignores the name). The cached call is then
//! sent once more with llama.cpp's `cache_prompt: false`: what reading its
//! history would cost without the cache.
//!
//! Env: `PROBE_SEEDS` (default 3), `PROBE_TEMPERATURE` (0.7),
//! `PROBE_TRAIL` / `PROBE_NEXT` (how many trail / planted-fact sessions,
//! default 4 / 2), `PROBE_SCALE` (their filler volume, 0.1),
//! `PROBE_PART` (`probes`, `cache` or both when unset), `PROBE_VERBOSE=1`
//! (every question and answer), `PROBE_CACHE_RUNS` (compactions of each
//! form, 3) and `PROBE_CACHE_SCALE` (the cache part's session, 0.15).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "continuity/sessions.rs"]
mod sessions;

#[path = "probes/questions.rs"]
mod questions;

#[path = "probes/summary_cache.rs"]
mod summary_cache;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use compactor::fake_upstream::FakeUpstream;
use questions::{flatten, probes, Probe, ProbeKind};
use serde_json::{json, Value};
use sessions::{RunConfig, Session};

/// One llama-server call's bound (a full history is a few thousand tokens
/// at a few hundred a second on two shared cores).
pub const CALL: Duration = Duration::from_secs(300);

/// Tokens a probe's answer may take.
const ANSWER_TOKENS: u64 = 48;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The llama-server's base URL (with `/v1`) when it answers its health
/// check; why not otherwise.
async fn reachable() -> Result<String, String> {
    let url = std::env::var("COMPACTOR_LLAMA_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .ok_or("COMPACTOR_LLAMA_URL is unset")?;
    let url = url.trim_end_matches('/').to_string();
    let health = format!("{}/health", url.trim_end_matches("/v1"));
    match reqwest::Client::new()
        .get(&health)
        .timeout(Duration::from_secs(5))
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => Ok(url),
        Ok(r) => Err(format!("{health} answered {}", r.status())),
        Err(e) => Err(format!("{health}: {e}")),
    }
}

/// One chat call to the llama-server; its answer's JSON.
pub async fn chat(client: &reqwest::Client, url: &str, body: &Value) -> Result<Value, String> {
    let resp = client
        .post(format!("{url}/chat/completions"))
        .json(body)
        .timeout(CALL)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    let v: Value = resp.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {v}"));
    }
    Ok(v)
}

/// The proxy's settings the probes compact each session at: (label, the
/// settings for a session of `tokens`). A window of the session's own size
/// with a shallow target (the cheap rungs, where they reach it) and a
/// 4,000-token window (the summary rung). Rows are named by the rung the
/// proxy used; a setting that gives the same compacted history as one
/// before it is asked once.
fn settings(tokens: u64) -> [(&'static str, RunConfig); 2] {
    [
        (
            "session's size",
            RunConfig {
                window: tokens,
                max_output: tokens / 8,
                tool_output_max_bytes: 512,
                target_ratio: Some(0.6),
            },
        ),
        (
            "4,000 window",
            RunConfig {
                window: 4_000,
                max_output: 500,
                tool_output_max_bytes: 8_192,
                target_ratio: None,
            },
        ),
    ]
}

/// How a question is put: open (free text, graded by the expected string
/// within it) or as a choice among the session's own alternatives (the
/// answer held to one of them by a grammar; graded by equality).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Mode {
    Open,
    Choice,
}

impl Mode {
    const ALL: [Mode; 2] = [Mode::Open, Mode::Choice];

    fn name(self) -> &'static str {
        match self {
            Mode::Open => "open",
            Mode::Choice => "choice",
        }
    }
}

/// Right answers per (row, mode, kind) and seed: (right, asked). A row is
/// the rung the proxy used, or `full@` it: the full histories of the
/// same sessions.
type Scores = BTreeMap<(String, Mode, ProbeKind), Vec<(usize, usize)>>;

/// One answer: how it was asked, its kind, seed, and whether it was right.
type Answer = (Mode, ProbeKind, usize, bool);

fn score(scores: &mut Scores, row: &str, answers: &[Answer]) {
    for &(mode, kind, seed, right) in answers {
        let per_seed = scores.entry((row.to_string(), mode, kind)).or_default();
        if per_seed.len() <= seed {
            per_seed.resize(seed + 1, (0, 0));
        }
        per_seed[seed].0 += right as usize;
        per_seed[seed].1 += 1;
    }
}

/// Asks every probe of one history, every seed, in that order so the
/// llama-server's cache keeps the history between questions.
struct Asker<'a> {
    client: reqwest::Client,
    url: &'a str,
    seeds: usize,
    temperature: f64,
    verbose: bool,
    /// Prompt tokens the llama-server counted for the last history asked.
    prompt_tokens: u64,
    failed: usize,
    /// Choices offered and asked, for the chance level: (Σ 1/choices, asked).
    chance: (f64, usize),
}

impl Asker<'_> {
    async fn ask(&mut self, label: &str, history: &[Value], list: &[Probe]) -> Vec<Answer> {
        let mut answers = Vec::new();
        for p in list {
            for seed in 0..self.seeds {
                for mode in Mode::ALL {
                    let mut body = json!({
                        "model": "probe",
                        "max_tokens": ANSWER_TOKENS,
                        "temperature": self.temperature,
                        "seed": seed as u64 + 1,
                        "stream": false,
                    });
                    let question = match mode {
                        Mode::Open => p.question.clone(),
                        Mode::Choice => {
                            let (q, grammar) = p.as_choice(seed);
                            body["grammar"] = json!(grammar);
                            self.chance.0 += 1.0 / p.choices.len().max(1) as f64;
                            self.chance.1 += 1;
                            q
                        }
                    };
                    let mut messages = history.to_vec();
                    messages.push(json!({"role": "user", "content": question}));
                    body["messages"] = Value::Array(messages);
                    let answer = match chat(&self.client, self.url, &body).await {
                        Ok(v) => {
                            if let Some(n) =
                                v.pointer("/usage/prompt_tokens").and_then(Value::as_u64)
                            {
                                self.prompt_tokens = n;
                            }
                            v.pointer("/choices/0/message/content")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string()
                        }
                        Err(e) => {
                            self.failed += 1;
                            eprintln!("  probe call failed ({label}): {e}");
                            String::new()
                        }
                    };
                    let right = match mode {
                        Mode::Open => p.right(&answer),
                        Mode::Choice => p.choice_right(&answer),
                    };
                    if self.verbose {
                        eprintln!(
                            "  [{label}, {}, seed {}] {} {question:?} → {answer:?}",
                            mode.name(),
                            seed + 1,
                            if right { "RIGHT" } else { "wrong" },
                        );
                    }
                    answers.push((mode, p.kind, seed, right));
                }
            }
        }
        answers
    }
}

/// The compacted history of `session` at `cfg`: the messages the proxy
/// sent upstream, and the rung it used.
async fn compacted(
    session: &Session,
    cfg: RunConfig,
    variant: usize,
) -> (Option<String>, Vec<Value>) {
    let fake = FakeUpstream::start().await.expect("fake upstream");
    fake.set_summary_reply(Some(sessions::useless_summary(variant)));
    let (g, sent) = sessions::run_sent(session, fake.url(), &fake, cfg).await;
    let messages = serde_json::from_str::<Value>(&sent)
        .ok()
        .and_then(|v| v["messages"].as_array().cloned())
        .unwrap_or_default();
    (g.rung, messages)
}

async fn probe_part(url: &str) {
    let scale: f64 = env_or("PROBE_SCALE", 0.1);
    let list: Vec<Session> = sessions::trail::trail_sessions(scale)
        .into_iter()
        .take(env_or("PROBE_TRAIL", 4))
        .chain(
            sessions::sessions(scale)
                .into_iter()
                .take(env_or("PROBE_NEXT", 2)),
        )
        .collect();
    let mut asker = Asker {
        client: reqwest::Client::new(),
        url,
        seeds: env_or("PROBE_SEEDS", 3usize).max(1),
        temperature: env_or("PROBE_TEMPERATURE", 0.7),
        verbose: std::env::var_os("PROBE_VERBOSE").is_some(),
        prompt_tokens: 0,
        failed: 0,
        chance: (0.0, 0),
    };
    println!(
        "probes: {} sessions (scale {scale}), {} seeds at temperature {}, answers of up to {ANSWER_TOKENS} tokens",
        list.len(),
        asker.seeds,
        asker.temperature
    );
    let mut scores = Scores::new();
    let t = Instant::now();
    for (i, s) in list.iter().enumerate() {
        let probes = probes(s);
        let tokens = sessions::session_tokens(s);
        let ts = Instant::now();
        let full = asker.ask("full", &flatten(&s.messages), &probes).await;
        let full_tokens = asker.prompt_tokens;
        let mut asked: Vec<Vec<Value>> = Vec::new();
        let mut shown = Vec::new();
        for (label, cfg) in settings(tokens) {
            let (rung, messages) = compacted(s, cfg, i).await;
            let Some(rung) = rung else {
                println!("  {}: not compacted at the {label}", s.name);
                continue;
            };
            let history = flatten(&messages);
            if asked.contains(&history) {
                shown.push(format!("{label}: the same"));
                continue;
            }
            let answers = asker.ask(&rung, &history, &probes).await;
            score(&mut scores, &rung, &answers);
            score(&mut scores, &format!("full@{rung}"), &full);
            shown.push(format!("{label}: {rung}, {} tokens", asker.prompt_tokens));
            asked.push(history);
        }
        println!(
            "  {}: {} probes; {tokens} tokens by the proxy's count, {full_tokens} by the model's; {} ({:.0}s)",
            s.name,
            probes.len(),
            shown.join("; "),
            ts.elapsed().as_secs_f64()
        );
    }
    print_scores(&scores, asker.seeds);
    println!(
        "(chance level of the choices: {:.0}%; {:.0}s, {} calls failed)",
        100.0 * asker.chance.0 / asker.chance.1.max(1) as f64,
        t.elapsed().as_secs_f64(),
        asker.failed
    );
}

/// Share `k/n` as a percentage.
fn pct(k: usize, n: usize) -> f64 {
    100.0 * k as f64 / n.max(1) as f64
}

/// Per kind, way of asking and rung: right answers from the full history
/// and from the compacted one (summed over seeds), the compacted/full
/// ratio, and the ratio's range over the seeds.
fn print_scores(scores: &Scores, seeds: usize) {
    println!("\nright answers, compacted vs full history, over {seeds} seeds (ratio = compacted/full, and its range over the seeds)");
    println!(
        "{:<20}{:<8}{:<10}{:>12}{:>12}{:>8}{:>14}",
        "kind", "asked", "rung", "full", "compacted", "ratio", "seeds' range"
    );
    let sum = |v: &[(usize, usize)]| v.iter().fold((0, 0), |(k, n), (a, b)| (k + a, n + b));
    let ratio = |c: usize, f: usize| (f > 0).then(|| c as f64 / f as f64);
    let rungs: Vec<&String> = {
        let mut r: Vec<&String> = scores
            .keys()
            .map(|(row, _, _)| row)
            .filter(|row| !row.starts_with("full@"))
            .collect();
        r.dedup();
        r
    };
    for kind in ProbeKind::ALL {
        for mode in Mode::ALL {
            for rung in &rungs {
                let (Some(full), Some(comp)) = (
                    scores.get(&(format!("full@{rung}"), mode, kind)),
                    scores.get(&(rung.to_string(), mode, kind)),
                ) else {
                    continue;
                };
                let ((fk, fnn), (ck, cn)) = (sum(full), sum(comp));
                let per_seed: Vec<f64> = full
                    .iter()
                    .zip(comp)
                    .filter_map(|(f, c)| ratio(c.0, f.0))
                    .collect();
                let range = match (
                    per_seed.iter().cloned().reduce(f64::min),
                    per_seed.iter().cloned().reduce(f64::max),
                ) {
                    (Some(lo), Some(hi)) => format!("{lo:.2}–{hi:.2}"),
                    _ => "-".into(),
                };
                println!(
                    "{:<20}{:<8}{:<10}{:>12}{:>12}{:>8}{:>14}",
                    kind.name(),
                    mode.name(),
                    rung,
                    format!("{fk}/{fnn} {:.0}%", pct(fk, fnn)),
                    format!("{ck}/{cn} {:.0}%", pct(ck, cn)),
                    ratio(ck, fk).map_or("-".into(), |r| format!("{r:.2}")),
                    range
                );
            }
        }
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let url = match reachable().await {
            Ok(url) => url,
            Err(why) => {
                println!("probes: skipped, no llama-server ({why}); start one with `scripts/llama-server.sh start PORT 8192` and set COMPACTOR_LLAMA_URL=http://127.0.0.1:PORT/v1");
                return;
            }
        };
        let part = std::env::var("PROBE_PART").unwrap_or_default();
        if part.is_empty() || part == "probes" {
            probe_part(&url).await;
        }
        if part.is_empty() || part == "cache" {
            summary_cache::run(&url).await;
        }
    });
}
