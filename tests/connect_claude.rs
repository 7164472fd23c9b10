//! `compactor connect claude-code` and `compactor run -- claude` through the
//! real binary: the `settings.json` it writes (its `env` entry, the user's
//! other keys kept, the diff and `--yes`), the variable `run` sets, and
//! (`#[ignore]`d, with the real Claude Code CLI) that Claude Code reads both
//! and its requests reach the proxy.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod claude;
mod support;

use std::path::Path;
use std::process::{Command, Stdio};

use compactor::fake_upstream::{FakeUpstream, AUTO_TEXT};
use serde_json::Value;
use support::{within, Harness};

/// One finished `compactor` process.
#[derive(Debug)]
struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// `compactor ARGS` with none of the caller's settings leaking in, and
/// Claude Code's files under `home`.
fn compactor(args: &[&str], home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_compactor"));
    c.args(args);
    for var in [
        "COMPACTOR_CONFIG",
        "COMPACTOR_LISTEN",
        "COMPACTOR_UPSTREAM",
        "COMPACTOR_DB",
        "CLAUDE_CONFIG_DIR",
        "ANTHROPIC_BASE_URL",
    ] {
        c.env_remove(var);
    }
    c.env("HOME", home);
    c
}

/// Runs `cmd` off the runtime, killed if it takes longer than a test step.
async fn run(mut cmd: Command) -> Out {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start compactor");
    let pid = child.id();
    let waited = tokio::time::timeout(
        support::STEP,
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await;
    let Ok(done) = waited else {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        panic!("compactor did not finish within {:?}", support::STEP);
    };
    let out = done.expect("join").expect("wait");
    Out {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display()))
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_claude_code_writes_the_base_url_into_settings_keeping_the_rest() {
    // An upstream that would answer, to see that nothing is asked of it.
    let fake = within(FakeUpstream::start()).await.expect("fake");
    let home = tempfile::tempdir().unwrap();
    let file = home.path().join(".claude/settings.json");
    let url = fake.url();
    let connect = |extra: &[&str]| {
        let mut args = vec![
            "connect",
            "claude-code",
            "--listen",
            "0.0.0.0:8787",
            "--upstream",
            url.as_str(),
        ];
        args.extend_from_slice(extra);
        compactor(&args, home.path())
    };

    // Printed, not written: the entry alone, and where it would go.
    let out = run(connect(&[])).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let printed: Value = serde_json::from_str(&out.stdout).expect("JSON on stdout");
    assert_eq!(
        printed["env"]["ANTHROPIC_BASE_URL"], "http://127.0.0.1:8787",
        "the origin a client on this machine reaches, without /v1: {out:#?}"
    );
    assert!(out.stderr.contains(&file.display().to_string()), "{out:#?}");
    assert!(!file.exists(), "nothing written without --write");

    // The user's own settings: a changed file wants --yes, and shows the diff.
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    let mine = "{\n  \"permissions\": {\n    \"allow\": [\"Bash(ls:*)\"]\n  },\n  \"env\": {\n    \"DISABLE_TELEMETRY\": \"1\"\n  },\n  \"theme\": \"dark\"\n}\n";
    std::fs::write(&file, mine).unwrap();
    let out = run(connect(&["--write"])).await;
    assert_eq!(out.code, Some(1), "{out:#?}");
    assert!(
        out.stderr
            .contains("+    \"ANTHROPIC_BASE_URL\": \"http://127.0.0.1:8787\"")
            && out.stderr.contains("--yes"),
        "{out:#?}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), mine, "untouched");

    let out = run(connect(&["--write", "--yes"])).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let written = read_json(&file);
    assert_eq!(
        written["env"]["ANTHROPIC_BASE_URL"],
        "http://127.0.0.1:8787"
    );
    assert_eq!(written["env"]["DISABLE_TELEMETRY"], "1");
    assert_eq!(written["permissions"]["allow"][0], "Bash(ls:*)");
    assert_eq!(written["theme"], "dark");
    assert_eq!(
        support::keys(&written),
        ["permissions", "env", "theme"],
        "the user's keys stay in their order"
    );
    assert!(
        written.get("model").is_none(),
        "no model unless one is named"
    );

    let out = run(connect(&["--write"])).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    assert!(out.stdout.contains("nothing to write"), "{out:#?}");

    // A file that is not JSON is left alone, with a reason.
    std::fs::write(&file, "{ not json").unwrap();
    let out = run(connect(&["--write", "--yes"])).await;
    assert_eq!(out.code, Some(1), "{out:#?}");
    assert!(out.stderr.contains("not valid JSON"), "{out:#?}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "{ not json");

    assert!(
        fake.received().is_empty(),
        "without a model named, nothing is asked of the upstream"
    );

    // CLAUDE_CONFIG_DIR moves the file, as it moves Claude Code's; a model
    // named is written, with the window the proxy uses for it (here the
    // one the upstream states) as the window Claude Code compacts by.
    // Asked twice: the listing, then the model's window.
    for _ in 0..2 {
        fake.push(compactor::fake_upstream::Reply::json(
            200,
            serde_json::json!({"object": "list", "data": [
                {"id": "qwen3-coder", "object": "model", "max_model_len": 65536}
            ]}),
        ));
    }
    let elsewhere = home.path().join("other-claude");
    let mut cmd = connect(&["--write", "--model", "qwen3-coder"]);
    cmd.env("CLAUDE_CONFIG_DIR", &elsewhere);
    let out = run(cmd).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    assert!(out.stdout.contains("new file"), "{out:#?}");
    let written = read_json(&elsewhere.join("settings.json"));
    assert_eq!(
        written["env"]["ANTHROPIC_BASE_URL"],
        "http://127.0.0.1:8787"
    );
    assert_eq!(written["model"], "qwen3-coder");
    assert_eq!(
        written["env"]["CLAUDE_CODE_AUTO_COMPACT_WINDOW"], "65536",
        "{written}"
    );
    // Below Claude Code's floor for that setting: said.
    assert!(
        out.stderr
            .contains("no CLAUDE_CODE_AUTO_COMPACT_WINDOW below 100000"),
        "{out:#?}"
    );
}

#[tokio::test]
async fn run_sets_anthropic_base_url_beside_the_openai_variables() {
    let home = tempfile::tempdir().unwrap();
    let out = run(compactor(
        &[
            "run",
            "--listen",
            "0.0.0.0:4323",
            "--",
            "sh",
            "-c",
            "printf '%s %s' \"$ANTHROPIC_BASE_URL\" \"$OPENAI_BASE_URL\"; exit 5",
        ],
        home.path(),
    ))
    .await;
    assert_eq!(out.code, Some(5), "the client's status: {out:#?}");
    assert_eq!(out.stdout, "http://127.0.0.1:4323 http://127.0.0.1:4323/v1");
}

/// Messages requests the fake received through the proxy (the proxy marks
/// what it forwards with its hop header).
fn proxied_messages(h: &Harness) -> Vec<compactor::fake_upstream::Received> {
    h.fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/messages" && r.headers.contains_key("x-compactor-hop"))
        .collect()
}

/// The real Claude Code reads the `settings.json` that `connect claude-code
/// --write` wrote: with no `ANTHROPIC_BASE_URL` in its environment, its
/// requests reach the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Claude Code CLI: run scripts/test"]
async fn claude_code_reads_the_settings_connect_writes() {
    let h = Harness::start().await;
    let claude = claude::Claude::new();
    let mut cmd = compactor(
        &[
            "connect",
            "claude-code",
            "--listen",
            &h.addr.to_string(),
            "--write",
        ],
        claude.home.path(),
    );
    cmd.env("CLAUDE_CONFIG_DIR", claude.config_dir());
    let out = run(cmd).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let out = claude.print("say hi", &[]).await;
    assert_eq!(out.code, Some(0), "{}", out.describe());
    assert!(out.stdout.contains(AUTO_TEXT), "{}", out.describe());
    let asked = proxied_messages(&h);
    assert_eq!(asked.len(), 1, "Claude Code went through the proxy");
    assert_eq!(asked[0].headers["x-api-key"], claude::KEY);
    h.wait_exchanges(1).await;
}

/// `compactor run -- claude …` points the real Claude Code at the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Claude Code CLI: run scripts/test"]
async fn compactor_run_claude_reaches_the_proxy() {
    let h = Harness::start().await;
    let claude = claude::Claude::new();
    let listen = h.addr.to_string();
    let out = claude
        .run(
            Path::new(env!("CARGO_BIN_EXE_compactor")),
            &["run", "--listen", &listen, "--"],
            "say hi",
            &[],
        )
        .await;
    assert_eq!(out.code, Some(0), "{}", out.describe());
    assert!(out.stdout.contains(AUTO_TEXT), "{}", out.describe());
    assert_eq!(
        proxied_messages(&h).len(),
        1,
        "Claude Code went through the proxy"
    );
    h.wait_exchanges(1).await;
}
