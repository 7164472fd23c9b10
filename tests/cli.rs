//! The `compactor` binary's configuration handling.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn compactor() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_compactor"));
    for var in [
        "COMPACTOR_CONFIG",
        "COMPACTOR_LISTEN",
        "COMPACTOR_UPSTREAM",
        "COMPACTOR_DB",
        "COMPACTOR_DATABASE_URL",
        "PGPASSWORD",
    ] {
        c.env_remove(var);
    }
    c
}

fn run(cmd: &mut Command) -> (i32, String) {
    let out = cmd.output().expect("run compactor");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn the_example_config_checks_out() {
    let (code, out) = run(compactor().args([
        "serve",
        "--config",
        concat!(env!("CARGO_MANIFEST_DIR"), "/proxy.toml"),
        "--check-config",
    ]));
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("127.0.0.1:8787") && out.contains("https://api.openai.com/v1"),
        "{out}"
    );
}

#[test]
fn unknown_keys_are_named_and_exit_64() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[compaction]\ntriger_ratio = 0.5\n").unwrap();
    let (code, out) = run(compactor()
        .args(["serve", "--check-config", "--config"])
        .arg(&path));
    assert_eq!(code, 64, "{out}");
    assert!(out.contains("triger_ratio"), "{out}");
}

#[test]
fn flags_beat_env_beat_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.toml");
    std::fs::write(
        &path,
        "[server]\nlisten = \"127.0.0.1:1111\"\n[upstream]\nbase_url = \"http://file.invalid/v1\"\n[store]\npath = \"file.db\"\n",
    )
    .unwrap();
    let (code, out) = run(compactor()
        .args(["serve", "--check-config", "--listen", "127.0.0.1:3333"])
        .env("COMPACTOR_CONFIG", &path)
        .env("COMPACTOR_LISTEN", "127.0.0.1:2222")
        .env("COMPACTOR_UPSTREAM", "http://env.invalid/v1"));
    assert_eq!(code, 0, "{out}");
    let setting = |key: &str| -> Vec<String> {
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(key))
            .unwrap_or_else(|| panic!("{key} in {out}"));
        line.split_whitespace().skip(1).map(String::from).collect()
    };
    assert_eq!(
        setting("server.listen"),
        ["\"127.0.0.1:3333\"", "flag", "--listen"],
        "flag wins: {out}"
    );
    assert_eq!(
        setting("upstream.base_url"),
        ["\"http://env.invalid/v1\"", "env", "COMPACTOR_UPSTREAM"],
        "env beats file: {out}"
    );
    assert_eq!(
        setting("store.path"),
        ["\"file.db\"", "file"],
        "file beats default: {out}"
    );
    assert_eq!(setting("compaction.trigger_ratio"), ["0.75", "default"]);
    assert!(
        out.contains("config file: ") && out.contains("(env COMPACTOR_CONFIG)"),
        "{out}"
    );
    let (code, out) = run(compactor().args(["serve", "--check-config"]));
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("127.0.0.1:8787") && out.contains("compactor.db"),
        "defaults: {out}"
    );
}

#[test]
fn check_config_with_an_unreachable_database_fails_and_never_prints_its_password() {
    // A port nothing listens on, a moment ago.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://compactor:s3cret-pw@127.0.0.1:{port}/compactor");
    let (code, out) = run(compactor()
        .args(["serve", "--check-config"])
        .env("COMPACTOR_DATABASE_URL", &url));
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "database: postgres://compactor:***@127.0.0.1:{port}/compactor"
        )) && out.contains("env COMPACTOR_DATABASE_URL"),
        "shown masked: {out}"
    );
    assert!(out.contains("cannot reach the database"), "{out}");
    assert!(!out.contains("s3cret-pw"), "the password leaked: {out}");
    // The flag too, and a URL that is not PostgreSQL's is a usage error.
    let (code, out) = run(compactor().args([
        "serve",
        "--check-config",
        "--database-url",
        "mysql://u:s3cret-pw@127.0.0.1/x",
    ]));
    assert_eq!(code, 64, "{out}");
    assert!(
        out.contains("store.url") && !out.contains("s3cret-pw"),
        "{out}"
    );
}

#[test]
fn bad_values_exit_64() {
    let (code, out) =
        run(compactor().args(["serve", "--check-config", "--listen", "not-an-address"]));
    assert_eq!(code, 64, "{out}");
    assert!(out.contains("server.listen"), "{out}");
}

#[test]
fn an_unset_api_key_env_fails_the_check_with_64() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("key.toml");
    std::fs::write(
        &path,
        "[upstream]\napi_key_env = \"COMPACTOR_TEST_UNSET_KEY_VAR\"\n",
    )
    .unwrap();
    let check = |set: Option<&str>| {
        let mut cmd = compactor();
        cmd.args(["serve", "--check-config", "--config"]).arg(&path);
        match set {
            Some(v) => cmd.env("COMPACTOR_TEST_UNSET_KEY_VAR", v),
            None => cmd.env_remove("COMPACTOR_TEST_UNSET_KEY_VAR"),
        };
        run(&mut cmd)
    };
    for unset in [None, Some("")] {
        let (code, out) = check(unset);
        assert_eq!(code, 64, "{out}");
        assert!(
            out.contains("upstream.api_key_env") && out.contains("COMPACTOR_TEST_UNSET_KEY_VAR"),
            "{out}"
        );
        assert!(!out.contains("configuration OK"), "{out}");
    }
    let (code, out) = check(Some("sk-server-key"));
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("sk-server-key"), "{out}");
}

#[test]
fn toml_errors_carry_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("typo.toml");
    std::fs::write(
        &path,
        "[server]\nlisten = \"127.0.0.1:1\"\nmax_body_bytes = \"lots\"\n",
    )
    .unwrap();
    let (code, out) = run(compactor()
        .args(["serve", "--check-config", "--config"])
        .arg(&path));
    assert_eq!(code, 64, "{out}");
    assert!(out.contains("line 3, column 18"), "{out}");
}

#[test]
fn an_upstream_at_the_proxys_own_address_is_refused_at_start_up() {
    for (listen, upstream) in [
        ("127.0.0.1:8787", "http://127.0.0.1:8787/v1"),
        ("127.0.0.1:8787", "http://localhost:8787/v1"),
        ("0.0.0.0:8787", "http://127.0.0.1:8787/v1"),
        ("127.0.0.1:8787", "http://0.0.0.0:8787/v1"),
    ] {
        let (code, out) = run(compactor().args([
            "serve",
            "--check-config",
            "--listen",
            listen,
            "--upstream",
            upstream,
        ]));
        assert_eq!(code, 64, "{listen} {upstream}: {out}");
        assert!(out.contains("upstream.base_url"), "{out}");
    }
    // `serve` itself exits before it listens (or it is killed, and fails).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let mut child = compactor()
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--upstream", &format!("http://localhost:{port}/v1")])
        .arg("--db")
        .arg(dir.path().join("c.db"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if started.elapsed() > std::time::Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(status, Some(64), "serve must refuse to start");
}

#[test]
fn check_config_shows_a_key_given_by_env_masked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("key.toml");
    std::fs::write(
        &path,
        "[upstream]\napi_key_env = \"CHECK_CONFIG_TEST_KEY\"\n[admin]\ntoken_env = \"CHECK_CONFIG_TEST_TOKEN\"\n",
    )
    .unwrap();
    let key = "sk-check-config-secret-0123456789";
    let (code, out) = run(compactor()
        .args(["serve", "--check-config", "--config"])
        .arg(&path)
        .env("CHECK_CONFIG_TEST_KEY", key)
        .env_remove("CHECK_CONFIG_TEST_TOKEN"));
    assert_eq!(code, 0, "{out}");
    let line = |key: &str| {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(key))
            .unwrap_or_else(|| panic!("{key} in {out}"))
            .to_string()
    };
    let shown = line("upstream.api_key");
    assert!(shown.contains("[set, 33 characters]"), "{shown}");
    assert!(
        shown.trim_end().ends_with("env CHECK_CONFIG_TEST_KEY"),
        "{shown}"
    );
    assert!(
        !out.contains("0123456789") && !out.contains("sk-check"),
        "masked: {out}"
    );
    assert!(line("upstream.api_key_env").trim_end().ends_with("file"));
    assert!(line("admin.token").contains("[unset]"), "{out}");
}

/// With a PostgreSQL store, `conversations` and `prune` read and delete
/// there. Once they read the default SQLite file beside the database the
/// proxies share, saying nothing; with the database unreachable they must
/// fail naming it, never print its password, and create no SQLite file.
#[test]
fn store_commands_on_an_unreachable_postgres_store_fail_and_open_no_sqlite_file() {
    let home = tempfile::tempdir().unwrap();
    for args in [
        &["conversations", "list"][..],
        &["conversations", "show", "conv_0123"][..],
        &["prune", "--older-than", "30d"][..],
    ] {
        let (code, out) = run(compactor()
            .args(args)
            .args(["--database-url", "postgres://u:s3cret-pw@127.0.0.1:1/x"])
            .env("HOME", home.path())
            .env("XDG_DATA_HOME", home.path().join("data")));
        assert_eq!(code, 1, "{args:?}: {out}");
        assert!(
            out.contains("cannot read the PostgreSQL store"),
            "{args:?}: {out}"
        );
        assert!(
            !out.contains("s3cret-pw"),
            "{args:?}: the password leaked: {out}"
        );
    }
    assert!(
        !home.path().join("data").exists(),
        "no SQLite store was created"
    );
}

/// Without `--config` or `COMPACTOR_CONFIG`, a `proxy.toml` in the working
/// directory is read, and the output says it was found there; a named file
/// wins over it; without either, the built-in defaults apply.
#[test]
fn a_proxy_toml_in_the_working_directory_is_read_and_said() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("proxy.toml"),
        "[upstream]\nbase_url = \"http://found.invalid/v1\"\n",
    )
    .unwrap();
    let (code, out) = run(compactor()
        .args(["serve", "--check-config"])
        .current_dir(dir.path()));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("http://found.invalid/v1"), "{out}");
    assert!(
        out.contains("config file: proxy.toml (found in the working directory)"),
        "{out}"
    );

    let named = dir.path().join("other.toml");
    std::fs::write(
        &named,
        "[upstream]\nbase_url = \"http://named.invalid/v1\"\n",
    )
    .unwrap();
    let (code, out) = run(compactor()
        .args(["serve", "--check-config", "--config"])
        .arg(&named)
        .current_dir(dir.path()));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("http://named.invalid/v1"), "{out}");
    assert!(!out.contains("found.invalid"), "{out}");

    let empty = tempfile::tempdir().unwrap();
    let (code, out) = run(compactor()
        .args(["serve", "--check-config"])
        .current_dir(empty.path()));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("https://api.openai.com/v1"), "{out}");
    assert!(!out.contains("config file:"), "{out}");
}
