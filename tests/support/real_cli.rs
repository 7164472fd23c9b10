//! The real client CLIs (Codex, Claude Code, Gemini CLI) for the tiers that
//! run one: the binary, installed by its script under `scripts/` when the
//! environment names none, and one bounded run of it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The binary the variable `var` names, else what `scripts/{script}.sh
/// install` prints as its last line (idempotent: a fraction of a second
/// once installed).
pub fn installed(var: &str, script: &str) -> PathBuf {
    if let Some(bin) = std::env::var_os(var) {
        let bin = PathBuf::from(bin);
        assert!(
            bin.is_file(),
            "{var}={} is not a file; run scripts/{script}.sh install",
            bin.display()
        );
        return bin;
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("scripts/{script}.sh"));
    let out = Command::new(&path)
        .arg("install")
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", path.display()));
    assert!(
        out.status.success(),
        "scripts/{script}.sh install failed ({}); its tests need npm and the network once",
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let bin = PathBuf::from(stdout.lines().last().unwrap_or_default().trim());
    assert!(
        bin.is_file(),
        "scripts/{script}.sh printed no binary path: {stdout}"
    );
    bin
}

/// One finished process.
#[derive(Debug)]
pub struct Outcome {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }

    pub fn describe(&self) -> String {
        format!(
            "exit {:?} after {:.1?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code,
            self.elapsed,
            self.stdout,
            tail(&self.stderr, 4000)
        )
    }
}

/// The last `n` bytes of `s` (from a character boundary).
pub fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Runs `cmd` with stdin closed and its output into files in `dir`, in a
/// process group of its own, until it exits or `timeout` passes, when the
/// whole group (a node launcher and what it started) is killed. The
/// outcome, and whether it finished.
pub fn run_bounded(mut cmd: Command, dir: &Path, timeout: Duration) -> (Outcome, bool) {
    use std::os::unix::process::CommandExt;
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let out_path = dir.join(format!("stdout-{n}"));
    let err_path = dir.join(format!("stderr-{n}"));
    cmd.stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .process_group(0);
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {:?}: {e}", cmd.get_program()));
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if start.elapsed() > timeout {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(25));
    };
    let outcome = Outcome {
        code: status.and_then(|s| s.code()),
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
        elapsed: start.elapsed(),
    };
    (outcome, status.is_some())
}

/// A long answer (~5 KB, ~1.2k tokens) for a scripted model turn: what
/// makes a session grow. The assistant's words are what a summary
/// replaces (user messages are kept).
pub fn long_answer(n: u32) -> String {
    let mut a = format!("Answer {n}: here is what I found in the parser. ");
    for i in 0..60 {
        a.push_str(&format!(
            "Step {n}.{i}: the lexer hands token {i} to parse_expr, which checks its span. "
        ));
    }
    a
}
