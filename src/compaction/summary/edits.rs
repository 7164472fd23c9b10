//! What tool calls do to files: apply_patch envelopes, old/new-string
//! edits, whole-file writes, heredoc writes in shell calls, reads and
//! deletes; and how each change lands on a file's recorded state, its
//! [`FileFact`] (applied onto a known full content, else kept in a capped
//! chain of changes).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::limits::{MAX_CHANGE_CHAIN, MAX_FILE_CONTENT};
pub(super) use super::ops::Op;
use super::ops::{clean_path, shell_words};
use super::plan::{is_plan_tool, render_plan};
use super::text::{head_tail, name_has, str_field, string_leaves};
use crate::compaction::items::ceil_boundary;

/// What the conversation did to one file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FileFact {
    /// The path exactly as the tool call gave it (a leading `./` dropped).
    pub path: String,
    /// What `content` holds: `write` = the full current content is known;
    /// `patch` / `edit` = the patches / edits written since the last known
    /// full content, oldest first; `delete`; `read` (never modified here).
    pub action: String,
    /// Last full content, or the changes written (see `action`).
    pub content: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Effect {
    File(String, Op),
    Plan(String),
}

/// One file of an apply_patch envelope.
pub(super) struct PatchFile {
    /// `A`, `U` or `D`.
    pub(super) op: char,
    pub(super) path: String,
    pub(super) move_to: Option<String>,
    /// The section: its header line(s) and body.
    pub(super) section: String,
    pub(super) body: Vec<String>,
}

/// The files of every `*** Begin Patch … *** End Patch` envelope in `text`.
fn parse_patch(text: &str) -> Vec<PatchFile> {
    let mut files: Vec<PatchFile> = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        let t = line.trim_end();
        if t.trim_start() == "*** Begin Patch" {
            inside = true;
            continue;
        }
        if !inside {
            continue;
        }
        if t.trim_start() == "*** End Patch" {
            inside = false;
            continue;
        }
        let header = [
            ("*** Add File: ", 'A'),
            ("*** Update File: ", 'U'),
            ("*** Delete File: ", 'D'),
        ]
        .iter()
        .find_map(|(p, op)| t.strip_prefix(p).map(|path| (*op, path.trim())));
        if let Some((op, path)) = header {
            files.push(PatchFile {
                op,
                path: clean_path(path),
                move_to: None,
                section: t.to_string(),
                body: Vec::new(),
            });
            continue;
        }
        let Some(cur) = files.last_mut() else {
            continue;
        };
        if let Some(to) = t.strip_prefix("*** Move to: ") {
            cur.move_to = Some(clean_path(to.trim()));
        } else if t != "*** End of File" {
            cur.body.push(line.to_string());
        }
        cur.section.push('\n');
        cur.section.push_str(line);
    }
    files
}

/// Patch envelopes anywhere in a call's arguments (custom-tool input,
/// `command` arrays, `cmd` heredocs).
pub(super) fn patch_files(args: &Value) -> Vec<PatchFile> {
    let mut leaves = Vec::new();
    string_leaves(args, 4, &mut leaves);
    leaves
        .into_iter()
        .flat_map(|s| {
            if s.contains("*** Begin Patch") {
                parse_patch(s)
            } else if s.contains("\n+++ ") || s.starts_with("+++ ") {
                parse_unified_diff(s)
            } else {
                Vec::new()
            }
        })
        .collect()
}

/// A path of a unified diff's `---` / `+++` line: `None` for `/dev/null`;
/// git's `a/` and `b/` prefixes and a trailing timestamp dropped.
fn diff_path(rest: &str, prefix: &str) -> Option<String> {
    let p = rest.split('\t').next().unwrap_or("").trim();
    if p == "/dev/null" || p.is_empty() {
        return None;
    }
    let p = p.strip_prefix(prefix).unwrap_or(p);
    Some(clean_path(p))
}

/// The files of a unified diff (`diff -u`, `git diff`): each file's hunks
/// turned into apply_patch form (`@@ context`, then ` `/`-`/`+` lines) so
/// they apply onto a known content the same way; a file from `/dev/null`
/// is added, one to `/dev/null` deleted.
fn parse_unified_diff(text: &str) -> Vec<PatchFile> {
    let lines: Vec<&str> = text.lines().collect();
    let mut files: Vec<PatchFile> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let (Some(old), Some(new)) = (
            lines[i].strip_prefix("--- "),
            lines.get(i + 1).and_then(|l| l.strip_prefix("+++ ")),
        ) else {
            i += 1;
            continue;
        };
        // git's prefixes; a side from or to `/dev/null` has none.
        let null = |s: &str| s.split('\t').next().unwrap_or("").trim() == "/dev/null";
        let git = (old.starts_with("a/") || null(old)) && (new.starts_with("b/") || null(new));
        let (from, to) = if git {
            (diff_path(old, "a/"), diff_path(new, "b/"))
        } else {
            (diff_path(old, ""), diff_path(new, ""))
        };
        let start = i;
        i += 2;
        let mut body = Vec::new();
        while i < lines.len() {
            let l = lines[i];
            if l.starts_with("--- ") && lines.get(i + 1).is_some_and(|n| n.starts_with("+++ ")) {
                break;
            }
            if let Some(h) = l.strip_prefix("@@") {
                // `@@ -10,7 +10,7 @@ fn ctx()`: the text after the ranges is context.
                let ctx = h.split_once("@@").map(|(_, c)| c.trim()).unwrap_or("");
                body.push(format!("@@ {ctx}").trim_end().to_string());
            } else if l.starts_with([' ', '-', '+']) || l.is_empty() {
                body.push(l.to_string());
            } else if l.starts_with("diff ") || l.starts_with("index ") || l.starts_with('\\') {
                // Headers of the next file, `\ No newline at end of file`.
            } else {
                break;
            }
            i += 1;
        }
        while body.last().is_some_and(|l| l.is_empty()) {
            body.pop();
        }
        // The hunks as written; the `---`/`+++` header only repeats the path.
        let section = lines[start + 2..i].join("\n");
        let (op, path) = match (from, to) {
            (None, Some(to)) => ('A', to),
            (Some(from), None) => ('D', from),
            (Some(from), Some(to)) if from != to => {
                files.push(PatchFile {
                    op: 'U',
                    path: from,
                    move_to: Some(to.clone()),
                    section,
                    body,
                });
                continue;
            }
            (_, Some(to)) => ('U', to),
            (None, None) => continue,
        };
        if op == 'A' {
            body.retain(|l| !l.starts_with("@@"));
        }
        files.push(PatchFile {
            op,
            path,
            move_to: None,
            section,
            body,
        });
    }
    files
}

/// Applies one Update section's hunks to `content`; `None` when a hunk's
/// old lines are not found (the caller then keeps the patch text instead).
fn apply_update(content: &str, body: &[String]) -> Option<String> {
    let mut lines: Vec<String> = content.lines().map(String::from).collect();
    let mut cursor = 0;
    // Hunks: (context header, old lines, new lines).
    let mut hunks: Vec<(Option<String>, Vec<String>, Vec<String>)> =
        vec![(None, Vec::new(), Vec::new())];
    for l in body {
        if let Some(h) = l.strip_prefix("@@") {
            let h = h.trim();
            hunks.push((
                (!h.is_empty()).then(|| h.to_string()),
                Vec::new(),
                Vec::new(),
            ));
            continue;
        }
        let hunk = hunks.last_mut()?;
        match l.chars().next() {
            Some('-') => hunk.1.push(l[1..].to_string()),
            Some('+') => hunk.2.push(l[1..].to_string()),
            Some(' ') => {
                hunk.1.push(l[1..].to_string());
                hunk.2.push(l[1..].to_string());
            }
            None => {
                hunk.1.push(String::new());
                hunk.2.push(String::new());
            }
            Some(_) => return None,
        }
    }
    for (ctx, old, new) in hunks {
        if old.is_empty() && new.is_empty() {
            continue;
        }
        let mut anchored = false;
        if let Some(ctx) = ctx {
            if let Some(i) = (cursor..lines.len()).find(|&i| lines[i].trim() == ctx) {
                cursor = i + 1;
                anchored = true;
            }
        }
        if old.is_empty() {
            let at = if anchored { cursor } else { lines.len() };
            lines.splice(at..at, new.iter().cloned());
            cursor = at + new.len();
            continue;
        }
        let matches = |i: usize, exact: bool| {
            old.iter().enumerate().all(|(j, o)| {
                let l = &lines[i + j];
                if exact {
                    l == o
                } else {
                    l.trim_end() == o.trim_end()
                }
            })
        };
        let last = lines.len().checked_sub(old.len())?;
        let at = (cursor..=last)
            .find(|&i| matches(i, true))
            .or_else(|| (cursor..=last).find(|&i| matches(i, false)))
            .or_else(|| (0..cursor.min(last + 1)).find(|&i| matches(i, false)))?;
        lines.splice(at..at + old.len(), new.iter().cloned());
        cursor = at + new.len();
    }
    let mut out = lines.join("\n");
    if content.ends_with('\n') || content.is_empty() {
        out.push('\n');
    }
    Some(out)
}

const PATH_KEYS: [&str; 10] = [
    "path",
    "file_path",
    "filePath",
    "filename",
    "file",
    "target_file",
    "absolute_path",
    "notebook_path",
    "relative_path",
    "file_name",
];

fn render_edit(old: &str, new: &str, all: bool) -> String {
    let mut s = String::from(if all {
        "@@ replace all\n"
    } else {
        "@@ replace\n"
    });
    for l in old.lines() {
        s.push('-');
        s.push_str(l);
        s.push('\n');
    }
    for l in new.lines() {
        s.push('+');
        s.push_str(l);
        s.push('\n');
    }
    s
}

fn edit_op(v: &Value, all_default: bool) -> Option<Op> {
    let old = str_field(
        v,
        &["old_string", "oldString", "old_str", "old_text", "search"],
    )?;
    let new = str_field(
        v,
        &["new_string", "newString", "new_str", "new_text", "replace"],
    )
    .unwrap_or("");
    let all = v
        .get("replace_all")
        .or_else(|| v.get("replaceAll"))
        .and_then(Value::as_bool)
        .unwrap_or(all_default);
    Some(Op::Edit {
        old: old.to_string(),
        new: new.to_string(),
        all,
        rendered: render_edit(old, new, all),
    })
}

/// `cat > PATH <<'EOF' … EOF` (or `cat <<EOF > PATH`) writes in a shell command.
fn heredoc_writes(cmd: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = cmd.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        let Some(pos) = line.find("<<") else { continue };
        if !line.contains("cat") || line[pos..].starts_with("<<<") {
            continue;
        }
        let delim: String = line[pos + 2..]
            .trim_start_matches('-')
            .trim_start()
            .chars()
            .take_while(|c| !c.is_whitespace() && !";|&>".contains(*c))
            .filter(|c| !"'\"\\".contains(*c))
            .collect();
        // The redirect target: a single `>` (not `>>` append, not `2>&1`).
        let bytes = line.as_bytes();
        let target = (0..bytes.len()).find_map(|j| {
            let single = bytes[j] == b'>'
                && bytes.get(j + 1) != Some(&b'>')
                && bytes.get(j + 1) != Some(&b'&')
                && (j == 0 || !matches!(bytes[j - 1], b'>' | b'<' | b'0'..=b'9'));
            if !single {
                return None;
            }
            let rest = line[j + 1..].trim_start();
            let path: String = rest
                .chars()
                .take_while(|c| !c.is_whitespace() && !";|&<".contains(*c))
                .collect();
            let path = clean_path(&path);
            (!path.is_empty()).then_some(path)
        });
        if delim.is_empty() {
            continue;
        }
        let start = i;
        while i < lines.len() && lines[i].trim() != delim {
            i += 1;
        }
        if let Some(path) = target {
            if i < lines.len() && !line.contains(">>") {
                let mut content = lines[start..i].join("\n");
                content.push('\n');
                out.push((path, content));
            }
        }
        i += 1;
    }
    out
}

/// aider's SEARCH/REPLACE blocks in an assistant's text: the file's path on
/// the line before the block (or before its opening fence), then
/// `<<<<<<< SEARCH`, the old lines, `=======`, the new lines,
/// `>>>>>>> REPLACE`. An empty SEARCH writes a new file.
pub(super) fn text_edits(text: &str) -> Vec<(String, Op)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_end() != "<<<<<<< SEARCH" {
            i += 1;
            continue;
        }
        let path = lines[..i]
            .iter()
            .rev()
            .map(|l| l.trim())
            .find(|l| !l.is_empty() && !l.starts_with("```"))
            .map(|l| clean_path(l.trim_matches('`')));
        let Some(sep) = (i + 1..lines.len()).find(|&j| lines[j].trim_end() == "=======") else {
            break;
        };
        let Some(end) =
            (sep + 1..lines.len()).find(|&j| lines[j].trim_end().starts_with(">>>>>>> REPLACE"))
        else {
            break;
        };
        let (old, new) = (lines[i + 1..sep].join("\n"), lines[sep + 1..end].join("\n"));
        if let Some(path) = path.filter(|p| !p.is_empty() && !p.contains(' ')) {
            let op = if old.is_empty() {
                let nl = if new.is_empty() { "" } else { "\n" };
                Op::Write(format!("{new}{nl}"))
            } else {
                Op::Edit {
                    rendered: render_edit(&old, &new, false),
                    old,
                    new,
                    all: false,
                }
            };
            out.push((path, op));
        }
        i = end + 1;
    }
    out
}

/// One `s<d>pattern<d>replacement<d>flags` sed command, as (pattern,
/// replacement, global).
fn sed_substitution(script: &str) -> Option<(String, String, bool)> {
    let mut chars = script.strip_prefix('s')?.chars();
    let d = chars.next()?;
    let mut parts = vec![String::new()];
    let mut escaped = false;
    for c in chars {
        let part = parts.last_mut()?;
        if escaped {
            // `\<d>` is the delimiter itself; other escapes stay as written.
            if c != d {
                part.push('\\');
            }
            part.push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == d {
            parts.push(String::new());
        } else {
            part.push(c);
        }
    }
    match parts.as_slice() {
        [pat, rep, flags] => Some((pat.clone(), rep.clone(), flags.contains('g'))),
        _ => None,
    }
}

/// `sed -i` substitutions in a shell command, per file. A pattern without
/// regex syntax applies as the literal replacement it is; any other is
/// kept as written in the file's chain of edits.
fn sed_edits(cmd: &str) -> Vec<(String, Op)> {
    let mut out = Vec::new();
    for line in cmd.lines() {
        let words = shell_words(line);
        let mut k = 0;
        while k < words.len() {
            if words[k] != "sed" {
                k += 1;
                continue;
            }
            let end = (k + 1..words.len())
                .find(|&j| matches!(words[j].as_str(), ";" | "|" | "&"))
                .unwrap_or(words.len());
            let args = &words[k + 1..end];
            k = end;
            if !args
                .iter()
                .any(|a| a.starts_with("-i") || a == "--in-place")
            {
                continue;
            }
            let mut scripts: Vec<String> = Vec::new();
            let mut files = Vec::new();
            let mut j = 0;
            while j < args.len() {
                let a = &args[j];
                j += 1;
                if a == "-e" || a == "--expression" {
                    scripts.extend(args.get(j).cloned());
                    j += 1;
                } else if a.starts_with('-') || a.is_empty() {
                    // Other options; macOS's `-i ''`.
                } else if scripts.is_empty() {
                    scripts.push(a.clone());
                } else {
                    files.push(clean_path(a));
                }
            }
            for script in scripts.iter().flat_map(|s| s.split(';')) {
                let Some((pat, rep, all)) = sed_substitution(script.trim()) else {
                    continue;
                };
                let literal = !pat.contains(['.', '*', '[', ']', '^', '$', '\\'])
                    && !rep.contains(['&', '\\']);
                for f in &files {
                    out.push((
                        f.clone(),
                        Op::Edit {
                            // An empty `old` is never applied onto a known content.
                            old: if literal { pat.clone() } else { String::new() },
                            new: rep.clone(),
                            all,
                            rendered: format!("@@ sed -i {}\n-{pat}\n+{rep}\n", script.trim()),
                        },
                    ));
                }
            }
        }
    }
    out
}

/// What a call does to files and the plan, if it succeeds.
pub(super) fn effects_of(name: &str, args: &Value) -> Vec<Effect> {
    let mut fx = Vec::new();
    if is_plan_tool(name) {
        fx.push(Effect::Plan(render_plan(args)));
        return fx;
    }
    let patches = patch_files(args);
    if !patches.is_empty() {
        for p in patches {
            match p.op {
                'A' => {
                    let mut content: String = p
                        .body
                        .iter()
                        .map(|l| l.strip_prefix('+').unwrap_or(l))
                        .collect::<Vec<_>>()
                        .join("\n");
                    if !p.body.is_empty() {
                        content.push('\n');
                    }
                    fx.push(Effect::File(p.path, Op::Write(content)));
                }
                'D' => fx.push(Effect::File(p.path, Op::Delete)),
                _ => match p.move_to {
                    Some(to) => {
                        fx.push(Effect::File(p.path, Op::Rename(to.clone())));
                        fx.push(Effect::File(
                            to,
                            Op::Patch {
                                section: p.section,
                                body: p.body,
                            },
                        ));
                    }
                    None => fx.push(Effect::File(
                        p.path,
                        Op::Patch {
                            section: p.section,
                            body: p.body,
                        },
                    )),
                },
            }
        }
        return fx;
    }
    let shell_like = name == "local_shell"
        || name_has(
            name,
            &["shell", "exec", "bash", "command", "run", "terminal", "sh"],
        );
    if shell_like {
        let mut leaves = Vec::new();
        string_leaves(args, 3, &mut leaves);
        for s in leaves {
            for (path, content) in heredoc_writes(s) {
                fx.push(Effect::File(path, Op::Write(content)));
            }
            for (path, op) in sed_edits(s) {
                fx.push(Effect::File(path, op));
            }
            for (path, op) in super::shell::file_ops(s) {
                fx.push(Effect::File(path, op));
            }
        }
        return fx;
    }
    let Some(path) = str_field(args, &PATH_KEYS)
        .map(clean_path)
        .filter(|p| !p.is_empty())
    else {
        if name_has(name, &["read", "view", "open", "cat", "show"]) {
            for key in ["paths", "file_paths", "files"] {
                for p in args
                    .get(key)
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                {
                    fx.push(Effect::File(clean_path(p), Op::Read));
                }
            }
        }
        return fx;
    };
    let command = str_field(args, &["command"]).unwrap_or("");
    if let Some(edits) = args.get("edits").and_then(Value::as_array) {
        for e in edits {
            if let Some(op) = edit_op(e, false) {
                fx.push(Effect::File(path.clone(), op));
            }
        }
    } else if let Some(op) = edit_op(args, false) {
        fx.push(Effect::File(path, op));
    } else if command == "insert" {
        let text = str_field(args, &["insert_text", "new_str", "text"]).unwrap_or("");
        let line = args
            .get("insert_line")
            .map(Value::to_string)
            .unwrap_or_default();
        let mut rendered = format!("@@ insert after line {line}\n");
        for l in text.lines() {
            rendered.push_str(&format!("+{l}\n"));
        }
        fx.push(Effect::File(
            path,
            Op::Edit {
                old: String::new(),
                new: text.to_string(),
                all: false,
                rendered,
            },
        ));
    } else if let Some(content) =
        str_field(args, &["content", "contents", "file_text", "new_content"]).or_else(|| {
            name_has(name, &["write", "create", "save", "put"])
                .then(|| str_field(args, &["text", "data", "code"]))
                .flatten()
        })
    {
        if !name_has(name, &["read", "view", "search", "grep", "find"]) {
            fx.push(Effect::File(path, Op::Write(content.to_string())));
        }
    } else if command == "view" || name_has(name, &["read", "view", "open", "cat", "show"]) {
        fx.push(Effect::File(path, Op::Read));
    } else if name_has(name, &["delete", "remove", "rm", "unlink"]) {
        fx.push(Effect::File(path, Op::Delete));
    }
    fx
}

/// Appends a change to a file's chain of patches/edits, newest kept.
pub(super) fn chain(prev: Option<&str>, change: &str) -> String {
    let mut s = match prev {
        Some(p) if !p.is_empty() => format!("{}\n{}", p.trim_end_matches('\n'), change),
        _ => change.to_string(),
    };
    if s.len() > MAX_CHANGE_CHAIN {
        let cut = ceil_boundary(&s, s.len() - MAX_CHANGE_CHAIN);
        let cut = s[cut..].find('\n').map(|i| cut + i + 1).unwrap_or(cut);
        s = format!("[… earlier changes elided …]\n{}", &s[cut..]);
    }
    s
}

pub(super) fn apply_op(files: &mut Vec<FileFact>, path: String, op: Op) {
    let idx = match files.iter().position(|f| f.path == path) {
        Some(i) => i,
        None => {
            files.push(FileFact {
                path,
                action: "read".into(),
                content: None,
            });
            files.len() - 1
        }
    };
    let f = &mut files[idx];
    let known = (f.action == "write").then(|| f.content.clone()).flatten();
    let chained = matches!(f.action.as_str(), "patch" | "edit")
        .then(|| f.content.clone())
        .flatten();
    match op {
        Op::Read => {}
        Op::Rename(to) => {
            // The old path says where it went; the new one takes its state
            // when it was known, else says where it came from.
            let from = f.path.clone();
            let state = (f.action != "read" && f.action != "rename" && f.action != "moved")
                .then(|| (f.action.clone(), f.content.clone()));
            f.action = "rename".into();
            f.content = Some(to.clone());
            if to == from {
                return;
            }
            let (action, content) = state.unwrap_or_else(|| ("moved".into(), Some(from)));
            let at = match files.iter().position(|x| x.path == to) {
                Some(i) => i,
                None => {
                    files.push(FileFact {
                        path: to,
                        ..FileFact::default()
                    });
                    files.len() - 1
                }
            };
            files[at].action = action;
            files[at].content = content;
        }
        Op::Delete => {
            f.action = "delete".into();
            f.content = None;
        }
        Op::Write(c) => {
            f.action = "write".into();
            f.content = Some(head_tail(&c, MAX_FILE_CONTENT));
        }
        Op::Patch { section, body } => {
            match known.as_deref().and_then(|c| apply_update(c, &body)) {
                Some(new) => f.content = Some(head_tail(&new, MAX_FILE_CONTENT)),
                None => {
                    f.action = "patch".into();
                    f.content = Some(chain(chained.as_deref(), &section));
                }
            }
        }
        Op::Edit {
            old,
            new,
            all,
            rendered,
        } => {
            let applied = known
                .as_deref()
                .filter(|c| !old.is_empty() && c.contains(old.as_str()))
                .map(|c| {
                    if all {
                        c.replace(old.as_str(), &new)
                    } else {
                        c.replacen(old.as_str(), &new, 1)
                    }
                });
            match applied {
                Some(new) => f.content = Some(head_tail(&new, MAX_FILE_CONTENT)),
                None => {
                    f.action = "edit".into();
                    f.content = Some(chain(chained.as_deref(), &rendered));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::compaction::summary::testing::*;
    use crate::compaction::summary::*;
    use serde_json::{json, Value};

    #[test]
    fn responses_shape_apply_patch_custom_tool_call() {
        let part = vec![
            json!({"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sys"}]}),
            umsg("<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"),
            umsg("# AGENTS.md instructions for /w\n\nbe nice"),
            umsg("Fix the expired cookie bug"),
            json!({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"}),
            json!({"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": AUTH_PATCH}),
            json!({"type": "custom_tool_call_output", "call_id": "p1",
                   "output": "{\"output\":\"Success. Updated the following files:\\nM src/auth.py\\n\",\"metadata\":{\"exit_code\":0,\"duration_seconds\":0.0}}"}),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(f.task.as_deref(), Some("Fix the expired cookie bug"));
        let auth = file(&f, "src/auth.py");
        assert_eq!(auth.action, "patch");
        let c = auth.content.as_deref().unwrap();
        assert!(
            c.starts_with("*** Update File: src/auth.py") && c.contains("+    max_age = 3600"),
            "{c}"
        );
        assert!(f.errors.is_empty());
        assert_eq!(
            f.tool_log,
            vec!["apply_patch(patch: U src/auth.py) → ok".to_string()]
        );
    }

    #[test]
    fn patch_applies_onto_known_content_so_the_file_state_survives() {
        let add = "*** Begin Patch\n*** Add File: src/auth.py\n+def check(cookie):\n+    max_age = 60\n+    return cookie.age < max_age\n*** End Patch";
        let part = vec![
            umsg("fix it"),
            json!({"type": "custom_tool_call", "call_id": "a", "name": "apply_patch", "input": add}),
            json!({"type": "custom_tool_call_output", "call_id": "a", "output": "Exit code: 0\nWall time: 0 seconds\nOutput:\nSuccess."}),
            // Codex also runs apply_patch through its shell tool.
            fc("b", "exec_command", json!({"cmd": format!("apply_patch <<'EOF'\n{AUTH_PATCH}\nEOF")})),
            fco("b", "Chunk ID: 1\nWall time: 0.1 seconds\nProcess exited with code 0\nOutput:\nSuccess."),
        ];
        let f = extract_facts(&part, None);
        let auth = file(&f, "src/auth.py");
        assert_eq!(auth.action, "write");
        assert_eq!(
            auth.content.as_deref(),
            Some("def check(cookie):\n    max_age = 3600\n    return cookie.age < max_age\n")
        );
        assert_eq!(f.tool_log[1], "exec_command(patch: U src/auth.py) → ok");
    }

    #[test]
    fn patch_delete_move_and_failed_patch_not_recorded() {
        let patch = "*** Begin Patch\n*** Delete File: old.txt\n*** Update File: a.rs\n*** Move to: b.rs\n@@\n-x\n+y\n*** End Patch";
        let bad = "*** Begin Patch\n*** Update File: c.rs\n@@\n-nope\n+yes\n*** End Patch";
        let part = vec![
            json!({"type": "custom_tool_call", "call_id": "1", "name": "apply_patch", "input": patch}),
            json!({"type": "custom_tool_call_output", "call_id": "1", "output": "Success."}),
            json!({"type": "custom_tool_call", "call_id": "2", "name": "apply_patch", "input": bad}),
            json!({"type": "custom_tool_call_output", "call_id": "2", "output": "apply_patch verification failed: Failed to find expected lines in c.rs:\nnope"}),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(file(&f, "old.txt").action, "delete");
        assert_eq!(file(&f, "a.rs").action, "rename");
        assert_eq!(file(&f, "a.rs").content.as_deref(), Some("b.rs"));
        assert!(file(&f, "b.rs")
            .content
            .as_deref()
            .unwrap()
            .contains("*** Move to: b.rs"));
        assert!(f.files.iter().all(|x| x.path != "c.rs"));
        assert_eq!(
            f.errors,
            vec![
                "apply_patch verification failed: Failed to find expected lines in c.rs:"
                    .to_string()
            ]
        );
        assert!(f.tool_log[1].contains("→ error: apply_patch verification failed"));
    }

    #[test]
    fn edits_apply_to_known_content_else_chain() {
        let part = vec![
            chat_call(
                "w",
                "Write",
                json!({"file_path": "/r/a.py", "content": "x = 1\ny = 2\n"}),
            ),
            chat_out("w", "File created"),
            chat_call(
                "e",
                "Edit",
                json!({"file_path": "/r/a.py", "old_string": "y = 2", "new_string": "y = 3"}),
            ),
            chat_out("e", "ok"),
            chat_call(
                "m",
                "MultiEdit",
                json!({"file_path": "/r/b.py", "edits": [{"old_string": "a", "new_string": "b"}, {"old_string": "c", "new_string": "d"}]}),
            ),
            chat_out("m", "ok"),
            chat_call("r", "Read", json!({"file_path": "/r/c.py"})),
            chat_out("r", "1\tprint()"),
            chat_call("r2", "Read", json!({"file_path": "/r/a.py"})),
            chat_out("r2", "x = 1"),
        ];
        let f = extract_facts(&part, None);
        let paths: Vec<&str> = f.files.iter().map(|x| x.path.as_str()).collect();
        assert_eq!(paths, ["/r/a.py", "/r/b.py", "/r/c.py"]);
        assert_eq!(
            file(&f, "/r/a.py").content.as_deref(),
            Some("x = 1\ny = 3\n")
        );
        assert_eq!(
            file(&f, "/r/a.py").action,
            "write",
            "a read does not downgrade a known file"
        );
        let b = file(&f, "/r/b.py");
        assert_eq!(b.action, "edit");
        assert_eq!(
            b.content.as_deref(),
            Some("@@ replace\n-a\n+b\n@@ replace\n-c\n+d\n")
        );
        assert_eq!(file(&f, "/r/c.py").action, "read");
    }

    #[test]
    fn local_shell_heredoc_write_and_json_exit_code() {
        let cmd = "cat > notes/todo.md <<'EOF'\n# Todo\n- ship\nEOF";
        let part = vec![
            json!({"type": "local_shell_call", "call_id": "s", "status": "completed",
                   "action": {"type": "exec", "command": ["bash", "-lc", cmd]}}),
            json!({"type": "local_shell_call_output", "call_id": "s", "output": "{\"output\":\"\",\"metadata\":{\"exit_code\":0}}"}),
            json!({"type": "local_shell_call", "call_id": "t", "status": "completed",
                   "action": {"type": "exec", "command": ["bash", "-lc", "cat > x.txt <<EOF\nhi\nEOF"]}}),
            json!({"type": "local_shell_call_output", "call_id": "t", "output": "{\"output\":\"bash: x.txt: Permission denied\\n\",\"metadata\":{\"exit_code\":1}}"}),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(f.files.len(), 1);
        assert_eq!(
            file(&f, "notes/todo.md").content.as_deref(),
            Some("# Todo\n- ship\n")
        );
        assert_eq!(f.errors, vec!["bash: x.txt: Permission denied".to_string()]);
        assert!(
            f.tool_log[0]
                .starts_with("local_shell(type=exec, command=bash -lc cat > notes/todo.md"),
            "{:?}",
            f.tool_log
        );
    }

    const SETTINGS: &str = "struct Settings {\n    name: String,\n    zone: Zone,\n}\n";

    /// The file's recorded action and content after `part`.
    fn state(part: &[Value], path: &str) -> (String, String) {
        let f = extract_facts(part, None);
        let x = file(&f, path);
        (x.action.clone(), x.content.clone().unwrap_or_default())
    }

    /// Unified diffs as `diff -u` and `git diff` write them: a change onto a
    /// file whose content is unknown keeps the hunks (without the `---`/`+++`
    /// header); onto a known content it applies; `/dev/null` adds and deletes.
    #[test]
    fn unified_diffs_are_recognised() {
        let git = "diff --git a/src/lib.rs b/src/lib.rs\nindex 1a2b3c4..5d6e7f8 100644\n--- a/src/lib.rs\n+++ b/src/lib.rs\n@@ -1,4 +1,4 @@ struct Settings {\n struct Settings {\n     name: String,\n-    zone: Zone,\n+    zone: UtcOnly,\n }\n";
        let part = [
            chat_call("d", "apply_patch", json!({"patch": git})),
            chat_out("d", "ok"),
        ];
        let (action, c) = state(&part, "src/lib.rs");
        assert_eq!(action, "patch");
        assert!(
            c.starts_with("@@ -1,4 +1,4 @@") && c.contains("+    zone: UtcOnly,"),
            "{c}"
        );
        let f = extract_facts(&part, None);
        assert_eq!(f.tool_log, ["apply_patch(patch: U src/lib.rs) → ok"]);
        // Onto a known content, through a shell `git apply` heredoc.
        let plain = "--- cfg.rs\t2024-05-01 10:00:00\n+++ cfg.rs\t2024-05-01 10:05:00\n@@ -2,2 +2,2 @@\n     name: String,\n-    zone: Zone,\n+    zone: UtcOnly,\n";
        let part = [
            chat_call(
                "w",
                "write_file",
                json!({"path": "cfg.rs", "content": SETTINGS}),
            ),
            chat_out("w", "ok"),
            chat_call(
                "g",
                "shell",
                json!({"command": format!("git apply <<'EOF'\n{plain}EOF")}),
            ),
            chat_out("g", "Process exited with code 0\n"),
        ];
        assert_eq!(
            state(&part, "cfg.rs"),
            (
                "write".into(),
                SETTINGS.replace("zone: Zone", "zone: UtcOnly")
            )
        );
        let add_del = "--- /dev/null\n+++ b/new.md\n@@ -0,0 +1,2 @@\n+# New\n+text\n--- a/old.md\n+++ /dev/null\n@@ -1 +0,0 @@\n-gone\n";
        let part = [
            fc("n", "apply_diff", json!({"diff": add_del})),
            fco("n", "done"),
        ];
        assert_eq!(
            state(&part, "new.md"),
            ("write".into(), "# New\ntext\n".into())
        );
        assert_eq!(state(&part, "old.md").0, "delete");
    }

    /// OpenHands' `str_replace_editor`: `create` with `file_text`, then
    /// `str_replace` with `old_str`/`new_str`, `insert` after a line, `view`.
    #[test]
    fn str_replace_editor_commands() {
        let part = [
            chat_call(
                "c",
                "str_replace_editor",
                json!({"command": "create", "path": "/w/app.py", "file_text": "a = 1\nb = 2\n"}),
            ),
            chat_out("c", "File created successfully at: /w/app.py"),
            chat_call(
                "r",
                "str_replace_editor",
                json!({"command": "str_replace", "path": "/w/app.py", "old_str": "b = 2", "new_str": "b = 3"}),
            ),
            chat_out("r", "The file /w/app.py has been edited."),
            chat_call(
                "i",
                "str_replace_editor",
                json!({"command": "insert", "path": "/w/other.py", "insert_line": 4, "new_str": "c = 5"}),
            ),
            chat_out("i", "The file /w/other.py has been edited."),
            chat_call(
                "v",
                "str_replace_editor",
                json!({"command": "view", "path": "/w/README"}),
            ),
            chat_out("v", "1\thello"),
        ];
        assert_eq!(
            state(&part, "/w/app.py"),
            ("write".into(), "a = 1\nb = 3\n".into())
        );
        assert_eq!(
            state(&part, "/w/other.py"),
            ("edit".into(), "@@ insert after line 4\n+c = 5\n".into())
        );
        assert_eq!(state(&part, "/w/README").0, "read");
    }

    /// aider's SEARCH/REPLACE blocks, in the assistant's own text: the path
    /// on the line before the fence; an empty SEARCH creates the file.
    #[test]
    fn aider_search_replace_blocks() {
        let text = "Here are the changes.\n\nsrc/cfg.py\n```python\n<<<<<<< SEARCH\nzone = 'local'\n=======\nzone = 'utc'\n>>>>>>> REPLACE\n```\n\nnotes/new.md\n```\n<<<<<<< SEARCH\n=======\n# Notes\n>>>>>>> REPLACE\n```\n";
        let part = [
            json!({"role": "user", "content": "use utc"}),
            json!({"role": "assistant", "content": text}),
        ];
        let (action, c) = state(&part, "src/cfg.py");
        assert_eq!(action, "edit");
        assert_eq!(c, "@@ replace\n-zone = 'local'\n+zone = 'utc'\n");
        assert_eq!(
            state(&part, "notes/new.md"),
            ("write".into(), "# Notes\n".into())
        );
        // Onto a known content the replacement applies.
        let mut known = vec![
            chat_call(
                "w",
                "Write",
                json!({"file_path": "src/cfg.py", "content": "x = 1\nzone = 'local'\n"}),
            ),
            chat_out("w", "ok"),
        ];
        known.extend(part);
        assert_eq!(
            state(&known, "src/cfg.py"),
            ("write".into(), "x = 1\nzone = 'utc'\n".into())
        );
    }

    /// Shell heredoc writes and `sed -i` substitutions: a literal one applies
    /// onto the known content, a regex one is kept as written.
    #[test]
    fn heredoc_and_sed_in_place() {
        let cmd = format!("cat > conf/app.toml <<'EOF'\n{SETTINGS}EOF\nsed -i 's/zone: Zone/zone: UtcOnly/g' conf/app.toml && sed -i.bak -e 's|^name.*|name = x|' conf/other.toml");
        let part = [
            fc("s", "exec_command", json!({"cmd": cmd})),
            fco("s", "Process exited with code 0\n"),
        ];
        assert_eq!(
            state(&part, "conf/app.toml"),
            (
                "write".into(),
                SETTINGS.replace("zone: Zone", "zone: UtcOnly")
            )
        );
        assert_eq!(
            state(&part, "conf/other.toml"),
            (
                "edit".into(),
                "@@ sed -i s|^name.*|name = x|\n-^name.*\n+name = x\n".into()
            )
        );
        // A failed sed changes nothing.
        let failed = [
            fc("f", "shell", json!({"command": "sed -i 's/a/b/' missing.txt"})),
            fco("f", "sed: can't read missing.txt: No such file or directory\nProcess exited with code 2\n"),
        ];
        assert!(extract_facts(&failed, None).files.is_empty());
    }

    /// A session whose only edits are unified diffs ends with their paths
    /// and contents in FILE/WORKSPACE STATE.
    #[test]
    fn a_session_of_unified_diffs_fills_the_workspace_state() {
        let diff = |path: &str, old: &str, new: &str| {
            format!("--- a/{path}\n+++ b/{path}\n@@ -3,3 +3,3 @@ fn main() {{\n     let a = 1;\n-    {old}\n+    {new}\n }}\n")
        };
        let part = vec![
            umsg("Print the totals in UTC."),
            fc(
                "1",
                "apply_patch",
                json!({"patch": diff("src/main.rs", "local();", "utc_totals();")}),
            ),
            fco("1", "Done"),
            fc(
                "2",
                "shell",
                json!({"cmd": format!("git apply <<'EOF'\n{}EOF", diff("src/report.rs", "fmt_local(t)", "fmt_utc(t)"))}),
            ),
            fco("2", "Process exited with code 0\nOutput:\n"),
        ];
        let f = extract_facts(&part, None);
        let s = crate::compaction::summary::assemble(&f, None, part.len(), 100_000);
        let state =
            &s[s.find("## FILE/WORKSPACE STATE").unwrap()..s.find("## CONSTRAINTS").unwrap()];
        for want in [
            "- src/main.rs — patched",
            "+    utc_totals();",
            "- src/report.rs — patched",
            "+    fmt_utc(t)",
        ] {
            assert!(state.contains(want), "{want} not in:\n{state}");
        }
    }
}
