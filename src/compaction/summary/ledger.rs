//! The two sections of a summary that go before the narrative, so the
//! byte budget cuts the narrative first: RULES & SYSTEM MESSAGES (the
//! user's standing instructions and the system messages inside the
//! conversation, verbatim and in order) and LEDGER (every file changed,
//! with its latest known state, and every command run, newest first, with
//! its exit status in the words of the output that stated it). Both are
//! bounded: what is left out is counted.

use super::edits::FileFact;
use super::facts::Facts;

/// Heading of the rules section.
pub(super) const RULES_HEADING: &str = "RULES & SYSTEM MESSAGES";
/// Heading of the ledger section.
pub(super) const LEDGER_HEADING: &str = "LEDGER";

/// How much of each pinned list a summary still shows: the first kept of
/// each (oldest cut first), and whether files only read are listed.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Shown {
    pub(super) rules_from: usize,
    pub(super) system_from: usize,
    pub(super) commands_from: usize,
    /// Changed files whose entries were cut, oldest first.
    pub(super) paths_cut: usize,
    pub(super) hide_reads: bool,
}

/// A short digest of a file's recorded content: its size and the first
/// 8 hex digits of its BLAKE3 hash.
fn digest(content: &str) -> String {
    let hash = blake3::hash(content.as_bytes()).to_hex();
    format!("{} bytes, blake3 {}", content.len(), &hash[..8])
}

/// A file's entry: what was done to it and its latest known state.
fn file_state(f: &FileFact) -> String {
    let c = f.content.as_deref();
    match (f.action.as_str(), c) {
        ("write", Some(c)) => format!("written ({})", digest(c)),
        ("patch", Some(c)) => format!("patched ({} of patches)", digest(c)),
        ("edit", Some(c)) => format!("edited ({} of edits)", digest(c)),
        ("delete", _) => "deleted".to_string(),
        ("rename", Some(to)) => format!("renamed to {to}"),
        ("moved", Some(from)) => format!("moved here from {from}"),
        ("read", _) => "read, not modified".to_string(),
        (action, _) => action.to_string(),
    }
}

/// The RULES & SYSTEM MESSAGES section's body (after its heading), `None`
/// when there is nothing to pin.
pub(super) fn rules_block(
    f: &Facts,
    shown: &Shown,
    label: &dyn Fn(&str) -> String,
) -> Option<String> {
    if f.rules.is_empty() && f.system.is_empty() && f.rules_dropped + f.system_dropped == 0 {
        return None;
    }
    let mut s = label("the user's standing instructions and the system messages inside the conversation, verbatim, in order");
    let rules = &f.rules[shown.rules_from.min(f.rules.len())..];
    let left = f.rules_dropped + shown.rules_from.min(f.rules.len());
    if left > 0 {
        s.push_str(&format!("\n- ({left} earlier rules left out)"));
    }
    for r in rules {
        s.push_str("\n- ");
        s.push_str(r);
    }
    let notes = &f.system[shown.system_from.min(f.system.len())..];
    let left = f.system_dropped + shown.system_from.min(f.system.len());
    if !notes.is_empty() || left > 0 {
        s.push_str("\nSystem messages:");
        if left > 0 {
            s.push_str(&format!("\n({left} earlier left out)"));
        }
        for n in notes {
            s.push('\n');
            s.push_str(n);
        }
    }
    Some(s)
}

/// The LEDGER section's body (after its heading), `None` when no file was
/// touched and no command run.
pub(super) fn ledger_block(
    f: &Facts,
    shown: &Shown,
    short: bool,
    label: &dyn Fn(&str) -> String,
) -> Option<String> {
    let commands_total = f.commands.len() + f.commands_dropped;
    if f.files.is_empty() && f.files_dropped == 0 && commands_total == 0 {
        return None;
    }
    let mut s = label("the files the tool calls touched and the commands they ran");
    if !f.files.is_empty() || f.files_dropped > 0 {
        s.push_str("\nFiles:");
        let mut reads = 0;
        let mut changed = 0;
        for x in &f.files {
            if x.action == "read" {
                if shown.hide_reads {
                    reads += 1;
                    continue;
                }
            } else {
                changed += 1;
                if changed <= shown.paths_cut {
                    continue;
                }
            }
            s.push_str(&format!("\n- {} — {}", x.path, file_state(x)));
        }
        if shown.paths_cut > 0 {
            s.push_str(&format!(
                "\n- and {} more changed earlier (paths cut for size)",
                shown.paths_cut.min(changed)
            ));
        }
        if reads > 0 {
            s.push_str(&format!("\n- and {reads} more read, not modified"));
        }
        if f.files_dropped > 0 {
            s.push_str(&format!(
                "\n- and {} more touched earlier, left out",
                f.files_dropped
            ));
        }
    }
    if commands_total > 0 {
        let from = shown.commands_from.min(f.commands.len());
        let kept = &f.commands[from..];
        s.push_str(if short {
            "\nCommands, newest first:"
        } else {
            "\nCommands, newest first, each with the exit status its output stated:"
        });
        for c in kept.iter().rev() {
            s.push_str("\n- ");
            s.push_str(&c.line());
        }
        let left = commands_total - kept.len();
        if left > 0 {
            s.push_str(&format!("\n- and {left} earlier left out"));
        }
    }
    Some(s)
}

/// The DECISIONS block's line for decision `d`: marked when a later one
/// replaced it.
pub(super) fn decision_line(f: &Facts, d: &str) -> String {
    match f.replaced.iter().find(|(old, _)| old == d) {
        Some((_, new)) => format!(
            "[REPLACED by the later decision \"{}\"] {d}",
            super::text::clip(new, 48)
        ),
        None => d.to_string(),
    }
}
