//! How the command line's settings layer over the config file and the
//! environment: flag > environment > config file > defaults.

use std::path::{Path, PathBuf};

use crate::config::{Config, ConfigError};

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

/// The config file in effect ([`crate::config::file_in_effect`]) with the given flag/env
/// values on top, validated.
pub fn layered_config(
    file: Option<&Path>,
    listen: Option<&str>,
    upstream: Option<&str>,
    db: Option<&Path>,
) -> Result<Config, ConfigError> {
    let mut config = match crate::config::file_in_effect(file) {
        Some(path) => Config::from_file(&path)?,
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
