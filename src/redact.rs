//! Credentials out of text bound for a log, a record or a relayed error.
//!
//! An upstream that refuses a key often quotes it in its error body, and
//! some echo the request's headers; that text is recorded with the
//! exchange and shown by `conversations export`. [`redact`] is the one
//! function every such path calls: it removes the credentials of the
//! request at hand (whatever header and scheme spelling carried them), the
//! server's own key, and anything shaped like a credential.

use std::borrow::Cow;
use std::sync::OnceLock;

use http::HeaderMap;
use regex::Regex;

/// The headers a client may authenticate with (all of them name its
/// tenant, and all are kept for the summarizer's calls).
pub const CREDENTIAL_HEADERS: [&str; 4] =
    ["authorization", "api-key", "x-api-key", "x-goog-api-key"];

/// What a credential is replaced with.
pub const REDACTED: &str = "[REDACTED]";

/// Shorter values are not searched for by value: they would match ordinary
/// words, and no real key is that short.
const MIN_SECRET_LEN: usize = 8;

/// `text` without the credentials of `credentials` (request headers; only
/// [`CREDENTIAL_HEADERS`] are read), without `server_key`, and without
/// anything shaped like a credential (`Bearer …`, `sk-…`, `api-key: …`).
pub fn redact<'a>(
    text: &'a str,
    credentials: &HeaderMap,
    server_key: Option<&str>,
) -> Cow<'a, str> {
    let mut secrets: Vec<&str> = Vec::new();
    for name in CREDENTIAL_HEADERS {
        for value in credentials.get_all(name) {
            let Ok(value) = value.to_str() else { continue };
            let value = value.trim();
            secrets.push(value);
            // `Bearer k`, `bearer k`, `BEARER k`, `Token k`: the key alone
            // is what an upstream quotes.
            if let Some((_, token)) = value.split_once(char::is_whitespace) {
                secrets.push(token.trim());
            }
        }
    }
    secrets.extend(server_key);
    secrets.retain(|s| s.len() >= MIN_SECRET_LEN);
    // The longest first: a value that contains a shorter one goes whole.
    secrets.sort_unstable_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = Cow::Borrowed(text);
    for secret in secrets {
        if out.contains(secret) {
            out = Cow::Owned(out.replace(secret, REDACTED));
        }
    }
    for (pattern, with) in shapes() {
        if pattern.is_match(&out) {
            out = Cow::Owned(pattern.replace_all(&out, *with).into_owned());
        }
    }
    out
}

/// Credential shapes, for keys that are not the request's own (another
/// request's, quoted back by a confused upstream, or a key in a header the
/// proxy does not know).
fn shapes() -> &'static [(Regex, &'static str)] {
    static SHAPES: OnceLock<Vec<(Regex, &'static str)>> = OnceLock::new();
    SHAPES.get_or_init(|| {
        [
            // An authorization scheme and its token, any case.
            (
                r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{8,}",
                "$1$2[REDACTED]",
            ),
            // OpenAI-style secret keys (`sk-…`, `sk-proj-…`).
            (r"\bsk-[A-Za-z0-9_-]{8,}", REDACTED),
            // A key header quoted as `name: value` or `"name":"value"`.
            (
                r#"(?i)\b((?:x-)?api[-_]key"?\s*[:=]\s*"?)[^\s",;}]{8,}"#,
                "$1[REDACTED]",
            ),
        ]
        .into_iter()
        // The patterns are constants: a failure is caught by the tests.
        .filter_map(|(p, with)| Regex::new(p).ok().map(|r| (r, with)))
        .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn every_shape_compiles() {
        assert_eq!(shapes().len(), 3);
    }

    #[test]
    fn the_requests_credentials_go_whatever_their_spelling() {
        let key = "k3y-0f-the-client-9f8e";
        for auth in [
            ("authorization", format!("Bearer {key}")),
            ("authorization", format!("bearer {key}")),
            ("authorization", format!("BEARER  {key}")),
            ("authorization", key.to_string()),
            ("api-key", key.to_string()),
            ("x-api-key", key.to_string()),
            ("x-goog-api-key", key.to_string()),
            ("Api-Key", key.to_string()),
        ] {
            let h = headers(&[(auth.0, &auth.1)]);
            let text = format!(
                r#"{{"error":"Incorrect API key provided: {key}. ({})"}}"#,
                auth.1
            );
            let out = redact(&text, &h, None);
            assert!(!out.contains(key), "{auth:?}: {out}");
            assert!(out.contains(REDACTED), "{out}");
        }
    }

    #[test]
    fn the_server_key_and_credential_shapes_go_too() {
        let h = HeaderMap::new();
        let out = redact("refused: srv-own-secret-42", &h, Some("srv-own-secret-42"));
        assert_eq!(out, "refused: [REDACTED]");
        for (text, gone) in [
            ("echo: authorization: bearer abcdefgh12345", "abcdefgh12345"),
            ("key sk-proj-AbCdEf0123456789 invalid", "AbCdEf0123456789"),
            (r#"{"x-api-key":"zzzzzzzzzzzz"}"#, "zzzzzzzzzzzz"),
            ("api_key=qqqqqqqqqqqq&x=1", "qqqqqqqqqqqq"),
        ] {
            let out = redact(text, &h, None);
            assert!(!out.contains(gone), "{text} -> {out}");
        }
        // Ordinary text stays as it is, and is not copied.
        let plain = "This model's maximum context length is 128000 tokens.";
        assert!(matches!(redact(plain, &h, Some("short")), Cow::Borrowed(_)));
        // A key shorter than the minimum is not searched for by value.
        assert_eq!(
            redact("a b c", &headers(&[("api-key", "b")]), None),
            "a b c"
        );
    }
}
