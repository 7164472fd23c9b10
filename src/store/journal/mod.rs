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
//! The frames, written and read, are in `frames`.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::error::StoreError;
use super::records::{ExchangeRecord, Record};

mod frames;

use frames::{decode_file, encode_frame, Skipped, MAGIC};

/// Above this size the journal is set aside and a new one started.
const ROTATE_BYTES: u64 = 64 << 20;
/// The staged frames' buffer is kept between writes up to this capacity.
const STAGED_KEPT: usize = 1 << 20;

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

/// For a reader in another process (the CLI): writes what the journal of
/// `db` holds with `write` (given the store's path and the records as a
/// batch) if no process serves the store, so that exchanges of a killed
/// server show. Returns how many records were imported.
pub fn import_orphaned(
    given: &Path,
    write: impl FnOnce(&Path, &[Record]) -> Result<(), StoreError>,
) -> Result<usize, StoreError> {
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
        write(&db, &exchanges(records))?;
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
pub fn exchanges(records: Vec<ExchangeRecord>) -> Vec<Record> {
    records
        .into_iter()
        .map(|r| Record::Exchange(Box::new(r)))
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::frames::FRAME_HEAD;
    use super::*;
    use crate::wire::hash::text_item_hash;
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
            chained_by_id: false,
            branched_from: None,
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
            stored_items: Default::default(),
            claimed_at: 0,
            journaled: false,
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
            chain_echoed: None,
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
    pub(super) fn journal_of(
        ids: impl IntoIterator<Item = i64>,
    ) -> (Vec<u8>, Vec<std::ops::Range<usize>>) {
        let mut bytes = MAGIC.to_vec();
        let mut frames = Vec::new();
        for id in ids {
            let start = bytes.len();
            bytes.extend(encode_frame(&record(id)).unwrap());
            frames.push(start..bytes.len());
        }
        (bytes, frames)
    }

    pub(super) fn ids(records: &[ExchangeRecord]) -> Vec<i64> {
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
        use crate::store::sqlite::import_orphaned;
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
