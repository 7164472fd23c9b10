//! Content addressing: a canonical hash per item and a chained hash per prefix.
//!
//! The canonical form sorts object keys, so two serialisations of the same
//! item (key order, whitespace) hash alike; any change of content does not.

use std::io::Write;

use serde_json::Value;

/// A 32-byte BLAKE3 digest.
pub type ItemHash = [u8; 32];

/// Hash of one item's canonical form.
pub fn item_hash(item: &Value) -> ItemHash {
    CANONICAL.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.clear();
        write_canonical(&mut buf, item);
        let hash = *blake3::hash(&buf).as_bytes();
        // Keep a moderate buffer for the next item; let a huge one go.
        if buf.capacity() > MAX_KEPT_BUFFER {
            *buf = Vec::new();
        }
        hash
    })
}

/// Largest canonical-form buffer kept between items, bytes.
const MAX_KEPT_BUFFER: usize = 1 << 20;

thread_local! {
    /// Reused per thread: an item's canonical form is built here, then hashed
    /// in one call (hashing many tiny pieces is several times slower).
    static CANONICAL: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `chain[i]` identifies the prefix `items[..=i]`: each link hashes the
/// previous link with the next item's hash, so equal chains mean equal prefixes.
pub fn chain_hashes(items: &[ItemHash]) -> Vec<ItemHash> {
    let mut out = Vec::with_capacity(items.len());
    let mut prev = [0u8; 32];
    for item in items {
        prev = chain_extend(prev, std::slice::from_ref(item));
        out.push(prev);
    }
    out
}

/// The chain hash after appending `items` to the prefix whose chain is `prev`
/// (all zeros for the empty prefix).
pub fn chain_extend(prev: ItemHash, items: &[ItemHash]) -> ItemHash {
    items.iter().fold(prev, |acc, item| {
        let mut h = blake3::Hasher::new();
        h.update(&acc);
        h.update(item);
        *h.finalize().as_bytes()
    })
}

/// Lowercase hex of a hash.
pub fn hex(hash: &ItemHash) -> String {
    blake3::Hash::from_bytes(*hash).to_hex().to_string()
}

/// The canonical form: a type tag per value, strings and numbers
/// length-prefixed as raw bytes (no escaping to do), object keys sorted.
/// Unambiguous, so equal forms mean equal values.
fn write_canonical(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Null => out.push(b'n'),
        Value::Bool(b) => out.push(if *b { b't' } else { b'f' }),
        Value::Number(n) => {
            out.push(b'#');
            // Numbers keep serde_json's canonical text (`1.0` stays `1.0`).
            let mark = out.len();
            out.extend_from_slice(&[0; 8]);
            let _ = write!(out, "{n}");
            let len = (out.len() - mark - 8) as u64;
            out[mark..mark + 8].copy_from_slice(&len.to_le_bytes());
        }
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            out.push(b'[');
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_canonical(out, item);
            }
        }
        Value::Object(map) => {
            out.push(b'{');
            out.extend_from_slice(&(map.len() as u64).to_le_bytes());
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (k, v) in entries {
                write_str(out, k);
                write_canonical(out, v);
            }
        }
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(b's');
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_order_does_not_matter_content_does() {
        let a: Value = serde_json::from_str(r#"{"role":"user","content":"hi"}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{ "content" : "hi", "role": "user" }"#).unwrap();
        assert_eq!(item_hash(&a), item_hash(&b));
        assert_ne!(
            item_hash(&a),
            item_hash(&json!({"role":"user","content":"hi!"}))
        );
        // Structure, not just the characters, is hashed.
        assert_ne!(item_hash(&json!(["a,b"])), item_hash(&json!(["a", "b"])));
    }

    #[test]
    fn chains_identify_prefixes() {
        let items: Vec<ItemHash> = (0..4).map(|i| item_hash(&json!(i))).collect();
        let full = chain_hashes(&items);
        let prefix = chain_hashes(&items[..2]);
        assert_eq!(&full[..2], &prefix[..]);
        let mut swapped = items.clone();
        swapped.swap(0, 1);
        assert_ne!(chain_hashes(&swapped)[3], full[3]);
        assert_eq!(chain_extend(prefix[1], &items[2..]), full[3]);
    }
}
