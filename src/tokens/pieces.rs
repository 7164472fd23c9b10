//! o200k token counts at the speed of the `regex` crate, equal to
//! tiktoken-rs's own.
//!
//! tiktoken first splits text into pieces with a pattern that has one
//! lookahead, `\s+(?!\S)`. That one lookahead puts the whole pattern on
//! fancy-regex's backtracking VM, which splits ~25 MB/s here and was most
//! of the accounting thread's time. Without it the pattern runs on the
//! `regex` crate's automata; what the lookahead does is applied to the
//! match instead: a run of whitespace (with no line break) followed by a
//! non-space leaves its last character to the piece that follows.
//!
//! Each piece is then tokenized by tiktoken-rs alone (a piece of the split
//! is split into itself) and its count kept, so a word, an indentation or a
//! punctuation run seen before costs a lookup.

use std::sync::{Mutex, TryLockError};

use regex::Regex;
use tiktoken_rs::CoreBPE;

/// The lookahead alternative of tiktoken's o200k pattern.
const LOOKAHEAD: &str = r"|\s+(?!\S)";

/// Distinct pieces kept before the cache starts over.
const PIECE_LIMIT: usize = 1 << 16;

/// One cache for the process (counting is mostly the accounting thread's),
/// so its memory stays bounded however many threads count.
static PIECES: Mutex<Option<foldhash::HashMap<Box<str>, u32>>> = Mutex::new(None);

/// The split without the lookahead, over tiktoken's tokenizer.
pub struct PieceCounter {
    split: Regex,
}

impl PieceCounter {
    /// `None` if tiktoken's pattern is not the one this emulates (then
    /// the tokenizer counts on its own).
    pub fn new() -> Option<Self> {
        let pattern = tiktoken_rs::O200K_BASE_PAT_STR;
        if pattern.matches(LOOKAHEAD).count() != 1 || !pattern.ends_with(r"|\s+") {
            return None;
        }
        let split = Regex::new(&pattern.replace(LOOKAHEAD, "")).ok()?;
        Some(Self { split })
    }

    /// The pieces tiktoken's pattern splits `text` into, in order.
    pub fn pieces<'a>(&'a self, text: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        // One search over the rest of the text, started again after a
        // shortened match (the pattern has no anchors or look-around, so a
        // search over a suffix finds what one from that offset would).
        let mut base = 0;
        let mut matches = self.split.find_iter(text);
        std::iter::from_fn(move || {
            let m = matches.next()?;
            let (start, mut end) = (base + m.start(), base + m.end());
            let piece = m.as_str();
            // A whitespace run without a line break (the `\s+`
            // alternative), followed by a non-space: `\s+(?!\S)` would
            // have matched all of it but its last character.
            if end < text.len()
                && !piece.ends_with(['\r', '\n'])
                && piece.chars().all(char::is_whitespace)
            {
                if let Some(last) = piece.chars().next_back() {
                    if piece.len() > last.len_utf8() {
                        end -= last.len_utf8();
                        base = end;
                        matches = self.split.find_iter(&text[end..]);
                    }
                }
            }
            Some(&text[start..end])
        })
    }

    /// Tokens of `text`: what `bpe.encode_ordinary(text).len()` gives.
    /// While another thread holds the cache, this one counts without it.
    pub fn count(&self, bpe: &CoreBPE, text: &str) -> u64 {
        let count = |piece: &str| bpe.encode_ordinary(piece).len() as u32;
        let mut guard = match PIECES.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return self.pieces(text).map(|p| u64::from(count(p))).sum();
            }
        };
        let cache = guard.get_or_insert_with(Default::default);
        let mut total = 0u64;
        for piece in self.pieces(text) {
            let n = match cache.get(piece) {
                Some(n) => *n,
                None => {
                    let n = count(piece);
                    if cache.len() >= PIECE_LIMIT {
                        cache.clear();
                    }
                    cache.insert(piece.into(), n);
                    n
                }
            };
            total += u64::from(n);
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bpe() -> &'static CoreBPE {
        static BPE: std::sync::OnceLock<CoreBPE> = std::sync::OnceLock::new();
        BPE.get_or_init(|| tiktoken_rs::o200k_base().unwrap())
    }

    fn counter() -> &'static PieceCounter {
        static C: std::sync::OnceLock<PieceCounter> = std::sync::OnceLock::new();
        C.get_or_init(|| PieceCounter::new().expect("the o200k pattern has its lookahead"))
    }

    /// tiktoken's own pieces, from its pattern on fancy-regex.
    fn reference_pieces(text: &str) -> Vec<String> {
        static RE: std::sync::OnceLock<fancy_regex::Regex> = std::sync::OnceLock::new();
        let re =
            RE.get_or_init(|| fancy_regex::Regex::new(tiktoken_rs::O200K_BASE_PAT_STR).unwrap());
        re.find_iter(text)
            .map(|m| m.unwrap().as_str().to_string())
            .collect()
    }

    #[test]
    fn whitespace_before_a_word_goes_to_the_word() {
        let pieces: Vec<_> = counter().pieces("a   b\t\tc  \n  d  ").collect();
        assert_eq!(pieces, reference_pieces("a   b\t\tc  \n  d  "));
        assert_eq!(
            pieces,
            ["a", "  ", " b", "\t", "\tc", "  \n", " ", " d", "  "]
        );
    }

    #[test]
    fn code_and_prose_count_as_tiktoken_counts() {
        let texts = [
            "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
            "It's 2026; they'll say: \"don't\" — naïve café, ÉCOLE, 中文 和 日本語…\r\n\r\n\tdone.",
            "    indented\n\n\n        deeper   \t \n  trailing   ",
            "{\"path\":\"src/a/b.rs\",\"command\":\"cargo test -p x -- y\"}  ",
            " \u{a0}\u{3000}x\u{2003} y  \u{85}z",
        ];
        for t in texts {
            assert_eq!(
                counter().pieces(t).collect::<Vec<_>>(),
                reference_pieces(t),
                "{t:?}"
            );
            assert_eq!(
                counter().count(bpe(), t),
                bpe().encode_ordinary(t).len() as u64,
                "{t:?}"
            );
        }
    }

    fn text() -> impl Strategy<Value = String> {
        // Heavy on what the lookahead decides: runs of assorted whitespace
        // and line breaks between words, digits, punctuation, apostrophes,
        // letters of several scripts and cases, marks.
        let part = prop_oneof![
            Just(" "),
            Just("  "),
            Just("\t"),
            Just("\n"),
            Just("\r\n"),
            Just("\r"),
            Just("\u{a0}"),
            Just("\u{3000}"),
            Just("\u{85}"),
            Just("\u{2028}"),
            Just("a"),
            Just("Word"),
            Just("ÉCOLE"),
            Just("naïve"),
            Just("中文"),
            Just("e\u{301}"),
            Just("'s"),
            Just("'LL"),
            Just("123"),
            Just("45678"),
            Just("!"),
            Just("?!"),
            Just("/"),
            Just("//"),
            Just("{"),
            Just("\""),
            Just("_"),
            Just("ǅ"),
            Just("Σσ"),
        ];
        prop::collection::vec(part, 0..40).prop_map(|p| p.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn pieces_and_counts_equal_tiktokens(t in text()) {
            prop_assert_eq!(counter().pieces(&t).collect::<Vec<_>>(), reference_pieces(&t));
            prop_assert_eq!(counter().count(bpe(), &t), bpe().encode_ordinary(&t).len() as u64);
        }

        #[test]
        fn counts_of_any_string_equal_tiktokens(t in any::<String>()) {
            prop_assert_eq!(counter().count(bpe(), &t), bpe().encode_ordinary(&t).len() as u64);
        }
    }
}
