//! The `compactor` command line: parsing, config layering, start-up.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod audit;
pub mod connect;
pub mod doctor;

use crate::app::AppState;
use crate::config::{Config, ConfigError};
use crate::demo::thousands;
use crate::server;
use crate::store::query::{self, CompactionRow, ConversationDetail, ConversationSummary};
use crate::store::sql::Sql;

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
    /// Inspect recorded conversations (reads the store; works while the proxy runs).
    #[command(subcommand)]
    Conversations(ConversationsCommand),
    /// Compact a conversation's next request, like Codex's `/compact` (asks
    /// the running proxy through its admin API).
    Compact(CompactArgs),
    /// Delete conversations last seen longer ago than `--older-than`, then
    /// the stored items nothing refers to any more, then VACUUM. Through
    /// the running proxy when one serves the store.
    Prune(PruneArgs),
    /// Watch compaction work, offline: the proxy in front of a built-in
    /// scripted upstream, driven through a long agent session.
    Demo(DemoArgs),
    /// Check a setup: the config, the upstream and the windows it states,
    /// the store, its journal, who may use the admin API. Exits non-zero
    /// on a failed check.
    Doctor(doctor::DoctorArgs),
    /// Print (or `--write`) a client's configuration for this proxy: Codex,
    /// aider, llm, Claude Code, or the environment of the OpenAI SDKs.
    Connect(connect::ConnectArgs),
    /// Run a client with the OpenAI and Anthropic base-URL variables pointing
    /// at this proxy: `compactor run -- aider --model openai/gpt-4o`.
    Run(connect::RunArgs),
    /// Print a shell completion script: `compactor completions bash`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// `compactor demo` options.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Number of requests the scripted agent sends.
    #[arg(long, default_value_t = 48)]
    pub requests: usize,
    /// Context window of the demo model, in tokens.
    #[arg(long, default_value_t = 8000)]
    pub window: u64,
    /// Keep the demo's SQLite store here (default: a temporary one).
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// Pause between requests, in milliseconds (to watch it live).
    #[arg(long, default_value_t = 0)]
    pub pause_ms: u64,
}

/// `compactor conversations …`
#[derive(Debug, Subcommand)]
pub enum ConversationsCommand {
    /// List conversations, most recently seen first.
    List {
        /// Where the store is.
        #[command(flatten)]
        store: StoreArgs,
        /// Show at most this many.
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// One conversation's timeline: exchanges, compactions, summaries.
    Show {
        /// Conversation id (or a unique prefix of one).
        id: String,
        /// Show only its Nth compaction (1 is the oldest), with its facts
        /// checklist, what was forgotten and the items it removed.
        #[arg(long, value_name = "N")]
        compaction: Option<usize>,
        /// Where the store is.
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Everything recorded about a conversation, as JSON: original items,
    /// the rewritten view, compactions, archived tool outputs.
    Export {
        /// Conversation id (or a unique prefix of one).
        id: String,
        /// Where the store is.
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Delete a conversation: its exchanges, its compactions, and the
    /// stored items nothing else refers to. Through the running proxy when
    /// one serves the store.
    Delete {
        /// Conversation id, an id its client sent, or an abbreviation.
        id: String,
        /// Where the store and the proxy are.
        #[command(flatten)]
        target: MaintainArgs,
    },
}

/// Where a command that changes the store finds it, and the proxy that
/// may be serving it.
#[derive(Debug, clap::Args)]
pub struct MaintainArgs {
    /// Where the store is.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Address the proxy listens on, when one serves the store.
    #[arg(long, env = "COMPACTOR_LISTEN")]
    pub listen: Option<String>,
}

/// `compactor prune --older-than 30d`
#[derive(Debug, clap::Args)]
pub struct PruneArgs {
    /// Conversations last seen longer ago than this go: `30d`, `12h`,
    /// `90m`, `3600s` (a bare number is days).
    #[arg(long)]
    pub older_than: String,
    /// Where the store and the proxy are.
    #[command(flatten)]
    pub target: MaintainArgs,
}

/// Where the read-only commands find the store; the same layering as
/// `serve`: flag > environment > config file > defaults.
#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    /// Config file (TOML; see proxy.toml).
    #[arg(long, env = "COMPACTOR_CONFIG")]
    pub config: Option<PathBuf>,
    /// SQLite database path.
    #[arg(long, env = "COMPACTOR_DB")]
    pub db: Option<PathBuf>,
    /// PostgreSQL URL, in place of the SQLite file (`[store] url`).
    #[arg(long, env = "COMPACTOR_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Machine-readable JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `compactor compact ID`
#[derive(Debug, clap::Args)]
pub struct CompactArgs {
    /// Conversation id, an id its client sent, or an abbreviation.
    pub id: String,
    /// Where the store and the proxy are: the config gives the listen
    /// address and admin token; `--db` names the store the proxy must be
    /// serving (the compaction itself runs in the proxy, which has the
    /// client's credentials for the summary).
    #[command(flatten)]
    pub target: MaintainArgs,
    /// Wait this many seconds for the outcome (the conversation's next
    /// request is compacted); 0: do not wait.
    #[arg(long, default_value_t = 10)]
    pub wait: u64,
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

/// The settings `serve` and `doctor` take from the command line; each also
/// reads an environment variable.
/// Precedence: flag > environment > config file > defaults.
#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    /// Config file (TOML; see proxy.toml).
    #[arg(long, env = "COMPACTOR_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listen address, e.g. 127.0.0.1:8787.
    #[arg(long, env = "COMPACTOR_LISTEN")]
    pub listen: Option<String>,
    /// Upstream base URL including /v1, e.g. `https://api.openai.com/v1`.
    #[arg(long, env = "COMPACTOR_UPSTREAM")]
    pub upstream: Option<String>,
    /// SQLite database path.
    #[arg(long, env = "COMPACTOR_DB")]
    pub db: Option<PathBuf>,
    /// PostgreSQL URL, in place of the SQLite file (`[store] url`).
    #[arg(long, env = "COMPACTOR_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
}

impl ConfigArgs {
    /// The effective configuration: file (if any) with flags/env on top.
    pub fn load_config(&self) -> Result<Config, ConfigError> {
        let config = layered_config(
            self.config.as_deref(),
            self.listen.as_deref(),
            self.upstream.as_deref(),
            self.db.as_deref(),
        )?;
        with_database_url(config, self.database_url.as_deref())
    }
}

/// `config` with the `--database-url` / `COMPACTOR_DATABASE_URL` given on
/// top, validated again.
pub fn with_database_url(mut config: Config, url: Option<&str>) -> Result<Config, ConfigError> {
    if let Some(u) = url.filter(|u| !u.is_empty()) {
        config.store.url = u.to_string();
        config.validate()?;
    }
    Ok(config)
}

/// What `--check-config` prints: every effective setting, where it came
/// from, secrets masked.
fn check_config(args: &ConfigArgs, config: &Config) -> String {
    use crate::config::Origin;
    // clap takes a flag over its variable: a value equal to the variable's
    // came from it unless the flag said the same.
    let origin = |flag: &'static str, var: &str, value: Option<String>| {
        let value = value?;
        let from_env = std::env::var(var).is_ok_and(|v| v == value)
            && !std::env::args().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
        Some(if from_env {
            Origin::Env(var.to_string())
        } else {
            Origin::Flag(flag)
        })
    };
    let given: Vec<(&str, Origin)> = [
        (
            "server.listen",
            origin("--listen", "COMPACTOR_LISTEN", args.listen.clone()),
        ),
        (
            "upstream.base_url",
            origin("--upstream", "COMPACTOR_UPSTREAM", args.upstream.clone()),
        ),
        (
            "store.path",
            origin(
                "--db",
                "COMPACTOR_DB",
                args.db.as_ref().map(|d| d.display().to_string()),
            ),
        ),
        (
            "store.url",
            origin(
                "--database-url",
                "COMPACTOR_DATABASE_URL",
                args.database_url.clone(),
            ),
        ),
    ]
    .into_iter()
    .filter_map(|(k, o)| Some((k, o?)))
    .collect();
    let file = args
        .config
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| t.parse::<toml::Table>().ok());
    let mut out = String::from("configuration OK\n");
    if let Some(path) = &args.config {
        let how = origin(
            "--config",
            "COMPACTOR_CONFIG",
            Some(path.display().to_string()),
        )
        .map(|o| o.to_string())
        .unwrap_or_default();
        out.push_str(&format!("  config file: {} ({how})\n", path.display()));
    }
    if config.store.is_postgres() {
        out.push_str(&format!("  database: {}\n", config.store.shown_url()));
    } else {
        out.push_str(&format!(
            "  store file: {}\n",
            config.store_path().display()
        ));
    }
    let settings = config.settings(file.as_ref(), &given);
    let rows: Vec<Vec<String>> = settings
        .into_iter()
        .map(|s| vec![s.key, s.value, s.origin.to_string()])
        .collect();
    let table = table(
        &[("SETTING", false), ("VALUE", false), ("FROM", false)],
        &rows,
    );
    for line in table.lines() {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// `compactor serve` flags.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Where the configuration comes from.
    #[command(flatten)]
    pub settings: ConfigArgs,
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
        self.settings.load_config()
    }
}

/// The file (if any) with the given flag/env values on top, validated.
pub fn layered_config(
    file: Option<&Path>,
    listen: Option<&str>,
    upstream: Option<&str>,
    db: Option<&Path>,
) -> Result<Config, ConfigError> {
    let mut config = match file {
        Some(path) => Config::from_file(path)?,
        None => Config::default(),
    };
    if let Some(l) = listen {
        config.server.listen = l.to_string();
    }
    if let Some(u) = upstream {
        config.upstream.base_url = u.to_string();
    }
    if let Some(d) = db {
        config.store.path = d.display().to_string();
    }
    config.validate()?;
    Ok(config)
}

/// Runs the parsed command line.
pub fn main(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Serve(args) => serve(args),
        Command::Conversations(cmd) => conversations(cmd),
        Command::Compact(args) => compact(args),
        Command::Prune(args) => prune(args),
        Command::Demo(args) => demo(args),
        Command::Doctor(args) => doctor::main(args),
        Command::Connect(args) => connect::main(args),
        Command::Run(args) => connect::run(args),
        Command::Completions { shell } => completions(shell),
    }
}

fn completions(shell: clap_complete::Shell) -> ExitCode {
    use clap::CommandFactory;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "compactor", &mut script);
    print_out(&String::from_utf8_lossy(&script))
}

fn demo(args: DemoArgs) -> ExitCode {
    // Only real warnings: the demo's own lines tell the story.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    let opts = crate::demo::DemoOptions {
        requests: args.requests,
        window: args.window,
        store: args.db,
        pause: std::time::Duration::from_millis(args.pause_ms),
    };
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
    let mut out = std::io::stdout();
    match runtime.block_on(crate::demo::run_and_print(opts, &mut out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("compactor demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for a person watching: a redirected log gets no escape codes.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Pretty => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

fn serve(args: ServeArgs) -> ExitCode {
    // The server-side key's variable is checked with the rest, so that
    // `--check-config` does not pass what `serve` then refuses.
    let config = match args
        .load_config()
        .and_then(|c| c.upstream.api_key().map(|_| c))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("compactor: configuration error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if args.check_config {
        print!("{}", check_config(&args.settings, &config));
        if config.store.is_postgres() {
            return check_database(&config);
        }
        return ExitCode::SUCCESS;
    }
    init_logging(args.log_format);
    let runtime = match crate::server::runtime_builder().build() {
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
    server::raise_open_file_limit(config.server.max_connections);
    let state = AppState::open(config)?;
    if let Some(days) = state.config.store.retain_days {
        tokio::spawn(crate::admin::retention_loop(state.clone(), days));
    }
    banner(&state, listener.local_addr()?);
    admin_notice(&state.config);
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
    // Windows the upstream told in earlier runs, which replace the table's.
    let told: Vec<String> = state
        .models_seen()
        .into_iter()
        .map(|(model, window, source)| format!("{model}={window} ({source})"))
        .collect();
    tracing::info!(
        listen = %addr,
        upstream = %crate::config::shown_url(state.upstream.base()),
        store = %c.store.shown(&c.store_path()),
        trigger_ratio = c.compaction.trigger_ratio,
        warn_ratio = c.compaction.warn_ratio,
        models = %models.join(", "),
        windows_told = %told.join(", "),
        "compactor listening"
    );
}

/// `--check-config` with a PostgreSQL store: connects, and says whether
/// the schema is current (`serve` brings it up to date at start-up).
fn check_database(config: &Config) -> ExitCode {
    let opts = crate::store::postgres::Options::from_config(&config.store);
    let status = crate::store::postgres::Postgres::new(&opts).and_then(|pg| pg.status());
    match status {
        Ok(s) if s.is_current() => {
            println!(
                "  database: reachable, schema current (version {})",
                s.applied
            );
            ExitCode::SUCCESS
        }
        Ok(s) => {
            println!(
                "  database: reachable, schema at version {} of {} (serve migrates it at start-up)",
                s.applied, s.latest
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "compactor: cannot reach the database {}: {e}",
                config.store.shown_url()
            );
            ExitCode::FAILURE
        }
    }
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

/// Says at start-up who may use `/admin/`.
fn admin_notice(config: &Config) {
    let loopback = config
        .listen_addr()
        .is_ok_and(|a| a.ip().to_canonical().is_loopback());
    let name = &config.admin.token_env;
    let token_set = !name.is_empty() && std::env::var(name).is_ok_and(|t| !t.is_empty());
    if !name.is_empty() && !token_set {
        tracing::warn!(token_env = %name, "admin.token_env names a variable that is unset or empty: /admin/ answers loopback clients of a loopback listener only");
    } else if !loopback && !token_set {
        tracing::warn!("listening on a non-loopback address without [admin] token_env: /admin/ refuses every request");
    }
}

// ---------------------------------------------------------------------------
// compactor conversations …

fn conversations(cmd: ConversationsCommand) -> ExitCode {
    let store = match &cmd {
        ConversationsCommand::Delete { id, target } => return delete(id, target),
        ConversationsCommand::List { store, .. }
        | ConversationsCommand::Show { store, .. }
        | ConversationsCommand::Export { store, .. } => store,
    };
    let config = match layered_config(store.config.as_deref(), None, None, store.db.as_deref())
        .and_then(|c| with_database_url(c, store.database_url.as_deref()))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("compactor: configuration error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let conn = match views(&config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("compactor: {e}");
            return ExitCode::FAILURE;
        }
    };
    let path = config.store_path();
    if let Some((kept, bytes)) = (!config.store.is_postgres())
        .then(|| crate::store::journal::quarantined(&path))
        .flatten()
    {
        // On stderr, so that --json output stays one document.
        eprintln!(
            "compactor: warning: {bytes} bytes of the journal could not be read and are kept in {}; \
             the exchanges they held are not in the store (each piece there follows a line that \
             says where it was; remove the file once it is looked at)",
            kept.display()
        );
    }
    let json = store.json;
    let out = match &cmd {
        ConversationsCommand::List { limit, .. } => {
            query::list_conversations(&*conn, &config, *limit).map(|list| {
                if json {
                    to_json(&serde_json::json!({ "conversations": list }), false)
                } else {
                    terminal_safe(&render_list(&list))
                }
            })
        }
        ConversationsCommand::Show {
            id,
            compaction: Some(n),
            ..
        } => {
            let shown = query::show(&*conn, &config, id)
                .map_err(|e| e.to_string())
                .and_then(|d| {
                    audit::pick(&d, *n).map(|k| {
                        if json {
                            to_json(k, false)
                        } else {
                            terminal_safe(&audit::render(k, &render_compaction(*n, k)))
                        }
                    })
                });
            return match shown {
                Ok(text) => print_out(&text),
                Err(e) => {
                    eprintln!("compactor: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        ConversationsCommand::Show { id, .. } => query::show(&*conn, &config, id).map(|d| {
            if json {
                to_json(&d, false)
            } else {
                terminal_safe(&render_show(&d))
            }
        }),
        // Export is JSON either way; --json makes it one line.
        ConversationsCommand::Export { id, .. } => {
            query::export(&*conn, &config, id).map(|e| to_json(&e, !json))
        }
        ConversationsCommand::Delete { .. } => return ExitCode::FAILURE,
    };
    match out {
        Ok(text) => print_out(&text),
        Err(e) => {
            eprintln!("compactor: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A connection for the views: the SQLite file read-only, or one pooled
/// connection to the PostgreSQL store (whose schema must be current).
fn views(config: &Config) -> Result<Box<dyn Sql>, String> {
    if config.store.is_postgres() {
        let opts = crate::store::postgres::Options::from_config(&config.store);
        return crate::store::postgres_queries::connect(&opts)
            .map(|c| Box::new(c) as Box<dyn Sql>)
            .map_err(|e| format!("cannot read the PostgreSQL store: {e}"));
    }
    let path = config.store_path();
    query::open_read_only(&path)
        .map(|c| Box::new(c) as Box<dyn Sql>)
        .map_err(|e| format!("cannot open the store {}: {e}", path.display()))
}

fn to_json<T: serde::Serialize>(value: &T, pretty: bool) -> String {
    let text = if pretty {
        serde_json::to_string_pretty(value)
    } else {
        serde_json::to_string(value)
    };
    let text = text.unwrap_or_default();
    // serde_json escapes C0 controls; C1 controls and bidi overrides go
    // out raw, and a terminal acts on them. They can stand only inside
    // JSON strings, where `\uXXXX` is the same character: still lossless.
    let mut out = String::with_capacity(text.len() + 1);
    for ch in text.chars() {
        // Line breaks outside strings are the pretty layout's own.
        if ch != '\n' && unsafe_for_terminal(ch) {
            out.push_str(&format!("\\u{:04x}", ch as u32));
        } else {
            out.push(ch);
        }
    }
    out.push('\n');
    out
}

/// Whether a terminal could act on `ch` rather than show it: C0 and C1
/// controls, DEL, and the bidirectional overrides and isolates that make
/// text read differently from how it is stored.
fn unsafe_for_terminal(ch: char) -> bool {
    ch.is_control()
        || matches!(ch, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Text for the terminal: every character a terminal could act on (see
/// [`unsafe_for_terminal`]) but the line breaks the rendering makes itself
/// shown as an escape (`\u{1b}`). Stored client strings (ids, previews,
/// models, summaries) reach the views as the client sent them.
fn terminal_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        if ch != '\n' && unsafe_for_terminal(ch) {
            out.push_str(&format!("\\u{{{:x}}}", ch as u32));
        } else {
            out.push(ch);
        }
    }
    out
}

/// Writes to stdout; a closed pipe (`| head`) is not an error.
pub(crate) fn print_out(text: &str) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("compactor: {e}");
            ExitCode::FAILURE
        }
    }
}

fn opt_thousands(n: Option<u64>) -> String {
    n.map(thousands).unwrap_or_else(|| "-".into())
}

fn percent(part: Option<u64>, whole: u64) -> String {
    match part {
        Some(p) if whole > 0 => format!("{:.0}%", 100.0 * p as f64 / whole as f64),
        _ => "-".into(),
    }
}

/// Unix ms → `YYYY-MM-DD HH:MM:SS` (UTC).
pub fn utc_time(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Left-aligned columns except those marked numeric (right-aligned).
fn table(header: &[(&str, bool)], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let pad = widths[i].saturating_sub(cell.chars().count());
            if i > 0 {
                out.push_str("  ");
            }
            if header[i].1 {
                out.push_str(&" ".repeat(pad));
                out.push_str(cell);
            } else {
                out.push_str(cell);
                if i + 1 < cells.len() {
                    out.push_str(&" ".repeat(pad));
                }
            }
        }
        let mut out = out.trim_end().to_string();
        out.push('\n');
        out
    };
    let mut out = line(header.iter().map(|(h, _)| *h).collect());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

fn last_tokens(c: &ConversationSummary) -> String {
    match c.last_tokens {
        Some(t) => format!(
            "{} / {} ({})",
            thousands(t),
            thousands(c.context_window),
            percent(Some(t), c.context_window)
        ),
        None => format!("- / {}", thousands(c.context_window)),
    }
}

/// Characters of a preview or a client id a table cell shows.
const CELL_CHARS: usize = 40;

/// A table cell: one line, at most [`CELL_CHARS`].
fn cell(text: &str) -> String {
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    terminal_safe(&crate::store::bounded_text(&line, CELL_CHARS))
}

fn render_list(list: &[ConversationSummary]) -> String {
    if list.is_empty() {
        return "no conversations recorded\n".into();
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|c| {
            vec![
                c.id.clone(),
                c.client_ids.first().map(|id| cell(id)).unwrap_or_default(),
                c.tenant.clone(),
                c.client.as_deref().map(cell).unwrap_or_default(),
                terminal_safe(&c.model),
                thousands(c.exchanges),
                thousands(c.compactions),
                last_tokens(c),
                utc_time(c.last_seen_ms),
                c.preview.as_deref().map(cell).unwrap_or_default(),
            ]
        })
        .collect();
    table(
        &[
            ("CONVERSATION", false),
            ("CLIENT ID", false),
            ("TENANT", false),
            ("CLIENT", false),
            ("MODEL", false),
            ("EXCHANGES", true),
            ("COMPACTIONS", true),
            ("LAST TOKENS / WINDOW", true),
            ("LAST SEEN (UTC)", false),
            ("FIRST MESSAGE", false),
        ],
        &rows,
    )
}

fn render_compaction(n: usize, k: &CompactionRow) -> String {
    let saved = if k.tokens_before > 0 {
        100.0 * (k.tokens_before as f64 - k.tokens_after as f64) / k.tokens_before as f64
    } else {
        0.0
    };
    // A summary's own header says how many earlier items it stands for
    // (items an earlier summary covered included): the count shown here.
    let compacted = match k.summarized_items {
        Some(n) => format!("summary of {} earlier items", thousands(n)),
        None => format!("{} items compacted", thousands(k.items_removed)),
    };
    let mut out = format!(
        "  ── compaction {n} {} · rung {} · {} UTC\n     tokens {} → {} (−{saved:.0}%), {compacted}, {} kept verbatim\n     reason: {}\n",
        k.id,
        k.rung,
        utc_time(k.created_ms),
        thousands(k.tokens_before),
        thousands(k.tokens_after),
        thousands(k.items_kept),
        k.reason,
    );
    out.extend(audit::summary_line(k));
    match &k.summary {
        Some(text) => {
            out.push_str("     summary:\n");
            for line in text.lines() {
                out.push_str("       │ ");
                out.push_str(line);
                out.push('\n');
            }
        }
        None => {
            out.push_str("     (no summary: older tool outputs replaced; originals in `export`)\n")
        }
    }
    out
}

/// The savings lines of `conversations show`.
fn render_savings(s: &crate::store::savings::Savings) -> String {
    let pct = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{:.0}%", r * 100.0));
    let mut out = format!(
        "  savings     {} input tokens received, {} without compaction; summarizer {} in + {} out; net {}\n",
        thousands(s.input_tokens),
        thousands(s.input_tokens_uncompacted),
        thousands(s.summarizer_input_tokens),
        thousands(s.summarizer_output_tokens),
        s.net_tokens_saved,
    );
    if s.tokens_saved_potential > 0 {
        out.push_str(&format!(
            "  observe     compaction would have saved {} input tokens\n",
            thousands(s.tokens_saved_potential)
        ));
    }
    out.push_str(&format!(
        "  cache       {} of input read from the upstream's cache ({} at best without compaction)\n",
        pct(s.cache_reuse),
        pct(s.cache_reuse_uncompacted)
    ));
    if let (Some(cost), Some(saved)) = (s.cost, s.money_saved) {
        out.push_str(&format!("  cost        {cost:.4}, {saved:.4} saved\n"));
    }
    out.push('\n');
    out
}

fn render_show(d: &ConversationDetail) -> String {
    let c = &d.conversation;
    let mut out = format!("conversation {}\n", c.id);
    if !c.client_ids.is_empty() {
        out.push_str(&format!("  client ids  {}\n", c.client_ids.join(", ")));
    }
    if let Some(client) = &c.client {
        out.push_str(&format!("  client      {client}\n"));
    }
    if let Some(preview) = &c.preview {
        out.push_str(&format!("  first       {}\n", cell(preview)));
    }
    out += &format!(
        "  tenant      {}\n  model       {} (window {} from {}, trigger {})\n  first seen  {} UTC\n  last seen   {} UTC\n  exchanges   {}, compactions {}, last tokens {}\n",
        c.tenant,
        c.model,
        thousands(c.context_window),
        c.window_source,
        thousands(c.trigger_tokens),
        utc_time(c.created_ms),
        utc_time(c.last_seen_ms),
        thousands(c.exchanges),
        thousands(c.compactions),
        last_tokens(c),
    );
    out.push_str(&render_savings(&d.savings));
    // Each compaction goes just before the first request it rewrote, or
    // after the last exchange that started before it.
    let position = |k: &CompactionRow| {
        d.exchanges
            .iter()
            .position(|e| Some(e.id) == k.first_applied_exchange)
            .unwrap_or_else(|| {
                d.exchanges
                    .iter()
                    .filter(|e| e.started_ms <= k.created_ms)
                    .count()
            })
    };
    let rows: Vec<Vec<String>> = d
        .exchanges
        .iter()
        .enumerate()
        .map(|(i, e)| {
            vec![
                (i + 1).to_string(),
                e.id.to_string(),
                utc_time(e.started_ms),
                format!("{}{}", e.status, if e.partial { " partial" } else { "" }),
                opt_thousands(e.input_tokens),
                opt_thousands(e.output_tokens),
                percent(
                    e.input_tokens.map(|i| i + e.output_tokens.unwrap_or(0)),
                    e.context_window.unwrap_or(c.context_window),
                ),
                e.compaction.clone().unwrap_or_default(),
            ]
        })
        .collect();
    let rendered = table(
        &[
            ("#", true),
            ("EXCHANGE", true),
            ("STARTED (UTC)", false),
            ("STATUS", false),
            ("INPUT", true),
            ("OUTPUT", true),
            ("IN+OUT OF WINDOW", true),
            ("COMPACTION APPLIED", false),
        ],
        &rows,
    );
    let mut lines = rendered.lines();
    if let Some(head) = lines.next() {
        out.push_str(&format!("  {head}\n"));
    }
    let positions: Vec<usize> = d.compactions.iter().map(position).collect();
    for (i, line) in lines.enumerate() {
        for (n, k) in d.compactions.iter().enumerate() {
            if positions[n] == i {
                out.push_str(&render_compaction(n + 1, k));
            }
        }
        out.push_str(&format!("  {line}\n"));
    }
    for (n, k) in d.compactions.iter().enumerate() {
        if positions[n] >= d.exchanges.len() {
            out.push_str(&render_compaction(n + 1, k));
        }
    }
    out
}

// ---------------------------------------------------------------------------
// compactor compact ID, conversations delete ID, prune

/// The config a command that changes the store works with.
fn maintain_config(target: &MaintainArgs) -> Result<Config, ExitCode> {
    let store = &target.store;
    layered_config(
        store.config.as_deref(),
        target.listen.as_deref(),
        None,
        store.db.as_deref(),
    )
    .and_then(|c| with_database_url(c, store.database_url.as_deref()))
    .map_err(|e| {
        eprintln!("compactor: configuration error: {e}");
        ExitCode::from(EXIT_USAGE)
    })
}

/// How long a request to the admin API may take; a prune of a large store
/// may take a while.
const ADMIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// A request to the running proxy's admin API (`path` below `/admin/api`):
/// its JSON answer, or the message to print.
fn admin_call(
    config: &Config,
    method: reqwest::Method,
    path: &str,
) -> Result<serde_json::Value, String> {
    let addr = config
        .listen_addr()
        .map_err(|e| format!("configuration error: server.listen: {e}"))?;
    let target = admin_target(addr);
    let url = format!("http://{target}/admin/api{path}");
    let token = Some(&config.admin.token_env)
        .filter(|n| !n.is_empty())
        .and_then(|n| std::env::var(n).ok())
        .filter(|t| !t.is_empty());
    let runtime = command_runtime()?;
    let answer = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(ADMIN_TIMEOUT)
            .build()?;
        let mut req = client.request(method, &url);
        if let Some(t) = &token {
            req = req.header(crate::admin::TOKEN_HEADER, t);
        }
        let resp = req.send().await?;
        let status = resp.status();
        let body = resp.bytes().await?;
        Ok::<_, reqwest::Error>((status, body))
    });
    let (status, body) = answer.map_err(|e| {
        format!(
            "cannot reach the proxy's admin API at http://{target} ({}): is `compactor serve` running there? (address from server.listen / --listen / COMPACTOR_LISTEN)",
            describe_error(&e)
        )
    })?;
    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if !status.is_success() {
        let message = value
            .pointer("/error/message")
            .and_then(|m| m.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
        return Err(format!(
            "the proxy at {target} answered {status}: {message}"
        ));
    }
    Ok(value)
}

/// Whether a running proxy serves the store at `path`.
fn served(path: &Path) -> bool {
    crate::store::journal::status(path).is_ok_and(|s| s.served)
}

/// `what` removed, in words.
fn removed_text(r: &crate::store::retention::Removed) -> String {
    let n = |count: u64, one: &str| {
        format!(
            "{} {one}{}",
            thousands(count),
            if count == 1 { "" } else { "s" }
        )
    };
    format!(
        "{}, {}, {}, {} no longer referenced",
        n(r.conversations, "conversation"),
        n(r.exchanges, "exchange"),
        n(r.compactions, "compaction"),
        n(r.items, "item")
    )
}

/// Runs a deletion through the proxy serving the store (`admin`) or, when
/// none does, on the file itself (`offline`); prints what went.
fn maintain(
    target: &MaintainArgs,
    admin: (reqwest::Method, String),
    offline: impl FnOnce(&dyn Sql) -> Result<crate::store::retention::Removed, query::QueryError>,
) -> ExitCode {
    use crate::store::retention;
    let config = match maintain_config(target) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let path = config.store_path();
    let removed: Result<retention::Removed, String> = if config.store.is_postgres() {
        // The database the replicas share: deleted there, and every replica
        // told to forget what went.
        let opts = crate::store::postgres::Options::from_config(&config.store);
        crate::store::postgres_queries::connect(&opts)
            .map_err(|e| format!("cannot read the PostgreSQL store: {e}"))
            .and_then(|conn| offline(&conn).map_err(|e| e.to_string()))
    } else if served(&path) {
        // The proxy forgets what goes, so no request is taken as part of
        // it, and deletes on its side of the store.
        admin_call(&config, admin.0, &admin.1)
            .and_then(|v| serde_json::from_value(v["removed"].clone()).map_err(|e| e.to_string()))
    } else {
        crate::store::journal::import_orphaned(&path)
            .map_err(query::QueryError::from)
            .and_then(|_| Ok(retention::open_for_maintenance(&path)?))
            .and_then(|conn| offline(&conn))
            .map_err(|e| e.to_string())
    };
    match removed {
        Err(e) => {
            eprintln!("compactor: {e}");
            ExitCode::FAILURE
        }
        Ok(r) if target.store.json => {
            print_out(&to_json(&serde_json::json!({ "removed": r }), false))
        }
        Ok(r) if config.store.is_postgres() => {
            print_out(&format!("removed {}\n", removed_text(&r)))
        }
        Ok(r) => print_out(&format!("removed {}; store vacuumed\n", removed_text(&r))),
    }
}

fn delete(name: &str, target: &MaintainArgs) -> ExitCode {
    let encoded = percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC);
    let name = name.to_string();
    maintain(
        target,
        (reqwest::Method::DELETE, format!("/conversations/{encoded}")),
        move |conn| {
            let id = query::resolve_id(conn, &name)?;
            Ok(crate::store::retention::delete_and_prune(conn, &[id])?)
        },
    )
}

/// `30d`, `12h`, `90m`, `3600s`, or a bare number of days, as seconds.
pub fn parse_age(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "d"),
    };
    let n: u64 = digits.parse().ok()?;
    let scale = match unit {
        "d" => 86_400,
        "h" => 3600,
        "m" => 60,
        "s" => 1,
        _ => return None,
    };
    n.checked_mul(scale)
}

fn prune(args: PruneArgs) -> ExitCode {
    let Some(secs) = parse_age(&args.older_than) else {
        eprintln!(
            "compactor: --older-than {:?}: give a number with d, h, m or s (30d, 12h)",
            args.older_than
        );
        return ExitCode::from(EXIT_USAGE);
    };
    let cutoff = crate::ids::now_ms() - (secs.min(i64::MAX as u64 / 1000) * 1000) as i64;
    maintain(
        &args.target,
        (
            reqwest::Method::POST,
            format!("/prune?older_than_secs={secs}"),
        ),
        move |conn| {
            use crate::store::retention;
            let old: Vec<String> = retention::seen_before(conn, cutoff, usize::MAX >> 1)?
                .into_iter()
                .map(|(_, id)| id)
                .collect();
            Ok(retention::delete_and_prune(conn, &old)?)
        },
    )
}

/// How often `compact` asks the proxy whether the compaction happened.
const COMPACT_POLL: std::time::Duration = std::time::Duration::from_millis(250);

fn compact(args: CompactArgs) -> ExitCode {
    let config = match maintain_config(&args.target) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let id = args.id.trim();
    if id.is_empty() || id.chars().any(char::is_control) {
        eprintln!("compactor: {id:?} is not a conversation id");
        return ExitCode::from(EXIT_USAGE);
    }
    // With a store named, it must be the one a proxy serves: the
    // compaction runs there (it needs the client's credentials).
    if args.target.store.db.is_some() && !served(&config.store_path()) {
        eprintln!(
            "compactor: no running proxy serves {}: a compaction runs in the proxy, with the next request's credentials; start `compactor serve` on it",
            config.store_path().display()
        );
        return ExitCode::FAILURE;
    }
    let encoded =
        percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC).to_string();
    let path = format!("/conversations/{encoded}/compact");
    let value = match admin_call(&config, reqwest::Method::POST, &path) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("compactor: {e}");
            return ExitCode::FAILURE;
        }
    };
    let conversation = value["conversation"].as_str().unwrap_or(id).to_string();
    let requested_ms = value["requested_ms"].as_i64().unwrap_or(0);
    // The outcome comes with the conversation's next request: wait for it
    // a while, asking the proxy.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.wait);
    let mut outcome = None;
    while args.wait > 0 && std::time::Instant::now() < deadline {
        match admin_call(&config, reqwest::Method::GET, &path) {
            Ok(v)
                if v["outcome"]["at_ms"].as_i64().unwrap_or(0) >= requested_ms
                    && v["outcome"].is_object() =>
            {
                outcome = Some(v["outcome"].clone());
                break;
            }
            Ok(_) => std::thread::sleep(COMPACT_POLL),
            Err(e) => {
                eprintln!("compactor: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if args.target.store.json {
        let mut v = value;
        v["outcome"] = outcome.unwrap_or(serde_json::Value::Null);
        return print_out(&to_json(&v, false));
    }
    let text = match outcome {
        Some(o) => format!("{conversation}: {}\n", outcome_text(&o)),
        None if value["already_pending"] == true => format!(
            "compaction of {conversation} was already requested: its next request will be compacted; the outcome shows in `compactor conversations show {conversation}` once it arrives\n"
        ),
        None => format!(
            "compaction of {conversation} requested: its next request will be compacted before it goes upstream; the outcome shows in `compactor conversations show {conversation}` once it arrives\n"
        ),
    };
    print_out(&text)
}

/// A compaction attempt's outcome as the proxy reports it, in words:
/// `discarded: 99 → 259 tokens, nothing to gain`.
fn outcome_text(o: &serde_json::Value) -> String {
    let before = thousands(o["tokens_before"].as_u64().unwrap_or(0));
    let after = thousands(o["tokens_after"].as_u64().unwrap_or(0));
    match o["result"].as_str() {
        Some("applied") => format!(
            "compacted: {before} → {after} tokens ({}, {})",
            o["rung"].as_str().unwrap_or("?"),
            o["compaction"].as_str().unwrap_or("?")
        ),
        Some("discarded") => format!("discarded: {before} → {after} tokens, nothing to gain"),
        _ => format!(
            "failed: {}",
            o["error"].as_str().unwrap_or("the proxy gave no reason")
        ),
    }
}

/// A one-thread runtime for a command's few requests (`compact`,
/// `doctor`, `connect`).
pub(crate) fn command_runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

/// Where to reach a proxy listening on `addr`: an unspecified address
/// (`0.0.0.0`, `::`) is reached over loopback.
pub fn admin_target(addr: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

fn describe_error(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_times() {
        assert_eq!(utc_time(0), "1970-01-01 00:00:00");
        assert_eq!(utc_time(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(utc_time(1_700_000_000_123), "2023-11-14 22:13:20");
    }

    #[test]
    fn numbers() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(percent(Some(750), 1000), "75%");
        assert_eq!(percent(None, 1000), "-");
    }

    #[test]
    fn outcomes_and_ages_in_words() {
        let discarded =
            serde_json::json!({"result": "discarded", "tokens_before": 99, "tokens_after": 259});
        assert_eq!(
            outcome_text(&discarded),
            "discarded: 99 → 259 tokens, nothing to gain"
        );
        let applied = serde_json::json!({"result": "applied", "tokens_before": 9000,
            "tokens_after": 1200, "rung": "summary", "compaction": "cmp_1"});
        assert_eq!(
            outcome_text(&applied),
            "compacted: 9,000 → 1,200 tokens (summary, cmp_1)"
        );
        assert_eq!(parse_age("30d"), Some(30 * 86_400));
        assert_eq!(parse_age("12h"), Some(12 * 3600));
        assert_eq!(parse_age("90m"), Some(5400));
        assert_eq!(parse_age("7"), Some(7 * 86_400));
        assert_eq!(parse_age("0s"), Some(0));
        for bad in ["", "d", "30x", "-1d", "1.5d"] {
            assert_eq!(parse_age(bad), None, "{bad}");
        }
    }

    #[test]
    fn unspecified_listen_is_reached_over_loopback() {
        assert_eq!(
            admin_target("0.0.0.0:8787".parse().unwrap()).to_string(),
            "127.0.0.1:8787"
        );
        assert_eq!(
            admin_target("[::]:1".parse().unwrap()).to_string(),
            "[::1]:1"
        );
        assert_eq!(
            admin_target("10.1.2.3:5".parse().unwrap()).to_string(),
            "10.1.2.3:5"
        );
    }
}
