//! Ids and the clock: what every layer stamps on what it creates.
//!
//! A leaf module (it imports nothing of the crate), so the store, the
//! engine and the server can all name an id or a time without naming each
//! other.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A new conversation id: unpredictable and unique, without a system call
/// per id (a keyed hash of a counter, under a key drawn once per process).
pub fn new_conversation_id() -> String {
    format!("conv_{}", unique_hex())
}

/// A new compaction id, drawn from the same sequence as conversation ids.
pub fn new_compaction_id() -> String {
    format!("cmp_{}", unique_hex())
}

/// A new id for a response the proxy answers itself (a WebSocket's
/// warm-up), from the same sequence.
pub fn new_response_id() -> String {
    format!("resp_{}", unique_hex())
}

/// 24 hex digits, distinct for every call in the process and unguessable
/// across processes. The key is process-wide on purpose: uniqueness needs
/// one counter, and an id carries no tenant state.
fn unique_hex() -> String {
    static KEY: OnceLock<[u8; 32]> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let key = KEY.get_or_init(|| {
        let mut k = [0u8; 32];
        if getrandom::fill(&mut k).is_err() {
            // Fall back to time: ids need to be unique, not secret.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            k[..16].copy_from_slice(&t.to_le_bytes());
        }
        k
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let h = blake3::keyed_hash(key, &n.to_le_bytes());
    h.to_hex()[..24].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversation_ids_are_distinct_hex() {
        let ids: std::collections::HashSet<String> =
            (0..10_000).map(|_| new_conversation_id()).collect();
        assert_eq!(ids.len(), 10_000);
        for id in ids.iter().take(100) {
            let hex = id.strip_prefix("conv_").expect("prefixed");
            assert_eq!(hex.len(), 24);
            assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
    }

    #[test]
    fn compaction_ids_share_the_sequence() {
        let a = new_compaction_id();
        let b = new_compaction_id();
        assert_ne!(a, b);
        assert_eq!(a.strip_prefix("cmp_").map(str::len), Some(24));
    }
}
