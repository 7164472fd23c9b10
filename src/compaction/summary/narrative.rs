//! Reading the model's answer: headings in the styles models write, the
//! body of each narrative section, and validation.

use super::labels::NARRATIVE_SECTIONS;
use super::prompt::SECTION_DESCRIPTIONS;

/// Uppercase words, `&`/`and` and leading numbering dropped, joined.
fn normalize(s: &str) -> String {
    let upper = s.to_uppercase();
    let words: Vec<&str> = upper
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty() && *w != "AND")
        .collect();
    let skip = words
        .iter()
        .take_while(|w| w.chars().all(|c| c.is_ascii_digit()))
        .count();
    words[skip..].concat()
}

/// Names models give each section besides its own (normalized by
/// [`normalize`] before comparing), in [`NARRATIVE_SECTIONS`] order.
const SYNONYMS: [&[&str]; 6] = [
    &[
        "plan",
        "current plan",
        "plan status",
        "progress",
        "status",
        "todo",
        "todo list",
        "tasks",
    ],
    &["decision", "key decisions", "decisions made", "choices"],
    &[
        "files",
        "file state",
        "workspace",
        "workspace state",
        "files changed",
        "file changes",
        "changed files",
        "modified files",
        "code changes",
        "changes",
    ],
    &[
        "constraints",
        "preferences",
        "constraint",
        "requirements",
        "rules",
        "user preferences",
    ],
    &[
        "errors",
        "errors fixes",
        "error",
        "issues",
        "problems",
        "bugs",
        "errors encountered",
    ],
    &[
        "next step",
        "next steps",
        "open items",
        "open item",
        "next",
        "remaining work",
        "next actions",
        "todo next",
        "pending",
    ],
];

/// The section a heading's text names: its own name (a longer heading that
/// starts with it counts) or one of its [`SYNONYMS`].
fn section_named(label: &str) -> Option<usize> {
    let norm = normalize(label);
    if norm.is_empty() {
        return None;
    }
    NARRATIVE_SECTIONS
        .iter()
        .position(|h| norm.starts_with(&normalize(h)))
        .or_else(|| {
            SYNONYMS
                .iter()
                .position(|names| names.iter().any(|n| normalize(n) == norm))
        })
}

/// The narrative section a line opens, with any text written on the same
/// line. Styles read, any case, numbered or not: `## X`, `### 1. X`, `**X**`,
/// `**X:** text`, `__X__`, `X:` alone, `X: text`, and `X` alone; `X` is a
/// section's name or a near-synonym ("Next steps", "Files"). A bulleted
/// line (`- Files: …`) is content, not a heading.
pub(super) fn heading_of(line: &str) -> Option<(usize, String)> {
    let t = line.trim();
    let marked = t.starts_with('#') || t.starts_with("**") || t.starts_with("__");
    let t = t.trim_start_matches('#').trim_start();
    // Leading numbering: `1.` or `2)` (roman numerals are not read).
    let t = match t.split_once(['.', ')']) {
        Some((n, rest)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => {
            rest.trim_start()
        }
        _ => t,
    };
    let (bold, t) = match t.get(..2) {
        Some(m @ ("**" | "__")) => (Some(m), &t[2..]),
        _ => (None, t),
    };
    // The label ends at the closing bold marker or the first colon.
    let (label, rest) = match bold.and_then(|m| t.find(m).map(|e| (m, e))) {
        Some((m, e)) => (&t[..e], t[e + m.len()..].trim()),
        None => match t.split_once(':') {
            Some((l, r)) => (l, r.trim()),
            None => (t, ""),
        },
    };
    let label = label.trim().trim_end_matches(':').trim();
    let rest = rest.trim_start_matches(':').trim();
    let i = if marked || bold.is_some() {
        section_named(label)
    } else {
        // A plain line: the label must be the whole name (not a sentence
        // that happens to start with "Plan"), and no bullet.
        let plain_ok =
            !t.starts_with(['-', '*', '+', '>', '`']) && label.split_whitespace().count() <= 5;
        plain_ok
            .then(|| section_named(label))
            .flatten()
            .filter(|&i| {
                let norm = normalize(label);
                norm == normalize(NARRATIVE_SECTIONS[i])
                    || SYNONYMS[i].iter().any(|n| normalize(n) == norm)
            })
    }?;
    Some((i, rest.to_string()))
}

pub(super) fn is_fence(line: &str) -> bool {
    let t = line.trim_start();
    t.starts_with("```") || t.starts_with("~~~")
}

/// Small models sometimes wrap their whole answer in a code fence.
fn unwrap_outer_fence(text: &str) -> &str {
    let t = text.trim();
    if !is_fence(t) {
        return text;
    }
    let Some((_, inner)) = t.split_once('\n') else {
        return text;
    };
    match inner.trim_end().rsplit_once('\n') {
        Some((body, last)) if is_fence(last) && last.trim().len() <= 4 => body,
        _ => text,
    }
}

/// The bodies of the narrative sections in `text` (`None` = heading absent).
/// Text before the first section is dropped; headings inside code fences are
/// not headings.
pub(super) fn split_sections(text: &str) -> [Option<String>; 6] {
    let text = unwrap_outer_fence(text);
    let mut out: [Option<String>; 6] = Default::default();
    let mut current: Option<usize> = None;
    let mut fence = false;
    for line in text.lines() {
        if is_fence(line) {
            fence = !fence;
        } else if !fence {
            if let Some((i, rest)) = heading_of(line) {
                current = Some(i);
                let body = out[i].get_or_insert_with(String::new);
                if !rest.is_empty() {
                    body.push_str(&rest);
                    body.push('\n');
                }
                continue;
            }
        }
        if let Some(i) = current {
            let body = out[i].get_or_insert_with(String::new);
            body.push_str(line);
            body.push('\n');
        }
    }
    out.map(|b| b.map(|b| b.trim().to_string()))
}

/// Fewest words a body needs to count as an echo of the prompt.
const MIN_ECHO_WORDS: usize = 3;

/// Lowercased words of `s` longer than two letters.
fn words(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.len() > 2)
        .map(str::to_lowercase)
        .collect()
}

/// Whether `body` only restates the prompt's description of its section
/// (small models copy the instructions in as content): nearly every word
/// of it is a word of the description or of the heading.
fn echoes_prompt(i: usize, body: &str) -> bool {
    let body_words = words(body);
    // A word or two ("fixed", "none pending") is an answer, not an echo.
    if body_words.len() < MIN_ECHO_WORDS {
        return false;
    }
    let mut known = words(SECTION_DESCRIPTIONS[i]);
    known.extend(words(NARRATIVE_SECTIONS[i]));
    let echoed = body_words.iter().filter(|w| known.contains(w)).count();
    echoed * 10 >= body_words.len() * 8
}

/// The sections the model really wrote: [`split_sections`] minus bodies that
/// only echo the prompt.
pub(super) fn written_sections(text: &str) -> [Option<String>; 6] {
    let mut s = split_sections(text);
    for (i, body) in s.iter_mut().enumerate() {
        if body.as_deref().is_some_and(|b| echoes_prompt(i, b)) {
            *body = None;
        }
    }
    s
}

/// Checks the model's answer: `Ok` if every [`NARRATIVE_SECTIONS`] section
/// was written (any heading style `heading_of` reads; a body that only
/// echoes the prompt does not count), else the missing sections. A partial
/// answer is still used (see [`usable`]); the missing list is for the retry.
pub fn validate(narrative: &str) -> Result<(), Vec<&'static str>> {
    let sections = written_sections(narrative);
    let missing: Vec<&'static str> = NARRATIVE_SECTIONS
        .iter()
        .zip(sections.iter())
        .filter(|(_, s)| s.is_none())
        .map(|(h, _)| *h)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing)
    }
}

/// How many sections of `narrative` were really written; an answer with at
/// least one is worth keeping (the assembled summary fills the rest from
/// the recorded facts).
pub fn usable(narrative: &str) -> usize {
    written_sections(narrative).iter().flatten().count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::summary::testing::GOOD;

    #[test]
    fn validate_accepts_varied_heading_styles() {
        assert_eq!(validate(GOOD), Ok(()));
        let varied = "Here is the summary.\n### 1. Plan state\nx\n**Decisions:** chose y\n# file / workspace state\nz\n__Constraints and Preferences__\nnone\nERRORS & FIXES:\nnone\n## Open items / next steps\nrun it\n";
        assert_eq!(validate(varied), Ok(()));
        assert_eq!(validate(&format!("```markdown\n{GOOD}```\n")), Ok(()));
        let sections = split_sections(varied);
        assert_eq!(sections[1].as_deref(), Some("chose y"));
        assert_eq!(sections[5].as_deref(), Some("run it"));
    }

    #[test]
    fn validate_reports_missing_headings() {
        let partial = "## PLAN STATE\nx\n## DECISIONS\ny\n- errors & fixes are discussed here\n```\n## OPEN ITEMS / NEXT STEP\n```\n";
        assert_eq!(
            validate(partial),
            Err(vec![
                "FILE/WORKSPACE STATE",
                "CONSTRAINTS & PREFERENCES",
                "ERRORS & FIXES",
                "OPEN ITEMS / NEXT STEP"
            ])
        );
        assert_eq!(validate(""), Err(NARRATIVE_SECTIONS.to_vec()));
    }

    /// One answer per heading style models write; each must yield all six
    /// sections with the text written under (or after) its heading.
    #[test]
    fn heading_style_corpus() {
        let bodies = [
            "step one done",
            "use chrono because offsets",
            "src/a.rs: UtcOnly",
            "no new deps",
            "`E1` fixed",
            "run the suite",
        ];
        let styles: [(&str, [&str; 6]); 9] = [
            ("## {h}\n{b}\n", NARRATIVE_SECTIONS),
            (
                "### {n}. {h}\n{b}\n",
                [
                    "Plan state",
                    "Decisions",
                    "File/workspace state",
                    "Constraints and preferences",
                    "Errors & fixes",
                    "Open items / next step",
                ],
            ),
            ("**{h}**\n{b}\n", NARRATIVE_SECTIONS),
            (
                "**{h}:** {b}\n",
                [
                    "Plan",
                    "Key decisions",
                    "Files",
                    "Constraints",
                    "Errors",
                    "Next steps",
                ],
            ),
            ("{h}:\n{b}\n\n", NARRATIVE_SECTIONS),
            ("{h}: {b}\n", NARRATIVE_SECTIONS),
            (
                "{n}. {h}: {b}\n",
                [
                    "plan state",
                    "decisions",
                    "workspace",
                    "preferences",
                    "issues",
                    "open items",
                ],
            ),
            (
                "# {h}\n\n{b}\n\n",
                [
                    "current plan",
                    "Decisions made",
                    "Files changed",
                    "Requirements",
                    "Errors and fixes",
                    "Next step",
                ],
            ),
            (
                "__{h}__\n{b}\n",
                [
                    "Progress",
                    "Choices",
                    "Workspace state",
                    "Rules",
                    "Problems",
                    "Remaining work",
                ],
            ),
        ];
        for (style, names) in styles {
            let text: String = names
                .iter()
                .zip(bodies)
                .enumerate()
                .map(|(n, (h, b))| {
                    style
                        .replace("{n}", &(n + 1).to_string())
                        .replace("{h}", h)
                        .replace("{b}", b)
                })
                .collect();
            let text = format!("Here is the summary.\n\n{text}");
            assert_eq!(validate(&text), Ok(()), "style {style:?}:\n{text}");
            let got = written_sections(&text);
            for (i, b) in bodies.iter().enumerate() {
                assert_eq!(got[i].as_deref(), Some(*b), "style {style:?}, section {i}");
            }
        }
    }

    #[test]
    fn bullets_and_sentences_are_content_not_headings() {
        let text =
            "## DECISIONS\n- Files: only src/a.rs\nPlan to keep it small.\nErrors were none.\n";
        let s = split_sections(text);
        assert_eq!(
            s[1].as_deref(),
            Some("- Files: only src/a.rs\nPlan to keep it small.\nErrors were none.")
        );
        assert!(s[0].is_none() && s[2].is_none() && s[4].is_none());
    }

    #[test]
    fn prompt_echoes_are_not_written_sections() {
        let echo = "PLAN STATE: the current plan or todo list, each step with its status.\nDECISIONS: choices made and why, one line each.\nERRORS & FIXES: none\nOPEN ITEMS / NEXT STEP: rerun the iso suite\n";
        let s = written_sections(echo);
        assert!(s[0].is_none() && s[1].is_none(), "{s:?}");
        assert_eq!(s[4].as_deref(), Some("none"));
        assert_eq!(s[5].as_deref(), Some("rerun the iso suite"));
        assert_eq!(usable(echo), 2);
        assert_eq!(
            validate(echo),
            Err(vec![
                "PLAN STATE",
                "DECISIONS",
                "FILE/WORKSPACE STATE",
                "CONSTRAINTS & PREFERENCES"
            ])
        );
        assert_eq!(usable("Sure! We made good progress."), 0);
    }
}
