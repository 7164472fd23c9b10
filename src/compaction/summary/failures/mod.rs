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
//! Bounds: at most [`MAX_BLOCK_LINES`](gather::MAX_BLOCK_LINES) lines and
//! [`MAX_BLOCK_BYTES`](gather::MAX_BLOCK_BYTES) bytes per failure,
//! [`MAX_FAILURES`] failures per output; an output over [`MAX_SCAN_BYTES`]
//! or [`MAX_SCAN_LINES`] is read at its head and tail only, and a line is
//! matched on its first [`MAX_MATCH_LINE`](line::MAX_MATCH_LINE) bytes, so
//! the cost is linear in at most a megabyte whatever the output.

use crate::compaction::items::{ceil_boundary, floor_boundary};

mod gather;
mod line;
mod markers;

use gather::{gather, quote};
use line::{line_of, Line};
use markers::{marker, Rank, Shape};

/// Most failures quoted per tool output.
pub const MAX_FAILURES: usize = 3;
/// Most bytes of an output read: the head and tail of a longer one.
pub const MAX_SCAN_BYTES: usize = 1 << 20;
/// Bytes of the head read when an output is over [`MAX_SCAN_BYTES`]: test
/// runners and compilers print their verdict at the end, so most is tail.
const SCAN_HEAD_BYTES: usize = MAX_SCAN_BYTES / 4;
/// Most lines read: the first quarter and the rest from the end.
pub const MAX_SCAN_LINES: usize = 40_000;

/// A failure found in an output: the quoted block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Failure {
    pub(super) text: String,
    /// Only a summary line (`test result: FAILED`).
    summary: bool,
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
    use super::gather::{MAX_BLOCK_BYTES, MAX_BLOCK_LINES};
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
