//! One line of a tool output, as printed and as matched: ANSI escape
//! sequences, box-drawing frames and BuildKit's step prefix stripped, the
//! match bounded to its first [`MAX_MATCH_LINE`] bytes.

use std::borrow::Cow;

use crate::compaction::items::floor_boundary;

/// Bytes of a line matched against the markers.
pub(super) const MAX_MATCH_LINE: usize = 4_096;

/// One line of the output: as printed, and as matched.
pub(super) struct Line<'a> {
    pub(super) raw: &'a str,
    /// ANSI codes, box-drawing frames and step prefixes stripped, trimmed.
    pub(super) clean: Cow<'a, str>,
    /// Leading whitespace of the cleaned line, in bytes.
    pub(super) indent: usize,
    /// The line sits inside a box-drawing frame.
    pub(super) boxed: bool,
}

/// Whether `c` is a box-drawing character (U+2500–U+257F).
pub(super) fn is_box(c: char) -> bool {
    ('\u{2500}'..='\u{257f}').contains(&c)
}

/// `s` without ANSI escape sequences (CSI `ESC [ … letter`, OSC `ESC ] …
/// BEL`, two-byte escapes) and other control characters but tab.
pub(super) fn strip_ansi(s: &str) -> Cow<'_, str> {
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
pub(super) fn strip_step_prefix(s: &str) -> &str {
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

pub(super) fn line_of(raw: &str) -> Line<'_> {
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
