//! The journal's frames: how a record is written (mark, length,
//! checksum, payload), and how a file of either format is read back,
//! a damaged frame skipped and the next one found by its mark.

use std::io;

use crate::store::records::ExchangeRecord;
use crate::wire::hash::{legacy_item_hash, text_item_hash};
use crate::wire::ItemHash;

/// The first bytes of a journal file: a name, then the format version.
pub(super) const MAGIC: &[u8; 8] = b"cmpjrn\0\x02";
/// Starts every frame. `0xFE` and `0xFF` never occur in UTF-8, so neither
/// a record's JSON nor an item body holds it: a reader that lost its place
/// looks for the next frame there.
pub(super) const FRAME_MARK: [u8; 4] = [0xFF, b'c', b'j', 0xFE];
/// A frame's mark, length and checksum.
pub(super) const FRAME_HEAD: usize = 12;

/// A frame: [`FRAME_MARK`]; `len: u32 LE` of the payload; a CRC-32 of
/// `len`'s bytes and the payload, `u32 LE`; the payload. The payload (the
/// whole of a first-format frame, after its bare `len`): `u32 LE` length
/// and JSON of the record without its hash lists and item bodies; the
/// suffix and the response item hashes, each list as a `u32 LE` count and
/// 32-byte hashes; then per new item its hash, `u32 LE` length and body, as
/// they are (no escaping to do).
pub(super) fn encode_frame(rec: &ExchangeRecord) -> io::Result<Vec<u8>> {
    const META_AT: usize = FRAME_HEAD + 4;
    let hashes = 32 * (rec.suffix_items.len() + rec.response_items.len());
    let bodies: usize = rec.new_items.iter().map(|(_, b)| 36 + b.len()).sum();
    let mut frame = Vec::with_capacity(1024);
    frame.extend_from_slice(&FRAME_MARK);
    frame.extend_from_slice(&[0; META_AT - 4]);
    serde_json::to_writer(&mut frame, rec)?;
    let meta = (frame.len() - META_AT) as u32;
    frame[FRAME_HEAD..META_AT].copy_from_slice(&meta.to_le_bytes());
    // The rest at once: the record's JSON has no fixed size, and a guess
    // short of it had the frame copied whole when its bodies went in.
    frame.reserve_exact(8 + hashes + bodies);
    for list in [&rec.suffix_items, &rec.response_items] {
        frame.extend_from_slice(&(list.len() as u32).to_le_bytes());
        for hash in list {
            frame.extend_from_slice(hash);
        }
    }
    for (hash, body) in &rec.new_items {
        frame.extend_from_slice(hash);
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(body.as_bytes());
    }
    let len = u32::try_from(frame.len() - FRAME_HEAD)
        .map_err(|_| io::Error::other("record too large for the journal"))?
        .to_le_bytes();
    let crc = checksum(len, &frame[FRAME_HEAD..]);
    frame[4..8].copy_from_slice(&len);
    frame[8..12].copy_from_slice(&crc.to_le_bytes());
    Ok(frame)
}

/// A frame's checksum: over its length's bytes too, so that a damaged
/// length is caught before it sends the reader past the next frames.
fn checksum(len: [u8; 4], payload: &[u8]) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    crc.update(&len);
    crc.update(payload);
    crc.finalize()
}

/// The record a frame's payload holds, if it is well formed and each of
/// its item bodies is what its hash says.
fn decode_frame(mut data: &[u8]) -> Option<ExchangeRecord> {
    fn take<'a>(data: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (data.len() >= n).then(|| data.split_at(n))?;
        *data = rest;
        Some(head)
    }
    fn len(data: &mut &[u8]) -> Option<usize> {
        Some(u32::from_le_bytes(take(data, 4)?.try_into().ok()?) as usize)
    }
    let meta = len(&mut data)?;
    let mut rec: ExchangeRecord = serde_json::from_slice(take(&mut data, meta)?).ok()?;
    for list in [&mut rec.suffix_items, &mut rec.response_items] {
        let n = len(&mut data)?;
        let bytes = take(&mut data, n.checked_mul(32)?)?;
        list.extend(
            bytes
                .chunks_exact(32)
                .filter_map(|h| ItemHash::try_from(h).ok()),
        );
    }
    while !data.is_empty() {
        let hash: ItemHash = take(&mut data, 32)?.try_into().ok()?;
        let n = len(&mut data)?;
        let body = String::from_utf8(take(&mut data, n)?.to_vec()).ok()?;
        // The store is content-addressed and keeps the first body of a
        // hash for good: a damaged one must not go in under it. A journal
        // an earlier version left hashed `cache_control` in; its bodies go
        // in under the hashes its records name.
        if text_item_hash(body.as_bytes()) != hash
            && legacy_item_hash(body.as_bytes()) != Some(hash)
        {
            return None;
        }
        rec.new_items.push((hash, body));
    }
    Some(rec)
}

/// What a journal file holds: its readable records, and the byte ranges
/// of what could not be read.
#[derive(Default)]
pub(super) struct Decoded {
    pub(super) records: Vec<ExchangeRecord>,
    /// Where each record's frame was.
    pub(super) frames: Vec<std::ops::Range<usize>>,
    pub(super) skipped: Vec<Skipped>,
}

/// Bytes of a journal file that hold no readable frame.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Skipped {
    pub(super) range: std::ops::Range<usize>,
    /// The file ends inside a frame that began there: a write cut short.
    pub(super) cut_short: bool,
}

/// Reads a journal file of either format. One that does not start with
/// [`MAGIC`] is of the current format all the same if frames are found in
/// it (its header is what was damaged), else of the first.
pub(super) fn decode_file(bytes: &[u8]) -> Decoded {
    if bytes.starts_with(MAGIC) {
        return Format::Current.read(bytes, MAGIC.len());
    }
    let current = Format::Current.read(bytes, 0);
    if !current.records.is_empty() || bytes.is_empty() {
        return current;
    }
    Format::First.read(bytes, 0)
}

/// The two frame formats.
#[derive(Clone, Copy)]
enum Format {
    /// Mark, length, checksum, payload (see [`encode_frame`]).
    Current,
    /// `len: u32 LE` of the payload, then the payload (no header, no mark).
    First,
}

impl Format {
    /// The frames of `bytes` from `at` on; after a bad one, the reading
    /// goes on at the next place a frame may start.
    fn read(self, bytes: &[u8], mut at: usize) -> Decoded {
        let mut out = Decoded::default();
        let mut bad_from = None;
        let end_bad = |out: &mut Decoded, from: Option<usize>, to: usize| {
            if let Some(from) = from {
                out.skipped.push(Skipped {
                    range: from..to,
                    cut_short: false,
                });
            }
        };
        while at < bytes.len() {
            match self.frame_at(bytes, at) {
                Some((rec, end)) => {
                    end_bad(&mut out, bad_from.take(), at);
                    out.records.push(rec);
                    out.frames.push(at..end);
                    at = end;
                }
                None => {
                    bad_from.get_or_insert(at);
                    at = self.next_start(bytes, at + 1);
                }
            }
        }
        end_bad(&mut out, bad_from, bytes.len());
        if let Some(last) = out.skipped.last_mut() {
            last.cut_short =
                last.range.end == bytes.len() && self.runs_past_end(bytes, last.range.start);
        }
        out
    }

    /// Where the next frame may start, from `from` on.
    fn next_start(self, bytes: &[u8], from: usize) -> usize {
        match self {
            Format::Current => {
                memchr::memmem::find(&bytes[from..], &FRAME_MARK).map_or(bytes.len(), |i| from + i)
            }
            // No mark: any byte may start the next frame.
            Format::First => from,
        }
    }

    /// The frame's length field at `at` and the bytes it covers after it.
    fn head(self, bytes: &[u8], at: usize) -> Option<([u8; 4], usize)> {
        let (len_at, head) = match self {
            Format::Current => (at + 4, FRAME_HEAD),
            Format::First => (at, 4),
        };
        if self.marked(bytes, at) {
            let len: [u8; 4] = bytes.get(len_at..len_at + 4)?.try_into().ok()?;
            return Some((len, head));
        }
        None
    }

    fn marked(self, bytes: &[u8], at: usize) -> bool {
        matches!(self, Format::First) || bytes[at..].starts_with(&FRAME_MARK)
    }

    /// Whether a frame begins at `at` whose length runs past the end.
    fn runs_past_end(self, bytes: &[u8], at: usize) -> bool {
        match self.head(bytes, at) {
            Some((len, head)) => at + head + u32::from_le_bytes(len) as usize > bytes.len(),
            None => self.marked(bytes, at),
        }
    }

    /// The frame at `at`: its record and where it ends.
    fn frame_at(self, bytes: &[u8], at: usize) -> Option<(ExchangeRecord, usize)> {
        let (len, head) = self.head(bytes, at)?;
        let end = (at + head).checked_add(u32::from_le_bytes(len) as usize)?;
        let payload = bytes.get(at + head..end)?;
        if let Format::Current = self {
            let crc = u32::from_le_bytes(bytes.get(at + 8..at + 12)?.try_into().ok()?);
            if checksum(len, payload) != crc {
                return None;
            }
        }
        Some((decode_frame(payload)?, end))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{ids, journal_of, record};
    use super::*;

    #[test]
    fn frames_round_trip_and_a_cut_tail_is_dropped() {
        let (mut bytes, _) = journal_of(1..=3);
        let whole = bytes.len();
        bytes.extend(&encode_frame(&record(4)).unwrap()[..20]);
        let out = decode_file(&bytes);
        assert_eq!(ids(&out.records), [1, 2, 3]);
        let got = &out.records[2];
        assert_eq!(
            serde_json::to_value(got).unwrap(),
            serde_json::to_value(record(3)).unwrap()
        );
        assert_eq!(got.new_items, record(3).new_items, "bodies as they were");
        assert_eq!(got.suffix_items, record(3).suffix_items);
        assert_eq!(got.response_items, record(3).response_items);
        let cut = Skipped {
            range: whole..whole + 20,
            cut_short: true,
        };
        assert_eq!(out.skipped, [cut]);
    }

    #[test]
    fn a_body_journaled_when_its_breakpoint_was_hashed_still_reads() {
        let body = r#"{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}"#;
        let old = crate::wire::hash::legacy_item_hash(body.as_bytes()).unwrap();
        assert_ne!(
            old,
            text_item_hash(body.as_bytes()),
            "the breakpoint was hashed"
        );
        let with = |hash: ItemHash| {
            let mut rec = record(1);
            rec.suffix_items[0] = hash;
            rec.new_items = vec![(hash, body.to_string())];
            let mut bytes = MAGIC.to_vec();
            bytes.extend(encode_frame(&rec).unwrap());
            decode_file(&bytes)
        };
        let read = with(old);
        assert_eq!(ids(&read.records), [1]);
        assert_eq!(read.records[0].new_items, [(old, body.to_string())]);
        // A body neither hash names is still not imported.
        assert!(with([9; 32]).records.is_empty());
    }

    #[test]
    fn a_damaged_frame_costs_its_own_record_only() {
        let (bytes, frames) = journal_of(1..=3);
        // A byte of the second frame's JSON, then of its item body: the
        // checksum catches either.
        for at in [frames[1].start + 20, frames[1].end - 3] {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x20;
            let out = decode_file(&damaged);
            assert_eq!(ids(&out.records), [1, 3]);
            assert_eq!(out.skipped.len(), 1);
            assert_eq!(out.skipped[0].range, frames[1].clone());
            assert!(!out.skipped[0].cut_short);
        }
        // Its length: the frame runs elsewhere, the next one is found all
        // the same.
        let mut damaged = bytes.clone();
        damaged[frames[1].start + 5] ^= 0x01;
        assert_eq!(ids(&decode_file(&damaged).records), [1, 3]);
        // A damaged header: the frames are read all the same.
        let mut damaged = bytes.clone();
        damaged[2] = b'?';
        let out = decode_file(&damaged);
        assert_eq!(ids(&out.records), [1, 2, 3]);
        assert_eq!(out.skipped[0].range, 0..MAGIC.len());
    }

    #[test]
    fn item_bodies_must_match_their_hashes() {
        // A first-format frame (no checksum) whose item body was changed.
        let frame = |id: i64, edit: bool| {
            let mut rec = record(id);
            if edit {
                rec.new_items[0].1 = rec.new_items[0].1.replace('é', "e");
            }
            let current = encode_frame(&rec).unwrap();
            let payload = &current[FRAME_HEAD..];
            let mut first = (payload.len() as u32).to_le_bytes().to_vec();
            first.extend_from_slice(payload);
            first
        };
        let bytes = [frame(1, false), frame(2, true), frame(3, false)].concat();
        let out = decode_file(&bytes);
        assert_eq!(
            ids(&out.records),
            [1, 3],
            "the first format, resynchronised"
        );
        assert_eq!(out.skipped.len(), 1);
        assert_eq!(out.skipped[0].range.len(), frame(2, true).len());
    }

    /// A mutation of a journal file: at an offset (a fraction of its
    /// length), cut it there, flip a byte's bits, or insert bytes.
    #[derive(Debug, Clone)]
    enum Damage {
        Truncate,
        Flip(u8),
        Insert(Vec<u8>),
    }

    fn any_damage() -> impl proptest::strategy::Strategy<Value = (f64, Damage)> {
        use proptest::prelude::*;
        let damage = prop_oneof![
            Just(Damage::Truncate),
            (1u8..=255).prop_map(Damage::Flip),
            // Garbage, including what looks like a frame's start.
            proptest::collection::vec(any::<u8>(), 1..64).prop_map(Damage::Insert),
            Just(Damage::Insert(FRAME_MARK.to_vec())),
            Just(Damage::Insert(
                [FRAME_MARK.as_slice(), &[9, 0, 0, 0]].concat()
            )),
        ];
        (0.0..1.0f64, damage)
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(
            crate::fuzz_cases(256),
        ))]

        /// Every frame the damage left intact is read, and nothing else;
        /// what is skipped is exactly the bytes that hold no intact frame.
        #[test]
        fn every_intact_frame_is_read_whatever_the_damage(
            n in 1i64..6,
            damages in proptest::collection::vec(any_damage(), 1..4),
        ) {
            let (mut bytes, mut frames) = journal_of(1..=n);
            let mut intact: Vec<Option<i64>> = (1..=n).map(Some).collect();
            for (at, damage) in damages {
                let at = ((bytes.len() as f64) * at) as usize;
                let touched = |f: &std::ops::Range<usize>, edge: bool| {
                    f.contains(&at) || (edge && f.end > at)
                };
                match damage {
                    Damage::Truncate => {
                        bytes.truncate(at);
                        for (i, f) in frames.iter().enumerate() {
                            if touched(f, true) { intact[i] = None }
                        }
                    }
                    Damage::Flip(bits) => {
                        if at < bytes.len() {
                            bytes[at] ^= bits;
                            for (i, f) in frames.iter().enumerate() {
                                if touched(f, false) { intact[i] = None }
                            }
                        }
                    }
                    Damage::Insert(garbage) => {
                        bytes.splice(at..at, garbage.iter().copied());
                        for (i, f) in frames.iter_mut().enumerate() {
                            if f.start < at && at < f.end {
                                intact[i] = None;
                            }
                            if f.start >= at {
                                *f = f.start + garbage.len()..f.end + garbage.len();
                            }
                        }
                    }
                }
            }
            let out = decode_file(&bytes);
            // Every intact frame is read, in order; whatever else is read
            // is one of the records written (garbage that happens to be a
            // mark, inserted after a frame's own, makes that frame whole).
            let read = ids(&out.records);
            let want: Vec<i64> = intact.iter().flatten().copied().collect();
            let mut rest = read.iter();
            for id in &want {
                proptest::prop_assert!(rest.any(|r| r == id), "{} not read: {:?}", id, read);
            }
            proptest::prop_assert!(read.windows(2).all(|w| w[0] < w[1]), "{:?}", read);
            for rec in &out.records {
                proptest::prop_assert_eq!(
                    serde_json::to_value(rec).unwrap(),
                    serde_json::to_value(record(rec.id)).unwrap()
                );
                proptest::prop_assert_eq!(&rec.new_items, &record(rec.id).new_items);
            }
            tiled(&bytes, &out)?;
        }

        /// The reader's fuzz target: any bytes, after a header or not,
        /// around frames or not. It never panics, and accounts for every
        /// byte.
        #[test]
        fn the_reader_accounts_for_any_bytes(
            header in proptest::bool::ANY,
            before in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
            frames in 0i64..3,
            after in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
        ) {
            let (journal, _) = journal_of(1..=frames);
            let mut bytes = if header { MAGIC.to_vec() } else { Vec::new() };
            bytes.extend(&before);
            bytes.extend(&journal[MAGIC.len()..]);
            bytes.extend(&after);
            let out = decode_file(&bytes);
            tiled(&bytes, &out)?;
            for rec in &out.records {
                proptest::prop_assert_eq!(&rec.new_items, &record(rec.id).new_items);
            }
        }
    }

    /// The header, the frames read and the bytes skipped tile the file:
    /// nothing is read twice, nothing dropped unreported.
    fn tiled(bytes: &[u8], out: &Decoded) -> Result<(), proptest::test_runner::TestCaseError> {
        let mut pieces: Vec<std::ops::Range<usize>> = out.frames.clone();
        pieces.extend(out.skipped.iter().map(|s| s.range.clone()));
        if bytes.starts_with(MAGIC) {
            pieces.push(0..MAGIC.len());
        }
        pieces.sort_by_key(|r| r.start);
        let mut at = 0;
        for p in &pieces {
            proptest::prop_assert_eq!(p.start, at, "{:?}", pieces);
            at = p.end;
        }
        proptest::prop_assert_eq!(at, bytes.len());
        Ok(())
    }
}
