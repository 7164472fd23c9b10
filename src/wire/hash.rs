//! Content addressing: a canonical hash per item and a chained hash per prefix.
//!
//! The canonical form sorts object keys, so two serialisations of the same
//! item (key order, whitespace) hash alike; any change of content does not.

use std::io::Write;

use serde_json::Value;

/// A 32-byte BLAKE3 digest.
pub type ItemHash = [u8; 32];

/// Hash of one item's canonical JSON.
pub fn item_hash(item: &Value) -> ItemHash {
    let mut h = blake3::Hasher::new();
    write_canonical(&mut h, item);
    *h.finalize().as_bytes()
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

fn write_canonical(h: &mut blake3::Hasher, v: &Value) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_unstable();
            h.update(b"{");
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                write_scalar(h, &Value::String(k.clone()));
                h.update(b":");
                write_canonical(h, &map[k]);
            }
            h.update(b"}");
        }
        Value::Array(items) => {
            h.update(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                write_canonical(h, item);
            }
            h.update(b"]");
        }
        scalar => write_scalar(h, scalar),
    }
}

fn write_scalar(h: &mut blake3::Hasher, v: &Value) {
    // Writing into a hasher cannot fail.
    let _ = serde_json::to_writer(&mut *h, v);
    let _ = h.flush();
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
