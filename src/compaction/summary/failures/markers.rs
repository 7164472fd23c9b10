//! The failure markers: which (cleaned) line opens a failure block, how
//! important it is, and how the lines around it are gathered.

use super::line::Line;

/// How important a failure marker is: a summary line (`test result:
/// FAILED`, `make: *** … Error 1`) says that something failed, a primary
/// one says what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rank {
    Primary,
    Summary,
}

/// How the lines around a marker are gathered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
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
pub(super) fn is_eslint_line(c: &str, indent: usize) -> bool {
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
pub(super) fn is_code_frame(c: &str) -> bool {
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
pub(super) fn marker(lines: &[Line<'_>], i: usize, lower: &mut String) -> Option<(Rank, Shape)> {
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
