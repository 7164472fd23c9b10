//! Commands that change the store (`delete`, `prune`, `compact`): through
//! the admin API of the proxy serving it, or on the file when none does.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;

use super::args::{CompactArgs, MaintainArgs, PruneArgs};
use super::layered::{layered_config, with_database_url};
use super::out::{print_out, said, to_json, EXIT_USAGE};
use super::reach::{admin_target, command_runtime};
use crate::config::Config;
use crate::demo::thousands;
use crate::store::query::{self};
use crate::store::sql::Sql;

/// The config a command that changes the store works with.
pub(super) fn maintain_config(target: &MaintainArgs) -> Result<Config, ExitCode> {
    let store = &target.store;
    layered_config(
        store.config.as_deref(),
        target.listen.as_deref(),
        None,
        store.db.as_deref(),
    )
    .and_then(|c| with_database_url(c, store.database_url.as_deref()))
    .map_err(|e| {
        eprintln!("compactor: configuration error: {e}");
        ExitCode::from(EXIT_USAGE)
    })
}

/// How long a request to the admin API may take; a prune of a large store
/// may take a while.
pub(super) const ADMIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// A request to the running proxy's admin API (`path` below `/admin/api`):
/// its JSON answer, or why not.
pub(super) fn admin_call(
    config: &Config,
    method: reqwest::Method,
    path: &str,
) -> anyhow::Result<serde_json::Value> {
    let addr = config
        .listen_addr()
        .context("configuration error: server.listen")?;
    let target = admin_target(addr);
    let url = format!("http://{target}/admin/api{path}");
    let token = Some(&config.admin.token_env)
        .filter(|n| !n.is_empty())
        .and_then(|n| std::env::var(n).ok())
        .filter(|t| !t.is_empty());
    let runtime = command_runtime()?;
    let answer = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(ADMIN_TIMEOUT)
            .build()?;
        let mut req = client.request(method, &url);
        if let Some(t) = &token {
            req = req.header(crate::admin::TOKEN_HEADER, t);
        }
        let resp = req.send().await?;
        let status = resp.status();
        let body = resp.bytes().await?;
        Ok::<_, reqwest::Error>((status, body))
    });
    let (status, body) = answer.map_err(|e| {
        let said = format!(
            "cannot reach the proxy's admin API at http://{target} ({}): is `compactor serve` running there? (address from server.listen / --listen / COMPACTOR_LISTEN)",
            describe_error(&e)
        );
        anyhow::Error::new(e).context(said)
    })?;
    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if !status.is_success() {
        let message = value
            .pointer("/error/message")
            .and_then(|m| m.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
        anyhow::bail!("the proxy at {target} answered {status}: {message}");
    }
    Ok(value)
}

/// Whether a running proxy serves the store at `path`.
pub(super) fn served(path: &Path) -> bool {
    crate::store::journal::status(path).is_ok_and(|s| s.served)
}

/// `what` removed, in words.
pub(super) fn removed_text(r: &crate::store::retention::Removed) -> String {
    let n = |count: u64, one: &str| {
        format!(
            "{} {one}{}",
            thousands(count),
            if count == 1 { "" } else { "s" }
        )
    };
    format!(
        "{}, {}, {}, {} no longer referenced",
        n(r.conversations, "conversation"),
        n(r.exchanges, "exchange"),
        n(r.compactions, "compaction"),
        n(r.items, "item")
    )
}

/// Runs a deletion through the proxy serving the store (`admin`) or, when
/// none does, on the file itself (`offline`); prints what went.
pub(super) fn maintain(
    target: &MaintainArgs,
    admin: (reqwest::Method, String),
    offline: impl FnOnce(&dyn Sql) -> Result<crate::store::retention::Removed, query::QueryError>,
) -> ExitCode {
    use crate::store::retention;
    let config = match maintain_config(target) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let path = config.store_path();
    let removed: anyhow::Result<retention::Removed> =
        if !config.store.is_postgres() && served(&path) {
            // The proxy forgets what goes, so no request is taken as part of
            // it, and deletes on its side of the store.
            admin_call(&config, admin.0, &admin.1).and_then(|v| {
                serde_json::from_value(v["removed"].clone())
                    .context("the proxy's answer does not say what was removed")
            })
        } else {
            // The file no proxy serves, or the database the replicas share
            // (deleted there, and every replica told to forget what went).
            crate::store::maintenance(&config).and_then(|conn| Ok(offline(&*conn)?))
        };
    match removed {
        Err(e) => {
            eprintln!("compactor: {}", said(&e));
            ExitCode::FAILURE
        }
        Ok(r) if target.store.json => {
            print_out(&to_json(&serde_json::json!({ "removed": r }), false))
        }
        Ok(r) if config.store.is_postgres() => {
            print_out(&format!("removed {}\n", removed_text(&r)))
        }
        Ok(r) => print_out(&format!("removed {}; store vacuumed\n", removed_text(&r))),
    }
}

pub(super) fn delete(name: &str, target: &MaintainArgs) -> ExitCode {
    let encoded = percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC);
    let name = name.to_string();
    maintain(
        target,
        (reqwest::Method::DELETE, format!("/conversations/{encoded}")),
        move |conn| {
            let id = query::resolve_id(conn, &name)?;
            Ok(crate::store::retention::delete_and_prune(conn, &[id])?)
        },
    )
}

/// `30d`, `12h`, `90m`, `3600s`, or a bare number of days, as seconds.
pub fn parse_age(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "d"),
    };
    let n: u64 = digits.parse().ok()?;
    let scale = match unit {
        "d" => 86_400,
        "h" => 3600,
        "m" => 60,
        "s" => 1,
        _ => return None,
    };
    n.checked_mul(scale)
}

pub(super) fn prune(args: PruneArgs) -> ExitCode {
    let Some(secs) = parse_age(&args.older_than) else {
        eprintln!(
            "compactor: --older-than {:?}: give a number with d, h, m or s (30d, 12h)",
            args.older_than
        );
        return ExitCode::from(EXIT_USAGE);
    };
    let cutoff = crate::ids::now_ms() - (secs.min(i64::MAX as u64 / 1000) * 1000) as i64;
    maintain(
        &args.target,
        (
            reqwest::Method::POST,
            format!("/prune?older_than_secs={secs}"),
        ),
        move |conn| {
            use crate::store::retention;
            let old: Vec<String> = retention::seen_before(conn, cutoff, usize::MAX >> 1)?
                .into_iter()
                .map(|(_, id)| id)
                .collect();
            Ok(retention::delete_and_prune(conn, &old)?)
        },
    )
}

/// How often `compact` asks the proxy whether the compaction happened.
pub(super) const COMPACT_POLL: std::time::Duration = std::time::Duration::from_millis(250);

pub(super) fn compact(args: CompactArgs) -> ExitCode {
    let config = match maintain_config(&args.target) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let id = args.id.trim();
    if id.is_empty() || id.chars().any(char::is_control) {
        eprintln!("compactor: {id:?} is not a conversation id");
        return ExitCode::from(EXIT_USAGE);
    }
    // With a store named, it must be the one a proxy serves: the
    // compaction runs there (it needs the client's credentials).
    if args.target.store.db.is_some() && !served(&config.store_path()) {
        eprintln!(
            "compactor: no running proxy serves {}: a compaction runs in the proxy, with the next request's credentials; start `compactor serve` on it",
            config.store_path().display()
        );
        return ExitCode::FAILURE;
    }
    let encoded =
        percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC).to_string();
    let path = format!("/conversations/{encoded}/compact");
    let value = match admin_call(&config, reqwest::Method::POST, &path) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("compactor: {}", said(&e));
            return ExitCode::FAILURE;
        }
    };
    let conversation = value["conversation"].as_str().unwrap_or(id).to_string();
    let requested_ms = value["requested_ms"].as_i64().unwrap_or(0);
    // The outcome comes with the conversation's next request: wait for it
    // a while, asking the proxy.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.wait);
    let mut outcome = None;
    while args.wait > 0 && std::time::Instant::now() < deadline {
        match admin_call(&config, reqwest::Method::GET, &path) {
            Ok(v)
                if v["outcome"]["at_ms"].as_i64().unwrap_or(0) >= requested_ms
                    && v["outcome"].is_object() =>
            {
                outcome = Some(v["outcome"].clone());
                break;
            }
            Ok(_) => std::thread::sleep(COMPACT_POLL),
            Err(e) => {
                eprintln!("compactor: {}", said(&e));
                return ExitCode::FAILURE;
            }
        }
    }
    if args.target.store.json {
        let mut v = value;
        v["outcome"] = outcome.unwrap_or(serde_json::Value::Null);
        return print_out(&to_json(&v, false));
    }
    let text = match outcome {
        Some(o) => format!("{conversation}: {}\n", outcome_text(&o)),
        None if value["already_pending"] == true => format!(
            "compaction of {conversation} was already requested: its next request will be compacted; the outcome shows in `compactor conversations show {conversation}` once it arrives\n"
        ),
        None => format!(
            "compaction of {conversation} requested: its next request will be compacted before it goes upstream; the outcome shows in `compactor conversations show {conversation}` once it arrives\n"
        ),
    };
    print_out(&text)
}

/// A compaction attempt's outcome as the proxy reports it, in words:
/// `discarded: 99 → 259 tokens, nothing to gain`.
pub(super) fn outcome_text(o: &serde_json::Value) -> String {
    let before = thousands(o["tokens_before"].as_u64().unwrap_or(0));
    let after = thousands(o["tokens_after"].as_u64().unwrap_or(0));
    match o["result"].as_str() {
        Some("applied") => format!(
            "compacted: {before} → {after} tokens ({}, {})",
            o["rung"].as_str().unwrap_or("?"),
            o["compaction"].as_str().unwrap_or("?")
        ),
        Some("discarded") => format!("discarded: {before} → {after} tokens, nothing to gain"),
        _ => format!(
            "failed: {}",
            o["error"].as_str().unwrap_or("the proxy gave no reason")
        ),
    }
}

pub(super) fn describe_error(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_and_ages_in_words() {
        let discarded =
            serde_json::json!({"result": "discarded", "tokens_before": 99, "tokens_after": 259});
        assert_eq!(
            outcome_text(&discarded),
            "discarded: 99 → 259 tokens, nothing to gain"
        );
        let applied = serde_json::json!({"result": "applied", "tokens_before": 9000,
            "tokens_after": 1200, "rung": "summary", "compaction": "cmp_1"});
        assert_eq!(
            outcome_text(&applied),
            "compacted: 9,000 → 1,200 tokens (summary, cmp_1)"
        );
        assert_eq!(parse_age("30d"), Some(30 * 86_400));
        assert_eq!(parse_age("12h"), Some(12 * 3600));
        assert_eq!(parse_age("90m"), Some(5400));
        assert_eq!(parse_age("7"), Some(7 * 86_400));
        assert_eq!(parse_age("0s"), Some(0));
        for bad in ["", "d", "30x", "-1d", "1.5d"] {
            assert_eq!(parse_age(bad), None, "{bad}");
        }
    }
}
