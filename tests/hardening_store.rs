//! The store against hostile input and unlucky operators: items with no
//! canonical form, credentials in upstream errors, a corrupted journal,
//! a second server on the same store under another name.

mod support;

use compactor::config::Config;
use compactor::fake_upstream::Reply;
use compactor::store::sqlite::{item_body, request_item_hashes};
use serde_json::json;
use support::{post_raw, within, Harness};

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

/// An upstream that quotes the key it refused: with a lowercase scheme,
/// `api-key` or `x-api-key`, the key used to be stored in the exchange's
/// error and shown by `conversations export`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_quoted_by_the_upstream_are_never_stored() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let cases = [
        ("authorization", "bearer sk-lowercase-scheme-0123456789"),
        ("authorization", "BEARER sk-upper-scheme-0123456789"),
        ("api-key", "azure-style-key-0123456789abcdef"),
        ("x-api-key", "anthropic-style-key-0123456789"),
    ];
    let client = support::client();
    for (header, value) in cases {
        let key = value.rsplit(' ').next().unwrap();
        h.fake.push(Reply::json(
            401,
            json!({"error": {"message": format!("Incorrect API key provided: {key}. You sent `{header}: {value}`."),
                             "type": "invalid_request_error", "code": "invalid_api_key"}}),
        ));
        let resp = within(
            client
                .post(&url)
                .header(header, value)
                .json(&json!({"model": "m", "messages": [{"role": "user", "content": header}]}))
                .send(),
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 401);
        let conversation = conversation_of(resp.headers());
        within(resp.bytes()).await.unwrap();

        let db = h.db();
        let errors: Vec<String> = {
            let mut stmt = db
                .prepare("SELECT error FROM exchanges WHERE error IS NOT NULL")
                .unwrap();
            let rows = stmt.query_map([], |r| r.get(0)).unwrap();
            rows.collect::<Result<_, _>>().unwrap()
        };
        assert!(!errors.is_empty());
        for e in &errors {
            assert!(!e.contains(key), "{header}: stored {e}");
        }
        let export = compactor::store::query::export(&db, &Config::default(), &conversation)
            .expect("export");
        let shown = serde_json::to_string(&export).unwrap();
        assert!(shown.contains("[REDACTED]"), "{shown}");
        assert!(!shown.contains(key), "{header}: exported {shown}");
    }
}

/// The server's own key (`upstream.api_key_env`) quoted in an upstream
/// error: not relayed to the client, who never had it, nor stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_own_key_is_not_relayed_or_stored() {
    const VAR: &str = "COMPACTOR_HARDENING_STORE_TEST_KEY";
    const KEY: &str = "server-side-secret-abcdef0123";
    // Only this test reads the variable.
    std::env::set_var(VAR, KEY);
    let h = Harness::start_with(|c| c.upstream.api_key_env = VAR.into()).await;
    h.fake.push(Reply::json(
        401,
        json!({"error": {"message": format!("Incorrect API key provided: {KEY}"),
                         "type": "invalid_request_error", "code": "invalid_api_key"}}),
    ));
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let url = format!("{}/chat/completions", h.url());
    let (status, _, answer) =
        post_raw(&url, "client-key", serde_json::to_vec(&body).unwrap()).await;
    assert_eq!(status, 401);
    let answer = String::from_utf8_lossy(&answer);
    assert!(!answer.contains(KEY), "relayed: {answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).expect("still JSON");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let error: String = h
        .db()
        .query_row("SELECT error FROM exchanges", [], |r| r.get(0))
        .unwrap();
    assert!(!error.contains(KEY), "stored: {error}");
}
