//! What a shell command does to files beyond heredocs and `sed -i`
//! (`edits`): `rm` and `git rm` delete, `mv` and `git mv` rename, and a
//! Python one-liner (`python -c "open('x', 'w').write(…)"`) writes; and
//! the command line a shell-like call runs, for the ledger.

use std::sync::OnceLock;

use regex::Regex;
use serde_json::Value;

use super::ops::{clean_path, shell_words, Op};
use super::text::{clip, name_has};

/// Longest command line a ledger entry keeps (its first line, clipped).
pub(super) const MAX_COMMAND: usize = 200;
/// Longest script a Python one-liner's recorded write keeps.
const MAX_SCRIPT: usize = 300;
/// Longest command line read for file operations (a longer one is a
/// script, not a command: its heredocs and seds are read by `edits`).
const MAX_SCANNED_LINE: usize = 4_096;
/// Most file operations one shell command records.
const MAX_FILE_OPS: usize = 256;

/// Whether a tool of this name runs shell commands.
pub(super) fn is_shell_tool(name: &str) -> bool {
    name == "local_shell"
        || name_has(
            name,
            &[
                "shell", "exec", "bash", "command", "run", "terminal", "sh", "execute",
            ],
        )
}

/// The command line a shell-like call runs: its `command` / `cmd` /
/// `script` (an argv array is joined, `bash -lc CMD` read as CMD), or its
/// whole input when it is a string; first line, clipped.
pub(super) fn command_of(name: &str, args: &Value) -> Option<String> {
    if !is_shell_tool(name) {
        return None;
    }
    let v = match args {
        Value::String(_) => Some(args),
        Value::Object(o) => ["command", "cmd", "script", "commands"]
            .iter()
            .find_map(|k| o.get(*k)),
        _ => None,
    }?;
    let text = match v {
        Value::String(s) => s.clone(),
        Value::Array(a) => {
            let words: Vec<&str> = a.iter().filter_map(Value::as_str).collect();
            match words.as_slice() {
                [sh, flag, cmd] if sh.ends_with("sh") && flag.starts_with('-') => cmd.to_string(),
                _ => words.join(" "),
            }
        }
        _ => return None,
    };
    let t = text.trim();
    if t.is_empty() {
        return None;
    }
    let first = t.lines().next().unwrap_or("");
    let line = if first.len() < t.len() {
        format!("{first} …")
    } else {
        first.to_string()
    };
    Some(clip(&line, MAX_COMMAND))
}

/// Whether word `k` of `words` starts a command (first, or after `;`,
/// `|`, `&`, `sudo`).
fn at_command(words: &[String], k: usize) -> bool {
    k == 0
        || matches!(
            words[k - 1].as_str(),
            ";" | "|" | "&" | "sudo" | "then" | "do"
        )
}

/// The operands of the command whose name is `words[k]`: the words up to
/// the next separator, options dropped.
fn operands(words: &[String], k: usize) -> Vec<String> {
    words[k + 1..]
        .iter()
        .take_while(|w| !matches!(w.as_str(), ";" | "|" | "&"))
        .filter(|w| !w.starts_with('-') && !w.is_empty() && !w.starts_with('>'))
        .map(|w| clean_path(w))
        .collect()
}

/// `rm`, `git rm`, `mv` and `git mv` in a shell command, per file.
fn removes_and_moves(cmd: &str) -> Vec<(String, Op)> {
    let mut out = Vec::new();
    for line in cmd.lines().filter(|l| l.len() <= MAX_SCANNED_LINE) {
        if out.len() >= MAX_FILE_OPS {
            break;
        }
        let words = shell_words(line);
        for k in 0..words.len() {
            let (name, start) = match words[k].as_str() {
                "git" if at_command(&words, k) => match words.get(k + 1).map(String::as_str) {
                    Some(w @ ("rm" | "mv")) => (w, k + 1),
                    _ => continue,
                },
                w @ ("rm" | "mv" | "unlink") if at_command(&words, k) => (w, k),
                _ => continue,
            };
            let args = operands(&words, start);
            match name {
                "mv" => {
                    if let [from, to] = args.as_slice() {
                        out.push((from.clone(), Op::Rename(to.clone())));
                    }
                }
                _ => out.extend(args.into_iter().map(|p| (p, Op::Delete))),
            }
        }
    }
    out
}

/// The patterns of what a Python script does to files, each with what it
/// does. Fixed patterns: a test compiles them all (`every_pattern_compiles`).
const PYTHON_PATTERNS: [(&str, &str); 4] = [
    (
        r#"open\(\s*['"]([^'"\n]{1,300})['"]\s*,\s*['"][wax]"#,
        "write",
    ),
    (
        r#"Path\(\s*['"]([^'"\n]{1,300})['"]\s*\)\s*\.\s*write_(?:text|bytes)"#,
        "write",
    ),
    (
        r#"os\.(?:remove|unlink)\(\s*['"]([^'"\n]{1,300})['"]"#,
        "delete",
    ),
    (
        r#"(?:os\.rename|os\.replace|shutil\.move)\(\s*['"]([^'"\n]{1,300})['"]\s*,\s*['"]([^'"\n]{1,300})['"]"#,
        "rename",
    ),
];

/// [`PYTHON_PATTERNS`], compiled once.
fn python_patterns() -> &'static [(Regex, &'static str)] {
    static P: OnceLock<Vec<(Regex, &'static str)>> = OnceLock::new();
    P.get_or_init(|| {
        PYTHON_PATTERNS
            .iter()
            .filter_map(|(p, what)| Some((Regex::new(p).ok()?, *what)))
            .collect()
    })
}

/// Files a Python script run from the shell (`python -c …`, `python3 - <<EOF`)
/// writes, deletes or renames. A write's content is unknown: the script
/// itself is recorded as the change.
fn python_writes(cmd: &str) -> Vec<(String, Op)> {
    if !cmd.contains("python") {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (re, what) in python_patterns() {
        for c in re.captures_iter(cmd).take(64) {
            let path = clean_path(&c[1]);
            let op = match *what {
                "delete" => Op::Delete,
                "rename" => Op::Rename(clean_path(&c[2])),
                _ => Op::Edit {
                    old: String::new(),
                    new: String::new(),
                    all: false,
                    rendered: format!("@@ written by: {}\n", clip(cmd.trim(), MAX_SCRIPT)),
                },
            };
            out.push((path, op));
        }
    }
    out
}

/// What a shell command does to files that `edits` does not read:
/// deletes, renames and Python writes.
pub(super) fn file_ops(cmd: &str) -> Vec<(String, Op)> {
    let mut out = removes_and_moves(cmd);
    out.extend(python_writes(cmd));
    out.truncate(MAX_FILE_OPS);
    out
}

/// The shell blocks of an assistant's text (fenced `bash`, `sh`, `shell`,
/// `console`): aider suggests commands this way, and runs them.
pub(super) fn shell_blocks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for line in text.lines() {
        let t = line.trim_start();
        match (&mut cur, t.strip_prefix("```")) {
            (None, Some(lang)) => {
                if matches!(lang.trim(), "bash" | "sh" | "shell" | "console" | "zsh") {
                    cur = Some(String::new());
                }
            }
            (Some(_), Some(_)) => out.extend(cur.take()),
            (Some(b), None) => {
                b.push_str(t.strip_prefix("$ ").unwrap_or(line));
                b.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pattern_compiles() {
        assert_eq!(python_patterns().len(), PYTHON_PATTERNS.len());
    }
    use serde_json::json;

    #[test]
    fn removes_moves_and_python_writes() {
        let ops = file_ops("rm -f build/old.log tmp/x.txt && git mv src/a.rs src/b.rs; mv -v c.txt d.txt | tee log");
        assert_eq!(
            ops,
            vec![
                ("build/old.log".to_string(), Op::Delete),
                ("tmp/x.txt".to_string(), Op::Delete),
                ("src/a.rs".to_string(), Op::Rename("src/b.rs".into())),
                ("c.txt".to_string(), Op::Rename("d.txt".into())),
            ]
        );
        let py = file_ops(r#"python3 -c "open('conf/limits.ini', 'w').write('max=5\n')""#);
        assert_eq!(py.len(), 1);
        assert_eq!(py[0].0, "conf/limits.ini");
        assert!(
            matches!(&py[0].1, Op::Edit { rendered, .. } if rendered.contains("write('max=5")),
            "{py:?}"
        );
        assert!(file_ops("echo rm -rf / ; grep mv notes.md").is_empty());
    }

    #[test]
    fn command_lines_of_shell_calls() {
        assert_eq!(
            command_of(
                "shell",
                &json!({"command": ["bash", "-lc", "cargo test -p x"]})
            ),
            Some("cargo test -p x".into())
        );
        assert_eq!(
            command_of("Bash", &json!({"command": "ls\npwd", "description": "d"})),
            Some("ls …".into())
        );
        assert_eq!(
            command_of("exec_command", &json!({"cmd": "make"})),
            Some("make".into())
        );
        assert_eq!(command_of("Read", &json!({"file_path": "a"})), None);
        assert_eq!(
            command_of("str_replace_editor", &json!({"command": "view"})),
            None
        );
    }

    #[test]
    fn aider_shell_blocks() {
        let text =
            "Remove the stale file:\n\n```bash\nrm notes/old.md\n```\n\n```python\nx = 1\n```\n";
        assert_eq!(shell_blocks(text), vec!["rm notes/old.md\n".to_string()]);
    }
}
