//! Reading a configuration: the file in effect, and TOML parsed into the
//! schema and checked, its errors said by line and column and a mistyped
//! key answered with the one it was meant to be.

use std::path::{Path, PathBuf};

use super::error::ConfigError;
use super::schema::Config;

/// The file read from the working directory when neither `--config` nor
/// `COMPACTOR_CONFIG` names one.
pub const FOUND_CONFIG: &str = "proxy.toml";

/// The config file in effect: the one named, else `./proxy.toml` when the
/// working directory has one, else none (built-in defaults).
pub fn file_in_effect(named: Option<&Path>) -> Option<PathBuf> {
    match named {
        Some(p) => Some(p.to_path_buf()),
        None => {
            let found = Path::new(FOUND_CONFIG);
            found.is_file().then(|| found.to_path_buf())
        }
    }
}

/// serde's "unknown field `x`, expected one of `a`, `b`, …" said as the
/// key and the valid one closest to it, when one is close enough to be a
/// slip; the whole list otherwise. Other messages pass unchanged.
fn closest_key(message: &str) -> String {
    let Some((head, list)) = message.split_once(", expected one of ") else {
        return message.to_string();
    };
    let Some(unknown) = head
        .strip_prefix("unknown field `")
        .and_then(|r| r.strip_suffix('`'))
    else {
        return message.to_string();
    };
    let best = list
        .split(", ")
        .map(|k| k.trim_matches('`'))
        .map(|k| (strsim::damerau_levenshtein(unknown, k), k))
        .min();
    match best {
        Some((distance, key)) if distance <= unknown.len().max(3) / 3 => {
            format!("unknown key `{unknown}`; did you mean `{key}`?")
        }
        _ => format!("unknown key `{unknown}`; the keys here: {list}"),
    }
}

impl Config {
    /// Parses a TOML document; unknown keys are an error naming the key.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| {
            let message = match e.span() {
                Some(span) => {
                    let (line, column) = line_and_column(text, span.start);
                    format!("line {line}, column {column}: {}", closest_key(e.message()))
                }
                None => closest_key(e.message()),
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
}

/// 1-based line and column (in characters) of byte `offset` of `text`.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..text.floor_char_boundary(offset.min(text.len()))];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_toml("[server]\nlisten = \"127.0.0.1:1\"\nlisten_port = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("listen_port"), "{err}");
        let err = Config::from_toml("[compactoin]\n").unwrap_err().to_string();
        assert!(err.contains("compactoin"), "{err}");
    }

    /// A slip of a key is answered with the key it was meant to be, not
    /// the list of every key; a word far from every key gets the list.
    #[test]
    fn a_mistyped_key_is_answered_with_the_closest() {
        let err = Config::from_toml("[compaction]\ntriger_ratio = 0.5\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("unknown key `triger_ratio`; did you mean `trigger_ratio`?"),
            "{err}"
        );
        assert!(!err.contains("warn_ratio"), "{err}");
        let err = Config::from_toml("[compaction]\nbananas = 1\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown key `bananas`; the keys here: "),
            "{err}"
        );
        assert!(err.contains("`trigger_ratio`"), "{err}");
        let err = Config::from_toml("[compactoin]\n").unwrap_err().to_string();
        assert!(err.contains("did you mean `compaction`?"), "{err}");
    }

    #[test]
    fn example_config_parses() {
        let text = include_str!("../../proxy.toml");
        let c = Config::from_toml(text).expect("proxy.toml must parse");
        assert_eq!(c.server.listen, "127.0.0.1:8787");
        assert_eq!(c.model_limits("gpt-4o-mini").context_window, 128_000);
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
}
