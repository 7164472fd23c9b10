//! Failure blocks of a tool output: the markers of the common toolchains
//! and the lines around each that carry its message, quoted verbatim.
//!
//! Most harnesses hand tool output back as plain text with no exit code, so
//! a failure is read from the text: a marker line (a panic, an `error:`
//! heading, a test runner's `FAIL` line, a traceback, a shell's `command not
//! found`, an HTTP error status…) and the lines that say what went wrong
//! beside it — the line after a panic or an `Error:` heading, the indented
//! detail lines of a test failure, the last frame and line of a traceback,
//! the first frame of a stack trace. `go test` prints its `x_test.go:88:`
//! detail before `--- FAIL` with `-v` and after it without, so both sides
//! are read there.
//!
//! Matching reads each line with ANSI escape sequences, box-drawing frames
//! (terraform's `│`) and BuildKit's `#8 2.114` step prefix stripped; what is
//! quoted is the line as the tool printed it (trailing blanks trimmed).
//!
//! Bounds: at most [`MAX_BLOCK_LINES`] lines and [`MAX_BLOCK_BYTES`] bytes per
//! failure, [`MAX_FAILURES`] failures per output; an output over
//! [`MAX_SCAN_BYTES`] or [`MAX_SCAN_LINES`] is read at its head and tail
//! only, and a line is matched on its first [`MAX_MATCH_LINE`] bytes, so the
//! cost is linear in at most a megabyte whatever the output.

use std::borrow::Cow;

use crate::compaction::items::{ceil_boundary, floor_boundary};

use super::text::clip;

/// Most lines quoted per failure.
pub const MAX_BLOCK_LINES: usize = 8;
/// Most bytes quoted per failure (its lines joined by newlines).
pub const MAX_BLOCK_BYTES: usize = 1_000;
/// Most failures quoted per tool output.
pub const MAX_FAILURES: usize = 3;
/// Most bytes of an output read: the head and tail of a longer one.
pub const MAX_SCAN_BYTES: usize = 1 << 20;
/// Bytes of the head read when an output is over [`MAX_SCAN_BYTES`]: test
/// runners and compilers print their verdict at the end, so most is tail.
const SCAN_HEAD_BYTES: usize = MAX_SCAN_BYTES / 4;
/// Most lines read: the first quarter and the rest from the end.
pub const MAX_SCAN_LINES: usize = 40_000;
/// Bytes of a line matched against the markers.
const MAX_MATCH_LINE: usize = 4_096;
/// Lines a traceback or stack trace is followed for before giving up.
const MAX_TRACE_LINES: usize = 200;

/// One line of the output: as printed, and as matched.
struct Line<'a> {
    raw: &'a str,
    /// ANSI codes, box-drawing frames and step prefixes stripped, trimmed.
    clean: Cow<'a, str>,
    /// Leading whitespace of the cleaned line, in bytes.
    indent: usize,
    /// The line sits inside a box-drawing frame.
    boxed: bool,
}

/// How important a failure marker is: a summary line (`test result:
/// FAILED`, `make: *** … Error 1`) says that something failed, a primary
/// one says what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rank {
    Primary,
    Summary,
}

/// How the lines around a marker are gathered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// The marker line alone.
    Alone,
    /// The marker and the detail lines after it (indented, `-->`, `|`,
    /// `LINE`, `HINT:`…) up to a blank line; inside a box frame, to its end.
    Heading,
    /// A Rust panic: the lines after it up to a blank line or `note:`.
    Panic,
    /// `Traceback (most recent call last):`: the last frame and the
    /// exception line.
    Traceback,
    /// An exception line: it and the first `at …` frame after it.
    Exception,
    /// `--- FAIL: TestX`: indented lines before (with `-v`) and after it.
    GoFail,
    /// A block opener (`---- x stdout ----`, jest's `●`, vitest's `FAIL`,
    /// unittest's `FAIL:`): the non-blank lines after it, code frames
    /// skipped, up to the next opener or a rule.
    Section,
    /// The marker and the lines after it that carry the same prefix (`npm
    /// error`, `[ERROR]`, pip's `ERROR:`).
    Family,
    /// eslint: the file header above, the rule lines of that file.
    Eslint,
    /// An HTTP error status line: it and the first line of the body.
    Http,
    /// A group of pytest `E ` lines and the `file.py:12: Error` line after.
    PytestE,
    /// gradle's `FAILURE:` heading: what went wrong, up to `* Try:`.
    Gradle,
    /// An `Error:` heading followed by a blank line (terraform without
    /// colour, cobra CLIs): the paragraphs after it, up to the next heading.
    Paragraphs,
}

/// A failure found in an output: the quoted block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Failure {
    pub(super) text: String,
    /// Only a summary line (`test result: FAILED`).
    summary: bool,
}

/// Whether `c` is a box-drawing character (U+2500–U+257F).
fn is_box(c: char) -> bool {
    ('\u{2500}'..='\u{257f}').contains(&c)
}

/// `s` without ANSI escape sequences (CSI `ESC [ … letter`, OSC `ESC ] …
/// BEL`, two-byte escapes) and other control characters but tab.
fn strip_ansi(s: &str) -> Cow<'_, str> {
    if !s.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            match it.next() {
                Some('[') => {
                    // Parameters and intermediates, then one final byte.
                    for d in it.by_ref() {
                        if ('@'..='~').contains(&d) {
                            break;
                        }
                    }
                }
                Some(']') => {
                    while let Some(d) = it.next() {
                        if d == '\u{7}' {
                            break;
                        }
                        if d == '\u{1b}' {
                            it.next();
                            break;
                        }
                    }
                }
                _ => {}
            }
        } else if !c.is_control() || c == '\t' {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// BuildKit's `#8 2.114 ` (step and seconds) or `#8 ` prefix.
fn strip_step_prefix(s: &str) -> &str {
    let Some(rest) = s.strip_prefix('#') else {
        return s;
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 || !rest[digits..].starts_with(' ') {
        return s;
    }
    let rest = &rest[digits + 1..];
    let secs = rest
        .bytes()
        .take_while(|b| b.is_ascii_digit() || *b == b'.')
        .count();
    if secs > 0 && rest[..secs].contains('.') && rest[secs..].starts_with(' ') {
        &rest[secs + 1..]
    } else {
        rest
    }
}

fn line_of(raw: &str) -> Line<'_> {
    let raw = raw.trim_end();
    // Colour codes can outweigh the text: strip first, then bound.
    let plain = match strip_ansi(raw) {
        Cow::Borrowed(b) => Cow::Borrowed(&b[..floor_boundary(b, MAX_MATCH_LINE)]),
        Cow::Owned(mut o) => {
            o.truncate(floor_boundary(&o, MAX_MATCH_LINE));
            Cow::Owned(o)
        }
    };
    let boxed = plain.trim_start().starts_with(is_box);
    let clean: Cow<'_, str> = if boxed {
        Cow::Owned(
            plain
                .trim_start()
                .trim_start_matches(is_box)
                .trim_end_matches(is_box)
                .to_string(),
        )
    } else {
        plain
    };
    let indent = clean.len() - clean.trim_start().len();
    let clean = match clean {
        Cow::Borrowed(b) => Cow::Borrowed(strip_step_prefix(b.trim())),
        Cow::Owned(o) => Cow::Owned(strip_step_prefix(o.trim()).to_string()),
    };
    Line {
        raw,
        clean,
        indent,
        boxed,
    }
}

/// The part of `text` read: all of it, or its head and tail when it is
/// over [`MAX_SCAN_BYTES`].
fn scanned(text: &str) -> (&str, &str) {
    if text.len() <= MAX_SCAN_BYTES {
        return (text, "");
    }
    let head = floor_boundary(text, SCAN_HEAD_BYTES);
    let tail = ceil_boundary(text, text.len() - (MAX_SCAN_BYTES - SCAN_HEAD_BYTES));
    (&text[..head], &text[tail..])
}

/// A Python/JS/Java-style exception line: `KeyError: 'session'`,
/// `json.decoder.JSONDecodeError: …`, `TypeError: x is not a function`,
/// `java.lang.IllegalStateException: …`.
pub(super) fn is_exception_line(t: &str) -> bool {
    let t = t.strip_prefix("Uncaught ").unwrap_or(t);
    let t = t.strip_prefix("Caused by: ").unwrap_or(t);
    let name = t.split(':').next().unwrap_or("");
    let ident = !name.is_empty()
        && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '$');
    let last = name.rsplit('.').next().unwrap_or(name);
    ident
        && (last.ends_with("Error") || last.ends_with("Exception") || last == "Panic")
        && (name.len() == t.len() || t[name.len()..].starts_with(':'))
}

/// `path:line[:col]: error: …` (gcc, clang, javac, go vet), `path(l,c):
/// error TS…` and `path:l:c - error TS…` (tsc), `path:[l,c] error` (maven).
fn is_located_error(c: &str) -> bool {
    let Some(pos) = c
        .find(": error")
        .or_else(|| c.find(" - error"))
        .or_else(|| {
            c.find("): error")
                .map(|p| p + 1)
                .or_else(|| c.find(": fatal error"))
        })
    else {
        return false;
    };
    let loc = &c[..pos];
    !loc.is_empty()
        && !loc.contains(' ')
        && loc.bytes().any(|b| b.is_ascii_digit())
        && (loc.contains(':') || loc.contains('('))
}

/// `./main.go:5:2: undefined: x`: a located diagnostic without the word
/// `error` (go build and vet print these under `# package`).
fn is_go_diagnostic(c: &str) -> bool {
    let Some((loc, msg)) = c.split_once(": ") else {
        return false;
    };
    let mut parts = loc.split(':');
    let file = parts.next().unwrap_or("");
    let nums: Vec<&str> = parts.collect();
    file.ends_with(".go")
        && !file.contains(' ')
        && !nums.is_empty()
        && nums
            .iter()
            .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        && !msg.is_empty()
}

/// `  1:7  error  'x' is assigned a value but never used  no-unused-vars`.
fn is_eslint_line(c: &str, indent: usize) -> bool {
    if indent == 0 {
        return false;
    }
    let mut words = c.split_whitespace();
    let loc = words.next().unwrap_or("");
    let (l, col) = loc.split_once(':').unwrap_or(("", ""));
    !l.is_empty()
        && !col.is_empty()
        && l.bytes().all(|b| b.is_ascii_digit())
        && col.bytes().all(|b| b.is_ascii_digit())
        && words.next() == Some("error")
}

/// An HTTP status line of an error answer (`HTTP/1.1 500 …`, `< HTTP/2 404`).
fn is_http_error(c: &str) -> bool {
    let c = c.strip_prefix("< ").unwrap_or(c);
    let Some(rest) = c.strip_prefix("HTTP/") else {
        return false;
    };
    let mut w = rest.split_whitespace();
    let _version = w.next();
    w.next()
        .and_then(|s| s.parse::<u16>().ok())
        .is_some_and(|s| (400..600).contains(&s))
}

/// A code frame line of jest, vitest, rustc or gcc (`  3 | x`, `> 4 | y`,
/// `    |     ^`), skipped inside blocks: the message is elsewhere.
fn is_code_frame(c: &str) -> bool {
    let c = c.strip_prefix('>').unwrap_or(c).trim_start();
    let digits = c.bytes().take_while(u8::is_ascii_digit).count();
    let rest = c[digits..].trim_start();
    rest == "|" || rest.starts_with("| ") || (digits == 0 && rest.starts_with('|'))
}

/// Whether a (cleaned, non-empty) line can be a marker at all: every
/// marker has a `:`, `!`, `*` or `=`, a test runner's symbol, or opens with
/// one of a few words. Most lines of a log or a file fail this cheap test,
/// and a passing test's line is rejected outright.
fn may_mark(c: &str) -> bool {
    let b = c.as_bytes();
    if b.starts_with(b"test ") && (b.ends_with(b" ok") || b.ends_with(b" ignored")) {
        return false;
    }
    const OPENERS: [&[u8]; 16] = [
        b"fail",
        b"error",
        b"fatal",
        b"found",
        b"test files",
        b"----",
        b"e ",
        b"segmentation",
        b"aborted",
        b"http/",
        b"< http/",
        b"exception",
        b"npm",
        b"[error]",
        b"build",
        b"err",
    ];
    let opens = |p: &[u8]| b.len() >= p.len() && b[..p.len()].eq_ignore_ascii_case(p);
    b.iter()
        .any(|&x| matches!(x, b':' | b'!' | b'*' | b'=') || x >= 0x80)
        || c == "E"
        || OPENERS.iter().any(|p| opens(p))
        || c.ends_with("Error")
        || c.ends_with("Exception")
}

/// The failure marker a (cleaned) line is, if any; inside a box frame
/// (terraform) the frame is the block.
fn marker(lines: &[Line<'_>], i: usize, lower: &mut String) -> Option<(Rank, Shape)> {
    let m = bare_marker(lines, i, lower)?;
    Some(if lines[i].boxed && m.0 == Rank::Primary {
        (Rank::Primary, Shape::Heading)
    } else {
        m
    })
}

fn bare_marker(lines: &[Line<'_>], i: usize, lower: &mut String) -> Option<(Rank, Shape)> {
    let line = &lines[i];
    let c: &str = &line.clean;
    if c.is_empty() {
        return None;
    }
    if !may_mark(c) {
        return None;
    }
    // One buffer for every line's lowercase form.
    lower.clear();
    lower.push_str(c);
    lower.make_ascii_lowercase();
    let l: &str = lower;
    use Rank::*;
    use Shape::*;
    // Summary lines first: they also match the primary patterns below.
    const SUMMARY_STARTS: [&str; 14] = [
        "error: could not compile",
        "test result: failed",
        "failed (failures=",
        "failed (errors=",
        "make: ***",
        "error command failed with exit code",
        "error: recipe for target",
        "error: failed to solve:",
        "error: process \"",
        "tests:",
        "test files ",
        "build failure",
        "error: build failed",
        "error: test failed",
    ];
    if SUMMARY_STARTS.iter().any(|p| l.starts_with(p))
        && (l.contains("fail") || l.contains("error") || l.contains("***"))
    {
        return Some((Summary, Alone));
    }
    if c == "FAIL"
        || c.starts_with("FAIL\t")
        || (c.starts_with("FAIL ") && c.ends_with("s")) && c.contains('\t')
    {
        return Some((Summary, Alone));
    }
    if (l.starts_with("=") && l.contains(" failed") && l.ends_with('='))
        || (l.starts_with('✖') && l.contains("problem") && !l.contains("(0 errors"))
        || (l.starts_with("found ") && l.contains(" error"))
        || l.starts_with("npm error a complete log")
        || l.starts_with("npm err! a complete log")
    {
        return Some((Summary, Alone));
    }
    if c.starts_with("thread '") && c.contains("panicked at") {
        return Some((Primary, Panic));
    }
    if c.starts_with("panic: ") || c.starts_with("fatal error: all goroutines") {
        return Some((Primary, Exception));
    }
    if c == "Traceback (most recent call last):" {
        return Some((Primary, Traceback));
    }
    if c.starts_with("--- FAIL") {
        return Some((Primary, GoFail));
    }
    if c.starts_with("---- ") && c.ends_with(" ----") {
        return Some((Primary, Section));
    }
    if (c.starts_with("FAIL: ") || c.starts_with("ERROR: ")) && c.ends_with(')') && c.contains(" (")
    {
        // unittest's `FAIL: test_x (pkg.Tests.test_x)`.
        return Some((Primary, Section));
    }
    if c.starts_with("● ") && !c.contains("Console") {
        return Some((Primary, Section));
    }
    if c.starts_with("FAIL ") && c.len() > 5 {
        // vitest / jest: ` FAIL  test/x.test.ts > suite > name`.
        return Some((Primary, Section));
    }
    if c.starts_with("FAILURE: ") {
        return Some((Primary, Gradle));
    }
    if ["×", "✗", "✕", "❌"].iter().any(|m| c.starts_with(m))
        && i + 1 < lines.len()
        && lines[i + 1].clean.starts_with('→')
    {
        return Some((Primary, Heading));
    }
    if c.starts_with("E ") || c == "E" {
        return (i == 0 || !(lines[i - 1].clean.starts_with("E ") || lines[i - 1].clean == "E"))
            .then_some((Primary, PytestE));
    }
    if c.starts_with("FAILED ") || c.starts_with("ERROR ") && c.contains("::") {
        return Some((Summary, Alone));
    }
    if l.starts_with("npm err!") || l.starts_with("npm error") || c.starts_with("[ERROR]") {
        return Some((Primary, Family));
    }
    if c.contains("ERR_PNPM_") || c.starts_with("ERR!") {
        return Some((Primary, Family));
    }
    if c.starts_with("ERROR: ") || c.starts_with("ERROR:  ") {
        // pip, BuildKit, psql.
        return Some((Primary, Family));
    }
    if c.starts_with("Error: ")
        && lines
            .get(i + 1)
            .is_some_and(|n| n.clean.is_empty() && !n.boxed)
    {
        return Some((Primary, Paragraphs));
    }
    if c.starts_with("Exception in thread") || is_exception_line(c) {
        return Some((Primary, Exception));
    }
    if is_eslint_line(c, line.indent) {
        return Some((Primary, Eslint));
    }
    if is_located_error(c) {
        return Some((Primary, Heading));
    }
    if c.starts_with("curl: (") {
        return Some((Primary, Alone));
    }
    if is_http_error(c) {
        return Some((Primary, Http));
    }
    const STARTS: [&str; 13] = [
        "error:",
        "error[",
        "fatal:",
        "fatal error",
        "error from server",
        "error ",
        "psql: error",
        "segmentation fault",
        "exception:",
        "err:",
        "failed:",
        "failure:",
        "aborted",
    ];
    const CONTAINS: [&str; 15] = [
        "cannot connect to the docker daemon",
        "connection refused",
        " was refused",
        ": error:",
        "command not found",
        ": not found",
        "no such file or directory",
        "permission denied",
        "verification failed",
        "undefined reference",
        "syntax error",
        "is invalid:",
        ") error:",
        ": error ",
        "cannot find module",
    ];
    if STARTS.iter().any(|p| l.starts_with(p)) || CONTAINS.iter().any(|p| l.contains(p)) {
        return Some((Primary, Heading));
    }
    if c.starts_with("ERROR") || c.starts_with("FATAL") || c.starts_with("FAILED") {
        return Some((Primary, Heading));
    }
    if is_go_diagnostic(c) && !line.raw.starts_with([' ', '\t']) {
        return Some((Primary, Alone));
    }
    None
}

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
fn gather(lines: &[Line<'_>], i: usize, shape: Shape) -> Vec<usize> {
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
fn quote(lines: &[Line<'_>], idx: &[usize], marker: usize) -> String {
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

/// The failures `text` reports, in order, at most [`MAX_FAILURES`]: primary
/// ones first, summary lines (`test result: FAILED`) only when there is room.
/// Each failure's lines are quoted as printed; a line already quoted in one
/// failure does not open another.
pub(super) fn failures(text: &str) -> Vec<Failure> {
    let (head, tail) = scanned(text);
    let mut raw: Vec<&str> = head.lines().chain(tail.lines()).collect();
    if raw.len() > MAX_SCAN_LINES {
        let first = MAX_SCAN_LINES / 4;
        raw.drain(first..raw.len() - (MAX_SCAN_LINES - first));
    }
    let lines: Vec<Line<'_>> = raw.into_iter().map(line_of).collect();
    let mut lower = String::new();
    let markers: Vec<Option<(Rank, Shape)>> = (0..lines.len())
        .map(|i| marker(&lines, i, &mut lower))
        .collect();
    let mut used = vec![false; lines.len()];
    let mut found: Vec<(usize, Failure)> = Vec::new();
    // Blocks with a structure of their own first (a test's section, a
    // traceback, `--- FAIL` and its detail): the markers inside them
    // (a detail line that looks like a diagnostic) belong to them.
    let structural = |s: Shape| {
        matches!(
            s,
            Shape::GoFail
                | Shape::Section
                | Shape::Traceback
                | Shape::PytestE
                | Shape::Gradle
                | Shape::Panic
        )
    };
    for pass in [true, false] {
        let mut taken = 0;
        for i in 0..lines.len() {
            if taken == MAX_FAILURES || found.len() == MAX_FAILURES {
                break;
            }
            let Some((Rank::Primary, shape)) = markers[i] else {
                continue;
            };
            if used[i] || structural(shape) != pass {
                continue;
            }
            let idx: Vec<usize> = gather(&lines, i, shape)
                .into_iter()
                .filter(|&j| j == i || !used[j])
                .collect();
            let text = quote(&lines, &idx, i);
            for &j in &idx {
                used[j] = true;
            }
            // The same failure repeated with other timestamps or counts
            // (klog's `E1201 20:00:09.504763`, retries) is one failure.
            let key = shape_key(&text);
            if found.iter().any(|(_, f)| shape_key(&f.text) == key) {
                continue;
            }
            taken += 1;
            found.push((
                i,
                Failure {
                    text,
                    summary: false,
                },
            ));
        }
    }
    // Summary lines only say that something failed: quoted when nothing
    // says what.
    for (i, m) in markers.iter().enumerate() {
        if !found.iter().all(|(_, f)| f.summary) || found.len() == MAX_FAILURES {
            break;
        }
        if used[i] || !matches!(m, Some((Rank::Summary, _))) {
            continue;
        }
        let text = quote(&lines, &[i], i);
        if !found.iter().any(|(_, f)| f.text.contains(&text)) {
            found.push((
                i,
                Failure {
                    text,
                    summary: true,
                },
            ));
        }
    }
    found.sort_by_key(|(i, _)| *i);
    found.into_iter().map(|(_, f)| f).collect()
}

/// A block's text without its digits, to tell repeats apart from failures.
fn shape_key(text: &str) -> String {
    text.chars().filter(|c| !c.is_ascii_digit()).collect()
}

/// The line of a failure's block that names it best, for one-line uses
/// (the tool-call log): the exception line of a traceback, the line after
/// a test's section header, else the first line.
pub(super) fn headline(block: &str) -> &str {
    let lines: Vec<&str> = block.lines().filter(|l| !l.trim().is_empty()).collect();
    let first = lines.first().map(|l| l.trim()).unwrap_or("");
    if first.starts_with("Traceback (") {
        return lines.last().map(|l| l.trim()).unwrap_or(first);
    }
    if (first.starts_with("---- ") && first.ends_with(" ----")) || first.starts_with("● ") {
        return lines.get(1).map(|l| l.trim()).unwrap_or(first);
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(out: &str) -> Vec<String> {
        failures(out).into_iter().map(|f| f.text).collect()
    }

    #[test]
    fn a_rust_panic_keeps_the_message_on_the_next_line() {
        let out = "running 3 tests\ntest archive::mtime ... FAILED\n\nfailures:\n\n---- archive::mtime stdout ----\nthread 'archive::mtime' panicked at src/archive.rs:212:9:\nassertion `left == right` failed: mtime not clamped\n  left: 0\n right: 1\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n\n\nfailures:\n    archive::mtime\n\ntest result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n";
        let t = texts(out);
        assert_eq!(
            t.len(),
            1,
            "the summary line only when nothing says what: {t:?}"
        );
        assert_eq!(t[0], "---- archive::mtime stdout ----\nthread 'archive::mtime' panicked at src/archive.rs:212:9:\nassertion `left == right` failed: mtime not clamped\n  left: 0\n right: 1");
        let only_summary = texts(
            "test result: FAILED. 2 passed; 1 failed\nerror: test failed, to rerun pass `--lib`\n",
        );
        assert_eq!(only_summary.len(), 2, "{only_summary:?}");
    }

    #[test]
    fn go_test_detail_is_read_both_ways() {
        let verbose = "=== RUN   TestSend\n    sender_test.go:88: Post: http: ContentLength=412 with Body length 0\n--- FAIL: TestSend (0.00s)\nFAIL\nFAIL\texample.com/sender\t0.003s\n";
        let t = texts(verbose);
        assert_eq!(
            t[0],
            "    sender_test.go:88: Post: http: ContentLength=412 with Body length 0\n--- FAIL: TestSend (0.00s)"
        );
        let quiet = "--- FAIL: TestSend (0.00s)\n    sender_test.go:88: Post: http: ContentLength=412 with Body length 0\nFAIL\nFAIL\texample.com/sender\t0.003s\n";
        let t = texts(quiet);
        assert_eq!(
            t[0],
            "--- FAIL: TestSend (0.00s)\n    sender_test.go:88: Post: http: ContentLength=412 with Body length 0"
        );
    }

    #[test]
    fn ansi_and_box_frames_are_stripped_for_matching_kept_when_quoted() {
        let tf = "\u{1b}[31m╷\u{1b}[0m\n\u{1b}[31m│\u{1b}[0m \u{1b}[1m\u{1b}[31mError: \u{1b}[0m\u{1b}[0m\u{1b}[1mUnsupported argument\u{1b}[0m\n\u{1b}[31m│\u{1b}[0m \n\u{1b}[31m│\u{1b}[0m \u{1b}[0m  on main.tf line 3, in resource \"null_resource\" \"x\":\n\u{1b}[31m│\u{1b}[0m \u{1b}[0m   3:   colour = \"red\"\n\u{1b}[31m│\u{1b}[0m \n\u{1b}[31m│\u{1b}[0m An argument named \"colour\" is not expected here.\n\u{1b}[31m╵\u{1b}[0m\n";
        let t = texts(tf);
        assert_eq!(t.len(), 1, "{t:?}");
        assert!(t[0].contains("\u{1b}[1mUnsupported argument"), "{t:?}");
        assert!(t[0].contains("An argument named \"colour\" is not expected here."));
        assert_eq!(t[0].lines().count(), 4, "{t:?}");
    }

    #[test]
    fn buildkit_step_prefixes_are_read_through() {
        let out = "#8 [4/5] RUN pip install --require-hashes -r requirements.txt\n#8 1.902 Collecting flask==3.0.0\n#8 2.114 ERROR: Hashes are required in --require-hashes mode, but they are missing from some requirements.\n#8 ERROR: process \"/bin/sh -c pip install --require-hashes -r requirements.txt\" did not complete successfully: exit code: 1\n";
        let t = texts(out);
        assert!(
            t[0].starts_with("#8 2.114 ERROR: Hashes are required"),
            "{t:?}"
        );
    }

    #[test]
    fn vitest_arrow_line_is_kept_with_its_test() {
        let out = " ❯ test/format.test.ts (2 tests | 1 failed) 4ms\n   × formats dates > uses the zone 3ms\n     → TypeError: Cannot read properties of undefined (reading 'timeZone')\n";
        let t = texts(out);
        assert_eq!(t[0], "   × formats dates > uses the zone 3ms\n     → TypeError: Cannot read properties of undefined (reading 'timeZone')");
    }

    #[test]
    fn an_exception_keeps_its_first_frame() {
        let go = "panic: runtime error: index out of range [5] with length 2\n\ngoroutine 1 [running]:\nmain.main()\n\t/src/main.go:6 +0x1d\nexit status 2\n";
        assert_eq!(
            texts(go)[0],
            "panic: runtime error: index out of range [5] with length 2\nmain.main()\n\t/src/main.go:6 +0x1d"
        );
        let java = "Exception in thread \"main\" java.lang.IllegalStateException: ledger key K7 missing\n\tat Main.load(Main.java:2)\n\tat Main.main(Main.java:3)\n";
        assert_eq!(
            texts(java)[0],
            "Exception in thread \"main\" java.lang.IllegalStateException: ledger key K7 missing\n\tat Main.load(Main.java:2)"
        );
    }

    #[test]
    fn bounds_hold_on_floods() {
        let flood = "error: boom\n".repeat(10_000);
        let t = failures(&flood);
        assert!(t.len() <= MAX_FAILURES);
        let long = format!("error: {}\n{}", "x".repeat(5_000), "  detail\n".repeat(50));
        let t = texts(&long);
        assert!(
            t.iter()
                .all(|f| f.len() <= MAX_BLOCK_BYTES && f.lines().count() <= MAX_BLOCK_LINES),
            "{t:?}"
        );
        let junk: String = (0..200_000u32)
            .map(|i| char::from_u32(i % 0x3000).unwrap_or('x'))
            .collect();
        let _ = failures(&junk);
        let ansi = "\u{1b}[31m\u{1b}[1m".repeat(100_000) + "error: x\n";
        let t = texts(&ansi);
        assert_eq!(t.len(), 1);
    }
}
