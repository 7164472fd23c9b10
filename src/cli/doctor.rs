//! `compactor doctor`: checks a setup the way the proxy will use it, one
//! line per finding: `✓` fine, `!` works but deserves a look, `✗` broken.
//! Any `✗` makes the exit status non-zero.
//!
//! It reads and asks, and changes nothing: the store is opened without
//! creating it and its write lock is taken inside a transaction that is
//! rolled back; the journal is read, not imported.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::Value;

use super::layered::ConfigArgs;
use super::out::{print_out, said};
use super::reach::command_runtime;
use crate::config::Config;
use crate::demo::thousands;
use crate::upstream::Upstream;
use crate::windows::{Source, Told};

/// Longest the doctor waits for one upstream answer (or the store's lock).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// At most this many of the upstream's models get a window line each.
const MAX_MODELS_CHECKED: usize = 20;
/// An admin token shorter than this is easy to guess.
const MIN_TOKEN_CHARS: usize = 16;

/// `compactor doctor` options: the same layering as `serve`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Where the configuration comes from.
    #[command(flatten)]
    pub settings: ConfigArgs,
    /// Also check this model's window (repeatable); the upstream's own
    /// models and the exact names in `[[models]]` are checked anyway.
    #[arg(long = "model")]
    pub models: Vec<String>,
}

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Fine.
    Ok,
    /// Works, but deserves a look.
    Warn,
    /// Broken: the exit status is non-zero.
    Fail,
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// How it came out.
    pub verdict: Verdict,
    /// What was checked, e.g. `upstream`.
    pub subject: String,
    /// What was found, and what to do when it is not fine.
    pub text: String,
}

impl Finding {
    fn new(verdict: Verdict, subject: impl Into<String>, text: impl Into<String>) -> Self {
        Finding {
            verdict,
            subject: subject.into(),
            text: text.into(),
        }
    }

    /// The finding as printed: `✓ subject: text`.
    pub fn line(&self) -> String {
        let mark = match self.verdict {
            Verdict::Ok => '✓',
            Verdict::Warn => '!',
            Verdict::Fail => '✗',
        };
        format!("{mark} {}: {}", self.subject, self.text)
    }
}

/// Runs `compactor doctor`.
pub fn main(args: DoctorArgs) -> ExitCode {
    let config = args.settings.load_config();
    let findings = match config {
        Err(e) => vec![Finding::new(Verdict::Fail, "config", e.to_string())],
        Ok(config) => {
            let from = match (&args.settings.config, crate::config::file_in_effect(None)) {
                (Some(p), _) => format!("valid ({})", p.display()),
                (None, Some(p)) => {
                    format!("valid ({}, found in the working directory)", p.display())
                }
                (None, None) => "valid (built-in defaults, flags and environment)".to_string(),
            };
            let runtime = match command_runtime() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("compactor: {}", said(&e));
                    return ExitCode::FAILURE;
                }
            };
            let mut findings = vec![Finding::new(Verdict::Ok, "config", from)];
            findings.extend(runtime.block_on(check(&config, &args.models)));
            findings
        }
    };
    let mut text: String = findings.iter().map(|f| f.line() + "\n").collect();
    let count = |v| findings.iter().filter(|f| f.verdict == v).count();
    let (warnings, failures) = (count(Verdict::Warn), count(Verdict::Fail));
    text.push_str(&format!(
        "{failures} failed, {warnings} to look at, {} fine\n",
        count(Verdict::Ok)
    ));
    let printed = print_out(&text);
    if failures > 0 {
        ExitCode::FAILURE
    } else {
        printed
    }
}

/// Every check after the config's, in the order printed.
pub async fn check(config: &Config, extra_models: &[String]) -> Vec<Finding> {
    let mut out = Vec::new();
    let listed = check_upstream(config, &mut out).await;
    if let Some((upstream, listed)) = listed {
        out.extend(check_windows(config, &upstream, &listed, extra_models).await);
    }
    if config.store.is_postgres() {
        // The records are in the database: no SQLite file or journal here.
        out.push(check_database(config).await);
    } else {
        out.push(check_store(&config.store_path()));
        out.push(check_journal(&config.store_path()));
    }
    out.extend(check_exposure(config));
    out
}

/// The headers the doctor asks the upstream with: the proxy's own key when
/// one is configured (the proxy sends it too), else `OPENAI_API_KEY` as a
/// client would, else none.
pub fn upstream_headers(upstream: &Upstream) -> http::HeaderMap {
    let mut client = http::HeaderMap::new();
    if let Some(v) = std::env::var("OPENAI_API_KEY")
        .ok()
        .filter(|k| !k.is_empty())
        .and_then(|k| http::HeaderValue::from_str(&format!("Bearer {k}")).ok())
    {
        let mut v = v;
        v.set_sensitive(true);
        client.insert(http::header::AUTHORIZATION, v);
    }
    upstream.request_headers(&client, true)
}

/// GETs `url` from the upstream within [`CHECK_TIMEOUT`]: the status and
/// the JSON body (`Null` when it is not JSON), or why it could not.
pub async fn get_json(
    upstream: &Upstream,
    url: &reqwest::Url,
    headers: &http::HeaderMap,
) -> anyhow::Result<(u16, Value)> {
    let ask = async {
        let resp = upstream
            .send_bodyless(http::Method::GET, url, headers.clone())
            .await?;
        let status = resp.status().as_u16();
        let body = upstream.read_body(resp).await?;
        Ok((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
    };
    match tokio::time::timeout(CHECK_TIMEOUT, ask).await {
        Ok(answer) => answer,
        Err(_) => Err(anyhow::anyhow!(
            "no answer within {}s",
            CHECK_TIMEOUT.as_secs()
        )),
    }
}

/// The upstream answers `/v1/models`: the client and that answer, for the
/// window checks.
async fn check_upstream(config: &Config, out: &mut Vec<Finding>) -> Option<(Upstream, Value)> {
    let base = crate::config::shown_url(&config.upstream.base_url);
    let upstream = match Upstream::new(&config.upstream) {
        Ok(u) => u,
        Err(e) => {
            out.push(Finding::new(
                Verdict::Fail,
                "upstream",
                format!("{base}: {e:#}"),
            ));
            return None;
        }
    };
    let headers = upstream_headers(&upstream);
    let keyed = headers.contains_key(http::header::AUTHORIZATION);
    let answer = match upstream.url("/models", None) {
        Ok(url) => get_json(&upstream, &url, &headers).await,
        Err(e) => Err(e.into()),
    };
    match answer {
        Err(why) => {
            out.push(Finding::new(Verdict::Fail, "upstream", {
                let said = said(&why);
                let detail = said.strip_prefix("upstream unreachable: ").unwrap_or(&said);
                format!("cannot reach {base}: {detail}")
            }));
            None
        }
        Ok((200, body)) => {
            let ids = model_ids(&body);
            let text = match ids.len() {
                0 => format!("{base} answers /v1/models (no models listed)"),
                n => format!(
                    "{base} answers /v1/models ({n} model{}: {})",
                    if n == 1 { "" } else { "s" },
                    preview(&ids)
                ),
            };
            out.push(Finding::new(Verdict::Ok, "upstream", text));
            Some((upstream, body))
        }
        Ok((status @ (401 | 403), _)) if !keyed => {
            out.push(Finding::new(
                Verdict::Warn,
                "upstream",
                format!("{base} is reachable and wants a key for /v1/models (HTTP {status}); clients' own keys go through, or set OPENAI_API_KEY for the doctor to look further"),
            ));
            None
        }
        Ok((status, body)) => {
            let why = body
                .pointer("/error/message")
                .and_then(Value::as_str)
                .map(|m| format!(": {}", upstream.redact(m, &headers)))
                .unwrap_or_default();
            out.push(Finding::new(
                Verdict::Fail,
                "upstream",
                format!("{base} answered /v1/models with HTTP {status}{why}"),
            ));
            None
        }
    }
}

/// The `id`s of a `/v1/models` answer, or the model names of Gemini's
/// (`models`, each `name` being `models/{model}`).
pub fn model_ids(body: &Value) -> Vec<String> {
    let listed = |list: &str, name: fn(&Value) -> Option<&str>| -> Vec<String> {
        body.get(list)
            .and_then(Value::as_array)
            .map(|d| d.iter().filter_map(name).map(str::to_string).collect())
            .unwrap_or_default()
    };
    let gemini = listed("models", |m| {
        m.get("name")?.as_str()?.strip_prefix("models/")
    });
    if gemini.is_empty() {
        listed("data", |m| m.get("id")?.as_str())
    } else {
        gemini
    }
}

fn preview(ids: &[String]) -> String {
    const SHOWN: usize = 5;
    let mut text = ids
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() > SHOWN {
        text.push_str(&format!(", … {} more", ids.len() - SHOWN));
    }
    text
}

/// The models to check: the upstream's, the exact names of `[[models]]`
/// entries, and those asked for; each once, in that order.
fn models_to_check(config: &Config, listed: &Value, extra: &[String]) -> Vec<String> {
    let mut names: Vec<String> = model_ids(listed);
    names.truncate(MAX_MODELS_CHECKED);
    names.extend(
        config
            .models
            .iter()
            .map(|m| m.pattern.clone())
            .filter(|p| !p.contains(['*', '?'])),
    );
    names.extend(extra.iter().cloned());
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| !n.is_empty() && seen.insert(n.clone()));
    names
}

async fn check_windows(
    config: &Config,
    upstream: &Upstream,
    listed: &Value,
    extra: &[String],
) -> Vec<Finding> {
    let headers = upstream_headers(upstream);
    // Every model asked at once, under one deadline: an upstream that
    // hangs on `/props` costs the doctor one timeout, not one per model.
    let deadline = tokio::time::Instant::now() + CHECK_TIMEOUT;
    let models = models_to_check(config, listed, extra);
    let asks = models.iter().map(|model| {
        let ask = crate::server::discovery::ask_upstream(upstream, model, headers.clone());
        tokio::time::timeout_at(deadline, ask)
    });
    let told = futures_util::future::join_all(asks).await;
    models
        .iter()
        .zip(told)
        .map(|(model, told)| match told {
            Ok(told) => window_finding(config, model, told),
            Err(_) => {
                let (limits, _) = configured(config, model);
                Finding::new(
                    Verdict::Warn,
                    format!("model {model}"),
                    format!(
                        "the upstream did not say within {}s what its window is; the proxy uses {} until it does",
                        CHECK_TIMEOUT.as_secs(),
                        thousands(limits.context_window)
                    ),
                )
            }
        })
        .collect()
}

/// What the upstream states of `model`'s window when asked, within
/// [`CHECK_TIMEOUT`] (the discovery the proxy makes at a model's first
/// request, [`crate::server::discovery::ask_upstream`]).
async fn told_window(upstream: &Upstream, headers: &http::HeaderMap, model: &str) -> Option<u64> {
    let ask = crate::server::discovery::ask_upstream(upstream, model, headers.clone());
    tokio::time::timeout(CHECK_TIMEOUT, ask)
        .await
        .ok()
        .flatten()
}

/// The table's (or `[[models]]`) limits of `model` and where they came from.
fn configured(config: &Config, model: &str) -> (crate::config::ModelLimits, Source) {
    let (limits, from_config) = config.model_limits_sourced(model);
    let source = if from_config {
        Source::Config
    } else {
        Source::Table
    };
    (limits, source)
}

/// One model's window: the table's (or `[[models]]`) against what the
/// upstream states, and which the proxy will use.
fn window_finding(config: &Config, model: &str, told: Option<u64>) -> Finding {
    let (limits, source) = configured(config, model);
    let subject = format!("model {model}");
    let ours = thousands(limits.context_window);
    let what = match source {
        Source::Config => "your [[models]] entry",
        _ => "the models table",
    };
    let Some(w) = told else {
        return Finding::new(
            Verdict::Ok,
            subject,
            format!("window {ours} ({what}); the upstream does not state one"),
        );
    };
    let theirs = thousands(w);
    let told = told_at(model, w);
    let (used, used_source) = crate::windows::effective(limits, source, Some(&told));
    let used = thousands(used.context_window);
    if w == limits.context_window {
        return Finding::new(
            Verdict::Ok,
            subject,
            format!("window {ours} ({what}), as the upstream states"),
        );
    }
    if !config.upstream.discover_windows {
        return Finding::new(
            Verdict::Warn,
            subject,
            format!("the upstream states a window of {theirs}, {what} says {ours}, and upstream.discover_windows is off: the proxy uses {ours} until an overflow answer tells it {theirs}"),
        );
    }
    match (source, used_source) {
        (Source::Config, Source::Config) => Finding::new(
            Verdict::Ok,
            subject,
            format!("window {ours} ({what}), less than the {theirs} the upstream states: your entry stays"),
        ),
        (Source::Config, _) => Finding::new(
            Verdict::Warn,
            subject,
            format!("{what} says {ours}, more than the {theirs} the upstream states; the proxy uses {used} (the smaller wins): correct the entry"),
        ),
        _ => Finding::new(
            Verdict::Ok,
            subject,
            format!("window {theirs} (discovered: the upstream states it) against {what}'s {ours}; the proxy uses {used}"),
        ),
    }
}

/// `window` as if the upstream had just told it for `model` on discovery.
fn told_at(model: &str, window: u64) -> Told {
    Told {
        upstream: String::new(),
        model: model.to_string(),
        window,
        source: Source::Discovered,
        updated_ms: 0,
    }
}

/// The model a client should ask for (`model`, else the upstream's only
/// one), the window the proxy uses for it and its room for an answer.
pub async fn effective_window(
    config: &Config,
    model: Option<&str>,
    offline: bool,
) -> anyhow::Result<(String, u64, u64)> {
    let asked = if offline {
        None
    } else {
        let upstream = Upstream::new(&config.upstream)?;
        let headers = upstream_headers(&upstream);
        let listed = match upstream.url("/models", None) {
            Ok(url) => match get_json(&upstream, &url, &headers).await {
                Ok((200, body)) => body,
                _ => Value::Null,
            },
            Err(_) => Value::Null,
        };
        Some((upstream, headers, listed))
    };
    let model = match model {
        Some(m) => m.to_string(),
        None => {
            let ids = asked
                .as_ref()
                .map(|(_, _, l)| model_ids(l))
                .unwrap_or_default();
            match ids.as_slice() {
                [only] => only.clone(),
                [] => anyhow::bail!(
                    "name the model with --model (the upstream lists none, or was not asked)"
                ),
                _ => anyhow::bail!(
                    "name the model with --model; the upstream has {}",
                    preview(&ids)
                ),
            }
        }
    };
    let (limits, source) = configured(config, &model);
    let told = match &asked {
        Some((upstream, headers, _)) if config.upstream.discover_windows => {
            told_window(upstream, headers, &model).await
        }
        _ => None,
    };
    let told = told.map(|w| told_at(&model, w));
    let (limits, _) = crate::windows::effective(limits, source, told.as_ref());
    Ok((model, limits.context_window, limits.max_output_tokens))
}

/// A PostgreSQL store answers: the doctor connects with the configured
/// credentials and reads where the schema stands, changing nothing.
async fn check_database(config: &Config) -> Finding {
    let shown = config.store.shown_url();
    // The pool has its own runtime, which may not be built or dropped on
    // an async thread.
    let config = config.clone();
    let status = tokio::task::spawn_blocking(move || crate::store::schema_status(&config));
    match tokio::time::timeout(2 * CHECK_TIMEOUT, status).await {
        Ok(Ok(Ok(s))) if s.is_current() => Finding::new(
            Verdict::Ok,
            "database",
            format!("{shown} answers; schema current (version {})", s.applied),
        ),
        Ok(Ok(Ok(s))) => Finding::new(
            Verdict::Ok,
            "database",
            format!(
                "{shown} answers; schema at version {} of {} (serve migrates it at start-up)",
                s.applied, s.latest
            ),
        ),
        Ok(Ok(Err(e))) => Finding::new(
            Verdict::Fail,
            "database",
            format!("{shown} cannot be used: {e}"),
        ),
        Ok(Err(e)) => Finding::new(Verdict::Fail, "database", format!("{shown}: {e}")),
        Err(_) => Finding::new(
            Verdict::Fail,
            "database",
            format!(
                "{shown} did not answer within {}s",
                (2 * CHECK_TIMEOUT).as_secs()
            ),
        ),
    }
}

/// The store can be written: an existing database takes a write lock (in a
/// transaction rolled back at once); a missing one can be created.
pub fn check_store(path: &Path) -> Finding {
    let shown = path.display();
    if !path.exists() {
        return match writable_dir(path) {
            Ok(dir) => Finding::new(
                Verdict::Ok,
                "store",
                format!(
                    "{shown} does not exist yet; {} is writable, so the first start creates it",
                    dir.display()
                ),
            ),
            Err(why) => Finding::new(
                Verdict::Fail,
                "store",
                format!("{shown} cannot be created: {}", said(&why)),
            ),
        };
    }
    match crate::store::writable(path, CHECK_TIMEOUT) {
        Ok(conversations) => Finding::new(
            Verdict::Ok,
            "store",
            format!(
                "{shown} is writable ({} conversations)",
                thousands(conversations)
            ),
        ),
        Err(why) => Finding::new(Verdict::Fail, "store", format!("{shown}: {}", said(&why))),
    }
}

/// The nearest existing directory above `path`, if a file can be made in it.
fn writable_dir(path: &Path) -> anyhow::Result<PathBuf> {
    let mut dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.as_os_str().is_empty() {
        dir = PathBuf::from(".");
    }
    while !dir.exists() {
        match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => dir = p.to_path_buf(),
            _ => dir = PathBuf::from("."),
        }
    }
    let probe = dir.join(format!(".compactor-doctor-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .with_context(|| dir.display().to_string())?;
    let _ = std::fs::remove_file(&probe);
    Ok(dir)
}

/// The journal (exchanges acknowledged and not yet in the database).
pub fn check_journal(db: &Path) -> Finding {
    if !db.exists() {
        return Finding::new(Verdict::Ok, "journal", "none yet (no store)");
    }
    let status = match crate::store::journal::status(db) {
        Ok(s) => s,
        Err(e) => return Finding::new(Verdict::Fail, "journal", format!("cannot be read: {e}")),
    };
    let mut notes = Vec::new();
    if status.cut_short_bytes > 0 {
        notes.push(format!(
            "it ends in {} bytes of a record cut short (a write a kill interrupted, never acknowledged: skipped)",
            thousands(status.cut_short_bytes)
        ));
    }
    if status.unreadable_bytes > 0 {
        notes.push(format!(
            "{} bytes cannot be read (damaged); the next import sets them aside",
            thousands(status.unreadable_bytes)
        ));
    }
    if let Some((path, len)) = &status.quarantined {
        notes.push(format!(
            "{} holds {} bytes set aside earlier",
            path.display(),
            thousands(*len)
        ));
    }
    let n = thousands(status.records as u64);
    let (mut verdict, mut text) = match (status.served, status.records) {
        (true, _) => (
            Verdict::Ok,
            format!("a running proxy serves this store ({n} exchanges on their way into the database)"),
        ),
        (false, 0) => (Verdict::Ok, "empty".to_string()),
        (false, _) => (
            Verdict::Warn,
            format!("{n} exchanges of a proxy that stopped without importing them wait in it; the next `compactor serve` (or `compactor conversations list`) imports them"),
        ),
    };
    if !notes.is_empty() {
        verdict = Verdict::Warn;
        text = format!("{text}; {}", notes.join("; "));
    }
    Finding::new(verdict, "journal", text)
}

/// Who can reach the admin API, and who can spend the proxy's own key.
pub fn check_exposure(config: &Config) -> Vec<Finding> {
    let listen = &config.server.listen;
    let loopback = config
        .listen_addr()
        .is_ok_and(|a| a.ip().to_canonical().is_loopback());
    let name = &config.admin.token_env;
    let token = (!name.is_empty())
        .then(|| std::env::var(name).ok())
        .flatten()
        .filter(|t| !t.is_empty());
    let mut out = Vec::new();
    let admin = match (&token, loopback) {
        _ if !name.is_empty() && token.is_none() => Finding::new(
            Verdict::Warn,
            "admin",
            format!("admin.token_env names {name}, which is unset or empty here: /admin/ answers {}", if loopback { "loopback clients only" } else { "nobody" }),
        ),
        (None, true) => Finding::new(
            Verdict::Ok,
            "admin",
            format!("/admin/ answers loopback clients only (listening on {listen}, no token)"),
        ),
        (None, false) => Finding::new(
            Verdict::Warn,
            "admin",
            format!("listening on {listen} without an admin token: /admin/ refuses every request; set [admin] token_env to use it"),
        ),
        (Some(t), _) if t.chars().count() < MIN_TOKEN_CHARS => Finding::new(
            Verdict::Warn,
            "admin",
            format!("the token in {name} has fewer than {MIN_TOKEN_CHARS} characters: easy to guess"),
        ),
        (Some(_), _) => Finding::new(
            Verdict::Ok,
            "admin",
            format!("/admin/ wants the token in {name} (listening on {listen})"),
        ),
    };
    out.push(admin);
    if !loopback && !config.upstream.api_key_env.is_empty() {
        out.push(Finding::new(
            Verdict::Warn,
            "exposure",
            format!("listening on {listen} with the proxy's own upstream key ({}): whoever reaches it spends that key", config.upstream.api_key_env),
        ));
    }
    out
}
