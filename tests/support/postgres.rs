//! A throwaway PostgreSQL cluster for the tests of the PostgreSQL store:
//! `initdb` into a temp dir, `pg_ctl start` on 127.0.0.1 and a free port,
//! stopped and removed when dropped. PostgreSQL refuses to run as root: as
//! root, its commands run as an unprivileged user (`scripts/test` creates it
//! before any test runs; a test run by hand creates it if missing).
//!
//! Under `CI=true` a cluster that cannot be started fails the test; on a
//! developer's machine without PostgreSQL the test says so and passes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The user the cluster runs as when the tests run as root.
const PG_USER: &str = "compactor-pg";

/// A running cluster.
pub struct PgCluster {
    bin: PathBuf,
    /// Whether commits are flushed to disk (off for the tests, which kill
    /// compactor processes, never the cluster's machine).
    fsync: bool,
    /// Whether `pg_stat_statements` is loaded (see [`PgCluster::statements`]).
    statements: bool,
    dir: tempfile::TempDir,
    pub port: u16,
    as_user: bool,
    databases: AtomicUsize,
}

/// Where `initdb` and `pg_ctl` are: the newest of Debian's
/// `/usr/lib/postgresql/*/bin`, else the `PATH`.
fn bin_dir() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find(|p| p.join("initdb").exists() && p.join("pg_ctl").exists())
}

/// Whether [`PG_USER`] exists.
fn user_known() -> bool {
    Command::new("id")
        .arg(PG_USER)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Creates [`PG_USER`] unless it exists (`scripts/test` creates it before
/// any test runs; this is for a test run by hand). Creations are serialised
/// across this process's threads and across processes: concurrent
/// `useradd`s of one name can each hand it another uid, so that a
/// directory given to the name a moment ago belongs to a uid the name no
/// longer has, and `initdb` may not write in it.
fn ensure_user() -> Result<(), String> {
    static KNOWN: Mutex<bool> = Mutex::new(false);
    let mut known = KNOWN.lock().unwrap_or_else(|p| p.into_inner());
    if *known {
        return Ok(());
    }
    let path = std::env::temp_dir().join(format!("{PG_USER}.user.lock"));
    let lock = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    lock.lock()
        .map_err(|e| format!("lock {}: {e}", path.display()))?;
    if !user_known() {
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
            ])
            .arg(PG_USER)
            .output()
            .map_err(|e| format!("useradd: {e}"))?;
        // Another process that does not take the lock may have won.
        if !user_known() {
            ok(out, "useradd")?;
            return Err(format!(
                "useradd {PG_USER} succeeded, yet the user is unknown"
            ));
        }
    }
    *known = true;
    Ok(())
}

/// The cluster's directory: a temp dir, given to [`PG_USER`] when `as_user`
/// and checked to be writable by it. A temp dir below a directory that user
/// may not enter (a `TMPDIR` in root's home, say) is replaced by one in
/// `/tmp`.
fn cluster_dir(as_user: bool) -> Result<tempfile::TempDir, String> {
    let make = |parent: &Path| -> Result<tempfile::TempDir, String> {
        let dir = tempfile::Builder::new()
            .prefix("compactor-pg-")
            .tempdir_in(parent)
            .map_err(|e| format!("a temp dir in {}: {e}", parent.display()))?;
        if as_user {
            let out = Command::new("chown")
                .args(["-R", PG_USER])
                .arg(dir.path())
                .output()
                .map_err(|e| e.to_string())?;
            ok(out, "chown")?;
            let out = Command::new("runuser")
                .args(["-u", PG_USER, "--", "test", "-w"])
                .arg(dir.path())
                .output()
                .map_err(|e| format!("runuser: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "{} is not writable by {PG_USER} (a directory above it is closed to it)",
                    dir.path().display()
                ));
            }
        }
        Ok(dir)
    };
    let tmp = std::env::temp_dir();
    match make(&tmp) {
        Err(why) if as_user && tmp != Path::new("/tmp") => {
            make(Path::new("/tmp")).map_err(|e| format!("{why}; and {e}"))
        }
        made => made,
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

impl PgCluster {
    /// A fresh cluster, or `None` (with the reason printed) when none can be
    /// started here; under `CI=true` that fails the test instead.
    pub fn start() -> Option<PgCluster> {
        Self::start_with(false)
    }

    /// [`PgCluster::start`], with commits flushed to disk if `fsync` (what a
    /// benchmark of the commit latency needs).
    pub fn start_with(fsync: bool) -> Option<PgCluster> {
        Self::start_profiled(fsync, false)
    }

    /// [`PgCluster::start_with`], with `pg_stat_statements` loaded if
    /// `statements` (what a benchmark that reports the database's time per
    /// statement needs).
    pub fn start_profiled(fsync: bool, statements: bool) -> Option<PgCluster> {
        match Self::try_start(fsync, statements) {
            Ok(c) => Some(c),
            Err(why) if std::env::var("CI").is_ok_and(|v| v == "true") => {
                panic!("PostgreSQL cannot be started (scripts/test installs it): {why}")
            }
            Err(why) => {
                eprintln!("skipped: PostgreSQL cannot be started here: {why}");
                None
            }
        }
    }

    fn try_start(fsync: bool, statements: bool) -> Result<PgCluster, String> {
        let bin = bin_dir().ok_or("no initdb (install Debian's postgresql)")?;
        let as_user = is_root();
        if as_user {
            ensure_user()?;
        }
        let dir = cluster_dir(as_user)?;
        let port = free_port();
        let cluster = PgCluster {
            bin,
            fsync,
            statements,
            dir,
            port,
            as_user,
            databases: AtomicUsize::new(0),
        };
        let data = cluster.data();
        cluster.run(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )?;
        cluster.start_server()?;
        Ok(cluster)
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    /// Runs one of PostgreSQL's programs (as the unprivileged user if root).
    fn run(&self, program: &str, args: &[&str]) -> Result<(), String> {
        self.output(program, args).map(drop)
    }

    /// [`PgCluster::run`]: what it printed.
    fn output(&self, program: &str, args: &[&str]) -> Result<String, String> {
        let exe = self.bin.join(program);
        let mut cmd = if self.as_user {
            let mut c = Command::new("runuser");
            c.args(["-u", PG_USER, "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let out = cmd
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .map_err(|e| format!("{program}: {e}"))?;
        let printed = String::from_utf8_lossy(&out.stdout).into_owned();
        ok(out, program).map(|()| printed)
    }

    /// Stops the server (as a crash would: no shutdown checkpoint).
    pub fn stop(&self) {
        let data = self.data();
        self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
            .expect("pg_ctl stop");
    }

    /// Starts the server again after [`PgCluster::stop`], on the same port.
    pub fn restart(&self) {
        self.start_server().expect("pg_ctl start");
    }

    fn start_server(&self) -> Result<(), String> {
        let (data, port) = (self.data(), self.port);
        let sockets = self.dir.path().display().to_string();
        let mut options = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -k {sockets} -c fsync={} -c max_connections=200",
            if self.fsync { "on" } else { "off" }
        );
        if self.statements {
            options.push_str(
                " -c shared_preload_libraries=pg_stat_statements \
                 -c pg_stat_statements.track_planning=on",
            );
        }
        let log = self.dir.path().join("pg.log").display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D", &data, "-o", &options, "-l", &log, "-w", "-t", "30", "start",
            ],
        )
    }

    /// A new, empty database in the cluster: its URL.
    pub fn database(&self) -> String {
        let n = self.databases.fetch_add(1, Ordering::Relaxed);
        let name = format!("compactor_{n}");
        let port = self.port.to_string();
        self.run(
            "createdb",
            &["-h", "127.0.0.1", "-p", &port, "-U", "postgres", &name],
        )
        .expect("createdb");
        self.url(&name)
    }

    /// The cluster's processes: the server's pid, and the server and its
    /// children (its backends and helpers), each with the fields of its
    /// `/proc/PID/stat` after the parenthesised command name (ppid is the
    /// 2nd; utime, stime, cutime, cstime the 12th to 15th).
    pub fn processes(&self) -> (u32, Vec<(u32, Vec<u64>)>) {
        let pid_file = self.dir.path().join("data").join("postmaster.pid");
        let Some(server) = std::fs::read_to_string(pid_file)
            .ok()
            .and_then(|s| s.lines().next()?.trim().parse::<u32>().ok())
        else {
            return (0, Vec::new());
        };
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return (server, Vec::new());
        };
        let mut found = Vec::new();
        for entry in procs.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let Some((_, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let f: Vec<u64> = rest
                .split_whitespace()
                .map(|v| v.parse().unwrap_or(0))
                .collect();
            if pid == server || f.get(1) == Some(&u64::from(server)) {
                found.push((pid, f));
            }
        }
        (server, found)
    }

    /// CPU seconds the cluster's processes have used so far: the run time
    /// of the server, its backends and helpers (in ns, from schedstat: the
    /// 10 ms ticks of /proc stat are sampled, too coarse for a few
    /// thousand requests), and the children that exited (the server's
    /// children's times, in ticks).
    pub fn cpu_secs(&self) -> f64 {
        let (server, processes) = self.processes();
        let mut secs = 0.0;
        for (pid, f) in &processes {
            // PostgreSQL's processes have one thread each.
            secs += run_ns(std::path::Path::new(&format!("/proc/{pid}"))) as f64 / 1e9;
            if *pid == server {
                let get = |i: usize| f.get(i).copied().unwrap_or(0);
                // USER_HZ, 100 on Linux.
                secs += (get(13) + get(14)) as f64 / 100.0;
            }
        }
        secs
    }

    /// Gives the database at `url` (its schema migrated) the history of a
    /// store that has served a while: `exchanges` exchanges of another
    /// tenant in conversations of 20, an item body each, and the
    /// statistics of it all (`ANALYZE`), as autovacuum keeps them.
    ///
    /// A database created empty and filled within seconds has statistics
    /// of an empty one, and its connections keep the plans made from them
    /// (a sequential scan of `exchanges` per look-up) until autovacuum
    /// analyzes it, up to a minute on: what a store does for the first
    /// minute of its life, not after.
    pub fn fill(&self, url: &str, exchanges: usize) -> Result<(), String> {
        let conversations = exchanges.div_ceil(20);
        self.psql(
            url,
            &format!(
                "INSERT INTO conversations (id, tenant, created_ms, last_seen_ms, model)
                     SELECT 'filler_' || c, 'filler', 0, c, 'm'
                     FROM generate_series(1, {conversations}) c;
                 INSERT INTO items (hash, body)
                     SELECT sha256(('item' || g)::bytea), repeat('x', 400)
                     FROM generate_series(1, {exchanges}) g;
                 INSERT INTO exchanges (id, conversation_id, tenant, endpoint, model,
                                        prefix_exchange, prefix_len, suffix_items,
                                        request_len, params, response_items, status,
                                        streamed, partial, started_ms, latency_ms,
                                        chain_request, chain_full)
                     SELECT -g, 'filler_' || (g % {conversations} + 1), 'filler', 'chat', 'm',
                            CASE WHEN g > {conversations} THEN -(g - {conversations}) END,
                            0, sha256(('item' || g)::bytea), 2 * (g / {conversations}) + 1,
                            ''::bytea, sha256(('item' || g)::bytea), 200, FALSE, FALSE,
                            g, 1.0, sha256(('r' || g)::bytea), sha256(('f' || g)::bytea)
                     FROM generate_series(1, {exchanges}) g;
                 ANALYZE"
            ),
        )
        .map(drop)
    }

    /// Forgets what `pg_stat_statements` counted so far (the cluster must
    /// be [`PgCluster::start_profiled`] with it).
    pub fn reset_statements(&self, url: &str) -> Result<(), String> {
        self.psql(
            url,
            "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()",
        )
        .map(drop)
    }

    /// The `top` statements of the database at `url` by time spent in
    /// them since [`PgCluster::reset_statements`], one line each: calls,
    /// total and mean milliseconds of execution, how many times it was
    /// planned and the milliseconds that took (a statement planned at each
    /// call pays that on top), rows, WAL bytes, and the statement's start.
    pub fn statements(&self, url: &str, top: usize) -> Result<String, String> {
        let sql = format!(
            "SELECT lpad(calls::text, 7) || lpad(round(total_exec_time)::text, 8) || ' ms'
                    || lpad(round(mean_exec_time::numeric, 3)::text, 9) || ' ms/call'
                    || lpad(plans::text, 7) || ' plans' || lpad(round(total_plan_time)::text, 6)
                    || ' ms' || lpad(rows::text, 8) || ' rows' || lpad(wal_bytes::text, 11)
                    || ' WAL B  '
                    || left(regexp_replace(query, '\\s+', ' ', 'g'), 80)
             FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
             ORDER BY total_exec_time DESC LIMIT {top}"
        );
        self.psql(url, &sql)
    }

    fn psql(&self, url: &str, sql: &str) -> Result<String, String> {
        self.output("psql", &["-X", "-q", "-t", "-A", "-d", url, "-c", sql])
    }

    /// What the server logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pg.log")).unwrap_or_default()
    }

    /// The URL of database `name`.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }
}

/// A port that was free a moment ago (this file stands alone: the bench
/// includes it too).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn ok(out: Output, what: &str) -> Result<(), String> {
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let data = self.data();
        let _ = self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
    }
}

/// How long the task at `dir` (`/proc/PID` or `/proc/PID/task/TID`) has
/// run, in ns: the first field of its schedstat, exact where the ticks of
/// its stat are sampled every 10 ms.
pub fn run_ns(dir: &std::path::Path) -> u64 {
    std::fs::read_to_string(dir.join("schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
