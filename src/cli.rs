//! The `compactor` command line: parsing, config layering, start-up.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::{Config, ConfigError};
use crate::server::{self, AppState};

/// Exit status for a bad configuration or invocation (sysexits EX_USAGE).
pub const EXIT_USAGE: u8 = 64;

/// A transparent OpenAI-compatible proxy that keeps long conversations alive.
#[derive(Debug, Parser)]
#[command(name = "compactor", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy.
    Serve(ServeArgs),
}

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Pretty,
    /// One JSON object per line.
    Json,
}

/// `compactor serve` flags; each also reads an environment variable.
/// Precedence: flag > environment > config file > defaults.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Config file (TOML; see proxy.toml).
    #[arg(long, env = "COMPACTOR_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listen address, e.g. 127.0.0.1:8787.
    #[arg(long, env = "COMPACTOR_LISTEN")]
    pub listen: Option<String>,
    /// Upstream base URL including /v1, e.g. https://api.openai.com/v1.
    #[arg(long, env = "COMPACTOR_UPSTREAM")]
    pub upstream: Option<String>,
    /// SQLite database path.
    #[arg(long, env = "COMPACTOR_DB")]
    pub db: Option<PathBuf>,
    /// Validate the configuration, print it, and exit.
    #[arg(long)]
    pub check_config: bool,
    /// Log format.
    #[arg(long, env = "COMPACTOR_LOG_FORMAT", value_enum, default_value_t)]
    pub log_format: LogFormat,
}

impl ServeArgs {
    /// The effective configuration: file (if any) with flags/env on top.
    pub fn load_config(&self) -> Result<Config, ConfigError> {
        let mut config = match &self.config {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        if let Some(l) = &self.listen {
            config.server.listen = l.clone();
        }
        if let Some(u) = &self.upstream {
            config.upstream.base_url = u.clone();
        }
        if let Some(d) = &self.db {
            config.store.path = d.display().to_string();
        }
        config.validate()?;
        Ok(config)
    }
}

/// Runs the parsed command line.
pub fn main(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Serve(args) => serve(args),
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Pretty => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

fn serve(args: ServeArgs) -> ExitCode {
    let config = match args.load_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("compactor: configuration error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if args.check_config {
        println!("configuration OK");
        println!("  listen:   {}", config.server.listen);
        println!("  upstream: {}", config.upstream.base_url);
        println!("  store:    {}", config.store_path().display());
        return ExitCode::SUCCESS;
    }
    init_logging(args.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("compactor: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve_async(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("compactor: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve_async(config: Config) -> anyhow::Result<()> {
    let addr = config.listen_addr()?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    let state = AppState::open(config)?;
    banner(&state, listener.local_addr()?);
    server::run(listener, state, shutdown_signal()).await;
    Ok(())
}

fn banner(state: &AppState, addr: std::net::SocketAddr) {
    let c = &state.config;
    let models: Vec<String> = c
        .models_table()
        .into_iter()
        .map(|(pattern, window, source)| format!("{pattern}={window} ({source})"))
        .collect();
    tracing::info!(
        listen = %addr,
        upstream = %state.upstream.base(),
        store = %c.store_path().display(),
        trigger_ratio = c.compaction.trigger_ratio,
        warn_ratio = c.compaction.warn_ratio,
        models = %models.join(", "),
        "compactor listening"
    );
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
