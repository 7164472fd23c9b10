//! A throwaway PostgreSQL cluster for the tests of the PostgreSQL store:
//! `initdb` into a temp dir, `pg_ctl start` on 127.0.0.1 and a free port,
//! stopped and removed when dropped. PostgreSQL refuses to run as root: as
//! root, its commands run as an unprivileged user (created if missing).
//!
//! Under `CI=true` a cluster that cannot be started fails the test; on a
//! developer's machine without PostgreSQL the test says so and passes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The user the cluster runs as when the tests run as root.
const PG_USER: &str = "compactor-pg";

/// A running cluster.
pub struct PgCluster {
    bin: PathBuf,
    /// Whether commits are flushed to disk (off for the tests, which kill
    /// compactor processes, never the cluster's machine).
    fsync: bool,
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
        match Self::try_start(fsync) {
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

    fn try_start(fsync: bool) -> Result<PgCluster, String> {
        let bin = bin_dir().ok_or("no initdb (install Debian's postgresql)")?;
        let as_user = is_root();
        if as_user {
            let known = Command::new("id")
                .arg(PG_USER)
                .output()
                .is_ok_and(|o| o.status.success());
            if !known {
                // Several test binaries may race to create it: either wins.
                let _ = Command::new("useradd")
                    .args([
                        "--system",
                        "--no-create-home",
                        "--shell",
                        "/usr/sbin/nologin",
                    ])
                    .arg(PG_USER)
                    .output();
            }
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let port = free_port();
        let cluster = PgCluster {
            bin,
            fsync,
            dir,
            port,
            as_user,
            databases: AtomicUsize::new(0),
        };
        if as_user {
            cluster.chown(cluster.dir.path())?;
        }
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

    fn chown(&self, path: &Path) -> Result<(), String> {
        let out = Command::new("chown")
            .args(["-R", PG_USER])
            .arg(path)
            .output()
            .map_err(|e| e.to_string())?;
        ok(out, "chown")
    }

    /// Runs one of PostgreSQL's programs (as the unprivileged user if root).
    fn run(&self, program: &str, args: &[&str]) -> Result<(), String> {
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
        ok(out, program)
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
        let options = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -k {sockets} -c fsync={} -c max_connections=200",
            if self.fsync { "on" } else { "off" }
        );
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
