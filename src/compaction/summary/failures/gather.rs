//! A failure block's lines: those around its marker that say what went
//! wrong, by the marker's shape, and their quoting within the bounds.

use std::borrow::Cow;

use crate::compaction::summary::text::clip;

use super::line::Line;
use super::markers::{is_code_frame, is_eslint_line, Shape};

/// Most lines quoted per failure.
pub(super) const MAX_BLOCK_LINES: usize = 8;
/// Most bytes quoted per failure (its lines joined by newlines).
pub(super) const MAX_BLOCK_BYTES: usize = 1_000;
/// Lines a traceback or stack trace is followed for before giving up.
const MAX_TRACE_LINES: usize = 200;

/// A detail line that belongs to the heading above it.
fn is_detail(line: &Line<'_>) -> bool {
    let c: &str = &line.clean;
    line.indent > 0
        || line.raw.starts_with([' ', '\t'])
        || c.starts_with("-->")
        || c.starts_with('|')
        || c.starts_with('=')
        || c.starts_with('^')
        || c.starts_with('→')
        || c.starts_with("LINE ")
        || c.starts_with("DETAIL:")
        || c.starts_with("HINT:")
        || c.starts_with("CONTEXT:")
        || c.starts_with("* ")
        || c.starts_with("symbol:")
        || c.starts_with("location:")
        || is_code_frame(c)
}

/// Whether a line of a block adds nothing when quoted (a bare `|` gutter).
fn is_noise(c: &str) -> bool {
    c.is_empty() || c.chars().all(|ch| ch == '|' || ch == ' ')
}

/// Indices of the lines that make the failure at `i` of `shape`.
// The loops walk indices on purpose: the indices are the result, and a
// block looks at the lines around the one it is at.
#[allow(clippy::needless_range_loop)]
pub(super) fn gather(lines: &[Line<'_>], i: usize, shape: Shape) -> Vec<usize> {
    let mut out = vec![i];
    let n = lines.len();
    let limit = (i + 1 + MAX_TRACE_LINES).min(n);
    let blank = |j: usize| lines[j].clean.trim().is_empty();
    match shape {
        Shape::Alone => {}
        Shape::Heading => {
            let boxed = lines[i].boxed;
            for j in i + 1..limit {
                if boxed {
                    if !lines[j].boxed || lines[j].raw.trim_start().starts_with('╵') {
                        break;
                    }
                    if !blank(j) {
                        out.push(j);
                    }
                } else {
                    if blank(j) || !is_detail(&lines[j]) {
                        break;
                    }
                    if !is_noise(&lines[j].clean) {
                        out.push(j);
                    }
                }
                if out.len() >= MAX_BLOCK_LINES {
                    break;
                }
            }
            // gcc and clang name the function first: `a.c: In function 'main':`.
            if i > 0 && lines[i - 1].clean.contains("In function") {
                out.insert(0, i - 1);
            }
        }
        Shape::Panic => {
            for j in i + 1..limit {
                let c: &str = &lines[j].clean;
                if blank(j) || c.starts_with("note:") || c.starts_with("stack backtrace") {
                    break;
                }
                out.push(j);
            }
        }
        Shape::Traceback => {
            // The exception line: the first unindented line after the frames.
            let mut last_frame = None;
            for j in i + 1..limit {
                let c: &str = &lines[j].clean;
                if c.starts_with("File \"") {
                    last_frame = Some(j);
                    continue;
                }
                if lines[j].indent == 0 && !lines[j].raw.starts_with([' ', '\t']) && !blank(j) {
                    if let Some(f) = last_frame {
                        out.push(f);
                        if f + 1 < j && !lines[f + 1].clean.starts_with("File \"") {
                            out.push(f + 1);
                        }
                    }
                    out.push(j);
                    break;
                }
            }
        }
        Shape::Exception => {
            // The first frame: `at …` (Java, node), `❯ …` (vitest), or Go's
            // function line and the `file.go:N` line under it.
            for j in i + 1..limit.min(i + 12) {
                let c: &str = &lines[j].clean;
                if c.starts_with("at ") || c.starts_with("❯ ") || c.contains(".go:") {
                    out.push(j);
                    break;
                }
                if c.starts_with("goroutine ") || blank(j) {
                    continue;
                }
                if lines[j].indent > 0 || !c.ends_with(')') {
                    break;
                }
                out.push(j);
            }
        }
        Shape::GoFail => {
            let mut before = Vec::new();
            let mut j = i;
            while j > 0 && before.len() < MAX_BLOCK_LINES / 2 {
                j -= 1;
                let l = &lines[j];
                if l.clean.starts_with("=== ") || !l.raw.starts_with([' ', '\t']) || blank(j) {
                    break;
                }
                before.push(j);
            }
            before.reverse();
            out.splice(0..0, before);
            for j in i + 1..limit {
                if !lines[j].raw.starts_with([' ', '\t']) || blank(j) {
                    break;
                }
                if lines[j].clean.starts_with("--- ") {
                    break;
                }
                out.push(j);
                if out.len() >= MAX_BLOCK_LINES {
                    break;
                }
            }
        }
        Shape::Section => {
            // cargo's `---- x stdout ----` ends at its first blank line;
            // jest's and vitest's sections have blank lines inside.
            let cargo = lines[i].clean.starts_with("---- ");
            let mut seen_text = false;
            for j in i + 1..limit {
                let c: &str = &lines[j].clean;
                if blank(j) {
                    if cargo && seen_text {
                        break;
                    }
                    continue;
                }
                if c.starts_with("test ") && (c.ends_with(" ok") || c.ends_with(" FAILED")) {
                    break;
                }
                if c.starts_with("● ")
                    || c.starts_with("---- ")
                    || c.starts_with("FAIL")
                    || c.starts_with("====")
                    || c.starts_with("----------")
                    || c.starts_with("⎯")
                    || c.starts_with("failures:")
                    || (c.starts_with("ERROR: ") && c.ends_with(')'))
                {
                    break;
                }
                if is_code_frame(c)
                    || c.starts_with("Traceback (most recent")
                    || c.starts_with("note: run with")
                {
                    continue;
                }
                // Frames of a stack: keep the first, and the last of a traceback.
                let frame = c.starts_with("at ") || c.starts_with("❯ ");
                if frame {
                    out.push(j);
                    break;
                }
                if c.starts_with("File \"") {
                    continue;
                }
                seen_text = true;
                out.push(j);
                if out.len() >= MAX_BLOCK_LINES {
                    break;
                }
            }
        }
        Shape::Family => {
            let prefix: String = lines[i]
                .clean
                .split([' ', ':'])
                .next()
                .unwrap_or("")
                .to_string();
            for j in i + 1..limit {
                let c: &str = &lines[j].clean;
                let l = c.to_ascii_lowercase();
                let same = !prefix.is_empty() && c.starts_with(&prefix);
                if !(same
                    || lines[j].clean.starts_with("LINE ")
                    || (is_detail(&lines[j]) && !blank(j)))
                {
                    break;
                }
                let bare = c
                    .trim_start_matches(prefix.as_str())
                    .trim_start_matches([':', '!'])
                    .trim();
                if bare.is_empty()
                    || l.contains("a complete log of this run")
                    || l.contains("to see the full stack trace")
                    || l.contains("re-run maven")
                    || l.contains("for more information about the errors")
                    || l.contains("[help 1]")
                    || l.contains("_logs/")
                {
                    continue;
                }
                out.push(j);
                if out.len() >= MAX_BLOCK_LINES {
                    break;
                }
            }
        }
        Shape::Eslint => {
            if let Some(h) = (0..i).rev().take(MAX_TRACE_LINES).find(|&j| {
                lines[j].indent == 0 && !lines[j].raw.starts_with([' ', '\t']) && !blank(j)
            }) {
                out.insert(0, h);
            }
            for j in i + 1..limit {
                if !is_eslint_line(&lines[j].clean, lines[j].indent) {
                    break;
                }
                out.push(j);
                if out.len() >= MAX_BLOCK_LINES {
                    break;
                }
            }
        }
        Shape::Http => {
            // Headers to the blank line, then the body's first line.
            if let Some(end) = (i + 1..limit.min(i + 60)).find(|&j| blank(j)) {
                if let Some(b) = (end + 1..limit).find(|&j| !blank(j)) {
                    out.push(b);
                }
            }
        }
        Shape::PytestE => {
            for j in i + 1..limit {
                let c: &str = &lines[j].clean;
                if c.starts_with("E ") || c == "E" {
                    if c != "E" {
                        out.push(j);
                    }
                    continue;
                }
                if blank(j) {
                    continue;
                }
                // `tests/test_x.py:12: AssertionError`
                if c.contains(".py:") && !c.starts_with('_') {
                    out.push(j);
                }
                break;
            }
        }
        Shape::Paragraphs => {
            let mut blanks = 0;
            for j in i + 1..limit {
                let c: &str = &lines[j].clean;
                if blank(j) {
                    blanks += 1;
                    if blanks == 3 {
                        break;
                    }
                    continue;
                }
                if c.starts_with("Error: ") || c.starts_with("Warning: ") {
                    break;
                }
                out.push(j);
                if out.len() >= MAX_BLOCK_LINES {
                    break;
                }
            }
        }
        Shape::Gradle => {
            for j in i + 1..limit {
                let c: &str = &lines[j].clean;
                if c.starts_with("* Try") || c.starts_with("* Get more help") {
                    break;
                }
                if blank(j) || c.starts_with("* What went wrong") || c.starts_with("* Where:") {
                    continue;
                }
                out.push(j);
                if out.len() >= MAX_BLOCK_LINES {
                    break;
                }
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The quoted text of a block: its lines as printed, within the bounds.
pub(super) fn quote(lines: &[Line<'_>], idx: &[usize], marker: usize) -> String {
    let mut text = String::new();
    let mut count = 0;
    // The marker always, the others while they fit.
    let first = idx.iter().position(|&j| j == marker).unwrap_or(0);
    // A line longer than half the budget (pip's list of every version) is
    // clipped when the block has more lines, so the next one still fits.
    let max_line = if idx.len() > 1 {
        MAX_BLOCK_BYTES / 2
    } else {
        MAX_BLOCK_BYTES
    };
    let quoted = |j: usize| -> Cow<'_, str> {
        let raw = lines[j].raw;
        if raw.len() > max_line {
            Cow::Owned(clip(raw, max_line))
        } else {
            Cow::Borrowed(raw)
        }
    };
    let mut chosen: Vec<usize> = vec![marker];
    let mut bytes = quoted(marker).len();
    for &j in idx.iter().skip(first + 1).chain(idx[..first].iter().rev()) {
        if chosen.len() == MAX_BLOCK_LINES {
            break;
        }
        let add = quoted(j).len() + 1;
        if bytes + add > MAX_BLOCK_BYTES {
            continue;
        }
        bytes += add;
        chosen.push(j);
    }
    chosen.sort_unstable();
    for j in chosen {
        if count > 0 {
            text.push('\n');
        }
        text.push_str(&quoted(j));
        count += 1;
    }
    if text.len() > MAX_BLOCK_BYTES {
        text = clip(&text, MAX_BLOCK_BYTES);
    }
    text
}
