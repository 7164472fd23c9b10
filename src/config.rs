//! Configuration: the `proxy.toml` schema, built-in defaults, and the layering
//! CLI > environment > file > defaults.
//!
//! Owns parsing and validation only. Unknown keys are rejected by name
//! (`deny_unknown_fields`) so a typo never silently falls back to a default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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

/// Where an effective setting came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A command-line flag.
    Flag(&'static str),
    /// An environment variable.
    Env(String),
    /// The config file.
    File,
    /// The built-in default.
    Default,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Flag(flag) => write!(f, "flag {flag}"),
            Origin::Env(var) => write!(f, "env {var}"),
            Origin::File => f.write_str("file"),
            Origin::Default => f.write_str("default"),
        }
    }
}

/// One effective setting, as `--check-config` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    /// Dotted key, as in the file (`compaction.trigger_ratio`).
    pub key: String,
    /// Its value in TOML's spelling; a secret is shown masked.
    pub value: String,
    /// Where it came from.
    pub origin: Origin,
}

/// A URL as the program may display it (`--check-config`, the banner,
/// `doctor`, errors): the password of its userinfo and the value of every
/// query parameter that can carry a credential (`password`, `sslpassword`,
/// `api_key`, `token`, ...) replaced by `***`. Every URL the program shows
/// goes through here. A string that is not a URL is not shown at all: what
/// cannot be parsed cannot be masked with confidence.
pub fn shown_url(url: &str) -> String {
    let Ok(mut u) = reqwest::Url::parse(url) else {
        return "(invalid URL)".into();
    };
    if u.password().is_some() {
        let _ = u.set_password(Some("***"));
    }
    if u.query().is_some() {
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret_parameter(&k) {
                    "***".to_string()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.to_string()
}

/// Whether a URL query parameter's name says its value is a credential.
fn secret_parameter(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "pass",
        "secret",
        "token",
        "key",
        "auth",
        "sig",
        "credential",
    ]
    .iter()
    .any(|w| name.contains(w))
}

/// A secret's value as shown: whether it is set and how long, never any
/// of it.
pub fn masked(secret: Option<&str>) -> String {
    match secret {
        Some(s) if !s.is_empty() => format!("[set, {} characters]", s.chars().count()),
        _ => "[unset]".to_string(),
    }
}

impl Config {
    /// Every effective setting with where it came from: `given` names the
    /// keys set on the command line or by environment variables, `file`
    /// is the config file's table (if one was read); the rest are
    /// defaults. The keys the variables `upstream.api_key_env` and
    /// `admin.token_env` name are shown masked, from their variables.
    pub fn settings(&self, file: Option<&toml::Table>, given: &[(&str, Origin)]) -> Vec<Setting> {
        let in_file = |table: &str, field: &str| {
            file.and_then(|f| f.get(table))
                .and_then(|t| t.as_table())
                .is_some_and(|t| t.contains_key(field))
        };
        let mut out = Vec::new();
        let value = serde_json::to_value(self).unwrap_or_default();
        for (table, fields) in value.as_object().into_iter().flatten() {
            let Some(fields) = fields.as_object() else {
                continue;
            };
            for (field, v) in fields {
                let key = format!("{table}.{field}");
                let origin = match given.iter().find(|(k, _)| *k == key) {
                    Some((_, o)) => o.clone(),
                    None if in_file(table, field) => Origin::File,
                    None => Origin::Default,
                };
                let value = match toml::Value::try_from(v) {
                    // Its password never shown.
                    Ok(_) if key == "store.url" && self.store.is_postgres() => {
                        format!("\"{}\"", self.store.shown_url())
                    }
                    Ok(_) if key == "upstream.base_url" => {
                        format!("\"{}\"", shown_url(&self.upstream.base_url))
                    }
                    Ok(t) => t.to_string(),
                    // TOML has no null: a setting left unset.
                    Err(_) => "(unset)".to_string(),
                };
                out.push(Setting { key, value, origin });
            }
        }
        // The models table in the order it is consulted: the file's
        // entries, then the built-in ones.
        for (pattern, window, source) in self.models_table() {
            out.push(Setting {
                key: "models".into(),
                value: format!("{pattern} = {window}"),
                origin: if source == "config" {
                    Origin::File
                } else {
                    Origin::Default
                },
            });
        }
        for (key, var) in [
            ("upstream.api_key", &self.upstream.api_key_env),
            ("admin.token", &self.admin.token_env),
        ] {
            if !var.is_empty() {
                out.push(Setting {
                    key: key.into(),
                    value: masked(std::env::var(var).ok().as_deref()),
                    origin: Origin::Env(var.clone()),
                });
            }
        }
        out
    }
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
    /// Most client connections open at once; more wait to be accepted.
    pub max_connections: usize,
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
        }
    }
}

impl StoreConfig {
    /// Whether the records are on PostgreSQL.
    pub fn is_postgres(&self) -> bool {
        !self.url.is_empty()
    }

    /// The URL as it may be shown: its passwords (userinfo, `?password=`,
    /// `?sslpassword=`) replaced by `***` ([`shown_url`]).
    pub fn shown_url(&self) -> String {
        shown_url(&self.url)
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

    /// Where records are, as the banner and `--check-config` show it.
    pub fn shown(&self, path: &Path) -> String {
        if self.is_postgres() {
            self.shown_url()
        } else {
            path.display().to_string()
        }
    }
}

/// Most rounds of recall one request may take: each is an upstream call,
/// so the setting bounds what one client request can cost.
pub const MAX_RECALL_ROUNDS: u32 = 16;

/// `[compaction]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CompactionConfig {
    /// Compact once the last exchange used this fraction of the model's window.
    pub trigger_ratio: f64,
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
}

impl Default for CompactionConfig {
    fn default() -> Self {
        Self {
            trigger_ratio: 0.75,
            warn_ratio: 0.6,
            recent_user_tokens: 20_000,
            tail_tokens: 16_000,
            target_ratio: 0.4,
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
    /// Price of a million input tokens, for the savings shown in money.
    #[serde(default)]
    pub input_price_per_mtok: Option<f64>,
    /// Price of a million input tokens served from the upstream's prompt
    /// cache (default: the input price).
    #[serde(default)]
    pub cached_input_price_per_mtok: Option<f64>,
    /// Price of a million output tokens (default: the input price).
    #[serde(default)]
    pub output_price_per_mtok: Option<f64>,
}

/// A model's prices per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Prices {
    /// Input tokens.
    pub input: f64,
    /// Input tokens read from the prompt cache.
    pub cached_input: f64,
    /// Output tokens.
    pub output: f64,
}

impl Prices {
    /// What `input` tokens (`cached` of them from the cache) and `output`
    /// tokens cost.
    pub fn cost(&self, input: u64, cached: u64, output: u64) -> f64 {
        let cached = cached.min(input);
        ((input - cached) as f64 * self.input
            + cached as f64 * self.cached_input
            + output as f64 * self.output)
            / 1e6
    }
}

/// What the proxy knows about one model's limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelLimits {
    /// Context window in tokens.
    pub context_window: u64,
    /// Largest completion, in tokens.
    pub max_output_tokens: u64,
    /// Fraction of the window at which compaction triggers.
    pub trigger_ratio: f64,
}

/// Built-in defaults for common model families: (glob, window, max output).
/// Consulted after the user's `[[models]]`, so any entry there wins.
const BUILTIN_MODELS: &[(&str, u64, u64)] = &[
    ("gpt-4o*", 128_000, 16_384),
    ("chatgpt-4o*", 128_000, 16_384),
    ("gpt-4.1*", 1_047_576, 32_768),
    ("gpt-5*", 400_000, 128_000),
    ("codex-*", 400_000, 128_000),
    ("o1*", 200_000, 100_000),
    ("o3*", 200_000, 100_000),
    ("o4*", 200_000, 100_000),
    ("gpt-4-turbo*", 128_000, 4_096),
    ("gpt-4", 8_192, 4_096),
    ("gpt-3.5-turbo*", 16_385, 4_096),
    ("gpt-oss*", 131_072, 32_768),
    ("claude*", 200_000, 32_000),
    ("*llama-3*", 131_072, 8_192),
    ("*qwen2.5*", 32_768, 8_192),
    ("*qwen3*", 40_960, 8_192),
    ("*mistral*", 32_768, 8_192),
    ("*deepseek*", 128_000, 8_192),
    ("*gemma*", 131_072, 8_192),
    ("*smollm2*", 8_192, 2_048),
    ("*", 128_000, 16_384),
];

impl Config {
    /// Parses a TOML document; unknown keys are an error naming the key.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| {
            let message = match e.span() {
                Some(span) => {
                    let (line, column) = line_and_column(text, span.start);
                    format!("line {line}, column {column}: {}", e.message())
                }
                None => e.message().to_string(),
            };
            ConfigError::Parse(message, e.span())
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and parses a config file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read(path.display().to_string(), e.to_string()))?;
        Self::from_toml(&text).map_err(|e| e.in_file(path))
    }

    /// `server.body_read_timeout_secs` as a duration; `None` for no limit.
    pub fn body_read_timeout(&self) -> Option<std::time::Duration> {
        let secs = self.server.body_read_timeout_secs;
        (secs > 0).then(|| std::time::Duration::from_secs(secs))
    }

    /// Checks values that parse but make no sense.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &str, why: &str| Err(ConfigError::Invalid(key.to_string(), why.to_string()));
        if self.listen_addr().is_err() {
            return invalid("server.listen", "not a socket address like 127.0.0.1:8787");
        }
        if self.store.retain_days == Some(0) {
            return invalid(
                "store.retain_days",
                "must be at least 1 (leave it out to keep conversations)",
            );
        }
        if self.upstream_is_listener() {
            return invalid(
                "upstream.base_url",
                "points at the proxy's own listen address (server.listen): every request would come back to it",
            );
        }
        if self.server.max_body_bytes == 0 {
            return invalid("server.max_body_bytes", "must be greater than 0");
        }
        if self.server.max_connections == 0 {
            return invalid("server.max_connections", "must be greater than 0");
        }
        match reqwest::Url::parse(&self.upstream.base_url) {
            Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
            _ => return invalid("upstream.base_url", "not an http(s) URL"),
        }
        // Unlike the server's, the upstream's timeouts have no "no limit":
        // 0 would fail every request.
        let u = &self.upstream;
        for (key, secs) in [
            ("upstream.connect_timeout_secs", u.connect_timeout_secs),
            ("upstream.response_timeout_secs", u.response_timeout_secs),
            ("upstream.idle_timeout_secs", u.idle_timeout_secs),
        ] {
            if secs == 0 {
                return invalid(key, "must be greater than 0");
            }
        }
        let c = &self.compaction;
        if !(c.trigger_ratio > 0.0 && c.trigger_ratio <= 1.0) {
            return invalid("compaction.trigger_ratio", "must be in (0, 1]");
        }
        if !(c.warn_ratio > 0.0 && c.warn_ratio <= 1.0) {
            return invalid("compaction.warn_ratio", "must be in (0, 1]");
        }
        if !(c.target_ratio > 0.0 && c.target_ratio < c.trigger_ratio) {
            return invalid("compaction.target_ratio", "must be in (0, trigger_ratio)");
        }
        if c.recall_max_rounds > MAX_RECALL_ROUNDS {
            return invalid(
                "compaction.recall_max_rounds",
                &format!("must be at most {MAX_RECALL_ROUNDS}"),
            );
        }
        if c.provider_timeout_secs == 0 {
            return invalid("compaction.provider_timeout_secs", "must be at least 1");
        }
        if c.tool_output_keep_bytes >= c.tool_output_max_bytes {
            return invalid(
                "compaction.tool_output_keep_bytes",
                "must be less than tool_output_max_bytes",
            );
        }
        let st = &self.store;
        if st.is_postgres() {
            match reqwest::Url::parse(&st.url) {
                Ok(u) if u.scheme() == "postgres" || u.scheme() == "postgresql" => {}
                _ => return invalid("store.url", "not a postgres:// URL"),
            }
            if st.pool_size == 0 {
                return invalid("store.pool_size", "must be greater than 0");
            }
            if st.statement_timeout_ms == 0 {
                return invalid("store.statement_timeout_ms", "must be greater than 0");
            }
            if st.stall_after_ms == 0 {
                return invalid("store.stall_after_ms", "must be greater than 0");
            }
            if st.claim_lapse_secs == 0 {
                return invalid("store.claim_lapse_secs", "must be greater than 0");
            }
            if !SYNCHRONOUS_COMMIT.contains(&st.synchronous_commit.as_str()) {
                return invalid(
                    "store.synchronous_commit",
                    "one of on, off, local, remote_write, remote_apply",
                );
            }
        }
        let token_env = &self.admin.token_env;
        if token_env.contains(['=', '\0']) || token_env.trim() != token_env {
            return invalid("admin.token_env", "not an environment variable name");
        }
        for t in &self.tenants {
            if t.id.len() < MIN_TENANT_PREFIX || !t.id.bytes().all(|b| b.is_ascii_hexdigit()) {
                return invalid(
                    "tenants.id",
                    "must be a tenant id (or its first 12 or more hex characters)",
                );
            }
        }
        for m in &self.models {
            for (key, price) in [
                ("models.input_price_per_mtok", m.input_price_per_mtok),
                (
                    "models.cached_input_price_per_mtok",
                    m.cached_input_price_per_mtok,
                ),
                ("models.output_price_per_mtok", m.output_price_per_mtok),
            ] {
                if price.is_some_and(|p| !(p.is_finite() && p >= 0.0)) {
                    return invalid(key, "must be a price of 0 or more");
                }
            }
            if m.context_window == 0 {
                return invalid("models.context_window", "must be greater than 0");
            }
            if let Some(r) = m.trigger_ratio {
                if !(r > 0.0 && r <= 1.0) {
                    return invalid("models.trigger_ratio", "must be in (0, 1]");
                }
            }
        }
        Ok(())
    }

    /// Whether `upstream.base_url` names the address the proxy listens on,
    /// in any spelling of it: `localhost`, a loopback address when the
    /// proxy listens on one, any local address when it listens on all
    /// (`0.0.0.0`, `[::]`). Others (the host's own LAN address, a name that
    /// resolves to it) are caught per request by the hop header.
    fn upstream_is_listener(&self) -> bool {
        use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
        let (Ok(listen), Ok(url)) = (
            self.listen_addr(),
            reqwest::Url::parse(&self.upstream.base_url),
        ) else {
            return false;
        };
        if listen.port() == 0 || url.port_or_known_default() != Some(listen.port()) {
            return false;
        }
        let Some(host) = url.host_str() else {
            return false;
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let named: Vec<IpAddr> = if host.eq_ignore_ascii_case("localhost")
            || host.to_ascii_lowercase().ends_with(".localhost")
        {
            vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()]
        } else {
            match host.parse::<IpAddr>() {
                Ok(ip) => vec![ip],
                Err(_) => return false,
            }
        };
        let listen = listen.ip().to_canonical();
        named.into_iter().map(|ip| ip.to_canonical()).any(|ip| {
            ip == listen
                || (listen.is_unspecified() && (ip.is_loopback() || ip.is_unspecified()))
                || (ip.is_unspecified() && listen.is_loopback())
        })
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

    /// Limits of `model`. Order: the user's `[[models]]` entries (first match),
    /// then the built-in families, and only then a user entry of bare `*` —
    /// so a fallback for unknown models does not hide what is known of gpt-5.
    pub fn model_limits(&self, model: &str) -> ModelLimits {
        self.model_limits_sourced(model).0
    }

    /// [`Config::model_limits`], and whether a `[[models]]` entry gave them
    /// (rather than the built-in table).
    pub fn model_limits_sourced(&self, model: &str) -> (ModelLimits, bool) {
        let lower = model.to_ascii_lowercase();
        let builtin = BUILTIN_MODELS
            .iter()
            .find(|(p, _, _)| *p != "*" && glob_match(p, &lower))
            .map(|(_, w, o)| (*w, *o));
        let chosen = self.model_entry(model);
        if let Some(m) = chosen {
            let default_out = builtin.map(|b| b.1).unwrap_or(16_384);
            let limits = ModelLimits {
                context_window: m.context_window,
                max_output_tokens: m
                    .max_output_tokens
                    .unwrap_or_else(|| default_out.min(m.context_window / 4)),
                trigger_ratio: m.trigger_ratio.unwrap_or(self.compaction.trigger_ratio),
            };
            return (limits, true);
        }
        let (window, out) = builtin.unwrap_or((128_000, 16_384));
        let limits = ModelLimits {
            context_window: window,
            max_output_tokens: out,
            trigger_ratio: self.compaction.trigger_ratio,
        };
        (limits, false)
    }

    /// The `[[models]]` entry that gives `model`'s limits, if one does
    /// (the same order as [`Config::model_limits`]).
    fn model_entry(&self, model: &str) -> Option<&ModelConfig> {
        let lower = model.to_ascii_lowercase();
        let user = |fallback: bool| {
            self.models.iter().find(|m| {
                (m.pattern == "*") == fallback
                    && glob_match(&m.pattern.to_ascii_lowercase(), &lower)
            })
        };
        let builtin = BUILTIN_MODELS
            .iter()
            .any(|(p, _, _)| *p != "*" && glob_match(p, &lower));
        user(false).or(if builtin { None } else { user(true) })
    }

    /// The mode of `tenant`'s requests to `model`: the tenant's entry,
    /// then the model's, then `compaction.mode`.
    pub fn mode_for(&self, tenant: &str, model: &str) -> Mode {
        self.layered(tenant, model, |t| t.mode, |m| m.mode)
            .unwrap_or(self.compaction.mode)
    }

    /// A per-request setting: the first `[[tenants]]` entry whose id starts
    /// `tenant` that sets it, else `model`'s `[[models]]` entry's.
    fn layered<T>(
        &self,
        tenant: &str,
        model: &str,
        of_tenant: impl Fn(&TenantConfig) -> Option<T>,
        of_model: impl Fn(&ModelConfig) -> Option<T>,
    ) -> Option<T> {
        self.tenants
            .iter()
            .find(|t| tenant.starts_with(&t.id.to_ascii_lowercase()))
            .and_then(of_tenant)
            .or_else(|| self.model_entry(model).and_then(of_model))
    }

    /// The summarizer of `tenant`'s requests to `model`: the tenant's
    /// entry, then the model's, then `compaction.summarizer` (the same
    /// order as [`Config::mode_for`]).
    pub fn summarizer_for(&self, tenant: &str, model: &str) -> Summarizer {
        self.layered(tenant, model, |t| t.summarizer, |m| m.summarizer)
            .unwrap_or(self.compaction.summarizer)
    }

    /// Whether `tenant`'s requests to `model` are offered `compactor_compact`:
    /// the tenant's entry, then the model's, then `compaction.agent_tool`.
    pub fn agent_tool_for(&self, tenant: &str, model: &str) -> bool {
        self.layered(tenant, model, |t| t.agent_tool, |m| m.agent_tool)
            .unwrap_or(self.compaction.agent_tool)
    }

    /// `model`'s prices, when its `[[models]]` entry gives an input price.
    pub fn prices(&self, model: &str) -> Option<Prices> {
        let m = self.model_entry(model)?;
        let input = m.input_price_per_mtok?;
        Some(Prices {
            input,
            cached_input: m.cached_input_price_per_mtok.unwrap_or(input),
            output: m.output_price_per_mtok.unwrap_or(input),
        })
    }

    /// The effective models table (user entries, then built-ins), for the banner.
    pub fn models_table(&self) -> Vec<(String, u64, String)> {
        let mut rows: Vec<(String, u64, String)> = self
            .models
            .iter()
            .map(|m| (m.pattern.clone(), m.context_window, "config".to_string()))
            .collect();
        rows.extend(
            BUILTIN_MODELS
                .iter()
                .map(|(p, w, _)| (p.to_string(), *w, "built-in".to_string())),
        );
        rows
    }
}

/// 1-based line and column (in characters) of byte `offset` of `text`.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..text.floor_char_boundary(offset.min(text.len()))];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    (line, column)
}

/// The platform's data dir for the default database.
pub fn default_store_path() -> PathBuf {
    dirs::data_dir()
        .unwrap_or_else(|| PathBuf::from("."))
        .join("compactor")
        .join("compactor.db")
}

/// Glob match with `*` (any run) and `?` (one char); everything else literal.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    // Position of the last `*` and the text index it was tried at, for backtracking.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {0}: {1}")]
    Read(String, String),
    /// TOML syntax error or unknown key; the message names it.
    #[error("{0}")]
    Parse(String, Option<std::ops::Range<usize>>),
    /// A key has a value that makes no sense.
    #[error("invalid value for `{0}`: {1}")]
    Invalid(String, String),
    /// Any of the above, located in a file.
    #[error("{0}: {1}")]
    InFile(String, Box<ConfigError>),
}

impl ConfigError {
    fn in_file(self, path: &Path) -> Self {
        match self {
            ConfigError::Read(..) => self,
            other => ConfigError::InFile(path.display().to_string(), Box::new(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_urls_mask_userinfo_and_credential_parameters() {
        assert_eq!(
            shown_url("postgres://u:pw@h:5432/db?password=a&sslpassword=b&sslmode=require"),
            "postgres://u:***@h:5432/db?password=***&sslpassword=***&sslmode=require"
        );
        assert_eq!(
            shown_url("https://u:pw@api.example/v1?api-key=k&x=1"),
            "https://u:***@api.example/v1?api-key=***&x=1"
        );
        assert_eq!(
            shown_url("http://127.0.0.1:8080/v1"),
            "http://127.0.0.1:8080/v1"
        );
        assert_eq!(shown_url("not a url pw"), "(invalid URL)");
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_toml("[server]\nlisten = \"127.0.0.1:1\"\nlisten_port = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("listen_port"), "{err}");
        let err = Config::from_toml("[compactoin]\n").unwrap_err().to_string();
        assert!(err.contains("compactoin"), "{err}");
    }

    #[test]
    fn postgres_settings_out_of_range_are_named() {
        let base = "[store]\nurl = \"postgres://u@127.0.0.1:5432/db\"\n";
        for (line, key) in [
            ("stall_after_ms = 0", "store.stall_after_ms"),
            ("claim_lapse_secs = 0", "store.claim_lapse_secs"),
            (
                "synchronous_commit = \"off; DROP\"",
                "store.synchronous_commit",
            ),
        ] {
            let c = Config::from_toml(&format!("{base}{line}\n"));
            let err = c
                .and_then(|c| c.validate().map(|()| c))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains(key), "{line}: {err}");
        }
        let c =
            Config::from_toml(&format!("{base}synchronous_commit = \"off\"\n")).expect("parses");
        assert!(c.validate().is_ok());
        assert_eq!(c.store.synchronous_commit, "off");
    }

    #[test]
    fn example_config_parses() {
        let text = include_str!("../proxy.toml");
        let c = Config::from_toml(text).expect("proxy.toml must parse");
        assert_eq!(c.server.listen, "127.0.0.1:8787");
        assert_eq!(c.model_limits("gpt-4o-mini").context_window, 128_000);
    }

    #[test]
    fn globs() {
        assert!(glob_match("gpt-4o*", "gpt-4o-mini"));
        assert!(glob_match("*", ""));
        assert!(glob_match(
            "*qwen3*",
            "Qwen/qwen3-8b".to_lowercase().as_str()
        ));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("gpt-4o*", "gpt-4.1"));
        assert!(!glob_match("gpt-4", "gpt-4o"));
        assert!(glob_match("*a*b", "xxaxxbxb"));
    }

    #[test]
    fn toml_errors_name_line_and_column() {
        let err = Config::from_toml("[server]\nlisten = \"127.0.0.1:1\"\nlisten_port = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 3, column 1"), "{err}");
        let err = Config::from_toml("[server]\nmax_body_bytes = \"many\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2, column 18"), "{err}");
        let err = Config::from_toml("[compaction\n").unwrap_err().to_string();
        assert!(err.contains("line 1, column"), "{err}");
    }

    #[test]
    fn an_upstream_at_the_listen_address_is_refused() {
        let check = |listen: &str, upstream: &str| {
            let mut c = Config::default();
            c.server.listen = listen.into();
            c.upstream.base_url = upstream.into();
            c.validate().map_err(|e| e.to_string())
        };
        for (listen, upstream) in [
            ("127.0.0.1:8787", "http://127.0.0.1:8787/v1"),
            ("127.0.0.1:8787", "http://localhost:8787/v1"),
            ("127.0.0.1:8787", "http://LocalHost:8787"),
            ("127.0.0.1:8787", "http://0.0.0.0:8787/v1"),
            ("0.0.0.0:8787", "http://127.0.0.1:8787/v1"),
            ("0.0.0.0:8787", "http://127.0.0.2:8787/v1"),
            ("0.0.0.0:80", "http://localhost/v1"),
            ("[::]:8787", "http://127.0.0.1:8787/v1"),
            ("[::1]:8787", "http://[::1]:8787/v1"),
            ("[::1]:8787", "http://localhost:8787/v1"),
            ("192.168.1.5:8787", "http://192.168.1.5:8787/v1"),
        ] {
            let err = check(listen, upstream).expect_err(upstream);
            assert!(err.contains("upstream.base_url"), "{err}");
        }
        for (listen, upstream) in [
            ("127.0.0.1:8787", "http://127.0.0.1:8788/v1"),
            ("127.0.0.1:8787", "https://127.0.0.1/v1"),
            ("127.0.0.1:8787", "http://127.0.0.2:8787/v1"),
            ("127.0.0.1:8787", "http://api.example.com:8787/v1"),
            ("127.0.0.1:0", "http://127.0.0.1:0/v1"),
            ("192.168.1.5:8787", "http://127.0.0.1:8787/v1"),
        ] {
            assert!(check(listen, upstream).is_ok(), "{listen} {upstream}");
        }
    }

    #[test]
    fn summarizer_is_set_per_tenant_then_model_then_globally() {
        let c = Config::from_toml(
            "[compaction]\nsummarizer = \"auto\"\n\
             [[models]]\nmatch = \"remote*\"\ncontext_window = 1000\nsummarizer = \"provider\"\n\
             [[tenants]]\nid = \"0123456789AB\"\nsummarizer = \"local\"\n",
        )
        .unwrap();
        assert_eq!(c.summarizer_for("fff", "gpt-4o"), Summarizer::Auto);
        assert_eq!(c.summarizer_for("fff", "remote-1"), Summarizer::Provider);
        assert_eq!(
            c.summarizer_for("0123456789abcdef", "remote-1"),
            Summarizer::Local
        );
        assert_eq!(
            Config::default().summarizer_for("fff", "m"),
            Summarizer::Local,
            "the default"
        );
        assert!(Config::from_toml("[compaction]\nsummarizer = \"sometimes\"\n").is_err());
        assert!(Config::from_toml("[compaction]\nprovider_timeout_secs = 0\n").is_err());
    }

    #[test]
    fn user_models_win_over_builtins() {
        let c = Config::from_toml(
            "[[models]]\nmatch = \"gpt-4o*\"\ncontext_window = 1000\ntrigger_ratio = 0.5\n",
        )
        .unwrap();
        let l = c.model_limits("gpt-4o");
        assert_eq!(l.context_window, 1000);
        assert_eq!(l.trigger_ratio, 0.5);
        assert_eq!(c.model_limits("gpt-5-codex").context_window, 400_000);
        assert_eq!(c.model_limits("something-new").context_window, 128_000);
        let c = Config::from_toml("[[models]]\nmatch = \"*\"\ncontext_window = 4096\n").unwrap();
        assert_eq!(c.model_limits("gpt-5").context_window, 400_000);
        assert_eq!(c.model_limits("my-local-model").context_window, 4096);
    }

    #[test]
    fn modes_go_tenant_then_model_then_default() {
        let c = Config::from_toml(
            "[compaction]\nmode = \"off\"\n\
             [[models]]\nmatch = \"watched*\"\ncontext_window = 1000\nmode = \"observe\"\n\
             [[tenants]]\nid = \"0123456789AB\"\nmode = \"auto\"\n",
        )
        .unwrap();
        assert_eq!(c.mode_for("fff", "gpt-4o"), Mode::Off);
        assert_eq!(c.mode_for("fff", "watched-1"), Mode::Observe);
        assert_eq!(c.mode_for("0123456789abcdef", "watched-1"), Mode::Auto);
        assert_eq!(Mode::parse(" Observe "), Some(Mode::Observe));
        assert_eq!(Mode::parse("sometimes"), None);
        assert!(Config::from_toml("[[tenants]]\nid = \"0123\"\n").is_err());
        assert!(Config::from_toml("[compaction]\nmode = \"maybe\"\n").is_err());
    }

    #[test]
    fn prices_default_to_the_input_price() {
        let c = Config::from_toml(
            "[[models]]\nmatch = \"m\"\ncontext_window = 1000\ninput_price_per_mtok = 3.0\n\
             [[models]]\nmatch = \"free\"\ncontext_window = 1000\n",
        )
        .unwrap();
        let p = c.prices("m").unwrap();
        assert_eq!((p.cached_input, p.output), (3.0, 3.0));
        assert_eq!(p.cost(2_000_000, 500_000, 0), 6.0);
        assert_eq!(c.prices("free"), None);
        assert!(Config::from_toml(
            "[[models]]\nmatch = \"m\"\ncontext_window = 1\noutput_price_per_mtok = -1.0\n"
        )
        .is_err());
    }

    #[test]
    fn bad_values_rejected() {
        assert!(Config::from_toml("[compaction]\ntrigger_ratio = 1.5\n").is_err());
        assert!(Config::from_toml("[server]\nlisten = \"nope\"\n").is_err());
        assert!(Config::from_toml("[upstream]\nbase_url = \"ftp://x\"\n").is_err());
        for key in [
            "connect_timeout_secs",
            "response_timeout_secs",
            "idle_timeout_secs",
        ] {
            let err = Config::from_toml(&format!("[upstream]\n{key} = 0\n")).unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
    }
}
