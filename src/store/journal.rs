//! The journal: exchange records on their way into the database.
//!
//! An exchange is appended here before its answer's last bytes go out;
//! from then on it survives the process being killed (the bytes are in the
//! OS). Exchanges that end in the same turn of the runtime can share one
//! `write` ([`Journal::stage`], [`Journal::write_staged`]). The writer
//! thread imports the records into the database in batches a little later,
//! which costs a fraction of one commit per exchange. Whatever the journal still holds at start-up (the process
//! was killed before an import) is imported before anything else runs.
//!
//! Files, next to the database `D` (its canonical path: a symlink to it,
//! or `..` on the way, finds the same files): `D-exchanges` (appended to),
//! `D-exchanges.old` (a full journal set aside while its records are
//! imported), `D-exchanges.lock`, locked by the process that serves the
//! store, so that a reader in another process imports a journal only when
//! nobody serves it (not `D-journal`: that name is SQLite's own), and
//! `D-exchanges.quarantine`, where whatever a reader could not read is
//! kept instead of being thrown away with the imported journal. The
//! server also locks the database file itself, which a hard link or a bind
//! mount of it reaches under a name of its own (see `StoreLock`).
//!
//! A journal file starts with `MAGIC` (what it is, and its format
//! version); each record is one frame (see `encode_frame`) with a mark, a
//! length and a checksum. A reader skips a frame that is damaged (a bit
//! flipped, bytes lost or inserted) and finds the next one by its mark, so
//! one bad frame costs its own record only; a record's item bodies must
//! match their hashes, too. A frame cut short by a kill, whose write never
//! returned, held an exchange that was never acknowledged. Journals of the
//! first format (no header, frames of a bare length) are still read.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::ExchangeRecord;
use crate::wire::hash::text_item_hash;
use crate::wire::ItemHash;

/// Above this size the journal is set aside and a new one started.
const ROTATE_BYTES: u64 = 64 << 20;
/// The staged frames' buffer is kept between writes up to this capacity.
const STAGED_KEPT: usize = 1 << 20;

/// The first bytes of a journal file: a name, then the format version.
const MAGIC: &[u8; 8] = b"cmpjrn\0\x02";
/// Starts every frame. `0xFE` and `0xFF` never occur in UTF-8, so neither
/// a record's JSON nor an item body holds it: a reader that lost its place
/// looks for the next frame there.
const FRAME_MARK: [u8; 4] = [0xFF, b'c', b'j', 0xFE];
/// A frame's mark, length and checksum.
const FRAME_HEAD: usize = 12;

/// Where [`Journal::stage`] put a record.
pub enum Staged {
    /// Its sequence number, for [`Journal::write_staged`].
    At(u64),
    /// The journal was handed over: the record, to be committed otherwise.
    Back(Box<ExchangeRecord>),
}

/// The journal of one store, held by the process that serves it.
pub struct Journal {
    log: PathBuf,
    old: PathBuf,
    /// The journal files next to the path the store was given as, when it
    /// is not the canonical one (emptied with the leftovers).
    given: Option<[PathBuf; 2]>,
    state: Mutex<State>,
}

struct State {
    file: File,
    bytes: u64,
    /// Records appended since start-up (staged, and written or not).
    appended: u64,
    /// Frames appended and not yet written, in order; the records up to
    /// `written` are in the file.
    staged: Vec<u8>,
    written: u64,
    /// A write failed: it and every record after it are not (reliably) in
    /// the file, until the file is emptied.
    failed_from: Option<u64>,
    /// While `D-exchanges.old` exists: the count of appended records it ends at.
    old_upto: Option<u64>,
    /// An import failed: keep every journal file for the next start-up.
    keep: bool,
    /// The store's lock, held until [`Journal::release`].
    lock: Option<StoreLock>,
}

/// `D-exchanges`, `D-exchanges.old`, `D-exchanges.lock`,
/// `D-exchanges.quarantine`.
fn paths(db: &Path) -> [PathBuf; 4] {
    [
        "-exchanges",
        "-exchanges.old",
        "-exchanges.lock",
        "-exchanges.quarantine",
    ]
    .map(|suffix| {
        let mut p = db.as_os_str().to_owned();
        p.push(suffix);
        PathBuf::from(p)
    })
}

/// The path `db` names, with symlinks and `..` resolved (its directory's,
/// when the file does not exist yet): every spelling of one store finds
/// the same journal and lock.
fn canonical(db: &Path) -> io::Result<PathBuf> {
    match std::fs::canonicalize(db) {
        Ok(path) => Ok(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let dir = db
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let name = db.file_name().ok_or(e)?;
            Ok(std::fs::canonicalize(dir)?.join(name))
        }
        Err(e) => Err(e),
    }
}

/// What makes one process the server of a store: the lock file next to
/// its canonical path (and next to the path as given, where a server of an
/// earlier version looks), and an advisory lock on the database file
/// itself, which a hard link or a bind mount reaches under another name.
struct StoreLock {
    /// `D-exchanges.lock`, locked.
    by_name: Vec<File>,
    /// The database file, locked; `None` once released.
    on_db: Option<File>,
}

/// Descriptors of database files this process opened to lock them.
///
/// Closing any descriptor of a file drops every POSIX lock the process
/// holds on it (a POSIX rule), SQLite's own included, and this process's
/// connections to the database may still be open when its lock is
/// released. So the descriptor is unlocked and kept open until the process
/// ends; a process serves a store once or a few times (tests), so these
/// are few.
static RELEASED: Mutex<Vec<File>> = Mutex::new(Vec::new());

impl StoreLock {
    /// Takes the locks of the store at `db` (canonical) whose path was
    /// given as `given`; `None` when another process holds one of them.
    fn take(db: &Path, given: &Path) -> io::Result<Option<StoreLock>> {
        let try_lock = |file: File| match file.try_lock() {
            Ok(()) => Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) => Ok(None),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        };
        let open = |path: &Path| {
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(path)
        };
        let mut by_name = Vec::new();
        let mut names = vec![db];
        if given != db {
            names.push(given);
        }
        for name in names {
            let [_, _, lock, _] = paths(name);
            let file = open(&lock)?;
            // A relative or differently spelled name of the same lock file:
            // locking it again through a second descriptor would block on
            // the lock this process already holds.
            if by_name.iter().any(|held| same_file(held, &file)) {
                continue;
            }
            match try_lock(file)? {
                Some(f) => by_name.push(f),
                None => return Ok(None),
            }
        }
        // An empty file is a new database to SQLite.
        let file = open(db)?;
        let on_db = match file.try_lock() {
            Ok(()) => file,
            Err(std::fs::TryLockError::WouldBlock) => {
                keep_open(file);
                return Ok(None);
            }
            Err(std::fs::TryLockError::Error(e)) => {
                keep_open(file);
                return Err(e);
            }
        };
        Ok(Some(StoreLock {
            by_name,
            on_db: Some(on_db),
        }))
    }
}

/// Whether two open files are one file on disk.
fn same_file(a: &File, b: &File) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (a.metadata(), b.metadata()) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (a, b);
        false
    }
}

/// Keeps a descriptor of a database file open until the process ends
/// (see [`RELEASED`]).
fn keep_open(file: File) {
    RELEASED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(file);
}

impl Drop for StoreLock {
    fn drop(&mut self) {
        if let Some(file) = self.on_db.take() {
            let _ = file.unlock();
            keep_open(file);
        }
        // The lock files are ours alone: closing them releases them.
        self.by_name.clear();
    }
}

/// The records in `D-exchanges.old` then `D-exchanges`, oldest first.
/// What cannot be read is copied to `D-exchanges.quarantine` first (an
/// error if that fails: the caller then keeps the journal) and logged.
fn read_all(db: &Path) -> io::Result<Vec<ExchangeRecord>> {
    read_journals(db, db)
}

/// [`read_all`] of the store at `db` (canonical), and first of the journal
/// next to the path it was given as, `given`, where an earlier version
/// kept it.
fn read_journals(db: &Path, given: &Path) -> io::Result<Vec<ExchangeRecord>> {
    let [.., quarantine] = paths(db);
    let mut sources = Vec::new();
    if given != db {
        let [log, old, ..] = paths(given);
        sources.extend([old, log]);
    }
    let [log, old, ..] = paths(db);
    sources.extend([old, log]);
    let mut out = Vec::new();
    for path in sources {
        match std::fs::read(&path) {
            Ok(bytes) => {
                let decoded = decode_file(&bytes);
                set_aside(&quarantine, &path, &bytes, &decoded.skipped)?;
                out.extend(decoded.records);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Copies the `skipped` ranges of `bytes` (the journal file `path`) to the
/// end of the `quarantine` file, each after a line that says where it was,
/// and logs them.
fn set_aside(quarantine: &Path, path: &Path, bytes: &[u8], skipped: &[Skipped]) -> io::Result<()> {
    if skipped.is_empty() {
        return Ok(());
    }
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(quarantine)?;
    let mut out = Vec::new();
    for s in skipped {
        let what = if s.cut_short {
            "a write cut short (its exchange was never acknowledged)"
        } else {
            "unreadable: damaged, or a record whose items do not match their hashes"
        };
        tracing::warn!(
            journal = %path.display(),
            offset = s.range.start,
            bytes = s.range.len(),
            quarantine = %quarantine.display(),
            "journal bytes skipped, {what}; kept in the quarantine file"
        );
        writeln!(
            out,
            "\n# compactor journal quarantine: {} offset {} length {}: {what}",
            path.display(),
            s.range.start,
            s.range.len()
        )?;
        out.extend_from_slice(&bytes[s.range.clone()]);
    }
    file.write_all(&out)?;
    file.sync_all()
}

/// The size of `db`'s quarantine file, with its path, when it holds
/// anything: journal bytes that could not be read, set aside on import.
pub fn quarantined(db: &Path) -> Option<(PathBuf, u64)> {
    let [_, _, _, quarantine] = paths(&canonical(db).ok()?);
    let len = std::fs::metadata(&quarantine).ok()?.len();
    (len > 0).then_some((quarantine, len))
}

/// Removes both journal files' records (after they were imported).
fn clear(log: &Path, old: &Path) -> io::Result<()> {
    match std::fs::remove_file(old) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if log.exists() {
        File::create(log)?;
    }
    Ok(())
}

impl Journal {
    /// Opens the journal of the database at `db` for serving it: takes its
    /// lock and returns the records left from an earlier run, which the
    /// caller imports before calling [`Journal::leftovers_imported`].
    pub fn open(given: &Path) -> io::Result<(Journal, Vec<ExchangeRecord>)> {
        let db = canonical(given)?;
        let lock = StoreLock::take(&db, given)?.ok_or_else(|| {
            let named = if db == given {
                String::new()
            } else {
                format!(" (the file {})", db.display())
            };
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "another process serves the store {}{named}",
                    given.display()
                ),
            )
        })?;
        let leftovers = read_journals(&db, given)?;
        let [log, old, _, _] = paths(&db);
        let file = OpenOptions::new().create(true).append(true).open(&log)?;
        let bytes = file.metadata()?.len();
        let given = (given != db).then(|| {
            let [log, old, ..] = paths(given);
            [log, old]
        });
        let journal = Journal {
            log,
            old,
            given,
            state: Mutex::new(State {
                file,
                bytes,
                appended: 0,
                staged: Vec::new(),
                written: 0,
                failed_from: None,
                old_upto: None,
                keep: false,
                lock: Some(lock),
            }),
        };
        Ok((journal, leftovers))
    }

    /// Empties the journal once the records [`Journal::open`] returned are
    /// in the database.
    pub fn leftovers_imported(&self) -> io::Result<()> {
        let mut st = self.lock();
        if let Some([log, old]) = &self.given {
            clear(log, old)?;
        }
        clear(&self.log, &self.old)?;
        st.bytes = 0;
        Ok(())
    }

    /// Appends `rec` (one write), then hands it to `then` with its
    /// sequence number, still in journal order. After [`Journal::release`]
    /// nothing is appended and the record comes back.
    #[cfg(test)]
    pub fn append(
        &self,
        rec: ExchangeRecord,
        then: impl FnOnce(u64, ExchangeRecord),
    ) -> io::Result<Option<ExchangeRecord>> {
        match self.stage(rec, then)? {
            Staged::Back(rec) => Ok(Some(*rec)),
            Staged::At(seq) => self.write_staged(seq).map(|()| None),
        }
    }

    /// Appends `rec` to the frames waiting for [`Journal::write_staged`] and
    /// hands it to `then` with its sequence number, in journal order. Each
    /// record's caller writes (or finds written) its frame before it
    /// acknowledges the exchange; records staged meanwhile, by other
    /// exchanges that end at the same time, share that one write.
    pub fn stage(
        &self,
        rec: ExchangeRecord,
        then: impl FnOnce(u64, ExchangeRecord),
    ) -> io::Result<Staged> {
        let frame = encode_frame(&rec)?;
        let mut st = self.lock();
        if st.lock.is_none() {
            return Ok(Staged::Back(Box::new(rec)));
        }
        st.staged.extend_from_slice(&frame);
        st.appended += 1;
        let seq = st.appended;
        then(seq, rec);
        Ok(Staged::At(seq))
    }

    /// Makes sure the record staged as `seq` is in the file: writes every
    /// staged frame unless an earlier call did.
    pub fn write_staged(&self, seq: u64) -> io::Result<()> {
        let mut st = self.lock();
        if st.written < seq && st.lock.is_some() {
            let st = &mut *st;
            let first = st.written + 1;
            // A file emptied (or new) starts with its header, in the same
            // write as its first frames.
            let head: &[u8] = if st.bytes == 0 { MAGIC } else { &[] };
            let result = if head.is_empty() {
                st.file.write_all(&st.staged)
            } else {
                st.file.write_all(&[head, &st.staged].concat())
            };
            st.written = st.appended;
            match result {
                Ok(()) => st.bytes += (head.len() + st.staged.len()) as u64,
                // Every record of the failed write, not only the caller's.
                Err(_) => {
                    st.failed_from.get_or_insert(first);
                }
            }
            st.staged.clear();
            if st.staged.capacity() > STAGED_KEPT {
                st.staged = Vec::new();
            }
            result?;
        }
        match st.failed_from {
            Some(from) if seq >= from => Err(io::Error::other(
                "an earlier journal write failed; the journal no longer holds new records",
            )),
            _ => Ok(()),
        }
    }

    /// Hands the store over (at shutdown, once everything is imported):
    /// releases the lock, and the journal's files are no longer touched, so
    /// another server may open the store while this process winds down.
    pub fn release(&self) {
        self.lock().lock = None;
    }

    /// The records up to sequence number `upto` are in the database: drops
    /// what no longer needs keeping, and sets a large journal aside.
    pub fn imported(&self, upto: u64) {
        let mut st = self.lock();
        if st.keep || st.lock.is_none() {
            return;
        }
        let result = (|| -> io::Result<()> {
            if st.old_upto.is_some_and(|end| upto >= end) {
                std::fs::remove_file(&self.old)?;
                st.old_upto = None;
            }
            if upto == st.appended && st.old_upto.is_none() {
                if st.bytes > 0 || st.failed_from.is_some() {
                    st.file.set_len(0)?;
                    st.bytes = 0;
                    // Whatever a failed write left is gone with the rest.
                    st.failed_from = None;
                }
            } else if st.bytes > ROTATE_BYTES && st.old_upto.is_none() {
                std::fs::rename(&self.log, &self.old)?;
                st.file = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.log)?;
                st.bytes = 0;
                st.old_upto = Some(st.appended);
                // Frames staged from now on go to a file of their own.
                st.failed_from = None;
            }
            Ok(())
        })();
        if let Err(e) = result {
            tracing::warn!(error = %e, "journal upkeep failed; it is kept for the next start");
            st.keep = true;
        }
    }

    /// An import failed: nothing is removed from the journal any more, so
    /// the next start-up imports it again (imports are idempotent).
    pub fn keep(&self) {
        self.lock().keep = true;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// For a reader in another process (the CLI): imports what the journal of
/// `db` holds if no process serves the store, so that exchanges of a
/// killed server show. Returns how many records were imported.
pub fn import_orphaned(given: &Path) -> Result<usize, super::StoreError> {
    let db = canonical(given)?;
    let [log, old, _, _] = paths(&db);
    let non_empty = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.len() > 0);
    if !non_empty(&log) && !non_empty(&old) {
        return Ok(0);
    }
    let Some(_lock) = StoreLock::take(&db, &db)? else {
        return Ok(0);
    };
    let records = read_all(&db)?;
    let n = records.len();
    if n > 0 {
        let mut backend = super::sqlite::SqliteBackend::open(&db)?;
        super::Backend::write(&mut backend, &exchanges(records))?;
    }
    clear(&log, &old)?;
    Ok(n)
}

/// What [`status`] found in a store's journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalStatus {
    /// Another process holds the store's lock: a proxy serves it.
    pub served: bool,
    /// Exchange records the journal holds, not yet imported.
    pub records: usize,
    /// Bytes of a record whose write was cut short (a kill): never
    /// acknowledged, skipped on import.
    pub cut_short_bytes: u64,
    /// Bytes that cannot be read (damage), set aside on import.
    pub unreadable_bytes: u64,
    /// The quarantine file and its size, when it holds anything.
    pub quarantined: Option<(PathBuf, u64)>,
}

/// Reads the journal of the store at `given` without changing it, for
/// `compactor doctor`. Whether a proxy serves the store is seen by trying
/// its locks (as [`import_orphaned`] does), let go at once.
pub fn status(given: &Path) -> io::Result<JournalStatus> {
    let db = canonical(given)?;
    let [log, old, lock, _] = paths(&db);
    let mut out = JournalStatus {
        served: false,
        records: 0,
        cut_short_bytes: 0,
        unreadable_bytes: 0,
        quarantined: quarantined(&db),
    };
    for path in [old, log] {
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let decoded = decode_file(&bytes);
        out.records += decoded.records.len();
        for s in decoded.skipped {
            let len = s.range.len() as u64;
            if s.cut_short {
                out.cut_short_bytes += len;
            } else {
                out.unreadable_bytes += len;
            }
        }
    }
    // No lock file: no proxy ever served the store under this name; and
    // taking the locks of a missing database would create it.
    out.served = lock.exists() && db.exists() && StoreLock::take(&db, &db)?.is_none();
    Ok(out)
}

/// The records as a batch for [`super::Backend::write`].
pub fn exchanges(records: Vec<ExchangeRecord>) -> Vec<super::Record> {
    records
        .into_iter()
        .map(|r| super::Record::Exchange(Box::new(r)))
        .collect()
}

/// A frame: [`FRAME_MARK`]; `len: u32 LE` of the payload; a CRC-32 of
/// `len`'s bytes and the payload, `u32 LE`; the payload. The payload (the
/// whole of a first-format frame, after its bare `len`): `u32 LE` length
/// and JSON of the record without its hash lists and item bodies; the
/// suffix and the response item hashes, each list as a `u32 LE` count and
/// 32-byte hashes; then per new item its hash, `u32 LE` length and body, as
/// they are (no escaping to do).
fn encode_frame(rec: &ExchangeRecord) -> io::Result<Vec<u8>> {
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
        // hash for good: a damaged one must not go in under it.
        if text_item_hash(body.as_bytes()) != hash {
            return None;
        }
        rec.new_items.push((hash, body));
    }
    Some(rec)
}

/// What a journal file holds: its readable records, and the byte ranges
/// of what could not be read.
#[derive(Default)]
struct Decoded {
    records: Vec<ExchangeRecord>,
    /// Where each record's frame was.
    frames: Vec<std::ops::Range<usize>>,
    skipped: Vec<Skipped>,
}

/// Bytes of a journal file that hold no readable frame.
#[derive(Debug, Clone, PartialEq)]
struct Skipped {
    range: std::ops::Range<usize>,
    /// The file ends inside a frame that began there: a write cut short.
    cut_short: bool,
}

/// Reads a journal file of either format. One that does not start with
/// [`MAGIC`] is of the current format all the same if frames are found in
/// it (its header is what was damaged), else of the first.
fn decode_file(bytes: &[u8]) -> Decoded {
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
pub(crate) mod tests {
    use super::*;
    use crate::wire::Api;

    /// What the server loads at start-up.
    const LIMITS: crate::store::Limits = crate::conversation::STORE_LIMITS;

    /// An exchange record to write, with one new item of its own.
    pub(crate) fn record(id: i64) -> ExchangeRecord {
        let body = format!("{{\"role\":\"user\",\"content\":\"é\\n{id}\"}}");
        let item = text_item_hash(body.as_bytes());
        ExchangeRecord {
            id,
            conversation: format!("conv_{id}"),
            new_conversation: true,
            explicit_key: None,
            tenant: "t".into(),
            api: Api::Chat,
            model: "m".into(),
            prefix: None,
            suffix_items: vec![item, [7; 32]],
            request_len: 2,
            params: [1; 32],
            response_items: vec![[2; 32]],
            new_items: vec![(item, body)],
            response_id: Some("chatcmpl-1".into()),
            usage: None,
            status: 200,
            streamed: false,
            partial: false,
            error: None,
            started_ms: 1,
            latency_ms: 0.5,
            ttfb_ms: None,
            chain_request: Some([3; 32]),
            chain_full: None,
            compaction: None,
            window: Some(crate::store::RecordedWindow {
                tokens: 4096,
                source: crate::windows::Source::Discovered,
            }),
            client_ids: crate::store::ClientIds {
                header: Some("my-session".into()),
                session: None,
                cache_key: Some("cache".into()),
            },
            client: Some("codex_cli_rs/0.1".into()),
            preview: Some(format!("Count to {id}.")),
            savings: Default::default(),
        }
    }

    /// A journal file of the current format holding `ids`' records, and
    /// where each frame is.
    fn journal_of(ids: impl IntoIterator<Item = i64>) -> (Vec<u8>, Vec<std::ops::Range<usize>>) {
        let mut bytes = MAGIC.to_vec();
        let mut frames = Vec::new();
        for id in ids {
            let start = bytes.len();
            bytes.extend(encode_frame(&record(id)).unwrap());
            frames.push(start..bytes.len());
        }
        (bytes, frames)
    }

    fn ids(records: &[ExchangeRecord]) -> Vec<i64> {
        records.iter().map(|r| r.id).collect()
    }

    #[test]
    fn a_record_journaled_before_client_ids_reads_without_them() {
        let mut old = serde_json::to_value(record(1)).unwrap();
        for field in ["window", "client_ids", "client", "preview"] {
            old.as_object_mut().unwrap().remove(field);
        }
        let rec: ExchangeRecord = serde_json::from_value(old).unwrap();
        assert_eq!(rec.window, None);
        assert_eq!(rec.client_ids, crate::store::ClientIds::default());
        assert_eq!((rec.client, rec.preview), (None, None));
    }

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

    #[test]
    fn what_cannot_be_read_is_kept_in_the_quarantine_file() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let [log, _, _, quarantine] = paths(&db);
        let (mut bytes, frames) = journal_of(1..=3);
        bytes[frames[1].start + 30] ^= 0x40;
        std::fs::write(&log, &bytes).unwrap();
        assert_eq!(quarantined(&db), None);
        assert_eq!(ids(&read_all(&db).unwrap()), [1, 3]);
        let (path, len) = quarantined(&db).unwrap();
        assert_eq!(path, quarantine);
        let kept = std::fs::read(&quarantine).unwrap();
        assert!(len as usize > frames[1].len());
        let damaged = &bytes[frames[1].clone()];
        assert!(
            kept.windows(damaged.len()).any(|w| w == damaged),
            "the frame's bytes"
        );
        let text = String::from_utf8_lossy(&kept);
        assert!(text.contains(&format!(
            "offset {} length {}",
            frames[1].start,
            frames[1].len()
        )));
    }

    #[test]
    fn every_spelling_is_one_store_and_a_journal_by_another_is_imported() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.db");
        std::fs::write(&real, b"").unwrap();
        let link = dir.path().join("link.db");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        // An earlier version journaled next to the path it was given.
        let [beside_link, ..] = paths(&link);
        std::fs::write(&beside_link, journal_of(1..=2).0).unwrap();
        let (j, left) = Journal::open(&link).unwrap();
        assert_eq!(ids(&left), [1, 2]);
        j.leftovers_imported().unwrap();
        assert_eq!(std::fs::metadata(&beside_link).unwrap().len(), 0);
        for other in [real.clone(), dir.path().join(".").join("real.db")] {
            assert!(Journal::open(&other).is_err(), "{}", other.display());
        }
        assert!(j.append(record(3), |_, _| {}).unwrap().is_none());
        assert_eq!(ids(&read_all(&real).unwrap()), [3], "beside the real file");
        // Released: the next server opens it, under any name.
        j.release();
        drop(j);
        assert!(Journal::open(&real).is_ok());
    }

    #[test]
    fn a_journal_of_the_first_format_is_still_imported() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let [log, _, _, _] = paths(&db);
        // As the first format wrote them: a bare length, then the payload.
        let mut bytes = Vec::new();
        for id in 1..=2 {
            let frame = encode_frame(&record(id)).unwrap();
            bytes.extend_from_slice(&((frame.len() - FRAME_HEAD) as u32).to_le_bytes());
            bytes.extend_from_slice(&frame[FRAME_HEAD..]);
        }
        std::fs::write(&log, &bytes).unwrap();
        let (j, left) = Journal::open(&db).unwrap();
        assert_eq!(ids(&left), [1, 2]);
        assert_eq!(quarantined(&db), None, "nothing skipped");
        j.leftovers_imported().unwrap();
        // From then on the file is of the current format.
        assert!(j.append(record(3), |_, _| {}).unwrap().is_none());
        let now = std::fs::read(&log).unwrap();
        assert!(now.starts_with(MAGIC));
        assert_eq!(ids(&decode_file(&now).records), [3]);
    }

    #[test]
    fn staged_records_share_one_write_and_a_failed_write_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let (j, _) = Journal::open(&db).unwrap();
        let [log, _, _, _] = paths(&db);
        let mut seqs = Vec::new();
        for id in 1..=3 {
            match j.stage(record(id), |_, _| {}).unwrap() {
                Staged::At(seq) => seqs.push(seq),
                Staged::Back(_) => panic!("the journal is held"),
            }
        }
        assert_eq!(
            std::fs::metadata(&log).unwrap().len(),
            0,
            "nothing written yet"
        );
        j.write_staged(seqs[1]).unwrap();
        let three = std::fs::metadata(&log).unwrap().len();
        let out = decode_file(&std::fs::read(&log).unwrap()).records;
        assert_eq!(ids(&out), [1, 2, 3]);
        // The others find theirs written.
        j.write_staged(seqs[0]).unwrap();
        j.write_staged(seqs[2]).unwrap();
        assert_eq!(std::fs::metadata(&log).unwrap().len(), three);

        // A write that fails fails all its records (whoever made it) and
        // the later ones.
        let writable = std::mem::replace(&mut j.lock().file, File::open(&log).unwrap());
        let Staged::At(staged_first) = j.stage(record(7), |_, _| {}).unwrap() else {
            panic!("staged")
        };
        let Staged::At(four) = j.stage(record(4), |_, _| {}).unwrap() else {
            panic!("staged")
        };
        assert!(j.write_staged(four).is_err());
        assert!(j.write_staged(staged_first).is_err(), "in the same write");
        j.lock().file = writable;
        let Staged::At(five) = j.stage(record(5), |_, _| {}).unwrap() else {
            panic!("staged")
        };
        assert!(j.write_staged(five).is_err(), "after a torn write");
        assert!(j.write_staged(seqs[2]).is_ok(), "written before it");
        // Once everything is imported the file starts over, and works.
        j.imported(five);
        let Staged::At(six) = j.stage(record(6), |_, _| {}).unwrap() else {
            panic!("staged")
        };
        j.write_staged(six).unwrap();
        let out = decode_file(&std::fs::read(&log).unwrap()).records;
        assert_eq!(ids(&out), [6]);
    }

    #[test]
    fn one_server_per_store_and_leftovers_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let (j, left) = Journal::open(&db).unwrap();
        assert!(left.is_empty());
        assert!(Journal::open(&db).is_err(), "the lock is held");
        for id in 1..=2 {
            assert!(j.append(record(id), |_, _| {}).unwrap().is_none());
        }
        drop(j);
        let (j, left) = Journal::open(&db).unwrap();
        assert_eq!(left.iter().map(|r| r.id).collect::<Vec<_>>(), [1, 2]);
        j.leftovers_imported().unwrap();
        // Handed over at shutdown: another server may open the store while
        // this one is still around, and nothing more goes into the journal.
        j.release();
        let (next, left) = Journal::open(&db).unwrap();
        assert!(left.is_empty());
        assert_eq!(
            j.append(record(3), |_, _| {}).unwrap().map(|r| r.id),
            Some(3)
        );
        j.imported(0);
        drop(next);
    }

    fn ids_in(db: &Path) -> Vec<i64> {
        let conn = rusqlite::Connection::open(db).unwrap();
        let mut stmt = conn
            .prepare("SELECT id FROM exchanges ORDER BY id")
            .unwrap();
        let ids = stmt.query_map([], |r| r.get(0)).unwrap();
        ids.collect::<Result<_, _>>().unwrap()
    }

    #[tokio::test]
    async fn journaled_exchanges_reach_the_database_at_start_or_on_flush() {
        use crate::store::{sqlite::SqliteBackend, Store};
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        // A run killed with two exchanges journaled, none imported.
        {
            let (j, _) = Journal::open(&db).unwrap();
            for id in 1..=2 {
                assert!(j.append(record(id), |_, _| {}).unwrap().is_none());
            }
        }
        let open = || {
            let backend = SqliteBackend::open(&db).unwrap();
            Store::start(Box::new(backend), Some(Journal::open(&db).unwrap()), LIMITS).unwrap()
        };
        let (store, snapshot) = open();
        let loaded: Vec<_> = snapshot.exchanges.iter().map(|e| e.id).collect();
        assert_eq!(loaded, [1, 2], "imported before the index is built");
        assert_eq!(std::fs::metadata(&paths(&db)[0]).unwrap().len(), 0);
        // A new exchange: journaled at once, in the database after a flush.
        let within = |f| tokio::time::timeout(std::time::Duration::from_secs(10), f);
        within(store.record(record(3))).await.unwrap().unwrap();
        assert_eq!(read_all(&db).unwrap().len(), 1);
        let flushed = tokio::time::timeout(std::time::Duration::from_secs(10), store.flush());
        flushed.await.unwrap().unwrap();
        assert_eq!(ids_in(&db), [1, 2, 3]);
        assert!(read_all(&db).unwrap().is_empty(), "imported, so dropped");
    }

    /// What runs before each write of a [`Hooked`] backend.
    type BeforeWrite = Box<dyn FnMut() -> Result<(), crate::store::StoreError> + Send>;

    /// A SQLite backend that runs a hook before each write: to fail one, or
    /// to stall it.
    struct Hooked(crate::store::sqlite::SqliteBackend, BeforeWrite);

    impl crate::store::Backend for Hooked {
        fn load(
            &mut self,
            limits: crate::store::Limits,
        ) -> Result<crate::store::Snapshot, crate::store::StoreError> {
            self.0.load(limits)
        }
        fn write(
            &mut self,
            batch: &[crate::store::Record],
        ) -> Result<(), crate::store::StoreError> {
            (self.1)()?;
            self.0.write(batch)
        }
    }

    /// A failed commit reaches its waiters as the backend's own error,
    /// typed, not as a string.
    #[tokio::test]
    async fn a_failed_commit_tells_its_waiters_the_backends_error() {
        use crate::store::{sqlite::SqliteBackend, Store, StoreError};
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let backend = Hooked(
            SqliteBackend::open(&db).unwrap(),
            Box::new(|| Err(io::Error::new(io::ErrorKind::StorageFull, "disk full").into())),
        );
        let (store, _) = Store::start(Box::new(backend), None, LIMITS).unwrap();
        let limit = std::time::Duration::from_secs(10);
        let err = tokio::time::timeout(limit, store.record(record(1)))
            .await
            .expect("in time")
            .expect_err("the commit failed");
        let StoreError::Commit(cause) = &err else {
            panic!("{err:?}");
        };
        assert!(
            matches!(&**cause, StoreError::Io(e) if e.kind() == io::ErrorKind::StorageFull),
            "{err:?}"
        );
        assert!(std::error::Error::source(&err).is_some());
    }

    #[tokio::test]
    async fn what_an_import_failed_to_write_stays_journaled_for_the_next_start() {
        use crate::store::{sqlite::SqliteBackend, Store};
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
            let limit = std::time::Duration::from_secs(10);
            tokio::time::timeout(limit, f).await.expect("in time")
        }
        {
            // The first write fails, as on a disk full for a moment.
            let mut failed = false;
            let backend = Hooked(
                SqliteBackend::open(&db).unwrap(),
                Box::new(move || {
                    if std::mem::replace(&mut failed, true) {
                        return Ok(());
                    }
                    Err(io::Error::other("no space left on device").into())
                }),
            );
            let (store, _) =
                Store::start(Box::new(backend), Some(Journal::open(&db).unwrap()), LIMITS).unwrap();
            within(store.record(record(1))).await.unwrap();
            assert!(within(store.flush()).await.is_err(), "the import failed");
            within(store.record(record(2))).await.unwrap();
            within(store.flush()).await.unwrap();
            assert_eq!(ids_in(&db), [2]);
            // A later import succeeding must not drop what an earlier one
            // failed to write.
            let ids: Vec<_> = read_all(&db).unwrap().iter().map(|r| r.id).collect();
            assert_eq!(ids, [1, 2], "still journaled");
        }
        // The writer thread lets go of the journal once the store is gone.
        let journal = within(async {
            loop {
                match Journal::open(&db) {
                    Ok(j) => break j,
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
                }
            }
        })
        .await;
        let (_store, snapshot) = Store::start(
            Box::new(SqliteBackend::open(&db).unwrap()),
            Some(journal),
            LIMITS,
        )
        .unwrap();
        let loaded: Vec<_> = snapshot.exchanges.iter().map(|e| e.id).collect();
        assert_eq!(loaded, [1, 2]);
        assert_eq!(ids_in(&db), [1, 2]);
    }

    #[tokio::test]
    async fn answers_wait_while_the_database_is_far_behind() {
        use crate::store::{sqlite::SqliteBackend, Store};
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        // The first write waits for a word, as on a database locked by
        // another process or a stalled disk.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let mut wait = Some(wait);
        let backend = Hooked(
            SqliteBackend::open(&db).unwrap(),
            Box::new(move || {
                if let Some(w) = wait.take() {
                    let _ = w.recv();
                }
                Ok(())
            }),
        );
        // Room for two records waiting for their import.
        let max = 2 * record(1).footprint();
        let (store, _) = Store::start_bounded(
            Box::new(backend),
            Some(Journal::open(&db).unwrap()),
            LIMITS,
            max,
        )
        .unwrap();
        async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
            tokio::time::timeout(Duration::from_secs(10), f)
                .await
                .expect("in time")
        }
        within(store.record(record(1))).await.unwrap();
        within(store.record(record(2))).await.unwrap();
        // The third is journaled (durable) but its caller waits.
        let third = store.record(record(3));
        let mut third = std::pin::pin!(third);
        let early = tokio::time::timeout(Duration::from_millis(500), third.as_mut()).await;
        assert!(early.is_err(), "returned while the database was stalled");
        assert_eq!(read_all(&db).unwrap().len(), 3, "all journaled meanwhile");
        go.send(()).unwrap();
        within(third).await.unwrap();
        within(store.flush()).await.unwrap();
        assert_eq!(ids_in(&db), [1, 2, 3]);
    }

    #[test]
    fn a_reader_imports_only_a_journal_nobody_serves() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        crate::store::sqlite::SqliteBackend::open(&db).unwrap();
        let (j, _) = Journal::open(&db).unwrap();
        assert!(j.append(record(1), |_, _| {}).unwrap().is_none());
        assert_eq!(
            import_orphaned(&db).unwrap(),
            0,
            "served: left to the server"
        );
        drop(j);
        assert_eq!(import_orphaned(&db).unwrap(), 1);
        assert_eq!(ids_in(&db), [1]);
        assert_eq!(import_orphaned(&db).unwrap(), 0, "nothing left");
    }

    #[test]
    fn a_set_aside_journal_is_removed_only_once_imported() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let (j, _) = Journal::open(&db).unwrap();
        let mut seqs = Vec::new();
        for id in 1..=3 {
            assert!(j.append(record(id), |s, _| seqs.push(s)).unwrap().is_none());
        }
        assert_eq!(seqs, [1, 2, 3]);
        // Pretend the journal is large: it is set aside at the next import.
        j.lock().bytes = ROTATE_BYTES + 1;
        j.imported(1);
        assert!(j.old.exists());
        assert!(j.append(record(4), |_, _| {}).unwrap().is_none());
        j.imported(2);
        assert!(j.old.exists(), "record 3 is not imported yet");
        // What a restart would import now: 1..3 from the old file, 4 after.
        let ids: Vec<_> = read_all(&db).unwrap().iter().map(|r| r.id).collect();
        assert_eq!(ids, [1, 2, 3, 4]);
        j.imported(4);
        assert!(!j.old.exists());
        assert_eq!(std::fs::metadata(&j.log).unwrap().len(), 0, "all imported");
    }
}
