//! Why a configuration was rejected.

use std::path::Path;

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
    pub(super) fn in_file(self, path: &Path) -> Self {
        match self {
            ConfigError::Read(..) => self,
            other => ConfigError::InFile(path.display().to_string(), Box::new(other)),
        }
    }
}
