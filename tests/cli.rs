//! The `compactor` binary's configuration handling.

use std::process::Command;

fn compactor() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_compactor"));
    for var in [
        "COMPACTOR_CONFIG",
        "COMPACTOR_LISTEN",
        "COMPACTOR_UPSTREAM",
        "COMPACTOR_DB",
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
    assert!(out.contains("listen:   127.0.0.1:3333"), "flag wins: {out}");
    assert!(
        out.contains("upstream: http://env.invalid/v1"),
        "env beats file: {out}"
    );
    assert!(
        out.contains("store:    file.db"),
        "file beats default: {out}"
    );
    let (code, out) = run(compactor().args(["serve", "--check-config"]));
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("127.0.0.1:8787") && out.contains("compactor.db"),
        "defaults: {out}"
    );
}

#[test]
fn bad_values_exit_64() {
    let (code, out) =
        run(compactor().args(["serve", "--check-config", "--listen", "not-an-address"]));
    assert_eq!(code, 64, "{out}");
    assert!(out.contains("server.listen"), "{out}");
}
