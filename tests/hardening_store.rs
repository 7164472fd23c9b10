//! The store against hostile input and unlucky operators: items with no
//! canonical form, credentials in upstream errors, a corrupted journal,
//! a second server on the same store under another name.

mod support;

use compactor::store::sqlite::{item_body, request_item_hashes};
use support::{post_raw, Harness};

fn conversation_of(headers: &http::HeaderMap) -> String {
    headers
        .get("x-compactor-conversation")
        .and_then(|v| v.to_str().ok())
        .expect("a conversation header")
        .to_string()
}

/// Items that parse to nothing the hash can use (a lone surrogate, nesting
/// past the parser's limit) used to hash as `null`: unrelated requests
/// then joined one conversation, and the store kept the first one's
/// content for all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_without_a_canonical_form_stay_apart_and_as_given() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let deep = |leaf: &str| format!("{}\"{leaf}\"{}", "[".repeat(300), "]".repeat(300));
    let items = [
        r#"{"role":"user","content":"\ud800 first request"}"#.to_string(),
        r#"{"role":"user","content":"\ud800 an unrelated one"}"#.to_string(),
        format!(r#"{{"role":"user","content":{}}}"#, deep("deep one")),
        format!(r#"{{"role":"user","content":{}}}"#, deep("deep two")),
    ];
    let mut seen = Vec::new();
    for item in &items {
        let body = format!(r#"{{"model":"m","messages":[{item}]}}"#);
        let (status, headers, _) = post_raw(&url, "k", body.into_bytes()).await;
        assert_eq!(status, 200);
        seen.push(conversation_of(&headers));
    }
    let distinct: std::collections::HashSet<_> = seen.iter().collect();
    assert_eq!(
        distinct.len(),
        items.len(),
        "one conversation each: {seen:?}"
    );

    let db = h.db();
    let ids: Vec<i64> = {
        let mut stmt = db.prepare("SELECT id FROM exchanges ORDER BY id").unwrap();
        let rows = stmt.query_map([], |r| r.get(0)).unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    };
    assert_eq!(ids.len(), items.len());
    for (id, item) in ids.iter().zip(&items) {
        let hashes = request_item_hashes(&db, *id).unwrap();
        assert_eq!(hashes.len(), 1);
        let stored = item_body(&db, &hashes[0]).unwrap();
        assert_eq!(stored.as_deref(), Some(item.as_str()), "its own bytes");
    }
}
