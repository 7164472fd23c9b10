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
//!
//! A piece longer than [`MAX_PIECE`] bytes (a run of letters without a
//! space: a pasted blob, a paragraph of a script written without spaces)
//! is estimated, not tokenized: BPE's cost grows faster than the piece (a
//! 4 MB word took seconds and hundreds of megabytes), so its density is
//! sampled on a few windows of it and applied to its length
//! ([`long_piece`]). Only such pieces count apart from tiktoken's count.

use std::hash::BuildHasher;
use std::sync::{Mutex, TryLockError};

use regex::Regex;
use tiktoken_rs::CoreBPE;

use crate::bounded::Generations;

/// The lookahead alternative of tiktoken's o200k pattern.
const LOOKAHEAD: &str = r"|\s+(?!\S)";

/// Most distinct pieces kept, the least recently used going first.
const PIECE_LIMIT: usize = 1 << 16;

/// Token counts of pieces, keyed by a 64-bit hash of the piece under a
/// seed drawn when the cache is made. Keyed by the piece itself, every
/// lookup followed a pointer to the stored piece to compare it (a second
/// cache miss) and every new piece was an allocation; counting new text
/// is ~8% faster this way. With at most [`PIECE_LIMIT`] entries, a new
/// piece takes another's count with a probability of about 2^-48: an
/// estimate off by a few tokens.
struct Pieces {
    key: foldhash::quality::RandomState,
    counts: Generations<u64, u32>,
}

impl Default for Pieces {
    fn default() -> Self {
        Pieces {
            key: Default::default(),
            // Two generations of half the limit: at most the limit kept.
            counts: Generations::new(PIECE_LIMIT / 2),
        }
    }
}

/// The counts of pieces seen, one per token counter (counting is mostly
/// the accounting thread's), so its memory stays bounded however many
/// threads count. The tokenizer and the split are read-only tables of the
/// tokenizer and are the process's ([`PieceCounter`]); what was counted
/// with them is the counter's owner's.
#[derive(Default)]
pub struct PieceCache(Mutex<Pieces>);

/// The split without the lookahead, over tiktoken's tokenizer.
pub struct PieceCounter {
    split: Regex,
    /// tiktoken's pattern is the one [`ascii_piece`] implements.
    ascii: bool,
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
        Some(Self {
            split,
            ascii: pattern == O200K_PATTERN,
        })
    }

    /// The pieces tiktoken's pattern splits `text` into, in order.
    pub fn pieces<'a>(&'a self, text: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        let mut at = 0;
        std::iter::from_fn(move || {
            if at >= text.len() {
                return None;
            }
            let (start, end) = match self.ascii.then(|| ascii_piece(text.as_bytes(), at)) {
                Some(Ok(end)) => (at, end),
                _ => self.regex_piece(text, at)?,
            };
            at = end;
            Some(&text[start..end])
        })
    }

    /// The piece at `at` by the regex, with the lookahead's effect applied.
    fn regex_piece(&self, text: &str, at: usize) -> Option<(usize, usize)> {
        let m = self.split.find(&text[at..])?;
        let (start, mut end) = (at + m.start(), at + m.end());
        let piece = m.as_str();
        // Whitespace with no line break that the lookahead would have cut
        // short: a non-space follows, so its last char goes with it.
        if end < text.len()
            && !piece.ends_with(['\r', '\n'])
            && piece.chars().all(char::is_whitespace)
        {
            if let Some(last) = piece.chars().next_back() {
                if piece.len() > last.len_utf8() {
                    end -= last.len_utf8();
                }
            }
        }
        Some((start, end))
    }

    /// Tokens of `text`: what `bpe.encode_ordinary(text).len()` gives,
    /// the count of each piece kept in `cache`. While another thread holds
    /// the cache, this one counts without it.
    pub fn count(&self, bpe: &CoreBPE, text: &str, cache: &PieceCache) -> u64 {
        let count = |piece: &str| match piece.len() {
            0..=MAX_PIECE => bpe.encode_ordinary(piece).len() as u32,
            _ => long_piece(bpe, piece),
        };
        let mut cache = match cache.0.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return self.pieces(text).map(|p| u64::from(count(p))).sum();
            }
        };
        let mut total = 0u64;
        for piece in self.pieces(text) {
            let key = cache.key.hash_one(piece);
            let n = match cache.counts.renew(&key) {
                Some(n) => *n,
                None => {
                    let n = count(piece);
                    cache.counts.insert(key, n);
                    n
                }
            };
            total += u64::from(n);
        }
        total
    }
}

/// The longest piece tokenized: a longer one is estimated ([`long_piece`]).
/// Far above the pieces of prose, code or data (a word, a number, an
/// indentation, a punctuation run: tens of bytes), so their counts stay
/// tiktoken's; a sentence of a script written without spaces (Chinese,
/// Japanese, Thai) stays under it too, its punctuation ending the piece.
pub const MAX_PIECE: usize = 1024;
/// The windows a long piece is sampled on, and their length in bytes.
const SAMPLES: usize = 4;
const SAMPLE_BYTES: usize = 256;

/// Tokens of a piece longer than [`MAX_PIECE`]: tiktoken's count of
/// [`SAMPLES`] windows spread over it, its start and end among them, the
/// densest applied to its whole length. Homogeneous text (random letters,
/// one letter repeated, a script without spaces) comes within a few
/// percent; a piece that changes along its length is taken at its densest
/// part, never below it. Linear in the piece, with a small constant.
fn long_piece(bpe: &CoreBPE, piece: &str) -> u32 {
    let len = piece.len();
    let mut densest = 0f64;
    for k in 0..SAMPLES {
        let mut start = (len - SAMPLE_BYTES) * k / (SAMPLES - 1);
        while !piece.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = (start + SAMPLE_BYTES).min(len);
        while !piece.is_char_boundary(end) {
            end += 1;
        }
        let window = &piece[start..end];
        let density = bpe.encode_ordinary(window).len() as f64 / window.len() as f64;
        densest = densest.max(density);
    }
    (densest * len as f64).ceil().min(f64::from(u32::MAX)) as u32
}

/// The o200k pattern [`ascii_piece`] implements, alternative by
/// alternative.
const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// A byte the split cannot classify alone: text that is not ASCII, where
/// the regex decides.
struct NotAscii;

/// What an ASCII byte is to the o200k pattern.
#[derive(Clone, Copy, PartialEq)]
enum Class {
    Upper,
    Lower,
    Digit,
    /// `\r` or `\n`.
    LineBreak,
    /// The rest of `\s`: space, tab, vertical tab, form feed.
    Space,
    /// Neither letter, digit nor whitespace: punctuation, symbols, controls.
    Other,
    End,
}

fn class(b: &[u8], i: usize) -> Result<Class, NotAscii> {
    Ok(match b.get(i) {
        None => Class::End,
        Some(b'A'..=b'Z') => Class::Upper,
        Some(b'a'..=b'z') => Class::Lower,
        Some(b'0'..=b'9') => Class::Digit,
        Some(b'\r' | b'\n') => Class::LineBreak,
        Some(b' ' | b'\t' | 0x0b | 0x0c) => Class::Space,
        Some(0x80..) => return Err(NotAscii),
        Some(_) => Class::Other,
    })
}

/// The end of the piece that starts at `at` (< `b.len()`), as the o200k
/// pattern (lookahead included) cuts it, when every byte that decides it
/// is ASCII. ASCII letters are `Lu` / `Ll`, digits the only `N`, and no
/// ASCII byte is a mark or titlecase: the alternatives reduce to scans of
/// byte classes, tried in the pattern's order.
fn ascii_piece(b: &[u8], at: usize) -> Result<usize, NotAscii> {
    use Class::*;
    let first = class(b, at)?;
    // 1 and 2: an optional char that is no line break, letter or digit,
    // then letters.
    if matches!(first, Upper | Lower | Space | Other) {
        let from = if matches!(first, Space | Other) {
            at + 1
        } else {
            at
        };
        for lower_needed in [true, false] {
            if let Some(end) = word(b, from, lower_needed)? {
                return Ok(end);
            }
        }
    }
    // 3: one to three digits.
    if first == Digit {
        let mut k = at + 1;
        while k < at + 3 && class(b, k)? == Digit {
            k += 1;
        }
        return Ok(k);
    }
    // 4: an optional space, symbols, then line breaks and slashes.
    let from = if b[at] == b' ' { at + 1 } else { at };
    if class(b, from)? == Other {
        let mut k = from + 1;
        while class(b, k)? == Other {
            k += 1;
        }
        while matches!(b.get(k), Some(b'\r' | b'\n' | b'/')) {
            k += 1;
        }
        return Ok(k);
    }
    // 5 to 7: whitespace, up to its last line break if it has one (5);
    // else all of it at the end of the text, or all but its last char
    // (6); or the one char before a non-space (7).
    let mut end = at;
    let mut last_break = None;
    loop {
        match class(b, end)? {
            LineBreak => last_break = Some(end),
            Space => {}
            _ => break,
        }
        end += 1;
    }
    Ok(match last_break {
        Some(k) => k + 1,
        None if end == b.len() || end - at == 1 => end,
        None => end - 1,
    })
}

/// `[Lu]*[Ll]+` (`lower_needed`) or `[Lu]+[Ll]*` at `at`, then an optional
/// contraction: the end, or `None` if it does not match.
fn word(b: &[u8], at: usize, lower_needed: bool) -> Result<Option<usize>, NotAscii> {
    let mut k = at;
    while class(b, k)? == Class::Upper {
        k += 1;
    }
    let uppers = k - at;
    while class(b, k)? == Class::Lower {
        k += 1;
    }
    let lowers = k - at - uppers;
    if (lower_needed && lowers == 0) || (!lower_needed && uppers == 0) {
        return Ok(None);
    }
    // `(?i:'s|'t|'re|'ve|'m|'ll|'d)?`; case folding maps some non-ASCII
    // chars to these letters (ſ to s).
    if b.get(k) != Some(&b'\'') {
        return Ok(Some(k));
    }
    let at = |i: usize| -> Result<u8, NotAscii> {
        class(b, i)?;
        Ok(b.get(i).map_or(0, u8::to_ascii_lowercase))
    };
    Ok(Some(match at(k + 1)? {
        b's' | b't' | b'm' | b'd' => k + 2,
        b'r' | b'v' if at(k + 2)? == b'e' => k + 3,
        b'l' if at(k + 2)? == b'l' => k + 3,
        _ => k,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bpe() -> &'static CoreBPE {
        static BPE: std::sync::OnceLock<CoreBPE> = std::sync::OnceLock::new();
        BPE.get_or_init(|| tiktoken_rs::o200k_base().unwrap())
    }

    /// One cache for the tests, so that counts are also taken from it.
    fn cache() -> &'static PieceCache {
        static C: std::sync::OnceLock<PieceCache> = std::sync::OnceLock::new();
        C.get_or_init(PieceCache::default)
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
    fn tiktokens_pattern_is_the_one_the_ascii_scan_implements() {
        assert!(counter().ascii, "{}", tiktoken_rs::O200K_BASE_PAT_STR);
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
                counter().count(bpe(), t, cache()),
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
            // What the ASCII scan decides, and where it hands over.
            Just("ABC"),
            Just("XMLHttp"),
            Just("x"),
            Just("7"),
            Just("'"),
            Just("'re"),
            Just("'Ve"),
            Just("'d"),
            Just("'l"),
            Just("'ſ"),
            Just("\u{212a}"),
            Just("});"),
            Just("\\"),
            Just("\u{b}"),
            Just("\u{c}"),
            Just("\u{0}"),
            Just("\u{1f}"),
            Just("\u{7f}"),
            Just("٣"),
            Just("Ⅷ"),
        ];
        prop::collection::vec(part, 0..40).prop_map(|p| p.concat())
    }

    /// Any ASCII text: the scan alone cuts it.
    fn ascii_text() -> impl Strategy<Value = String> {
        let byte = prop_oneof![
            4 => prop::sample::select(b" \t\n\r".to_vec()),
            4 => prop::sample::select(b"aeiosrtvldmAZ'".to_vec()),
            2 => prop::sample::select(b"0123456789".to_vec()),
            1 => 0u8..0x80,
        ];
        prop::collection::vec(byte, 0..64)
            .prop_map(|b| String::from_utf8(b).expect("ASCII is UTF-8"))
    }

    /// A piece of `n` bytes or so of one kind of text, without spaces.
    fn long_word(kind: usize, n: usize, seed: u64) -> String {
        let mut x = seed | 1;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let from =
            |abc: &[u8], r: &mut dyn FnMut() -> u64| abc[(r() % abc.len() as u64) as usize] as char;
        match kind {
            0 => (0..n)
                .map(|_| from(b"abcdefghijklmnopqrstuvwxyz", &mut rnd))
                .collect(),
            1 => (0..n)
                .map(|_| {
                    from(
                        b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                        &mut rnd,
                    )
                })
                .collect(),
            2 => "x".repeat(n),
            3 => {
                let words = ["the", "parser", "config", "value", "error", "stream"];
                let mut s = String::new();
                while s.len() < n {
                    s.push_str(words[(rnd() % 6) as usize]);
                }
                s
            }
            4 => (0..n / 3)
                .map(|_| char::from_u32(0x4e00 + (rnd() % 2000) as u32).unwrap())
                .collect(),
            _ => (0..n).map(|_| from(b"=-*#~^", &mut rnd)).collect(),
        }
    }

    #[test]
    fn a_long_piece_is_estimated_near_its_count_and_not_below() {
        for kind in 0..6 {
            for n in [MAX_PIECE + 1, 5_000, 40_000] {
                let t = long_word(kind, n, 7 + n as u64);
                // Mixed case is cut at each capital: pieces of a few letters.
                let longest = counter().pieces(&t).map(str::len).max();
                assert_eq!(longest == Some(t.len()), kind != 1, "kind {kind}");
                let exact = bpe().encode_ordinary(&t).len() as f64;
                let estimate = counter().count(bpe(), &t, cache()) as f64;
                let ratio = estimate / exact;
                assert!(
                    (0.97..1.25).contains(&ratio),
                    "kind {kind}, {n} bytes: {estimate} for {exact}"
                );
            }
        }
        // Dense at one end only: taken at its densest.
        let t = format!("{}{}", "x".repeat(20_000), long_word(1, 20_000, 3));
        let exact = bpe().encode_ordinary(&t).len() as f64;
        let estimate = counter().count(bpe(), &t, cache()) as f64;
        assert!(estimate >= exact, "{estimate} < {exact}");
        // Text of ordinary pieces around a long one: those counted exactly.
        let word = long_word(0, 3_000, 11);
        let around = "fn main() {\n    println!(\"hi\");\n}\n";
        let t = format!("{around} {word} {around}");
        let pieces: Vec<_> = counter().pieces(&t).collect();
        assert_eq!(pieces.iter().filter(|p| p.len() > MAX_PIECE).count(), 1);
        let want: u64 = pieces
            .iter()
            .map(|p| match p.len() {
                0..=MAX_PIECE => bpe().encode_ordinary(p).len() as u64,
                _ => u64::from(long_piece(bpe(), p)),
            })
            .sum();
        assert_eq!(counter().count(bpe(), &t, cache()), want);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// (Every piece of these texts is under [`MAX_PIECE`]: their counts
        /// are tiktoken's exactly.)
        #[test]
        fn pieces_and_counts_equal_tiktokens(t in text()) {
            prop_assert_eq!(counter().pieces(&t).collect::<Vec<_>>(), reference_pieces(&t));
            prop_assert_eq!(counter().count(bpe(), &t, cache()), bpe().encode_ordinary(&t).len() as u64);
        }

        #[test]
        fn ascii_pieces_equal_tiktokens(t in ascii_text()) {
            prop_assert_eq!(counter().pieces(&t).collect::<Vec<_>>(), reference_pieces(&t));
        }

        #[test]
        fn pieces_of_any_string_equal_tiktokens(t in any::<String>()) {
            prop_assert_eq!(counter().pieces(&t).collect::<Vec<_>>(), reference_pieces(&t));
        }

        #[test]
        fn counts_of_any_string_equal_tiktokens(t in any::<String>()) {
            prop_assume!(counter().pieces(&t).all(|p| p.len() <= MAX_PIECE));
            prop_assert_eq!(counter().count(bpe(), &t, cache()), bpe().encode_ordinary(&t).len() as u64);
        }
    }
}
