//! Configuration: the `proxy.toml` schema, built-in defaults, and the layering
//! CLI > environment > file > defaults.
//!
//! Owns parsing and validation only. Unknown keys are rejected by name
//! (`deny_unknown_fields`) so a typo never silently falls back to a default.
//!
//! This file only declares the children and hands their names on: the
//! schema and its defaults are in `schema`, its reading and parsing in
//! `read`, why a configuration was rejected in `error`, the models table in
//! `models`, the per-request settings a tenant or model entry may set in
//! `lookup`, the checks of values in `validate`, and what `--check-config`
//! shows (secrets masked) in `shown`. The children name each other, never
//! this file.

mod error;
mod lookup;
mod models;
mod read;
mod schema;
mod shown;
mod validate;

pub use error::ConfigError;
pub use models::{glob_match, ModelLimits};
pub use read::{file_in_effect, FOUND_CONFIG};
pub use schema::{
    default_store_path, AdminConfig, CompactionConfig, Config, Mode, ModelConfig, ServerConfig,
    StoreConfig, Summarizer, TenantConfig, UpstreamConfig, UpstreamWebSocket, DEFAULT_LISTEN,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_UPSTREAM, MAX_RECALL_ROUNDS,
    MIN_TENANT_PREFIX, SYNCHRONOUS_COMMIT,
};
pub use shown::{masked, shown_url, Origin, Setting};
