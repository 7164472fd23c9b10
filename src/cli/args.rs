//! The command line's shape (clap) and how its flags layer over the
//! config file and the environment.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use super::layered::ConfigArgs;
use super::{connect, doctor};
use crate::config::{Config, ConfigError};

/// A transparent proxy for the OpenAI, Anthropic and Gemini APIs that keeps long conversations alive.
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
