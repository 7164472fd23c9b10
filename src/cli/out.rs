//! What the commands print and how they end: stdout that a closed pipe
//! does not fail, a failure said with each cause once, JSON safe for a
//! terminal, the exit status of a bad invocation.

use std::io::Write;
use std::process::ExitCode;

/// Exit status for a bad configuration or invocation (sysexits EX_USAGE).
pub const EXIT_USAGE: u8 = 64;

/// Writes to stdout; a closed pipe (`| head`) is not an error.
pub(crate) fn print_out(text: &str) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("compactor: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What the command line prints of a failure: the error and its causes
/// (`a: b: c`), each cause said once (one a message before already names
/// is left out). Below the upstream client's error, whose message names
/// its innermost cause, nothing more is said; a reqwest error is told
/// without its URL, which could carry a key ([`crate::upstream::describe`]).
pub(crate) fn said(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        let reqwest = cause.downcast_ref::<reqwest::Error>();
        let text = reqwest.map_or(text, crate::upstream::describe);
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
        if reqwest.is_some() || cause.is::<crate::upstream::Error>() {
            break;
        }
    }
    out
}

pub(super) fn to_json<T: serde::Serialize>(value: &T, pretty: bool) -> String {
    let text = if pretty {
        serde_json::to_string_pretty(value)
    } else {
        serde_json::to_string(value)
    };
    let text = text.unwrap_or_default();
    // serde_json escapes C0 controls; C1 controls and bidi overrides go
    // out raw, and a terminal acts on them. They can stand only inside
    // JSON strings, where `\uXXXX` is the same character: still lossless.
    let mut out = String::with_capacity(text.len() + 1);
    for ch in text.chars() {
        // Line breaks outside strings are the pretty layout's own.
        if ch != '\n' && unsafe_for_terminal(ch) {
            out.push_str(&format!("\\u{:04x}", ch as u32));
        } else {
            out.push(ch);
        }
    }
    out.push('\n');
    out
}

/// Whether a terminal could act on `ch` rather than show it: C0 and C1
/// controls, DEL, and the bidirectional overrides and isolates that make
/// text read differently from how it is stored.
pub(super) fn unsafe_for_terminal(ch: char) -> bool {
    ch.is_control()
        || matches!(ch, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each cause is said once, after the context; one a message already
    /// names is not repeated.
    #[test]
    fn a_failure_is_said_with_each_cause_once() {
        let e = anyhow::Error::new(std::io::Error::other("disk full")).context("cannot write x");
        assert_eq!(said(&e), "cannot write x: disk full");
        let store = crate::store::StoreError::Io(std::io::Error::other("disk full"));
        let e = anyhow::Error::new(store).context("cannot open the store");
        assert_eq!(said(&e), "cannot open the store: store io: disk full");
    }

    /// Below the upstream client's error nothing more is said: its message
    /// already names the innermost cause, and the reqwest error's would
    /// carry the URL.
    #[test]
    fn an_upstream_failure_is_said_without_its_url() {
        let runtime = crate::cli::reach::command_runtime().unwrap();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let failed = runtime.block_on(async {
            let send = reqwest::Client::new()
                .get(format!("http://127.0.0.1:{port}/v1/models?key=sk-in-url"))
                .send();
            tokio::time::timeout(std::time::Duration::from_secs(10), send)
                .await
                .expect("timed out")
                .unwrap_err()
        });
        let e = anyhow::Error::new(crate::upstream::Error::broke(failed)).context("doctor");
        let text = said(&e);
        assert!(
            text.starts_with(&format!(
                "doctor: upstream unreachable: connection to http://127.0.0.1:{port} failed: "
            )),
            "{text}"
        );
        assert!(!text.contains("sk-in-url"), "{text}");
    }
}
