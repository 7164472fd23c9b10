//! The `proxy.toml` schema: each section's keys with their built-in
//! defaults, and what the values say read together (the listen address,
//! the store's path, the upstream's key).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::error::ConfigError;

/// Default listen address: loopback, so a fresh install exposes nothing.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8787";
/// Default upstream: OpenAI's API.
pub const DEFAULT_UPSTREAM: &str = "https://api.openai.com/v1";
/// Default request body limit for the parsed endpoints (32 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// Default bound on concurrent client connections (lowered further by the
/// process's open-file limit, see `server::connection_limit`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// The whole configuration, as read from `proxy.toml` and then overridden.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where the proxy listens and how it treats client connections.
    pub server: ServerConfig,
    /// The real OpenAI-compatible API the proxy forwards to.
    pub upstream: UpstreamConfig,
    /// Where records are kept.
    pub store: StoreConfig,
    /// When and how conversations are compacted.
    pub compaction: CompactionConfig,
    /// Per-model context windows; the built-in table is consulted after these.
    pub models: Vec<ModelConfig>,
    /// Who may use the admin page and API (`/admin/`).
    pub admin: AdminConfig,
    /// Per-tenant settings (a tenant is a salted hash of the credential,
    /// as the admin page and `conversations list` show it).
    pub tenants: Vec<TenantConfig>,
}

/// What the proxy does to a request's history.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Compacts, retries on overflow, answers recall calls.
    #[default]
    Auto,
    /// Forwards every request as the client sent it, and records what a
    /// compaction would have done and saved.
    Observe,
    /// Forwards and records, nothing more.
    Off,
    /// Compacts only when asked: by the model (`compactor_compact`), the
    /// CLI or the admin API; no threshold or hard-limit compaction happens
    /// on its own. A request the upstream refuses as too long is still
    /// compacted and sent again (it would fail otherwise).
    Manual,
}

impl Mode {
    /// Name used in config, headers, records and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Auto => "auto",
            Mode::Observe => "observe",
            Mode::Off => "off",
            Mode::Manual => "manual",
        }
    }

    /// Whether the proxy may rewrite the request's history in this mode
    /// (apply compactions, answer its own tools' calls).
    pub fn rewrites(self) -> bool {
        matches!(self, Mode::Auto | Mode::Manual)
    }

    /// Parses [`Mode::as_str`] (ASCII case ignored, spaces trimmed).
    pub fn parse(s: &str) -> Option<Mode> {
        let s = s.trim();
        [Mode::Auto, Mode::Observe, Mode::Off, Mode::Manual]
            .into_iter()
            .find(|m| m.as_str().eq_ignore_ascii_case(s))
    }
}

/// Who writes the summary rung's summary (`compaction.summarizer`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Summarizer {
    /// The proxy's own summarizer call (`summarizer_model`).
    #[default]
    Local,
    /// The upstream's own compaction (Responses `/responses/compact`,
    /// Messages on-demand compaction), the proxy's facts added; the local
    /// summarizer when it fails.
    Provider,
    /// `provider` where the upstream has been seen to offer it, learned
    /// once per upstream and model; `local` elsewhere.
    Auto,
}

impl Summarizer {
    /// Name used in config and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Summarizer::Local => "local",
            Summarizer::Provider => "provider",
            Summarizer::Auto => "auto",
        }
    }
}

/// One `[[tenants]]` entry.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// The tenant id, or a prefix of it of at least
    /// [`MIN_TENANT_PREFIX`] characters.
    pub id: String,
    /// The tenant's mode, over the model's and `compaction.mode`.
    #[serde(default)]
    pub mode: Option<Mode>,
    /// The tenant's summarizer, over the model's and `compaction.summarizer`.
    #[serde(default)]
    pub summarizer: Option<Summarizer>,
    /// The tenant's `agent_tool`, over the model's and `compaction.agent_tool`.
    #[serde(default)]
    pub agent_tool: Option<bool>,
}

/// Shortest tenant id prefix a `[[tenants]]` entry may name (what the admin
/// page shows).
pub const MIN_TENANT_PREFIX: usize = 12;

/// `[server]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: String,
    /// Largest accepted body for the parsed endpoints; larger ones get 413.
    pub max_body_bytes: usize,
    /// How long in-flight requests and streams may take to finish at shutdown.
    pub shutdown_grace_secs: u64,
    /// How long a client connection may take to send a request's headers,
    /// counted from when it is accepted and then from when it is ready for
    /// its next request (so also how long an idle keep-alive or HTTP/2
    /// connection stays open); 0: no limit.
    pub header_read_timeout_secs: u64,
    /// How long a client may send nothing of a request body it has begun,
    /// whether the proxy reads it before forwarding or streams it through;
    /// then 408. 0: no limit.
    pub body_read_timeout_secs: u64,
    /// Most client connections open at once, WebSockets included; more
    /// wait to be accepted.
    pub max_connections: usize,
    /// How long a WebSocket on `/v1/responses` may sit with no response
    /// under way and nothing from its client before it is closed; 0: no
    /// limit.
    pub websocket_idle_secs: u64,
    /// Whether a client may choose the mode of its own request
    /// (`x-compactor-mode`, `x-compactor-compact`, metadata
    /// `compactor_mode`); false: those are ignored (and logged).
    pub client_control: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN.to_string(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            shutdown_grace_secs: 30,
            header_read_timeout_secs: 30,
            body_read_timeout_secs: 60,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            websocket_idle_secs: 900,
            client_control: true,
        }
    }
}

/// `[upstream]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// Base URL including the API prefix, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// Name of an environment variable holding a key the proxy sends upstream
    /// instead of the client's own credential. Empty: pass the client's through.
    pub api_key_env: String,
    /// Seconds to establish the TCP/TLS connection.
    pub connect_timeout_secs: u64,
    /// Seconds until the upstream's response headers must arrive once the
    /// request is sent (504 after).
    pub response_timeout_secs: u64,
    /// Seconds a response body may stay silent before it is abandoned.
    pub idle_timeout_secs: u64,
    /// At a model's first request, ask the upstream for its context window
    /// (vLLM's `/v1/models`, llama.cpp's `/props`), at most 2 s.
    pub discover_windows: bool,
    /// Whether a response a client asked over a WebSocket goes to the
    /// upstream over one when it takes one.
    pub websocket: UpstreamWebSocket,
}

/// `upstream.websocket`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamWebSocket {
    /// Try the upgrade; an upstream that refuses it is asked over HTTP
    /// with SSE from then on.
    #[default]
    Auto,
    /// Always HTTP with SSE.
    Off,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            base_url: DEFAULT_UPSTREAM.to_string(),
            api_key_env: String::new(),
            connect_timeout_secs: 10,
            response_timeout_secs: 600,
            idle_timeout_secs: 300,
            discover_windows: true,
            websocket: UpstreamWebSocket::Auto,
        }
    }
}

impl UpstreamConfig {
    /// The server-side key from the variable `api_key_env` names; `None`
    /// when it names none. An unset or empty variable is an error, caught
    /// by `--check-config` as well as at start-up.
    pub fn api_key(&self) -> Result<Option<String>, ConfigError> {
        if self.api_key_env.is_empty() {
            return Ok(None);
        }
        match std::env::var(&self.api_key_env) {
            Ok(v) if !v.is_empty() => Ok(Some(v)),
            _ => Err(ConfigError::Invalid(
                "upstream.api_key_env".into(),
                format!(
                    "names `{}`, which is not set (or empty) in the environment",
                    self.api_key_env
                ),
            )),
        }
    }
}

/// `[store]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// SQLite database file. Empty: the platform data dir.
    pub path: String,
    /// PostgreSQL URL (`postgres://user@host:5432/db`): records shared by
    /// every replica given the same URL. Empty: the SQLite file above.
    pub url: String,
    /// Environment variable holding the PostgreSQL password, when neither
    /// the URL nor `PGPASSWORD` gives one.
    pub password_env: String,
    /// Most PostgreSQL connections one process keeps open.
    pub pool_size: usize,
    /// A PostgreSQL statement running longer than this is cancelled, ms;
    /// also how long a request waits for a pooled connection.
    pub statement_timeout_ms: u64,
    /// PostgreSQL: a commit under way longer than this (ms) declares the
    /// database stalled: parsed requests are refused before they go
    /// upstream (503 with `Retry-After`) and `/readyz` fails, until a
    /// commit succeeds again.
    pub stall_after_ms: u64,
    /// PostgreSQL: how long a replica's claim on computing a
    /// conversation's compaction lasts, s; past it (the replica died or
    /// overran) another may compute it. Longer than a summary takes.
    pub claim_lapse_secs: u64,
    /// PostgreSQL: the sessions' `synchronous_commit`, which decides what
    /// of an acknowledged exchange survives a crash of the database's host
    /// (`on`: everything; `off`: all but the last moments, for a shorter
    /// commit). A kill of the proxy loses nothing acknowledged either way.
    pub synchronous_commit: String,
    /// PostgreSQL: each exchange is written to a local journal (files
    /// beside `path`, named `…-postgres-exchanges`) and its answer
    /// released before its commit, which follows at once in the
    /// background. A `kill -9` loses nothing acknowledged if the process
    /// starts again with the same files (it commits what they hold
    /// first); other replicas see an exchange once it is committed. Off:
    /// every answer waits for its commit.
    pub local_journal: bool,
    /// PostgreSQL with `local_journal`: how long a journaled exchange may
    /// wait for its commit, ms, so that one commit holds the exchanges of
    /// that time (what a commit costs the proxy and the database is mostly
    /// per commit, not per exchange). Other replicas see an exchange up to
    /// this much later; a conversation's first exchange, a branch and one
    /// continuing another by `previous_response_id` are committed before
    /// their answers go, whatever it is. 0: at once.
    pub commit_delay_ms: u64,
    /// Conversations last seen longer ago than this many days are deleted
    /// by the running proxy (hourly), with the items nothing else refers
    /// to. None: kept until deleted by hand.
    pub retain_days: Option<u32>,
}

/// The values PostgreSQL's `synchronous_commit` takes.
pub const SYNCHRONOUS_COMMIT: &[&str] = &["on", "off", "local", "remote_write", "remote_apply"];

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            path: String::new(),
            url: String::new(),
            password_env: String::new(),
            pool_size: 16,
            statement_timeout_ms: 5_000,
            stall_after_ms: 2_000,
            claim_lapse_secs: 120,
            synchronous_commit: "on".into(),
            retain_days: None,
            local_journal: false,
            commit_delay_ms: 50,
        }
    }
}

impl StoreConfig {
    /// Whether the records are on PostgreSQL.
    pub fn is_postgres(&self) -> bool {
        !self.url.is_empty()
    }

    /// The password: from the URL, else `PGPASSWORD`, else the variable
    /// `password_env` names.
    pub fn password(&self) -> Option<String> {
        let from_url = reqwest::Url::parse(&self.url).ok().and_then(|u| {
            u.password().map(|p| {
                percent_encoding::percent_decode_str(p)
                    .decode_utf8_lossy()
                    .into_owned()
            })
        });
        let from_env = |name: &str| std::env::var(name).ok().filter(|p| !p.is_empty());
        from_url
            .or_else(|| from_env("PGPASSWORD"))
            .or_else(|| (!self.password_env.is_empty()).then(|| from_env(&self.password_env))?)
    }
}

/// Most rounds of recall one request may take: each is an upstream call,
/// so the setting bounds what one client request can cost.
pub const MAX_RECALL_ROUNDS: u32 = 16;

/// `[compaction]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CompactionConfig {
    /// Compact once the last exchange used this fraction of the model's
    /// effective limit (its window less the answer's budget)...
    pub trigger_ratio: f64,
    /// ...or this many tokens, whichever is fewer (0: no cap). Under prompt
    /// caching every turn pays for reading its whole prompt: past this size
    /// a compaction costs less than the reads it saves.
    pub trigger_max_tokens: u64,
    /// Log a warning once the last exchange used this fraction of the window.
    pub warn_ratio: f64,
    /// Token budget of verbatim user messages kept from the summarized part.
    pub recent_user_tokens: u64,
    /// Token budget of the verbatim tail after the cut (capped at 20% of the window).
    pub tail_tokens: u64,
    /// A compaction aims to bring the request to this fraction of the window.
    pub target_ratio: f64,
    /// Model used for summaries; empty: the conversation's own model.
    pub summarizer_model: String,
    /// Compute compactions in the background after the triggering answer.
    pub background: bool,
    /// Rung 1 truncates tool outputs longer than this many bytes.
    pub tool_output_max_bytes: usize,
    /// ...keeping this many bytes of them (two thirds head, one third tail).
    pub tool_output_keep_bytes: usize,
    /// How long a request that does not fit waits for a background
    /// compaction still being computed, seconds.
    pub wait_secs: u64,
    /// Most summarizer calls one compaction makes; past it the older part
    /// of a long history is left to the facts the proxy extracts itself.
    /// 0: summaries are those facts alone, with no model call.
    pub max_summary_calls: u32,
    /// `auto`, `observe` or `off` (see [`Mode`]); `[[models]]` and
    /// `[[tenants]]` entries may say otherwise.
    pub mode: Mode,
    /// In observe mode, call the summarizer to write the summary a
    /// compaction would have sent; false: no summarizer call, the figures
    /// are estimated from the cheap rungs and the facts.
    pub observe_summaries: bool,
    /// Most rounds of `compactor_recall` calls the proxy answers itself
    /// within one request; 0: the recall tool is never offered.
    pub recall_max_rounds: u32,
    /// Who writes the summary rung's summary (see [`Summarizer`]);
    /// `[[models]]` and `[[tenants]]` entries may say otherwise.
    pub summarizer: Summarizer,
    /// How long the provider's compaction may take before the local
    /// summarizer takes over, seconds.
    pub provider_timeout_secs: u64,
    /// Offer the model the `compactor_compact` tool (beside the client's
    /// own tools), with which it asks for a compaction at the next turn
    /// boundary; `[[models]]` and `[[tenants]]` entries may say otherwise.
    pub agent_tool: bool,
    /// The share of new conversations held out of compaction, to compare
    /// the bill with: they run in observe mode, chosen from their ids (so
    /// the same ones on every replica and after a restart). 0: none.
    pub holdout_ratio: f64,
    /// How long the upstream keeps an idle conversation's prompt cache,
    /// seconds: 300 (Anthropic's default lifetime, the lower bound of
    /// OpenAI's); a Messages request whose breakpoints ask for `ttl: "1h"`
    /// takes 3,600. A conversation past `cold_ratio` that stays idle for
    /// most of it gets a compaction computed in the background, applied
    /// when it comes back after the cache expired: its prefix is written
    /// again then anyway. 0: never.
    pub cache_ttl_secs: f64,
    /// The lower threshold of that compaction, a fraction of the effective
    /// limit (the window less the answer's budget), as `trigger_ratio`.
    pub cold_ratio: f64,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        Self {
            trigger_ratio: 0.75,
            trigger_max_tokens: 85_000,
            warn_ratio: 0.6,
            recent_user_tokens: 4_000,
            tail_tokens: 4_000,
            target_ratio: 0.15,
            summarizer_model: String::new(),
            background: true,
            tool_output_max_bytes: 8_192,
            tool_output_keep_bytes: 3_072,
            wait_secs: 120,
            max_summary_calls: 8,
            mode: Mode::Auto,
            observe_summaries: false,
            recall_max_rounds: 3,
            summarizer: Summarizer::Local,
            provider_timeout_secs: 60,
            agent_tool: false,
            holdout_ratio: 0.0,
            cache_ttl_secs: 300.0,
            cold_ratio: 0.25,
        }
    }
}

/// `[admin]`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Name of an environment variable holding the admin token, sent as
    /// `Authorization: Bearer …` or `x-compactor-admin-token`. Empty: the
    /// admin page and API answer loopback clients of a loopback listener only.
    pub token_env: String,
}

/// One `[[models]]` entry.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Exact model name or a glob (`*` and `?`).
    #[serde(rename = "match")]
    pub pattern: String,
    /// Context window in tokens.
    pub context_window: u64,
    /// The proxy's budget for an answer, in tokens: the room it keeps free
    /// in the window when it decides what fits. Not sent upstream, not a cap.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    /// Per-model override of `compaction.trigger_ratio`.
    #[serde(default)]
    pub trigger_ratio: Option<f64>,
    /// Per-model override of `compaction.mode`.
    #[serde(default)]
    pub mode: Option<Mode>,
    /// Per-model override of `compaction.summarizer`.
    #[serde(default)]
    pub summarizer: Option<Summarizer>,
    /// Per-model override of `compaction.agent_tool`.
    #[serde(default)]
    pub agent_tool: Option<bool>,
    /// Price of a million input tokens, for the bill (default: the
    /// built-in list's, see [`crate::prices`]).
    #[serde(default)]
    pub input_price_per_mtok: Option<f64>,
    /// Price of a million input tokens read from the upstream's prompt
    /// cache (default: the built-in list's, else the input price).
    #[serde(default)]
    pub cached_input_price_per_mtok: Option<f64>,
    /// Price of a million input tokens written to the cache for five
    /// minutes (default: the built-in list's, else the input price).
    #[serde(default)]
    pub cache_write_price_per_mtok: Option<f64>,
    /// Price of a million input tokens written to the cache for an hour
    /// (default: the built-in list's, else the input price).
    #[serde(default)]
    pub cache_write_1h_price_per_mtok: Option<f64>,
    /// Price of a million output tokens (default: the built-in list's,
    /// else the input price).
    #[serde(default)]
    pub output_price_per_mtok: Option<f64>,
}

impl Config {
    /// `server.body_read_timeout_secs` as a duration; `None` for no limit.
    pub fn body_read_timeout(&self) -> Option<std::time::Duration> {
        let secs = self.server.body_read_timeout_secs;
        (secs > 0).then(|| std::time::Duration::from_secs(secs))
    }

    /// The listen address as a socket address.
    pub fn listen_addr(&self) -> Result<SocketAddr, std::net::AddrParseError> {
        self.server.listen.parse()
    }

    /// The store path, falling back to the platform data dir.
    pub fn store_path(&self) -> PathBuf {
        if self.store.path.is_empty() {
            default_store_path()
        } else {
            PathBuf::from(&self.store.path)
        }
    }

    /// Where `store.local_journal` keeps a PostgreSQL store's journal: the
    /// name its files start with, beside the SQLite path (which is not
    /// used then).
    pub fn postgres_journal_path(&self) -> PathBuf {
        let mut name = self.store_path().into_os_string();
        name.push("-postgres");
        PathBuf::from(name)
    }
}

/// The platform's data dir for the default database.
pub fn default_store_path() -> PathBuf {
    dirs::data_dir()
        .unwrap_or_else(|| PathBuf::from("."))
        .join("compactor")
        .join("compactor.db")
}
