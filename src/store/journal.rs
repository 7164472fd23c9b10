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
//! Files, next to the database `D`: `D-exchanges` (appended to),
//! `D-exchanges.old` (a full journal set aside while its records are
//! imported) and `D-exchanges.lock`, locked by the process that serves the
//! store, so that a reader in another process imports a journal only when
//! nobody serves it. (Not `D-journal`: that name is SQLite's own.)
//!
//! Each record is one length-prefixed frame (see `encode_frame`). A frame
//! cut short by a kill, whose write never returned, ends the reading; its
//! exchange was never acknowledged.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::ExchangeRecord;
use crate::wire::ItemHash;

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
    lock: Option<File>,
}

/// `D-exchanges`, `D-exchanges.old`, `D-exchanges.lock`.
fn paths(db: &Path) -> [PathBuf; 3] {
    ["-exchanges", "-exchanges.old", "-exchanges.lock"].map(|suffix| {
        let mut p = db.as_os_str().to_owned();
        p.push(suffix);
        PathBuf::from(p)
    })
}

/// Takes the lock of `db`'s journal; `None` when another process holds it.
fn lock(db: &Path) -> io::Result<Option<File>> {
    let [_, _, lock] = paths(db);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock)?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

/// The records in `D-exchanges.old` then `D-exchanges`, oldest first.
fn read_all(db: &Path) -> io::Result<Vec<ExchangeRecord>> {
    read_frames(db).map(|(records, _)| records)
}

/// [`read_all`], and how many bytes follow the last whole record.
fn read_frames(db: &Path) -> io::Result<(Vec<ExchangeRecord>, u64)> {
    let [log, old, _] = paths(db);
    let mut out = Vec::new();
    let mut torn = 0;
    for path in [old, log] {
        match std::fs::read(&path) {
            Ok(bytes) => {
                let end = decode_frames(&bytes, &mut out, &path);
                torn += (bytes.len() - end) as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok((out, torn))
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
    pub fn open(db: &Path) -> io::Result<(Journal, Vec<ExchangeRecord>)> {
        let lock = lock(db)?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("another process serves the store {}", db.display()),
            )
        })?;
        let leftovers = read_all(db)?;
        let [log, old, _] = paths(db);
        let file = OpenOptions::new().create(true).append(true).open(&log)?;
        let bytes = file.metadata()?.len();
        let journal = Journal {
            log,
            old,
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
            let result = st.file.write_all(&st.staged);
            st.written = st.appended;
            match result {
                Ok(()) => st.bytes += st.staged.len() as u64,
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
pub fn import_orphaned(db: &Path) -> Result<usize, super::StoreError> {
    let [log, old, _] = paths(db);
    let non_empty = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.len() > 0);
    if !non_empty(&log) && !non_empty(&old) {
        return Ok(0);
    }
    let Some(_lock) = lock(db)? else {
        return Ok(0);
    };
    let records = read_all(db)?;
    let n = records.len();
    if n > 0 {
        let mut backend = super::sqlite::SqliteBackend::open(db)?;
        super::Backend::write(&mut backend, &exchanges(records))?;
    }
    clear(&log, &old)?;
    Ok(n)
}

/// What [`status`] found in a store's journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalStatus {
    /// A process holds the store's lock: a proxy serves it.
    pub served: bool,
    /// Exchange records the journal holds, not yet imported.
    pub records: usize,
    /// Bytes after the last whole record: a write cut short by a kill,
    /// whose exchange was never acknowledged.
    pub torn_bytes: u64,
}

/// Reads the journal of `db` without changing it, for `compactor doctor`.
/// Whether a proxy serves the store is seen by trying its lock, which is
/// let go at once.
pub fn status(db: &Path) -> io::Result<JournalStatus> {
    let (records, torn_bytes) = read_frames(db)?;
    // No lock file yet: no proxy ever served this store, so none does.
    let [_, _, lock_path] = paths(db);
    let served = lock_path.exists() && lock(db)?.is_none();
    Ok(JournalStatus {
        served,
        records: records.len(),
        torn_bytes,
    })
}

/// The records as a batch for [`super::Backend::write`].
pub fn exchanges(records: Vec<ExchangeRecord>) -> Vec<super::Record> {
    records
        .into_iter()
        .map(|r| super::Record::Exchange(Box::new(r)))
        .collect()
}

/// A frame: `len: u32 LE` (of what follows); `u32 LE` length and JSON of
/// the record without its hash lists and item bodies; the suffix and the
/// response item hashes, each list as a `u32 LE` count and 32-byte hashes;
/// then per new item its hash, `u32 LE` length and body, as they are (no
/// escaping to do).
fn encode_frame(rec: &ExchangeRecord) -> io::Result<Vec<u8>> {
    let hashes = 32 * (rec.suffix_items.len() + rec.response_items.len());
    let bodies: usize = rec.new_items.iter().map(|(_, b)| 36 + b.len()).sum();
    let mut frame = Vec::with_capacity(1024);
    frame.extend_from_slice(&[0; 8]);
    serde_json::to_writer(&mut frame, rec)?;
    let meta = (frame.len() - 8) as u32;
    frame[4..8].copy_from_slice(&meta.to_le_bytes());
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
    let len = u32::try_from(frame.len() - 4)
        .map_err(|_| io::Error::other("record too large for the journal"))?;
    frame[..4].copy_from_slice(&len.to_le_bytes());
    Ok(frame)
}

/// The record a frame's content (after its length) holds.
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
        rec.new_items.push((hash, body));
    }
    Some(rec)
}

/// Appends the complete frames of `bytes` to `out`; stops at the first
/// that is cut short (its write never finished: the process was killed).
/// Returns where the reading stopped: `bytes.len()` unless a frame was cut short.
fn decode_frames(bytes: &[u8], out: &mut Vec<ExchangeRecord>, path: &Path) -> usize {
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let len = rest
            .get(..4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
        let Some((len, rec)) =
            len.and_then(|len| Some((len, decode_frame(rest.get(4..4 + len)?)?)))
        else {
            tracing::warn!(
                path = %path.display(),
                offset = at,
                "journal ends in an incomplete record (a write cut short); ignored"
            );
            return at;
        };
        out.push(rec);
        at += 4 + len;
    }
    at
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::wire::Api;

    /// An exchange record to write.
    pub(crate) fn record(id: i64) -> ExchangeRecord {
        ExchangeRecord {
            id,
            conversation: format!("conv_{id}"),
            new_conversation: true,
            explicit_key: None,
            tenant: "t".into(),
            api: Api::Chat,
            model: "m".into(),
            prefix: None,
            suffix_items: vec![[id as u8; 32], [7; 32]],
            request_len: 2,
            params: [1; 32],
            response_items: vec![[2; 32]],
            new_items: vec![(
                [id as u8; 32],
                "{\"role\":\"user\",\"content\":\"é\\n\"}".into(),
            )],
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
        }
    }

    #[test]
    fn frames_round_trip_and_a_cut_tail_is_dropped() {
        let mut bytes = Vec::new();
        for id in 1..=3 {
            bytes.extend(encode_frame(&record(id)).unwrap());
        }
        let whole = bytes.len();
        bytes.extend(&encode_frame(&record(4)).unwrap()[..20]);
        let mut out = Vec::new();
        decode_frames(&bytes, &mut out, Path::new("j"));
        assert_eq!(out.len(), 3);
        assert_eq!(
            serde_json::to_value(&out[2]).unwrap(),
            serde_json::to_value(record(3)).unwrap()
        );
        assert_eq!(out[2].new_items, record(3).new_items, "bodies as they were");
        assert_eq!(out[2].suffix_items, record(3).suffix_items);
        assert_eq!(out[2].response_items, record(3).response_items);
        // A frame that does not parse ends the reading there.
        bytes.truncate(whole);
        let second = encode_frame(&record(1)).unwrap().len() + 8;
        bytes[second] = b'!';
        out.clear();
        decode_frames(&bytes, &mut out, Path::new("j"));
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn staged_records_share_one_write_and_a_failed_write_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let (j, _) = Journal::open(&db).unwrap();
        let [log, _, _] = paths(&db);
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
        let mut out = Vec::new();
        decode_frames(&std::fs::read(&log).unwrap(), &mut out, &log);
        assert_eq!(out.iter().map(|r| r.id).collect::<Vec<_>>(), [1, 2, 3]);
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
        out.clear();
        decode_frames(&std::fs::read(&log).unwrap(), &mut out, &log);
        assert_eq!(out.iter().map(|r| r.id).collect::<Vec<_>>(), [6]);
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
            Store::start(Box::new(backend), Some(Journal::open(&db).unwrap())).unwrap()
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
        fn load(&mut self) -> Result<crate::store::Snapshot, crate::store::StoreError> {
            self.0.load()
        }
        fn write(
            &mut self,
            batch: &[crate::store::Record],
        ) -> Result<(), crate::store::StoreError> {
            (self.1)()?;
            self.0.write(batch)
        }
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
                Store::start(Box::new(backend), Some(Journal::open(&db).unwrap())).unwrap();
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
        let (_store, snapshot) =
            Store::start(Box::new(SqliteBackend::open(&db).unwrap()), Some(journal)).unwrap();
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
        let (store, _) =
            Store::start_bounded(Box::new(backend), Some(Journal::open(&db).unwrap()), max)
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
