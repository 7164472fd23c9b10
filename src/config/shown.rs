//! Configuration as it is shown: every effective setting with where it
//! came from (`--check-config`), and the masking of what may carry a
//! secret (URLs' passwords and credential parameters, keys' values).

use std::path::Path;

use super::schema::{Config, StoreConfig};

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
        // entries, then the built-in ones, then the fallback `*`.
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

impl StoreConfig {
    /// The URL as it may be shown: its passwords (userinfo, `?password=`,
    /// `?sslpassword=`) replaced by `***` ([`shown_url`]).
    pub fn shown_url(&self) -> String {
        shown_url(&self.url)
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
}
