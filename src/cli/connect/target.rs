//! What `connect` tells a client of this proxy: the proxy's base URL (as an
//! Anthropic client wants it too), the model with its window, and the
//! provider's name; and where a variable says a client keeps its files.

use std::path::PathBuf;

/// The name of the provider (Codex) and the prefix of the model id (llm).
pub(super) const PROVIDER: &str = "compactor";

/// What a client needs to know about this proxy and the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// The proxy's base URL, with `/v1`.
    pub base_url: String,
    /// The model.
    pub model: String,
    /// The window the proxy uses for it, in tokens.
    pub window: u64,
    /// Room for the answer the proxy assumes, in tokens.
    pub max_output: u64,
    /// Whether the proxy compacts this model's conversations (its mode
    /// rewrites them), or only observes them.
    pub proxy_compacts: bool,
}

/// A path the variable `var` names, when it is set and not empty.
pub(super) fn env_dir(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The proxy's address as an Anthropic client wants it: the origin, since
/// the client appends `/v1/messages` itself.
pub fn anthropic_base_url(base_url: &str) -> String {
    base_url.strip_suffix("/v1").unwrap_or(base_url).to_string()
}
