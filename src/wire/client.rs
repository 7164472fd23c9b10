//! What a client says of itself in a request: its credential, the ids it
//! sent for its conversation ([`ClientIds`]) and the explicit conversation
//! key they make ([`explicit_conversation_key`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::messages;

/// What a client's credential header holds, if any: the first of
/// [`crate::redact::CREDENTIAL_HEADERS`] it sent (`Authorization`,
/// `api-key`, `x-api-key`).
pub fn credential(headers: &http::HeaderMap) -> Option<&[u8]> {
    crate::redact::CREDENTIAL_HEADERS
        .iter()
        .find_map(|name| headers.get(*name))
        .map(|v| v.as_bytes())
}

/// The ids a client sent for its conversation, each as sent (cut to
/// `MAX_CLIENT_ID_CHARS`): what people call the conversation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientIds {
    /// Our `x-compactor-conversation` header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A `session-id` / `session_id` header (Codex sends one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The body's `prompt_cache_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<String>,
}

impl ClientIds {
    /// The distinct ids, in the order [`ClientIds`] lists them.
    pub fn distinct(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for id in [&self.header, &self.session, &self.cache_key]
            .into_iter()
            .flatten()
        {
            if !out.contains(&id.as_str()) {
                out.push(id);
            }
        }
        out
    }
}

/// Most characters kept of each client-sent id.
pub const MAX_CLIENT_ID_CHARS: usize = 200;

/// The ids a client sent for its conversation: our header, a session
/// header (Codex's `session-id`), the body's `prompt_cache_key`; each cut to
/// [`MAX_CLIENT_ID_CHARS`].
pub fn client_ids(headers: &http::HeaderMap, body: &Value) -> ClientIds {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    let bounded = |s: &str| Some(bounded_text(s, MAX_CLIENT_ID_CHARS));
    ClientIds {
        header: text("x-compactor-conversation").and_then(bounded),
        session: SESSION_HEADERS
            .into_iter()
            .find_map(text)
            .map(String::from)
            .or_else(|| messages::metadata_session(body))
            .as_deref()
            .and_then(bounded),
        cache_key: body
            .get("prompt_cache_key")
            .and_then(Value::as_str)
            .filter(|k| !k.trim().is_empty())
            .and_then(bounded),
    }
}

/// `s` cut to at most `max` characters (with an ellipsis when cut).
pub fn bounded_text(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        None => s.to_string(),
        Some((at, _)) => {
            let mut out = s[..at].to_string();
            out.push('…');
            out
        }
    }
}

/// The headers that carry a client's session id: Codex's `session-id`
/// (or `session_id`), Claude Code's `x-claude-code-session-id`.
pub const SESSION_HEADERS: [&str; 3] = ["session-id", "session_id", "x-claude-code-session-id"];

/// An explicit conversation key the client sent, in order of preference:
/// our own header, a session header ([`SESSION_HEADERS`]),
/// `prompt_cache_key`, then `metadata.session_id`/`metadata.conversation_id`
/// or the session in Claude Code's `metadata.user_id`. Every session id
/// shares one namespace, so a client that sends it in two places is one
/// conversation. A key longer than [`MAX_KEY_BYTES`] stands as a hash of
/// itself in a namespace of its own (`…#blake3:`), so that any length a
/// client sends names one conversation and fits every store's index.
pub fn explicit_conversation_key(headers: &http::HeaderMap, body: &Value) -> Option<String> {
    let key = client_conversation_key(headers, body)?;
    if key.len() <= MAX_KEY_BYTES {
        return Some(key);
    }
    let (ns, _) = key.split_once(':').unwrap_or(("key", ""));
    let digest = blake3::hash(key.as_bytes());
    Some(format!("{ns}#blake3:{}", digest.to_hex()))
}

/// The longest explicit conversation key kept as the client sent it
/// (PostgreSQL's B-tree index takes about 2,700 bytes a row).
pub const MAX_KEY_BYTES: usize = 512;

fn client_conversation_key(headers: &http::HeaderMap, body: &Value) -> Option<String> {
    let header = |name: &str| {
        headers
            .get(name)
            // Any UTF-8 id: `to_str` takes visible ASCII only.
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
            .filter(|v| !v.is_empty())
    };
    if let Some(v) = header("x-compactor-conversation") {
        return Some(format!("x-compactor-conversation:{v}"));
    }
    for name in SESSION_HEADERS {
        if let Some(v) = header(name) {
            // `session_id` keeps the key it always had.
            let ns = if name == "session_id" {
                name
            } else {
                "session-id"
            };
            return Some(format!("{ns}:{v}"));
        }
    }
    if let Some(k) = body.get("prompt_cache_key").and_then(Value::as_str) {
        // Codex sends the same value as its `session-id` header; keep one namespace.
        return Some(format!("session-id:{k}"));
    }
    let meta = body.get("metadata")?;
    for key in ["session_id", "conversation_id"] {
        if let Some(v) = meta.get(key).and_then(Value::as_str) {
            return Some(format!("session-id:{v}"));
        }
    }
    messages::metadata_session(body).map(|v| format!("session-id:{v}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_long_explicit_key_is_one_bounded_key() {
        let long = "k".repeat(12_000);
        let body = json!({"prompt_cache_key": long});
        let key = explicit_conversation_key(&http::HeaderMap::new(), &body).unwrap();
        assert!(key.len() <= MAX_KEY_BYTES, "{}", key.len());
        assert!(key.starts_with("session-id#blake3:"), "{key}");
        assert_eq!(
            explicit_conversation_key(&http::HeaderMap::new(), &body),
            Some(key.clone()),
            "the same key every time"
        );
        let other = json!({"prompt_cache_key": format!("{long}x")});
        assert_ne!(
            explicit_conversation_key(&http::HeaderMap::new(), &other),
            Some(key)
        );
        let short = json!({"prompt_cache_key": "abc"});
        assert_eq!(
            explicit_conversation_key(&http::HeaderMap::new(), &short).as_deref(),
            Some("session-id:abc")
        );
    }

    #[test]
    fn explicit_keys_share_a_namespace() {
        let mut h = http::HeaderMap::new();
        h.insert("session-id", "abc".parse().unwrap());
        let body = json!({"prompt_cache_key": "abc"});
        assert_eq!(
            explicit_conversation_key(&h, &json!({})),
            explicit_conversation_key(&http::HeaderMap::new(), &body)
        );
    }
}
