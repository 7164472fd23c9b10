//! The summary message: TASK verbatim, the six narrative sections with the
//! proxy's facts after the model's text, the tool-call log, all within a
//! byte budget; and reading a previous summary's narrative back for
//! re-compaction.

use super::facts::Facts;
use super::labels::{FACTS_LABEL, NARRATIVE_SECTIONS, NOT_PROVIDED, UNAVAILABLE};
use super::ledger::{
    decision_line, ledger_block, rules_block, Shown, LEDGER_HEADING, RULES_HEADING,
};
use super::narrative::{heading_of, is_fence, written_sections};
use super::text::{clip, fenced, head_tail};
use crate::compaction::items::SUMMARY_MARKER;

/// Shortest a narrative body is clipped to before it is cut altogether.
const MIN_BODY: usize = 24;
/// Shortest a file's content is shortened to before the statements give
/// way (its head and tail: a patch's first lines carry the change).
const MIN_CONTENT: usize = 256;

/// The trimmable state of one assembled summary.
struct Draft<'a> {
    facts: &'a Facts,
    covered: usize,
    bodies: [String; 6],
    fallback: bool,
    /// The one-line header instead of the explanatory one.
    short_header: bool,
    plan: Option<String>,
    contents: Vec<Option<String>>,
    errors_from: usize,
    log_from: usize,
    /// First kept of decisions, constraints and next steps.
    statements_from: [usize; 3],
    /// How much of the rules, system messages, commands and files the
    /// sections before the narrative still show.
    shown: Shown,
}

impl Draft<'_> {
    /// The line opening a block of recorded facts: what it holds, unless
    /// the budget is tight (the section heading says enough then).
    fn label(&self, what: &str) -> String {
        if self.short_header {
            format!("{FACTS_LABEL}:")
        } else {
            format!("{FACTS_LABEL}: {what}")
        }
    }

    /// The recorded statements of `kind` (0 decisions, 1 constraints, 2
    /// next steps) still kept, minus those the model's text already quotes.
    fn statements(&self, kind: usize) -> Vec<&str> {
        let f = self.facts;
        let list = [&f.decisions, &f.constraints, &f.next_steps][kind];
        list[self.statements_from[kind].min(list.len())..]
            .iter()
            .map(String::as_str)
            .filter(|s| !self.bodies.iter().any(|b| b.contains(s)))
            .collect()
    }

    fn statements_block(&self, kind: usize) -> Option<String> {
        let list = self.statements(kind);
        if list.is_empty() {
            return None;
        }
        let what = [
            "the assistant's decisions",
            "the user's requests after the task",
            "the assistant's next steps",
        ][kind];
        let mut s = self.label(what);
        for l in list {
            s.push_str("\n- ");
            if kind == 0 {
                s.push_str(&decision_line(self.facts, l));
            } else {
                s.push_str(l);
            }
        }
        Some(s)
    }

    fn render(&self) -> String {
        let f = self.facts;
        let n = self.covered;
        let items = format!("{n} earlier item{}", if n == 1 { "" } else { "s" });
        let mut s = if self.short_header {
            format!("{SUMMARY_MARKER} of {items}]\n")
        } else {
            format!(
                "{SUMMARY_MARKER} of {items}]\nEarlier conversation items were compacted into this summary. \
Blocks starting \"{FACTS_LABEL}\" were extracted verbatim from the conversation; the rest was written by a model.\n"
            )
        };
        if self.fallback && !self.short_header {
            s.push_str("The model-written narrative is unavailable (the summarizer failed): only the facts the proxy recorded follow.\n");
        }
        s.push_str("\n## TASK\n");
        s.push_str(f.task.as_deref().unwrap_or("(not recorded)"));
        let label = |what: &str| self.label(what);
        for (heading, block) in [
            (RULES_HEADING, rules_block(f, &self.shown, &label)),
            (
                LEDGER_HEADING,
                ledger_block(f, &self.shown, self.short_header, &label),
            ),
        ] {
            if let Some(b) = block {
                s.push_str(&format!("\n\n## {heading}\n{b}"));
            }
        }
        for (i, heading) in NARRATIVE_SECTIONS.iter().enumerate() {
            s.push_str(&format!("\n\n## {heading}"));
            if !self.bodies[i].is_empty() {
                s.push('\n');
                s.push_str(&self.bodies[i]);
            }
            let facts = match i {
                0 => self
                    .plan
                    .as_ref()
                    .map(|p| format!("{}\n{p}", self.label("the latest plan/todo list"))),
                1 => self.statements_block(0),
                2 => self.files_block(),
                3 => self.statements_block(1),
                4 => (self.errors_from < f.errors.len()).then(|| {
                    let errs = f.errors[self.errors_from..].join("\n");
                    format!(
                        "{}\n{}",
                        self.label("exact error lines of failed tool calls"),
                        fenced(&errs, "text")
                    )
                }),
                _ => self.statements_block(2),
            };
            if let Some(block) = facts {
                s.push_str(if self.bodies[i].is_empty() {
                    "\n"
                } else {
                    "\n\n"
                });
                s.push_str(&block);
            }
        }
        s.push_str("\n\n## TOOL CALL LOG\n");
        let total = f.tool_log.len();
        let shown = total - self.log_from.min(total);
        if total == 0 {
            s.push_str("(no tool calls)");
        } else if shown == 0 {
            s.push_str(&format!(
                "{FACTS_LABEL}: {total} tool calls (log cut for size)"
            ));
        } else {
            s.push_str(&format!(
                "{FACTS_LABEL}: the last {shown} of {total} recorded tool calls, oldest first"
            ));
            for l in &f.tool_log[total - shown..] {
                s.push_str("\n- ");
                s.push_str(l);
            }
        }
        s.push('\n');
        s
    }

    /// FILE/WORKSPACE STATE's facts: what each changed file now contains,
    /// or the changes written to it, while they fit (the LEDGER lists every
    /// file).
    fn files_block(&self) -> Option<String> {
        let mut lines = Vec::new();
        for (f, content) in self.facts.files.iter().zip(&self.contents) {
            let (p, Some(c)) = (&f.path, content) else {
                continue;
            };
            lines.push(match f.action.as_str() {
                "write" => format!("- {p} — current content:\n{}", fenced(c, "")),
                "patch" => format!(
                    "- {p} — patched; the patches written, oldest first:\n{}",
                    fenced(c, "diff")
                ),
                "edit" => format!(
                    "- {p} — edited; the edits written, oldest first:\n{}",
                    fenced(c, "diff")
                ),
                _ => continue,
            });
        }
        if lines.is_empty() {
            return None;
        }
        Some(format!(
            "{}\n{}",
            self.label("the content of the files changed, in order of first touch"),
            lines.join("\n")
        ))
    }
}

/// The full summary message text: [`SUMMARY_MARKER`] header, `## TASK`
/// (verbatim), `## RULES & SYSTEM MESSAGES` and `## LEDGER` (see
/// `ledger`: placed before the narrative, and the last facts to give way),
/// the six narrative sections with the proxy's facts after the
/// model's text — PLAN STATE (plan), DECISIONS (the assistant's own
/// decisions), FILE/WORKSPACE STATE (files with their content or changes in
/// fenced blocks), CONSTRAINTS & PREFERENCES (what the user asked after the
/// task), ERRORS & FIXES (exact lines), OPEN ITEMS / NEXT STEP (the
/// assistant's own next steps) — then `## TOOL CALL LOG`.
///
/// The sections the model wrote are kept; one it left out (or filled with
/// the prompt's own description) says it was not provided, and the facts
/// follow. `narrative = None` gives the deterministic fallback: same
/// headings, facts only, a line saying the narrative is unavailable.
///
/// Within `max_bytes`, facts first: the narrative is cut before any fact,
/// then, in order: the explanatory header, the tool log (oldest first; its
/// size is still stated), the list of files only read, file contents
/// shortened (context lines of patches first, then largest first, head and
/// tail kept). Then the facts give way lowest-first: the user's
/// constraints, the decisions, file contents, the ledger's commands, the
/// system messages, the ledger's changed files (each oldest first; how
/// many is stated), errors (oldest first), the plan, the next steps, the
/// user's standing rules. TASK is never cut, so a task that alone exceeds
/// the budget yields a longer text.
pub fn assemble(
    facts: &Facts,
    narrative: Option<&str>,
    covered_items: usize,
    max_bytes: usize,
) -> String {
    let bodies: [String; 6] = match narrative {
        Some(n) => written_sections(n).map(|b| match b {
            Some(b) if !b.is_empty() => b,
            Some(_) => "none".to_string(),
            None => NOT_PROVIDED.to_string(),
        }),
        None => std::array::from_fn(|_| UNAVAILABLE.to_string()),
    };
    let mut d = Draft {
        facts,
        covered: covered_items,
        bodies,
        fallback: narrative.is_none(),
        short_header: false,
        plan: facts.plan.clone(),
        contents: facts
            .files
            .iter()
            .map(|f| {
                matches!(f.action.as_str(), "write" | "patch" | "edit")
                    .then(|| f.content.clone())
                    .flatten()
            })
            .collect(),
        errors_from: 0,
        log_from: 0,
        statements_from: [0; 3],
        shown: Shown::default(),
    };
    let mut text = d.render();
    let over = |t: &str| t.len().saturating_sub(max_bytes);
    // 1. The narrative, longest section first: clipped, then cut.
    while over(&text) > 0 {
        let Some((i, len)) = d
            .bodies
            .iter()
            .map(String::len)
            .enumerate()
            .filter(|&(_, l)| l > 0)
            .max_by_key(|&(_, l)| l)
        else {
            break;
        };
        let excess = over(&text);
        d.bodies[i] = if len > MIN_BODY {
            clip(&d.bodies[i], len.saturating_sub(excess + 8).max(MIN_BODY))
        } else {
            String::new()
        };
        text = d.render();
    }
    // 2. The explanatory header.
    if over(&text) > 0 {
        d.short_header = true;
        text = d.render();
    }
    // 3. The tool log, oldest lines first.
    while over(&text) > 0 && d.log_from < facts.tool_log.len() {
        d.log_from += 1;
        text = d.render();
    }
    // 4. Files only read.
    if over(&text) > 0 {
        d.shown.hide_reads = true;
        text = d.render();
    }
    // 5. File contents: patches and edits without their context lines, then
    // largest first shortened (head and tail), then dropped.
    if over(&text) > 0 {
        for (c, f) in d.contents.iter_mut().zip(&facts.files) {
            if let (Some(c), "patch" | "edit") = (c.as_mut(), f.action.as_str()) {
                *c = c
                    .lines()
                    .filter(|l| !l.starts_with(' '))
                    .collect::<Vec<_>>()
                    .join("\n");
            }
        }
        text = d.render();
    }
    // Contents shortened (head and tail kept), largest first, not yet dropped.
    for _ in 0..facts.files.len() * 3 + 1 {
        let excess = over(&text);
        if excess == 0 {
            break;
        }
        let Some((i, len)) = d
            .contents
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c.len())))
            .filter(|&(_, len)| len > MIN_CONTENT)
            .max_by_key(|&(_, len)| len)
        else {
            break;
        };
        let keep = len.saturating_sub(excess + 16).max(MIN_CONTENT);
        d.contents[i] = Some(head_tail(d.contents[i].as_deref().unwrap_or(""), keep));
        text = d.render();
    }
    // Then the facts give way lowest-first: constraints, decisions, files
    // (contents, then paths), errors, the plan, next steps; the task never.
    let cut_statements = |d: &mut Draft<'_>, text: &mut String, k: usize| {
        let list = [&facts.decisions, &facts.constraints, &facts.next_steps][k];
        while over(text) > 0 && d.statements_from[k] < list.len() {
            d.statements_from[k] += 1;
            *text = d.render();
        }
    };
    // 6. Constraints, oldest first.
    cut_statements(&mut d, &mut text, 1);
    // 7. Decisions, oldest first.
    cut_statements(&mut d, &mut text, 0);
    // 8. File contents, largest first.
    while over(&text) > 0 {
        let Some(i) = d
            .contents
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c.len())))
            .max_by_key(|&(_, len)| len)
            .map(|(i, _)| i)
        else {
            break;
        };
        d.contents[i] = None;
        text = d.render();
    }
    let changed = facts.files.iter().filter(|f| f.action != "read").count();
    // 9. Commands, oldest first (how many is stated), then the system
    // messages, oldest first.
    while over(&text) > 0 && d.shown.commands_from < facts.commands.len() {
        d.shown.commands_from += 1;
        text = d.render();
    }
    while over(&text) > 0 && d.shown.system_from < facts.system.len() {
        d.shown.system_from += 1;
        text = d.render();
    }
    while over(&text) > 0 && d.shown.paths_cut < changed {
        d.shown.paths_cut += 1;
        text = d.render();
    }
    // 10. Errors, oldest first.
    while over(&text) > 0 && d.errors_from < facts.errors.len() {
        d.errors_from += 1;
        text = d.render();
    }
    // 11. The plan.
    if over(&text) > 0 {
        if let Some(p) = d.plan.as_deref() {
            let excess = over(&text);
            d.plan = Some(clip(p, p.len().saturating_sub(excess + 8).max(16)));
            text = d.render();
        }
    }
    // 12. Next steps, oldest first.
    cut_statements(&mut d, &mut text, 2);
    // 13. The user's standing rules, oldest first (how many is stated).
    while over(&text) > 0 && d.shown.rules_from < facts.rules.len() {
        d.shown.rules_from += 1;
        text = d.render();
    }
    text
}

/// `text` (an assembled summary) with `section` (the model's own notes of
/// what to keep, `## …` heading first) placed right after TASK, so it reads
/// before the narrative; a re-compaction's [`previous_narrative`] does not
/// carry it on (it is not one of the narrative sections). A text not in
/// this format gets it at the end.
pub fn with_notes(text: &str, task: Option<&str>, section: &str) -> String {
    let head = "\n## TASK\n";
    let task_len = task.map_or("(not recorded)".len(), str::len);
    let at = text
        .find(head)
        .map(|i| i + head.len() + task_len)
        .filter(|&i| {
            text.get(i..)
                .is_some_and(|rest| rest.starts_with("\n\n## "))
        });
    match at {
        Some(i) => format!("{}\n\n{section}{}", &text[..i], &text[i..]),
        None => format!("{}\n\n{section}\n", text.trim_end()),
    }
}

/// The model-written sections of a previous assembled summary, for
/// re-compaction (the model updates them instead of re-reading raw history;
/// the facts are carried separately in [`Facts`]): each of the six
/// sections, cut before its `Recorded by the proxy` block, as `## HEADING`
/// blocks. When there is no narrative to carry (a deterministic fallback, or
/// a text not in this format) it returns the whole text after the header
/// line instead, so the model still sees the facts.
pub fn previous_narrative(summary_text: &str) -> String {
    let mut bodies: [Option<String>; 6] = Default::default();
    let mut current: Option<usize> = None;
    let mut fence = false;
    for line in summary_text.lines() {
        if is_fence(line) {
            fence = !fence;
        }
        let ours = line.starts_with("## ")
            && (heading_of(line).is_some()
                || matches!(
                    line.trim_end().trim_start_matches("## "),
                    "TASK" | "TOOL CALL LOG" | RULES_HEADING | LEDGER_HEADING
                ));
        if !fence && !is_fence(line) && ours {
            current = heading_of(line).map(|(i, _)| i);
            if let Some(i) = current {
                bodies[i] = Some(String::new());
            }
            continue;
        }
        if !fence && line.starts_with(FACTS_LABEL) {
            current = None;
        }
        if let Some(i) = current {
            if let Some(b) = bodies[i].as_mut() {
                b.push_str(line);
                b.push('\n');
            }
        }
    }
    let has_narrative = bodies
        .iter()
        .flatten()
        .any(|b| !matches!(b.trim(), "" | "none" | UNAVAILABLE | NOT_PROVIDED));
    if !has_narrative {
        let body = match summary_text.split_once('\n') {
            Some((first, rest)) if first.starts_with(SUMMARY_MARKER) => rest,
            _ => summary_text,
        };
        return body.trim().to_string();
    }
    NARRATIVE_SECTIONS
        .iter()
        .zip(bodies)
        .map(|(h, b)| {
            let b = b
                .map(|b| b.trim().to_string())
                .filter(|b| !b.is_empty() && b != UNAVAILABLE && b != NOT_PROVIDED);
            format!("## {h}\n{}", b.unwrap_or_else(|| "none".into()))
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::items::{is_summary, user_message};
    use crate::compaction::summary::testing::*;
    use crate::compaction::summary::*;

    #[test]
    fn assemble_places_facts_in_their_sections() {
        let f = sample_facts();
        let s = assemble(&f, Some(&format!("Sure! Here it is:\n{GOOD}")), 41, 100_000);
        if std::env::var_os("SHOW_SUMMARY").is_some() {
            eprintln!("{s}\n-----\n{}", assemble(&f, None, 41, 100_000));
        }
        assert!(
            s.starts_with("[compactor summary of 41 earlier items]\n"),
            "{s}"
        );
        assert!(is_summary(&user_message(s.clone())));
        assert!(!s.contains("Sure!"), "preamble dropped");
        let at = |h: &str| {
            s.find(&format!("\n## {h}\n"))
                .unwrap_or_else(|| panic!("{h} missing in {s}"))
        };
        let order: Vec<usize> = ["TASK"]
            .iter()
            .chain(NARRATIVE_SECTIONS.iter())
            .chain(["TOOL CALL LOG"].iter())
            .map(|h| at(h))
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
        assert!(s.contains(
            "## TASK\nFix the expired cookie bug in src/auth.py; keep the API unchanged.\n"
        ));
        let plan = s.find("- [in_progress] Fix").unwrap();
        assert!(plan > at("PLAN STATE") && plan < at("DECISIONS"));
        let patch = s.find("+    max_age = 3600").unwrap();
        assert!(patch > at("FILE/WORKSPACE STATE") && patch < at("CONSTRAINTS & PREFERENCES"));
        assert!(s.contains("- src/auth.py — patched"));
        let err = s
            .find("    s = req['session']\nKeyError: 'session'\n```")
            .unwrap();
        assert!(err > at("ERRORS & FIXES") && err < at("OPEN ITEMS / NEXT STEP"));
        assert!(s.contains("- max_age 3600: sessions last an hour"));
        assert!(s.contains(
            "- exec_command(cmd=pytest) → error (Process exited with code 1): KeyError: 'session'"
        ));
        // The ledger, before the narrative: the file and the command with
        // the words that stated its exit status.
        let ledger = at("LEDGER");
        assert!(at("TASK") < ledger && ledger < at("PLAN STATE"), "{s}");
        assert!(
            s[ledger..].starts_with("\n## LEDGER\nRecorded by the proxy: the files the tool calls touched and the commands they ran\nFiles:\n- src/auth.py — patched ("),
            "{s}"
        );
        assert!(
            s.contains("\n- pytest → Process exited with code 1\n"),
            "{s}"
        );
        assert!(s.len() <= 100_000);
    }

    #[test]
    fn assemble_fallback_is_facts_only() {
        let f = sample_facts();
        let s = assemble(&f, None, 7, 100_000);
        assert!(s.starts_with("[compactor summary of 7 earlier items]"));
        assert!(s.contains("narrative is unavailable"));
        for h in ["TASK"]
            .iter()
            .chain(NARRATIVE_SECTIONS.iter())
            .chain(["TOOL CALL LOG"].iter())
        {
            assert!(s.contains(&format!("\n## {h}\n")), "{h}");
        }
        assert!(
            s.contains("+    max_age = 3600")
                && s.contains("KeyError: 'session'")
                && s.contains("- [in_progress] Fix")
        );
        // A narrative missing sections still yields every heading.
        let s2 = assemble(&f, Some("## DECISIONS\nonly this"), 7, 100_000);
        assert!(s2.contains("## PLAN STATE\n(not provided by the summarizer)"));
        assert!(s2.contains("## DECISIONS\nonly this"));
    }

    #[test]
    fn assemble_within_budget_gives_facts_way_lowest_first() {
        let mut f = Facts {
            task: Some("Refactor the storage layer".into()),
            plan: Some("- [pending] everything".into()),
            ..Facts::default()
        };
        for i in 0..10 {
            f.files.push(FileFact {
                path: format!("src/module_{i}.rs"),
                action: "write".into(),
                content: Some(format!("// {i}\n{}", "fn x() {}\n".repeat(400))),
            });
        }
        f.files.push(FileFact {
            path: "gone.rs".into(),
            action: "delete".into(),
            content: None,
        });
        f.errors = (0..20)
            .map(|i| format!("error[E{i:04}]: something {}", "x".repeat(100)))
            .collect();
        f.tool_log = (0..40)
            .map(|i| format!("exec_command(cmd=step {i}) → ok {}", "y".repeat(100)))
            .collect();
        let full = assemble(&f, Some(GOOD), 100, usize::MAX);
        assert!(full.len() > 40_000);
        for max in [30_000, 8_000] {
            let s = assemble(&f, Some(GOOD), 100, max);
            assert!(s.len() <= max, "{} > {max}", s.len());
            assert!(s.contains("## TASK\nRefactor the storage layer\n"));
            for x in &f.files {
                assert!(
                    s.contains(&format!("- {} —", x.path)),
                    "{} missing at {max}",
                    x.path
                );
            }
        }
        // Tighter, the paths of the oldest changed files give way before the
        // errors, and how many is stated.
        let s = assemble(&f, Some(GOOD), 100, 3_000);
        assert!(s.len() <= 3_000, "{}", s.len());
        assert!(s.contains("## TASK\nRefactor the storage layer\n"));
        assert!(s.contains("- gone.rs — deleted"), "{s}");
        assert!(!s.contains("- src/module_0.rs —"), "{s}");
        assert!(
            s.contains("more changed earlier (paths cut for size)"),
            "{s}"
        );
        assert!(s.contains(&f.errors[19]), "{s}");
        // The tool log goes first: with room for everything else, contents stay whole.
        let log_bytes: usize = f.tool_log.iter().map(|l| l.len() + 3).sum();
        let s = assemble(&f, Some(GOOD), 100, full.len() - log_bytes / 2);
        assert!(s.contains(f.files[9].content.as_deref().unwrap()));
        assert!(!s.contains(&f.tool_log[0]) && s.contains(&f.tool_log[39]));
        // Then contents: errors stay.
        let s = assemble(&f, Some(GOOD), 100, 12_000);
        assert!(s.contains(&f.errors[0]), "{s}");
        assert!(s.contains("40 tool calls (log cut for size)"), "{s}");
    }

    /// Facts first: with a budget too small for everything, the narrative
    /// goes before any fact, and the log never reads "the last 0 of N".
    #[test]
    fn a_tight_budget_keeps_facts_before_narrative() {
        let mut f = sample_facts();
        f.decisions = vec!["Decision: max_age 3600 because sessions last an hour".into()];
        f.constraints = vec!["Never change the cookie name.".into()];
        f.next_steps = vec!["Next step: rerun pytest -k cookie".into()];
        f.files.push(FileFact {
            path: "docs/notes.md".into(),
            action: "read".into(),
            content: None,
        });
        f.tool_log = (0..7).map(|i| format!("sh(cmd=step {i}) → ok")).collect();
        let long_narrative = GOOD.replace("- run tests", &"- run tests again\n".repeat(40));
        let full = assemble(&f, Some(&long_narrative), 9, usize::MAX);
        for max in [1400, 1100, 800] {
            let s = assemble(&f, Some(&long_narrative), 9, max);
            assert!(s.len() <= max, "{} > {max}:\n{s}", s.len());
            assert!(!s.contains("the last 0 of"), "{s}");
            let mut must = vec![
                "Fix the expired cookie bug in src/auth.py; keep the API unchanged.",
                "src/auth.py —",
                "KeyError: 'session'",
            ];
            if max > 800 {
                // Room for the statements too (the read-only file is counted instead).
                must.extend([
                    "Decision: max_age 3600 because sessions last an hour",
                    "Never change the cookie name.",
                    "Next step: rerun pytest -k cookie",
                ]);
            }
            for m in must {
                assert!(s.contains(m), "{m} missing at {max}:\n{s}");
            }
            assert!(
                !s.contains("run tests again"),
                "narrative cut first at {max}"
            );
        }
        assert!(full.contains("run tests again") && full.contains("the last 7 of 7"));
        // With no room for the log at all, its size is still stated.
        let s = assemble(&f, None, 9, 600);
        assert!(s.contains("7 tool calls (log cut for size)"), "{s}");
    }

    #[test]
    fn missing_sections_are_marked_and_filled_from_facts() {
        let mut f = sample_facts();
        f.decisions = vec!["Decision: keep the API because clients pin it".into()];
        let answer = "PLAN STATE: the current plan or todo list, each step with its status.\nERRORS & FIXES: KeyError fixed with a default\n";
        let s = assemble(&f, Some(answer), 5, 100_000);
        assert!(!s.contains("narrative is unavailable"));
        assert!(
            s.contains("## ERRORS & FIXES\nKeyError fixed with a default\n"),
            "{s}"
        );
        assert!(s.contains("## PLAN STATE\n(not provided by the summarizer)\n\nRecorded by the proxy: the latest plan"), "{s}");
        assert!(s.contains("## DECISIONS\n(not provided by the summarizer)\n\nRecorded by the proxy: the assistant's decisions\n- Decision: keep the API because clients pin it"), "{s}");
        assert!(
            !s.contains("each step with its status."),
            "echo dropped: {s}"
        );
    }

    #[test]
    fn task_is_never_cut() {
        let f = Facts {
            task: Some("t".repeat(5000)),
            tool_log: vec!["a → ok".into()],
            ..Facts::default()
        };
        let s = assemble(&f, Some(GOOD), 3, 1000);
        assert!(s.contains(&"t".repeat(5000)));
    }

    #[test]
    fn fences_survive_backticks_in_content() {
        let f = Facts {
            files: vec![FileFact {
                path: "README.md".into(),
                action: "write".into(),
                content: Some("```sh\nls\n```\n## DECISIONS\n".into()),
            }],
            ..Facts::default()
        };
        let s = assemble(&f, Some(GOOD), 1, 100_000);
        assert!(
            s.contains("````\n```sh\nls\n```\n## DECISIONS\n````"),
            "{s}"
        );
        assert_eq!(validate(&s), Ok(()));
        let prev = previous_narrative(&s);
        assert!(prev.contains("## DECISIONS\n- max_age 3600: sessions last an hour"));
        assert!(!prev.contains("```sh"));
    }

    #[test]
    fn previous_narrative_round_trip() {
        let f = sample_facts();
        let s = assemble(&f, Some(GOOD), 12, 100_000);
        let prev = previous_narrative(&s);
        assert_eq!(validate(&prev), Ok(()));
        assert!(prev.starts_with("## PLAN STATE\n- fix cookie (in progress)"));
        assert!(prev.contains("## OPEN ITEMS / NEXT STEP\n- run tests"));
        assert!(
            !prev.contains(FACTS_LABEL)
                && !prev.contains("## TASK")
                && !prev.contains("TOOL CALL LOG")
        );
        assert_eq!(written_sections(&prev), written_sections(GOOD));
        // A fallback has no narrative to carry: the facts are handed over instead.
        let fb = assemble(&f, None, 12, 100_000);
        let prev_fb = previous_narrative(&fb);
        assert!(
            prev_fb.starts_with("Earlier conversation items")
                && prev_fb.contains("KeyError: 'session'")
        );
        assert_eq!(previous_narrative("free text summary"), "free text summary");
    }

    #[test]
    fn the_agents_notes_go_after_the_task_and_are_not_carried_as_narrative() {
        let f = sample_facts();
        let s = assemble(&f, Some(GOOD), 12, 100_000);
        let section = "## NOTES\nkeep port 8123";
        let with = with_notes(&s, f.task.as_deref(), section);
        let task = with.find("## TASK").unwrap();
        let notes = with.find(section).unwrap();
        let plan = with.find("## PLAN STATE").unwrap();
        assert!(task < notes && notes < plan, "{with}");
        assert_eq!(with.replace(&format!("\n\n{section}"), ""), s);
        assert!(!previous_narrative(&with).contains("keep port 8123"));
        // A text not in this format gets the notes at its end.
        assert!(with_notes("free text", None, section).ends_with("keep port 8123\n"));
    }
}
