//! Per-request control: the mode a request is served in, from the
//! configuration (`compaction.mode`, a `[[models]]` or `[[tenants]]`
//! entry) and, when `server.client_control` allows it, from the client:
//!
//! - `x-compactor-mode: auto | observe | off`, or the same as the request's
//!   `metadata.compactor_mode` (the header wins);
//! - `x-compactor-compact: now`: compact this request (auto mode).
//!
//! Both headers are removed before the request goes upstream (see
//! [`crate::upstream::Upstream::request_headers`]), and so is the metadata
//! key: the whole `metadata` object when the key was all it held (the
//! client added it for the proxy alone), the key only otherwise. The
//! upstream never sees either. A value the proxy does not know is refused
//! with 400, naming it; a client whose config forbids control is ignored,
//! with a log line.

use http::HeaderMap;
use serde_json::Value;

use crate::config::{Config, Mode};
use crate::error::{InvalidField, ProxyError};
use crate::wire::RawMembers;

/// Request header choosing the request's mode.
pub const MODE_HEADER: &str = "x-compactor-mode";
/// Request header asking for this request to be compacted.
pub const COMPACT_HEADER: &str = "x-compactor-compact";
/// Request header naming the request's conversation.
pub const CONVERSATION_HEADER: &str = "x-compactor-conversation";
/// The `metadata` key choosing the request's mode.
pub const MODE_METADATA: &str = "compactor_mode";

/// How one request is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Control {
    /// Its mode.
    pub mode: Mode,
    /// The client asked for it to be compacted now.
    pub compact_now: bool,
}

/// The request's control, and whether `body` changed (its metadata key
/// taken out).
pub fn control(
    config: &Config,
    headers: &HeaderMap,
    body: &mut Value,
    tenant: &str,
    model: &str,
) -> Result<(Control, bool), ProxyError> {
    // A conversation id is any UTF-8 text; bytes that are not would be
    // ignored, and the request filed under another conversation.
    if let Some(v) = headers.get(CONVERSATION_HEADER) {
        if std::str::from_utf8(v.as_bytes()).is_err() {
            return Err(ProxyError::InvalidRequest(InvalidField {
                param: Some(CONVERSATION_HEADER.to_string()),
                code: "invalid_value",
                message: format!("the {CONVERSATION_HEADER} header is not UTF-8 text"),
            }));
        }
    }
    let configured = Control {
        mode: config.mode_for(tenant, model),
        compact_now: false,
    };
    let metadata = take_metadata_mode(body);
    let changed = metadata.is_some();
    let header = |name: &str| {
        headers
            .get(name)
            .map(|v| v.to_str().map(str::to_string).unwrap_or_default())
    };
    let (mode_header, compact_header) = (header(MODE_HEADER), header(COMPACT_HEADER));
    let asked = mode_header.clone().or(metadata.clone());
    if asked.is_none() && compact_header.is_none() {
        return Ok((configured, changed));
    }
    if !config.server.client_control {
        tracing::warn!(
            mode = asked.as_deref().unwrap_or(""),
            compact = compact_header.as_deref().unwrap_or(""),
            "client control ignored: server.client_control is false"
        );
        return Ok((configured, changed));
    }
    let bad = |what: &str, value: &str, allowed: &str| {
        ProxyError::InvalidRequest(InvalidField {
            param: Some(what.to_string()),
            code: "invalid_value",
            message: format!("{what} is {value:?}; it must be one of {allowed}"),
        })
    };
    let mode = match (&mode_header, &metadata) {
        (Some(v), _) => {
            Mode::parse(v).ok_or_else(|| bad(MODE_HEADER, v, "auto, observe, off, manual"))?
        }
        (None, Some(v)) => Mode::parse(v)
            .ok_or_else(|| bad("metadata.compactor_mode", v, "auto, observe, off, manual"))?,
        (None, None) => configured.mode,
    };
    let compact_now = match compact_header.as_deref() {
        None => false,
        Some(v) if v.trim().eq_ignore_ascii_case("now") => true,
        Some(v) => return Err(bad(COMPACT_HEADER, v, "now")),
    };
    if compact_now && !mode.rewrites() {
        tracing::info!(
            mode = mode.as_str(),
            "x-compactor-compact ignored: the request is not in auto or manual mode"
        );
    }
    Ok((
        Control {
            mode,
            compact_now: compact_now && mode.rewrites(),
        },
        changed,
    ))
}

/// Takes `metadata.compactor_mode` out of `body` (the whole `metadata`
/// when nothing else is in it) and returns it; a value that is not a
/// string is taken out too, and reads as an empty (unknown) mode.
fn take_metadata_mode(body: &mut Value) -> Option<String> {
    let metadata = body.get_mut("metadata")?.as_object_mut()?;
    let value = metadata.remove(MODE_METADATA)?;
    if metadata.is_empty() {
        if let Some(obj) = body.as_object_mut() {
            obj.remove("metadata");
        }
    }
    Some(value.as_str().unwrap_or_default().to_string())
}

/// The header Codex describes each request's turn with (JSON).
pub const CODEX_TURN_METADATA: &str = "x-codex-turn-metadata";

/// Whether the request is the client's own compaction of its history
/// (Codex marks it `request_kind: compaction` in its turn metadata): a
/// summary the client asks the model for, which must not be summarized
/// again by the proxy.
pub fn is_client_compaction(headers: &HeaderMap) -> bool {
    headers
        .get(CODEX_TURN_METADATA)
        .and_then(|v| serde_json::from_slice::<Value>(v.as_bytes()).ok())
        .is_some_and(|m| m.get("request_kind").and_then(Value::as_str) == Some("compaction"))
}

/// The client's bytes without `metadata.compactor_mode` (and without
/// `metadata` when that key was all it held), every other byte as the
/// client sent it: re-serialising the whole body instead would rewrite
/// numbers beyond 64 bits, escapes and spellings of the rest. `None` when
/// the bytes do not hold exactly one such key where [`control`] took it
/// from (the body is then rebuilt from its parsed form).
pub fn splice_metadata_mode(raw: &[u8]) -> Option<bytes::Bytes> {
    let text = std::str::from_utf8(raw).ok()?;
    let top: RawMembers = serde_json::from_str(text).ok()?;
    let (at, metadata) = only(&top.0, "metadata")?;
    let inner: RawMembers = serde_json::from_str(metadata.get()).ok()?;
    only(&inner.0, MODE_METADATA)?;
    let cut = if inner.0.len() == 1 {
        member_span(text, &top.0, at)?
    } else {
        let (i, _) = only(&inner.0, MODE_METADATA)?;
        let base = offset(text, metadata.get());
        let (a, b) = member_span(metadata.get(), &inner.0, i)?;
        (base + a, base + b)
    };
    let mut out = Vec::with_capacity(raw.len());
    out.extend_from_slice(&raw[..cut.0]);
    out.extend_from_slice(&raw[cut.1..]);
    Some(out.into())
}

/// The one member named `key`, with its index; `None` when there is none
/// or several (which one a parser keeps is its own choice).
fn only<'r>(
    members: &[(String, &'r serde_json::value::RawValue)],
    key: &str,
) -> Option<(usize, &'r serde_json::value::RawValue)> {
    let mut found = members.iter().enumerate().filter(|(_, (k, _))| k == key);
    let (i, (_, v)) = found.next()?;
    found.next().is_none().then_some((i, *v))
}

/// Where `part`, a slice of `whole`, starts in it.
fn offset(whole: &str, part: &str) -> usize {
    part.as_ptr() as usize - whole.as_ptr() as usize
}

/// The byte range of `object` to cut to remove its member `i`: from the
/// end of the member before it through its value, or for the first member
/// from the opening brace through the comma after its value (through the
/// value when it is the only one).
fn member_span(
    object: &str,
    members: &[(String, &serde_json::value::RawValue)],
    i: usize,
) -> Option<(usize, usize)> {
    let value = members.get(i)?.1.get();
    let end = offset(object, value) + value.len();
    if i > 0 {
        let prev = members[i - 1].1.get();
        return Some((offset(object, prev) + prev.len(), end));
    }
    let open = object.find('{')? + 1;
    if members.len() == 1 {
        return Some((open, end));
    }
    let rest = &object[end..];
    let comma = rest.find(|c: char| !c.is_ascii_whitespace())?;
    (rest.as_bytes()[comma] == b',').then_some((open, end + comma + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(
        config: &Config,
        headers: &[(&str, &str)],
        body: &mut Value,
    ) -> Result<(Control, bool), ProxyError> {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        control(config, &h, body, "tenant", "gpt-4o")
    }

    #[test]
    fn the_metadata_key_is_spliced_out_of_the_client_bytes() {
        let cases = [
            (
                r#"{"model":"m","metadata":{"compactor_mode":"off"},"n":123456789012345678901234567890}"#,
                r#"{"model":"m","n":123456789012345678901234567890}"#,
            ),
            (
                r#"{"metadata": {"compactor_mode": "off"}, "model": "mé"}"#,
                r#"{ "model": "mé"}"#,
            ),
            (
                r#"{"model":"m","metadata":{"a":"A","compactor_mode":"observe"}}"#,
                r#"{"model":"m","metadata":{"a":"A"}}"#,
            ),
            (
                r#"{"model":"m","metadata":{ "compactor_mode" : "off" , "b":1.50}}"#,
                r#"{"model":"m","metadata":{ "b":1.50}}"#,
            ),
        ];
        for (raw, want) in cases {
            let got = splice_metadata_mode(raw.as_bytes()).expect(raw);
            assert_eq!(std::str::from_utf8(&got).unwrap(), want);
        }
        for raw in [
            r#"{"model":"m"}"#,
            r#"{"metadata":{"compactor_mode":"off","compactor_mode":"on"}}"#,
            r#"{"metadata":1,"metadata":{"compactor_mode":"off"}}"#,
            "not json",
        ] {
            assert!(splice_metadata_mode(raw.as_bytes()).is_none(), "{raw}");
        }
    }

    #[test]
    fn the_header_wins_then_metadata_then_the_config() {
        let c = Config::default();
        let mut body = json!({"model": "gpt-4o"});
        let (got, changed) = run(&c, &[], &mut body).unwrap();
        assert_eq!(
            (got.mode, got.compact_now, changed),
            (Mode::Auto, false, false)
        );
        let (got, _) = run(&c, &[(MODE_HEADER, "Observe")], &mut body).unwrap();
        assert_eq!(got.mode, Mode::Observe);
        let mut body = json!({"metadata": {"compactor_mode": "off"}});
        let (got, changed) = run(&c, &[], &mut body).unwrap();
        assert_eq!((got.mode, changed), (Mode::Off, true));
        assert_eq!(body, json!({}), "metadata held only the proxy's key");
        let mut body = json!({"metadata": {"compactor_mode": "off", "user": "u1"}});
        let (got, _) = run(&c, &[(MODE_HEADER, "auto")], &mut body).unwrap();
        assert_eq!(got.mode, Mode::Auto);
        assert_eq!(
            body,
            json!({"metadata": {"user": "u1"}}),
            "the client's own metadata stays"
        );
        let (got, _) = run(&c, &[(COMPACT_HEADER, "now")], &mut json!({})).unwrap();
        assert!(got.compact_now);
        let (got, _) = run(
            &c,
            &[(COMPACT_HEADER, "now"), (MODE_HEADER, "off")],
            &mut json!({}),
        )
        .unwrap();
        assert!(!got.compact_now, "only auto compacts");
    }

    #[test]
    fn unknown_values_are_refused_and_forbidden_control_ignored() {
        let c = Config::default();
        let err = run(&c, &[(MODE_HEADER, "sometimes")], &mut json!({})).unwrap_err();
        assert_eq!(err.status(), http::StatusCode::BAD_REQUEST);
        assert!(err.to_string().contains(MODE_HEADER), "{err}");
        assert!(run(&c, &[(COMPACT_HEADER, "later")], &mut json!({})).is_err());
        let mut strict = Config::default();
        strict.server.client_control = false;
        strict.compaction.mode = Mode::Observe;
        let mut body = json!({"metadata": {"compactor_mode": "off"}});
        let (got, changed) = run(
            &strict,
            &[(MODE_HEADER, "sometimes"), (COMPACT_HEADER, "now")],
            &mut body,
        )
        .unwrap();
        assert_eq!((got.mode, got.compact_now), (Mode::Observe, false));
        assert!(changed && body == json!({}), "the key never goes upstream");
    }
}
