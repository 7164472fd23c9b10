//! The operator's and user's tools around the proxy, through the real
//! binary and real sockets: `doctor`, `connect`, `run`, `completions`,
//! what `GET /` answers, and the logs a redirected stderr gets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::Path;
use std::process::{Command, Stdio};

use compactor::fake_upstream::{FakeUpstream, Reply};
use serde_json::{json, Value};
use support::{within, Harness};

/// One finished `compactor` process.
#[derive(Debug)]
struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// `compactor ARGS` with none of the caller's settings leaking in.
fn compactor(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_compactor"));
    c.args(args);
    for var in [
        "COMPACTOR_CONFIG",
        "COMPACTOR_LISTEN",
        "COMPACTOR_UPSTREAM",
        "COMPACTOR_DB",
        "OPENAI_API_KEY",
        "CODEX_HOME",
        "LLM_USER_PATH",
    ] {
        c.env_remove(var);
    }
    c
}

/// Runs `cmd` off the runtime (the fake upstream and proxy under test run
/// on it), killed if it takes longer than the test's step.
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

fn lines_of<'a>(out: &'a Out, subject: &str) -> Vec<&'a str> {
    let tail = format!(" {subject}:");
    out.stdout
        .lines()
        .filter(|l| {
            let mut chars = l.chars();
            chars.next();
            chars.as_str().starts_with(&tail)
        })
        .collect()
}

/// The one line about `subject`, which must start with `mark`.
fn line<'a>(out: &'a Out, mark: char, subject: &str) -> &'a str {
    let found = lines_of(out, subject);
    assert_eq!(found.len(), 1, "one {subject} line expected:\n{out:#?}");
    assert!(
        found[0].starts_with(mark),
        "{subject} should be {mark}:\n{}",
        out.stdout
    );
    found[0]
}

fn models_answer(models: &[(&str, Option<u64>)]) -> Reply {
    let data: Vec<Value> = models
        .iter()
        .map(|(id, n_ctx)| match n_ctx {
            Some(n) => json!({"id": id, "object": "model", "meta": {"n_ctx": n}}),
            None => json!({"id": id, "object": "model"}),
        })
        .collect();
    Reply::json(200, json!({"object": "list", "data": data}))
}

fn doctor(upstream: &str, db: &Path) -> Command {
    let mut c = compactor(&["doctor", "--upstream", upstream, "--db"]);
    c.arg(db);
    c
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_passes_a_healthy_setup_line_by_line() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    fake.push(models_answer(&[("gpt-4o-mini", None)]));
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("new/compactor.db");
    let out = run(doctor(&fake.url(), &db)).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    line(&out, '✓', "config");
    let up = line(&out, '✓', "upstream");
    assert!(up.contains("1 model: gpt-4o-mini"), "{up}");
    let m = line(&out, '✓', "model gpt-4o-mini");
    assert!(m.contains("128,000"), "{m}");
    let store = line(&out, '✓', "store");
    assert!(store.contains("does not exist yet"), "{store}");
    assert!(!db.exists(), "the doctor creates nothing");
    line(&out, '✓', "journal");
    let admin = line(&out, '✓', "admin");
    assert!(admin.contains("loopback clients only"), "{admin}");
    assert!(
        out.stdout.ends_with("0 failed, 0 to look at, 6 fine\n"),
        "{}",
        out.stdout
    );
    let asked = fake.received();
    assert_eq!(asked[0].path, "/v1/models", "{asked:?}");
}

/// llama-server reports its `-c` in `/v1/models` (`meta.n_ctx`); the table
/// guesses 8,192 for SmolLM2 from its name.
#[tokio::test(flavor = "multi_thread")]
async fn doctor_reports_the_window_the_upstream_states_against_the_table() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    // Once for the reachability check, once for the window discovery.
    for _ in 0..2 {
        fake.push(models_answer(&[("smollm2", Some(2048))]));
    }
    let out = run(doctor(&fake.url(), &db)).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let m = line(&out, '✓', "model smollm2");
    assert!(
        m.contains("window 2,048 (discovered") && m.contains("the models table's 8,192"),
        "{m}"
    );

    // A [[models]] entry larger than what the upstream enforces.
    let config = dir.path().join("p.toml");
    std::fs::write(
        &config,
        "[[models]]\nmatch = \"smollm2\"\ncontext_window = 8192\n",
    )
    .unwrap();
    for _ in 0..2 {
        fake.push(models_answer(&[("smollm2", Some(2048))]));
    }
    let mut cmd = doctor(&fake.url(), &db);
    cmd.arg("--config").arg(&config);
    let out = run(cmd).await;
    assert_eq!(out.code, Some(0), "a warning is not a failure: {out:#?}");
    let m = line(&out, '!', "model smollm2");
    assert!(
        m.contains("your [[models]] entry says 8,192, more than the 2,048")
            && m.contains("uses 2,048"),
        "{m}"
    );

    // connect gives the client the window the proxy uses.
    let home = tempfile::tempdir().unwrap();
    for _ in 0..2 {
        fake.push(models_answer(&[("smollm2", Some(2048))]));
    }
    let out = run(connect("aider", &fake, home.path(), &[])).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let meta: Value = serde_json::from_str(&out.stdout).expect("JSON");
    assert_eq!(meta["openai/smollm2"]["max_input_tokens"], 2048, "{meta}");
    assert_eq!(meta["openai/smollm2"]["max_output_tokens"], 512, "{meta}");
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_fails_on_an_unreachable_upstream_and_an_uncreatable_store() {
    let dir = tempfile::tempdir().unwrap();
    // A store whose directory would have to be made inside a file.
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, "x").unwrap();
    let port = support::free_port();
    let out = run(doctor(
        &format!("http://127.0.0.1:{port}/v1"),
        &blocker.join("compactor.db"),
    ))
    .await;
    assert_eq!(out.code, Some(1), "{out:#?}");
    let up = line(&out, '✗', "upstream");
    // Which server, once, without the doubled "unreachable: upstream unreachable".
    assert!(
        up.contains(&format!(
            "cannot reach http://127.0.0.1:{port}/v1: connection to http://127.0.0.1:{port} failed"
        )),
        "{up}"
    );
    assert!(!up.contains("unreachable"), "{up}");
    line(&out, '✗', "store");
    assert!(out.stdout.contains("2 failed"), "{}", out.stdout);

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[compaction]\ntriger_ratio = 0.5\n").unwrap();
    let mut cmd = compactor(&["doctor", "--config"]);
    cmd.arg(&bad);
    let out = run(cmd).await;
    assert_eq!(out.code, Some(1), "{out:#?}");
    assert!(
        line(&out, '✗', "config").contains("triger_ratio"),
        "{out:#?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_sees_a_running_proxy_and_a_torn_journal() {
    let mut h = Harness::start().await;
    let (status, _, _) = support::post(
        &format!("{}/chat/completions", h.url()),
        "sk-test",
        &json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 200);
    h.wait_exchanges(1).await;
    let out = run(doctor(&h.fake.url(), &h.db)).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let store = line(&out, '✓', "store");
    assert!(store.contains("is writable (1 conversations)"), "{store}");
    let journal = line(&out, '✓', "journal");
    assert!(
        journal.contains("a running proxy serves this store"),
        "{journal}"
    );
    h.stop().await;

    // A kill in the middle of a write leaves part of a frame behind.
    let mut log = h.db.as_os_str().to_owned();
    log.push("-exchanges");
    std::fs::write(&log, [200u8, 0, 0, 0, 1, 2, 3]).unwrap();
    let out = run(doctor(&h.fake.url(), &h.db)).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let journal = line(&out, '!', "journal");
    assert!(
        journal.contains("7 bytes of a record cut short"),
        "{journal}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_says_who_may_use_the_admin_api() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let mut cmd = doctor(&fake.url(), &db);
    cmd.args(["--listen", "0.0.0.0:8787"]);
    let out = run(cmd).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    assert!(
        line(&out, '!', "admin").contains("refuses every request"),
        "{out:#?}"
    );

    let config = dir.path().join("p.toml");
    std::fs::write(
        &config,
        "[admin]\ntoken_env = \"DOCTOR_TEST_TOKEN\"\n[upstream]\napi_key_env = \"DOCTOR_TEST_KEY\"\n",
    )
    .unwrap();
    let mut cmd = doctor(&fake.url(), &db);
    cmd.args(["--listen", "0.0.0.0:8787", "--config"])
        .arg(&config)
        .env("DOCTOR_TEST_TOKEN", "short")
        .env("DOCTOR_TEST_KEY", "sk-proxy-secret");
    let out = run(cmd).await;
    assert!(
        line(&out, '!', "admin").contains("easy to guess"),
        "{out:#?}"
    );
    assert!(
        line(&out, '!', "exposure").contains("spends that key"),
        "{out:#?}"
    );
    assert!(
        !out.stdout.contains("sk-proxy-secret") && !out.stdout.contains("short"),
        "{out:#?}"
    );
    let sent = fake.last().expect("asked /v1/models");
    assert_eq!(
        sent.headers["authorization"], "Bearer sk-proxy-secret",
        "the doctor asks as the proxy would"
    );

    let mut cmd = doctor(&fake.url(), &db);
    cmd.args(["--listen", "0.0.0.0:8787", "--config"])
        .arg(&config)
        .env("DOCTOR_TEST_TOKEN", "a-long-enough-admin-token");
    let out = run(cmd).await;
    assert!(
        line(&out, '✓', "admin").contains("wants the token in DOCTOR_TEST_TOKEN"),
        "{out:#?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn get_root_points_to_the_admin_page_and_the_docs() {
    let mut h = Harness::start().await;
    let resp = within(support::client().get(format!("http://{}/", h.addr)).send())
        .await
        .expect("GET /");
    assert_eq!(resp.status(), 200);
    let body: Value = within(resp.json()).await.expect("JSON");
    assert_eq!(body["admin"], "/admin/", "{body}");
    assert_eq!(body["health"], "/healthz", "{body}");
    assert!(
        body["docs"].as_str().is_some_and(|d| d.contains("README")),
        "{body}"
    );
    h.stop().await;
}

/// `GET path` of the proxy: status and JSON.
async fn get_json_status(h: &Harness, path: &str) -> (u16, Value) {
    let resp = within(
        support::client()
            .get(format!("http://{}{path}", h.addr))
            .send(),
    )
    .await
    .expect("GET");
    let status = resp.status().as_u16();
    (status, within(resp.json()).await.expect("JSON"))
}

#[tokio::test(flavor = "multi_thread")]
async fn readyz_answers_for_the_store_and_the_upstream_healthz_for_the_process() {
    // Up: nothing exchanged yet, so the upstream is asked (`/v1/models`).
    let mut h = Harness::start().await;
    let (status, body) = get_json_status(&h, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "ready");
    assert_eq!(body["checks"]["store"]["ok"], true, "{body}");
    assert!(
        body["checks"]["upstream"]["probe_status"].is_u64(),
        "{body}"
    );
    assert!(h
        .fake
        .received()
        .iter()
        .any(|r| r.path.ends_with("/models")));
    // After an exchange answered whole, it is not asked again.
    let (status, _, _) = support::post(
        &format!("{}/chat/completions", h.url()),
        "k",
        &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 200);
    let asked = h.fake.count();
    let (status, body) = get_json_status(&h, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body["checks"]["upstream"]["reached_ms_ago"].is_u64(),
        "{body}"
    );
    assert_eq!(
        h.fake.count(),
        asked,
        "no probe while the upstream answered lately"
    );
    let (_, root) = get_json_status(&h, "/").await;
    assert_eq!(root["ready"], "/readyz", "{root}");
    h.stop().await;

    // Down: nothing listens where the upstream should be. Not ready, with
    // the reason; the process itself is alive.
    let (port, _dead) = support::dead_port();
    let mut h =
        Harness::start_with(|c| c.upstream.base_url = format!("http://127.0.0.1:{port}/v1")).await;
    let (status, body) = get_json_status(&h, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "not_ready");
    assert_eq!(body["checks"]["store"]["ok"], true, "{body}");
    assert_eq!(body["checks"]["upstream"]["ok"], false, "{body}");
    assert!(body["checks"]["upstream"]["error"].is_string(), "{body}");
    let (status, body) = get_json_status(&h, "/healthz").await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")));
    h.stop().await;
}

/// `compactor serve` on a free port against `upstream`, with `extra`
/// arguments, its log redirected: the process, its port, its store's
/// folder, and its log's lines as they come.
fn serve_logged(
    upstream: &str,
    extra: &[&std::ffi::OsStr],
) -> (
    support::Binary,
    u16,
    tempfile::TempDir,
    std::sync::mpsc::Receiver<String>,
) {
    use std::io::{BufRead, BufReader};
    let port = support::free_port();
    let dir = tempfile::tempdir().unwrap();
    let mut child = support::Binary(
        compactor(&["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--upstream", upstream, "--db"])
            .arg(dir.path().join("c.db"))
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start compactor"),
    );
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, port, dir, rx)
}

/// The start-up banner of `compactor serve` with `extra` arguments.
fn banner(extra: &[&std::ffi::OsStr]) -> String {
    let (_child, _, _dir, lines) = serve_logged("http://127.0.0.1:9/v1", extra);
    loop {
        let line = lines.recv_timeout(support::STEP).expect("the banner");
        if line.contains("compactor listening") {
            break line;
        }
    }
}

/// An upstream nothing listens on is said at start-up, naming it, and the
/// first request's 502 names it too.
#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_upstream_is_said_at_start_up_and_in_the_502() {
    let (dead, _held) = support::dead_port();
    let (_child, port, _dir, lines) = serve_logged(&format!("http://127.0.0.1:{dead}/v1"), &[]);
    let warned = loop {
        let line = lines
            .recv_timeout(support::STEP)
            .expect("a warning after the banner");
        if line.contains("cannot reach the upstream") {
            break line;
        }
    };
    assert!(warned.contains("WARN"), "{warned}");
    assert!(
        warned.contains(&format!("connection to http://127.0.0.1:{dead} failed")),
        "{warned}"
    );
    let (status, _, body) = within(support::post(
        &format!("http://127.0.0.1:{port}/v1/chat/completions"),
        "sk-test",
        &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ))
    .await;
    let body: Value = serde_json::from_slice(&body).expect("a JSON error");
    assert_eq!(status, 502, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("http://127.0.0.1:{dead}")),
        "the 502 names the upstream: {body}"
    );
    assert!(!message.contains("sk-test"), "{body}");
}

#[test]
fn logs_to_a_redirected_stderr_carry_no_colour_codes() {
    let line = banner(&[]);
    assert!(
        !line.contains('\u{1b}'),
        "escape codes in a redirected log: {line:?}"
    );
}

/// The banner lists the models table in the order it applies: the first
/// pattern that matches a model gives that model's window, a `[[models]]`
/// fallback of `*` written first included.
#[test]
fn the_banner_lists_models_in_the_order_they_apply() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("p.toml");
    std::fs::write(
        &config,
        "[[models]]\nmatch = \"*\"\ncontext_window = 50000\n\n\
         [[models]]\nmatch = \"my-model*\"\ncontext_window = 9000\n",
    )
    .unwrap();
    let line = banner(&["--config".as_ref(), config.as_os_str()]);
    let listed = line
        .split(" models=")
        .nth(1)
        .and_then(|rest| rest.split(" windows_told=").next())
        .unwrap_or_else(|| panic!("no models in {line}"));
    let rows: Vec<(&str, u64)> = listed
        .split(", ")
        .map(|row| {
            let (pattern, rest) = row.split_once('=').expect("pattern=window");
            let window = rest.split(' ').next().unwrap().parse().expect("a window");
            (pattern, window)
        })
        .collect();
    for (model, window) in [
        ("my-model-7b", 9000),
        ("gpt-5-codex", 400_000),
        ("claude-sonnet-4", 200_000),
        ("something-else", 50_000),
    ] {
        let first = rows
            .iter()
            .find(|(p, _)| compactor::config::glob_match(p, model))
            .unwrap_or_else(|| panic!("nothing matches {model}: {listed}"));
        assert_eq!(first.1, window, "{model}: {listed}");
    }
    assert_eq!(
        rows.iter().filter(|(p, _)| *p == "*").count(),
        1,
        "{listed}"
    );
}

#[tokio::test]
async fn completions_are_scripts_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let out = run(compactor(&["completions", shell])).await;
        assert_eq!(out.code, Some(0), "{out:#?}");
        for sub in ["doctor", "connect", "serve", "conversations"] {
            assert!(out.stdout.contains(sub), "{shell} lacks {sub}");
        }
    }
    // bash itself reads the bash one.
    let script = run(compactor(&["completions", "bash"])).await.stdout;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("compactor.bash");
    std::fs::write(&path, script).unwrap();
    let mut check = Command::new("bash");
    check.arg("-c").arg(format!(
        "source {} && complete -p compactor",
        path.display()
    ));
    let out = run(check).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    assert!(out.stdout.contains("compactor"), "{out:#?}");
}

// ---------------------------------------------------------------------------
// connect and run

/// `compactor connect CLIENT` against the fake (for the model list and
/// window) with the client's files under `home`.
fn connect(client: &str, fake: &FakeUpstream, home: &Path, extra: &[&str]) -> Command {
    let mut c = compactor(&["connect", client, "--upstream", &fake.url()]);
    if !extra.contains(&"--listen") {
        c.args(["--listen", "127.0.0.1:8787"]);
    }
    c.args(extra)
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("CODEX_HOME", home.join("codex"))
        .env("LLM_USER_PATH", home.join("llm"));
    c
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_aider_writes_metadata_aider_reads_as_json() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    let home = tempfile::tempdir().unwrap();
    fake.push(models_answer(&[("gpt-4o", None)]));
    let out = run(connect("aider", &fake, home.path(), &["--write"])).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let text = std::fs::read_to_string(home.path().join(".aider.model.metadata.json")).unwrap();
    let meta: Value = serde_json::from_str(&text).expect("JSON");
    let entry = &meta["openai/gpt-4o"];
    assert_eq!(entry["max_input_tokens"], 128_000, "{meta}");
    assert_eq!(entry["litellm_provider"], "openai", "{meta}");
    assert!(
        out.stderr
            .contains("OPENAI_API_BASE=http://127.0.0.1:8787/v1 aider --model openai/gpt-4o"),
        "{out:#?}"
    );
}

/// opencode, Qwen Code and goose each get the window the proxy uses for
/// the model (here the one the upstream states) in their own setting,
/// read back from the file written.
#[tokio::test(flavor = "multi_thread")]
async fn connect_writes_each_agents_window_where_it_reads_it() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    let home = tempfile::tempdir().unwrap();
    for client in ["opencode", "qwen", "goose"] {
        // The listing names the model; the window is asked after it.
        fake.push(models_answer(&[("served-coder", Some(24_576))]));
        fake.push(models_answer(&[("served-coder", Some(24_576))]));
        let out = run(connect(client, &fake, home.path(), &["--write"])).await;
        assert_eq!(out.code, Some(0), "{client}: {out:#?}");
    }
    let opencode: Value = serde_json::from_str(
        &std::fs::read_to_string(home.path().join(".config/opencode/opencode.json")).unwrap(),
    )
    .expect("opencode.json is JSON");
    let model = &opencode["provider"]["compactor"]["models"]["served-coder"];
    assert_eq!(model["limit"]["context"], 24_576, "{opencode}");
    assert_eq!(
        opencode["provider"]["compactor"]["options"]["baseURL"],
        "http://127.0.0.1:8787/v1"
    );
    assert_eq!(opencode["model"], "compactor/served-coder");

    let qwen: Value = serde_json::from_str(
        &std::fs::read_to_string(home.path().join(".qwen/settings.json")).unwrap(),
    )
    .expect("settings.json is JSON");
    let entry = &qwen["modelProviders"]["openai"][0];
    assert_eq!(
        entry["generationConfig"]["contextWindowSize"], 24_576,
        "{qwen}"
    );
    assert_eq!(entry["baseUrl"], "http://127.0.0.1:8787/v1");

    let goose = std::fs::read_to_string(home.path().join(".config/goose/config.yaml")).unwrap();
    assert!(goose.contains("GOOSE_CONTEXT_LIMIT: 24576\n"), "{goose}");
    assert!(
        goose.contains("OPENAI_HOST: \"http://127.0.0.1:8787\"\n"),
        "{goose}"
    );
}

/// Gemini CLI assumes 1,048,576 tokens for every model and compresses at
/// `model.compressionThreshold` of it: the share written puts that point a
/// quarter past the proxy's window when the proxy compacts (never reached),
/// at half the window when it only observes. Read back from the file.
#[tokio::test(flavor = "multi_thread")]
async fn connect_gemini_cli_writes_the_window_as_its_compression_threshold() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    let home = tempfile::tempdir().unwrap();
    let file = home.path().join(".gemini/settings.json");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(&file, r#"{"ui": {"theme": "Dracula"}}"#).unwrap();
    let point = |settings: &Value| {
        let share = settings["model"]["compressionThreshold"].as_f64().unwrap();
        (share * 1_048_576.0).round() as u64
    };
    let read = || -> Value {
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).expect("JSON")
    };
    // A Gemini upstream's listing names the model and states its window.
    let listing = json!({"models": [{"name": "models/served-gemini", "inputTokenLimit": 24_576}]});
    fake.push(Reply::json(200, listing.clone()));
    fake.push(Reply::json(200, listing));
    let out = run(connect(
        "gemini-cli",
        &fake,
        home.path(),
        &["--write", "--yes"],
    ))
    .await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let settings = read();
    assert_eq!(point(&settings), 24_576 * 5 / 4, "{settings}");
    assert_eq!(settings["model"]["name"], "served-gemini");
    assert_eq!(
        settings["security"]["auth"]["selectedType"],
        "gemini-api-key"
    );
    assert_eq!(settings["ui"]["theme"], "Dracula", "the user's keys stay");
    assert!(
        out.stderr
            .contains("GOOGLE_GEMINI_BASE_URL=http://127.0.0.1:8787 gemini"),
        "{out:#?}"
    );

    // A proxy that only observes: Gemini CLI compresses at half the window.
    let config = home.path().join("proxy.toml");
    std::fs::write(&config, "[compaction]\nmode = \"observe\"\n").unwrap();
    let args = ["--write", "--yes", "--model", "served-gemini", "--offline"];
    let mut c = connect("gemini-cli", &fake, home.path(), &args);
    c.arg("--config").arg(&config);
    let out = run(c).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let table = compactor::config::Config::default().model_limits("served-gemini");
    assert_eq!(point(&read()), table.context_window / 2, "{out:#?}");
    assert!(out.stderr.contains("compresses by itself"), "{out:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_llm_writes_yaml_llm_can_load() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    let home = tempfile::tempdir().unwrap();
    let file = home.path().join("llm/extra-openai-models.yaml");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(&file, "# mine\n- model_id: local\n  model_name: x\n").unwrap();
    let out = run(connect(
        "llm",
        &fake,
        home.path(),
        &["--model", "gpt-4o", "--write"],
    ))
    .await;
    assert_eq!(
        out.code,
        Some(1),
        "an existing file that changes wants --yes: {out:#?}"
    );
    assert!(
        out.stderr.contains("+- model_id: \"compactor-gpt-4o\""),
        "the diff: {out:#?}"
    );
    let out = run(connect(
        "llm",
        &fake,
        home.path(),
        &["--model", "gpt-4o", "--write", "--yes"],
    ))
    .await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    // llm reads the file with PyYAML's safe_load.
    let mut load = Command::new("python3");
    load.args([
        "-c",
        "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
    ])
    .arg(&file);
    let loaded = run(load).await;
    assert_eq!(loaded.code, Some(0), "{loaded:#?}");
    let entries: Value = serde_json::from_str(&loaded.stdout).expect("JSON");
    assert_eq!(
        entries,
        json!([
            {"model_id": "local", "model_name": "x"},
            // Without supports_tools, `llm -T` refuses the model.
            {"model_id": "compactor-gpt-4o", "model_name": "gpt-4o", "api_base": "http://127.0.0.1:8787/v1",
             "supports_tools": true},
        ])
    );
}

#[tokio::test]
async fn connect_openai_env_and_run_set_the_base_url() {
    let out = run(compactor(&[
        "connect",
        "openai-env",
        "--listen",
        "127.0.0.1:4321",
    ]))
    .await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let mut shell = Command::new("sh");
    shell.args([
        "-c",
        &format!(
            "{}\nprintf '%s %s' \"$OPENAI_BASE_URL\" \"$OPENAI_API_BASE\"",
            out.stdout
        ),
    ]);
    let set = run(shell).await;
    assert_eq!(
        set.stdout, "http://127.0.0.1:4321/v1 http://127.0.0.1:4321/v1",
        "{set:#?}"
    );

    let out = run(compactor(&[
        "run",
        "--listen",
        "0.0.0.0:4322",
        "--",
        "sh",
        "-c",
        "printf '%s %s %s' \"$OPENAI_BASE_URL\" \"$OPENAI_API_BASE\" \"$GOOGLE_GEMINI_BASE_URL\"; exit 7",
    ]))
    .await;
    assert_eq!(out.code, Some(7), "the client's status: {out:#?}");
    assert_eq!(
        out.stdout,
        "http://127.0.0.1:4322/v1 http://127.0.0.1:4322/v1 http://127.0.0.1:4322"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_codex_refuses_to_change_a_config_silently() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    let home = tempfile::tempdir().unwrap();
    let file = home.path().join("codex/config.toml");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    let mine = "# my settings\napproval_policy = \"never\"\nmodel = \"o3\"\n";
    std::fs::write(&file, mine).unwrap();
    let args = ["--model", "gpt-5", "--offline", "--write"];
    let out = run(connect("codex", &fake, home.path(), &args)).await;
    assert_eq!(out.code, Some(1), "{out:#?}");
    assert!(
        out.stderr.contains("-model = \"o3\"") && out.stderr.contains("--yes"),
        "{out:#?}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), mine, "untouched");
    let out = run(connect(
        "codex",
        &fake,
        home.path(),
        &[&args[..], &["--yes"]].concat(),
    ))
    .await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let written = std::fs::read_to_string(&file).unwrap();
    assert!(written.starts_with("# my settings\n"), "{written}");
    let doc: toml::Table = toml::from_str(&written).expect("TOML");
    assert_eq!(doc["approval_policy"].as_str(), Some("never"));
    assert_eq!(doc["model"].as_str(), Some("gpt-5"));
    // A quarter above the proxy's 400,000: Codex's own compaction (at 90%
    // of it) never comes before the proxy's.
    assert_eq!(doc["model_context_window"].as_integer(), Some(500_000));
    assert_eq!(
        doc["model_providers"]["compactor"]["base_url"].as_str(),
        Some("http://127.0.0.1:8787/v1")
    );
    assert!(fake.received().is_empty(), "--offline asks nobody");
    let out = run(connect("codex", &fake, home.path(), &args)).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    assert!(out.stdout.contains("nothing to write"), "{out:#?}");
}

/// README and what `connect codex` writes agree: every README sentence
/// naming `model_auto_compact_token_limit` also names the key that really
/// leaves compaction to the proxy, when connect does not write it.
#[tokio::test(flavor = "multi_thread")]
async fn the_readme_tells_codex_users_what_connect_writes() {
    let fake = within(FakeUpstream::start()).await.expect("fake");
    let home = tempfile::tempdir().unwrap();
    let args = ["--model", "gpt-5", "--offline", "--write"];
    let out = run(connect("codex", &fake, home.path(), &args)).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let written = std::fs::read_to_string(home.path().join("codex/config.toml")).unwrap();
    let doc: toml::Table = toml::from_str(&written).expect("TOML");
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let key = "model_auto_compact_token_limit";
    let sentences: Vec<String> = readme
        .split("\n\n")
        .flat_map(|p| {
            p.replace('\n', " ")
                .split(". ")
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .filter(|s| s.contains(key))
        .collect();
    assert!(
        !sentences.is_empty(),
        "the README says how Codex's own compaction is left to the proxy"
    );
    for s in &sentences {
        if !doc.contains_key(key) {
            assert!(
                s.contains("`model_context_window`") && doc.contains_key("model_context_window"),
                "a sentence that names {key} without the window connect writes: {s}"
            );
        }
    }
}

/// The real Codex CLI loads what `connect codex --write` wrote (with
/// `--strict-config`, so an unknown key fails it) and talks through the
/// proxy with it.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs the Codex CLI (COMPACTOR_CODEX_BIN; scripts/test installs it)"]
async fn codex_runs_on_the_config_connect_writes() {
    let bin = std::env::var_os("COMPACTOR_CODEX_BIN")
        .expect("COMPACTOR_CODEX_BIN names the Codex binary (scripts/test sets it)");
    let mut h = Harness::start().await;
    let home = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    h.fake.push(models_answer(&[("tiny-codex", Some(32_768))]));
    let out = run(connect(
        "codex",
        &h.fake,
        home.path(),
        &["--listen", &h.addr.to_string(), "--write"],
    ))
    .await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let mut codex = Command::new(bin);
    codex
        .args(["exec", "--strict-config", "--skip-git-repo-check", "say hi"])
        .current_dir(work.path())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .env("CODEX_HOME", home.path().join("codex"))
        .env("OPENAI_API_KEY", "sk-test")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("TERM", "dumb");
    let out = run(codex).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let asked: Vec<_> = h
        .fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/responses")
        .collect();
    assert!(!asked.is_empty(), "Codex went through the proxy");
    assert_eq!(asked[0].json()["model"], "tiny-codex");
    h.stop().await;
}

// ---------------------------------------------------------------------------
// deployment files

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// A YAML file as JSON, read by PyYAML (what docker compose's own schema
/// check would need a daemon-side tool for).
async fn yaml(path: &str) -> Value {
    let mut load = Command::new("python3");
    load.args([
        "-c",
        "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
    ])
    .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(path));
    let out = run(load).await;
    assert_eq!(out.code, Some(0), "{path}: {out:#?}");
    serde_json::from_str(&out.stdout).expect("JSON")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_grafana_dashboard_charts_metrics_the_proxy_serves() {
    let mut h = Harness::start().await;
    let resp = within(
        support::client()
            .get(format!("http://{}/metrics", h.addr))
            .send(),
    )
    .await
    .expect("GET /metrics");
    let text = within(resp.text()).await.expect("body");
    h.stop().await;
    let served: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    let dashboard: Value = serde_json::from_str(&repo_file("docs/grafana-dashboard.json")).unwrap();
    let panels = dashboard["panels"].as_array().expect("panels");
    let name = regex::Regex::new(r"compactor_[a-z_]+").unwrap();
    let mut charted = 0;
    for target in panels.iter().flat_map(|p| p["targets"].as_array().unwrap()) {
        let expr = target["expr"].as_str().expect("expr");
        for m in name.find_iter(expr) {
            let metric = m.as_str();
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| metric.strip_suffix(s))
                .unwrap_or(metric);
            assert!(
                served.contains(&base),
                "{metric} is not in /metrics ({served:?})"
            );
            charted += 1;
        }
    }
    assert!(charted >= 10, "{charted} metric uses");
}

#[tokio::test]
async fn compose_and_prometheus_scrape_the_proxy_where_it_listens() {
    let prometheus = yaml("docs/prometheus.yml").await;
    let job = &prometheus["scrape_configs"][0];
    assert_eq!(job["metrics_path"], "/metrics");
    assert_eq!(
        job["static_configs"][0]["targets"][0],
        compactor::config::DEFAULT_LISTEN
    );
    let compose = yaml("compose.yaml").await;
    let services = &compose["services"];
    assert_eq!(services["prometheus"]["network_mode"], "service:compactor");
    let mounts = services["prometheus"]["volumes"].to_string();
    assert!(
        mounts.contains("./docs/prometheus.yml:/etc/prometheus/prometheus.yml"),
        "{mounts}"
    );
    let proxy = &services["compactor"];
    assert_eq!(proxy["volumes"][0], "compactor-data:/data");
    let ports = proxy["ports"].to_string();
    assert!(
        ports.contains("8787:8787") && ports.contains("9090:9090"),
        "{ports}"
    );
    // The records on the compose file's PostgreSQL, once it is healthy.
    let url = proxy["environment"]["COMPACTOR_DATABASE_URL"]
        .as_str()
        .expect("COMPACTOR_DATABASE_URL");
    assert!(
        url.starts_with("postgres://") && url.contains("@postgres:5432/"),
        "{url}"
    );
    assert_eq!(
        proxy["depends_on"]["postgres"]["condition"],
        "service_healthy"
    );
    let postgres = &services["postgres"];
    assert_eq!(
        postgres["environment"]["POSTGRES_PASSWORD"],
        proxy["environment"]["PGPASSWORD"]
    );
    assert!(postgres["healthcheck"]["test"]
        .to_string()
        .contains("pg_isready"));
    let config = compactor::config::Config {
        store: compactor::config::StoreConfig {
            url: url.into(),
            ..Default::default()
        },
        ..Default::default()
    };
    config
        .validate()
        .expect("the compose file's database URL is valid");
}

/// The settings the Dockerfile and the systemd unit start the proxy with
/// are ones it accepts.
#[tokio::test]
async fn the_image_and_the_unit_start_the_proxy_with_valid_settings() {
    let dir = tempfile::tempdir().unwrap();
    let proxy_toml = Path::new(env!("CARGO_MANIFEST_DIR")).join("proxy.toml");
    let docker = repo_file("Dockerfile");
    let env_value = |key: &str| {
        let at = docker
            .find(&format!("{key}="))
            .unwrap_or_else(|| panic!("ENV {key}"));
        docker[at + key.len() + 1..]
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    assert_eq!(env_value("COMPACTOR_CONFIG"), "/etc/compactor/proxy.toml");
    assert!(docker.contains("COPY proxy.toml /etc/compactor/proxy.toml"));
    let listen = env_value("COMPACTOR_LISTEN");
    let db = env_value("COMPACTOR_DB");
    assert!(
        db.starts_with("/data/") && docker.contains("VOLUME [\"/data\"]"),
        "{db}"
    );
    let port = listen.rsplit(':').next().unwrap();
    assert!(
        docker.contains(&format!("http://127.0.0.1:{port}/healthz")),
        "health check port"
    );
    assert!(docker.contains(&format!("EXPOSE {port}")));
    assert!(docker.contains("\nUSER compactor\n"), "not root");
    let mut check = compactor(&["serve", "--check-config"]);
    check
        .env("COMPACTOR_CONFIG", &proxy_toml)
        .env("COMPACTOR_LISTEN", &listen)
        .env("COMPACTOR_DB", dir.path().join("c.db"));
    let out = run(check).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    assert!(out.stdout.contains(&listen), "{out:#?}");

    let unit = repo_file("docs/compactor.service");
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart");
    let mut words = exec.split_whitespace();
    assert_eq!(words.next(), Some("/usr/local/bin/compactor"));
    let args: Vec<String> = words
        .map(|w| match w {
            "/etc/compactor/proxy.toml" => proxy_toml.display().to_string(),
            w if w.starts_with("/var/lib/compactor/") => {
                dir.path().join("u.db").display().to_string()
            }
            w => w.to_string(),
        })
        .collect();
    assert!(unit.contains("StateDirectory=compactor"));
    let mut check = compactor(&[]);
    check.args(&args).arg("--check-config");
    let out = run(check).await;
    assert_eq!(out.code, Some(0), "{args:?}: {out:#?}");
}
