//! Running the real Claude Code CLI (npm `@anthropic-ai/claude-code`,
//! pinned in `scripts/claude.sh`) in print mode, offline, with a home and
//! config dir of its own, for the tests that need it.
//!
//! The binary comes from `COMPACTOR_CLAUDE_BIN` (`scripts/test` exports
//! it); when that is unset, `scripts/claude.sh install` is run (idempotent:
//! a fraction of a second once installed, ~10 s the first time) and the
//! path it prints is used.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::support::real_cli;
pub use crate::support::real_cli::Outcome;

/// The model Claude Code is told to use; `[[models]]` gives it a window.
pub const MODEL: &str = "claude-tiny-1";
/// The key Claude Code sends (`x-api-key`); nothing checks it but the
/// tests, which look for it where it must not be.
pub const KEY: &str = "sk-ant-claude-code-test-0001";
/// Longest one `claude -p` run may take.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);
/// Claude Code's `max_tokens` (`CLAUDE_CODE_MAX_OUTPUT_TOKENS`).
pub const MAX_OUTPUT: u64 = 1024;

/// The Claude Code binary: `COMPACTOR_CLAUDE_BIN`, else what
/// `scripts/claude.sh install` prints as its last line.
pub fn claude_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| real_cli::installed("COMPACTOR_CLAUDE_BIN", "claude"))
}

/// A Claude Code installation of its own: `HOME` (its config dir inside)
/// and a working directory, both temporary.
pub struct Claude {
    pub home: tempfile::TempDir,
    pub work: tempfile::TempDir,
}

impl Claude {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Claude {
        let home = tempfile::tempdir().expect("tempdir");
        let work = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(home.path().join(".claude")).unwrap();
        Claude { home, work }
    }

    /// Claude Code's config dir (`CLAUDE_CONFIG_DIR`), where it reads its
    /// user `settings.json`.
    pub fn config_dir(&self) -> PathBuf {
        self.home.path().join(".claude")
    }

    /// `claude -p PROMPT` with `env` added (e.g. `ANTHROPIC_BASE_URL`).
    pub async fn print(&self, prompt: &str, env: &[(&str, &str)]) -> Outcome {
        self.run(claude_bin(), &[], prompt, env).await
    }

    /// `LAUNCHER LAUNCHER_ARGS… claude -p PROMPT …` (e.g. `compactor run
    /// --listen ADDR --`), or `claude -p PROMPT …` alone when
    /// `launcher_args` is empty and `launcher` is Claude Code itself; with a
    /// bounded wait, off the runtime's worker threads (the proxy under test
    /// runs on them).
    pub async fn run(
        &self,
        launcher: &Path,
        launcher_args: &[&str],
        prompt: &str,
        env: &[(&str, &str)],
    ) -> Outcome {
        let bin = launcher.to_path_buf();
        let mut args: Vec<String> = launcher_args.iter().map(|s| s.to_string()).collect();
        if !launcher_args.is_empty() {
            args.push(claude_bin().display().to_string());
        }
        args.extend(
            [
                "-p",
                prompt,
                "--model",
                MODEL,
                // Only Bash: a smaller first request, and the one tool the
                // fake calls, allowed without a prompt.
                "--tools",
                "Bash",
                "--allowedTools",
                "Bash",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let home = self.home.path().to_path_buf();
        let config = self.config_dir();
        let work = self.work.path().to_path_buf();
        let (outcome, finished) = tokio::task::spawn_blocking(move || {
            run_bounded(&bin, &args, &env, &home, &config, &work)
        })
        .await
        .expect("claude runner");
        assert!(
            finished,
            "claude did not finish within {RUN_TIMEOUT:?} (killed)\n{}",
            outcome.describe()
        );
        outcome
    }
}

fn run_bounded(
    bin: &Path,
    args: &[String],
    env: &[(String, String)],
    home: &Path,
    config: &Path,
    work: &Path,
) -> (Outcome, bool) {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .current_dir(work)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("CLAUDE_CONFIG_DIR", config)
        .env("ANTHROPIC_API_KEY", KEY)
        // Offline: no telemetry, no error reports, no update checks, no
        // non-essential requests (release notes, model capabilities).
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_ERROR_REPORTING", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("DISABLE_BUG_COMMAND", "1")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("CLAUDE_CODE_MAX_OUTPUT_TOKENS", MAX_OUTPUT.to_string())
        // No client retries: a proxy failure must show, not be papered over.
        .env("CLAUDE_CODE_MAX_RETRIES", "0")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("LANG", "C.UTF-8")
        .env("TERM", "dumb")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    // Its own process group: a timeout kills the launcher and whatever it
    // started (the Bash tool's shells) together.
    real_cli::run_bounded(cmd, home, RUN_TIMEOUT)
}
