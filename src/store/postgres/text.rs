//! Text as PostgreSQL stores it. PostgreSQL's `text` refuses U+0000, which
//! a client may send in any string (a message, its `model`, its
//! `prompt_cache_key`): such text is stored escaped, losslessly, so that
//! one client's record cannot make the database refuse the batch that
//! carries other tenants' records.
//!
//! The escape is U+FDD0, a Unicode noncharacter (set aside for a
//! program's internal use, so no client text needs it): U+0000 is stored
//! as U+FDD0 followed by `0`, U+FDD0 itself as two of it; nothing else
//! changes. Every text the PostgreSQL backend binds goes through
//! [`escape`], every text it reads through [`unescape`]. Escaping keeps
//! equality and prefixes (the escape of a prefix is a prefix of the
//! escape), so lookups and prefix matches in SQL find what they would on
//! the text itself.

use std::borrow::Cow;

/// The escape character.
const MARK: char = '\u{FDD0}';

/// The first byte of [`MARK`] in UTF-8: text without it or a NUL byte is
/// stored as it is, which one `memchr2` tells.
const MARK_LEAD: u8 = 0xEF;

/// `s` as stored.
pub fn escape(s: &str) -> Cow<'_, str> {
    if memchr::memchr2(0, MARK_LEAD, s.as_bytes()).is_none() || !s.contains(['\0', MARK]) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\0' => {
                out.push(MARK);
                out.push('0');
            }
            MARK => {
                out.push(MARK);
                out.push(MARK);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// [`escape`] of an optional text.
pub fn escape_opt(s: Option<&str>) -> Option<Cow<'_, str>> {
    s.map(escape)
}

/// The text `stored` was escaped from. A `MARK` that escapes nothing (text
/// written by something else) is kept as it is.
pub fn unescape(stored: String) -> String {
    if memchr::memchr(MARK_LEAD, stored.as_bytes()).is_none() || !stored.contains(MARK) {
        return stored;
    }
    let mut out = String::with_capacity(stored.len());
    let mut chars = stored.chars().peekable();
    while let Some(c) = chars.next() {
        if c != MARK {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('0') => {
                chars.next();
                out.push('\0');
            }
            Some(&MARK) => {
                chars.next();
                out.push(MARK);
            }
            _ => out.push(MARK),
        }
    }
    out
}

/// [`unescape`] of an optional text.
pub fn unescape_opt(stored: Option<String>) -> Option<String> {
    stored.map(unescape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ordinary_text_is_stored_as_it_is() {
        for s in ["", "gpt-4o", "héllo 世界", "\u{FEFF}bom", "\u{FFFD}"] {
            assert!(matches!(escape(s), Cow::Borrowed(_)), "{s:?}");
            assert_eq!(unescape(s.to_string()), s);
        }
    }

    #[test]
    fn nul_and_the_mark_are_escaped_without_a_nul_left() {
        let s = "a\0b\u{FDD0}c\0";
        let stored = escape(s);
        assert!(!stored.contains('\0'));
        assert_eq!(stored, "a\u{FDD0}0b\u{FDD0}\u{FDD0}c\u{FDD0}0");
        assert_eq!(unescape(stored.into_owned()), s);
    }

    proptest! {
        #[test]
        fn escaping_is_lossless_and_keeps_prefixes(
            s in "[a0\\x00\u{FDD0}é]{0,24}",
            cut in 0usize..24,
        ) {
            let stored = escape(&s).into_owned();
            prop_assert!(!stored.contains('\0'));
            prop_assert_eq!(unescape(stored.clone()), s.clone());
            let prefix: String = s.chars().take(cut).collect();
            prop_assert!(stored.starts_with(escape(&prefix).as_ref()));
        }
    }
}
