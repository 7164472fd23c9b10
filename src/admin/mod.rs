//! The admin page and JSON API under `/admin/`: the conversation list, each
//! conversation's timeline and export, and manual compaction.
//!
//! Access ([`authorize`]): loopback clients of a loopback listener may use
//! it without a token; a proxy listening on any other address answers only
//! requests carrying the token named by `[admin] token_env`. Requests from a
//! browser on another origin are refused, and so are host names other than
//! `localhost` without a token (DNS rebinding). Refusals are 403s with an
//! OpenAI-style JSON error.
//!
//! Routes (JSON unless noted):
//!
//! - `GET /admin/` — the page (HTML, inline JS/SVG)
//! - `GET /admin/api/conversations?limit=N` — the list, most recent first
//! - `GET /admin/api/conversations/ID` — timeline: exchanges and compactions
//!   (ID: the conversation id, an id its client sent, or an abbreviation)
//! - `GET /admin/api/conversations/ID/export` — items, rewritten view, compactions, archived outputs
//! - `POST /admin/api/conversations/ID/compact` — compact the conversation's next request;
//!   `GET` the same — the latest attempt's outcome
//! - `GET /admin/api/conversations/ID/attempts` — recent compaction attempts, discarded ones included
//! - `DELETE /admin/api/conversations/ID` — delete it, its exchanges, compactions and the items nothing else refers to
//! - `POST /admin/api/prune?older_than_secs=N` — delete conversations last seen longer ago, then unreferenced items, then VACUUM
//! - `GET /admin/api/savings` — tokens (and money) saved, per conversation, per tenant, in total

mod api;

pub use api::{retention_loop, RETENTION_EVERY};

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use subtle::ConstantTimeEq;

use crate::app::AppState;
use crate::error::{full, ProxyBody, ProxyError};

/// Header carrying the admin token (alternative to `Authorization: Bearer`).
pub const TOKEN_HEADER: &str = "x-compactor-admin-token";

/// The page, embedded at build time (no front-end build step).
const PAGE: &str = include_str!("page.html");

/// Why an admin request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// The proxy listens on a non-loopback address (or the client is not
    /// local) and the request carries no token.
    TokenRequired,
    /// The request carries a token that is not the configured one.
    BadToken,
    /// Same as `TokenRequired`, but no token is configured at all.
    NoTokenConfigured,
    /// A browser page of another origin sent the request.
    CrossOrigin,
    /// A host name other than `localhost` or a loopback address, without a token.
    ForeignHost,
}

impl Denial {
    /// The `code` of the JSON error.
    pub fn code(self) -> &'static str {
        match self {
            Denial::TokenRequired => "admin_token_required",
            Denial::BadToken => "admin_token_invalid",
            Denial::NoTokenConfigured => "admin_loopback_only",
            Denial::CrossOrigin => "admin_cross_origin",
            Denial::ForeignHost => "admin_foreign_host",
        }
    }

    /// What the client is told.
    pub fn message(self) -> &'static str {
        match self {
            Denial::TokenRequired => "the admin API needs the admin token here: send `Authorization: Bearer <token>` or `x-compactor-admin-token`",
            Denial::BadToken => "the admin token is not valid",
            Denial::NoTokenConfigured => "the admin API answers loopback clients of a loopback listener only; set `[admin] token_env` to use it from elsewhere",
            Denial::CrossOrigin => "admin requests from another origin are refused",
            Denial::ForeignHost => "admin requests must address the proxy as localhost or a loopback address (or carry the admin token)",
        }
    }
}

/// What the access decision looks at.
#[derive(Debug, Clone, Copy)]
pub struct AccessRequest<'a> {
    /// The address the proxy is configured to listen on.
    pub listen: SocketAddr,
    /// The client's address.
    pub peer: SocketAddr,
    /// The `Host` header (or HTTP/2 authority), if any.
    pub host: Option<&'a str>,
    /// The `Origin` header, if any (browsers send it on cross-origin and POST requests).
    pub origin: Option<&'a str>,
    /// The token the request carries, if any.
    pub token: Option<&'a str>,
}

/// The access rule: a browser request from another origin is refused; a
/// request with the configured token (`expected`) is allowed from anywhere;
/// without one, only a loopback client of a loopback listener that names
/// the proxy by a loopback host.
pub fn authorize(req: &AccessRequest<'_>, expected: Option<&str>) -> Result<(), Denial> {
    if let (Some(origin), Some(host)) = (req.origin, req.host) {
        let origin_host = origin.split_once("://").map(|(_, rest)| rest).unwrap_or("");
        if !origin_host.eq_ignore_ascii_case(host) {
            return Err(Denial::CrossOrigin);
        }
    }
    if let Some(expected) = expected {
        match req.token {
            Some(t) if bool::from(t.as_bytes().ct_eq(expected.as_bytes())) => return Ok(()),
            Some(_) => return Err(Denial::BadToken),
            None => {}
        }
    }
    let local = is_loopback(req.listen.ip()) && is_loopback(req.peer.ip());
    if local {
        return match req.host {
            Some(h) if !is_loopback_host(h) => Err(Denial::ForeignHost),
            _ => Ok(()),
        };
    }
    Err(if expected.is_some() {
        Denial::TokenRequired
    } else {
        Denial::NoTokenConfigured
    })
}

fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// `localhost`, `*.localhost` or a loopback address, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host)
    };
    let lower = name.to_ascii_lowercase();
    lower == "localhost"
        || lower.ends_with(".localhost")
        || name.parse::<IpAddr>().is_ok_and(is_loopback)
}

/// The token a request carries: `x-compactor-admin-token`, else a bearer
/// `Authorization`.
pub fn presented_token(headers: &HeaderMap) -> Option<&str> {
    if let Some(t) = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok()) {
        return Some(t.trim());
    }
    let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = auth.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// The configured admin token: the value of the variable `[admin] token_env` names.
pub fn expected_token(state: &AppState) -> Option<String> {
    let name = &state.config.admin.token_env;
    if name.is_empty() {
        return None;
    }
    std::env::var(name).ok().filter(|t| !t.is_empty())
}

/// Handles every request under `/admin`.
pub async fn handle(
    state: Arc<AppState>,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    let mut resp = route(state, peer, req).await;
    let h = resp.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    resp
}

async fn route(
    state: Arc<AppState>,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let sub = path.strip_prefix("/admin").unwrap_or("");
    let page = matches!(sub, "" | "/" | "/index.html");

    let expected = expected_token(&state);
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    let access = AccessRequest {
        listen: state
            .config
            .listen_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0))),
        peer,
        host: host.as_deref(),
        origin: req
            .headers()
            .get(header::ORIGIN)
            .and_then(|v| v.to_str().ok()),
        token: presented_token(req.headers()),
    };
    if let Err(denial) = authorize(&access, expected.as_deref()) {
        // The page holds no data; where a token is configured it asks for it
        // and the API checks it.
        let shell_ok = page
            && method == Method::GET
            && matches!(denial, Denial::TokenRequired | Denial::BadToken);
        if !shell_ok {
            tracing::info!(%peer, code = denial.code(), "admin request refused");
            return ProxyError::Forbidden {
                code: denial.code(),
                message: denial.message(),
            }
            .into_response();
        }
    }

    if page {
        return match (method == Method::GET || method == Method::HEAD, sub) {
            (false, _) => method_not_allowed("GET"),
            (true, "") => {
                let mut r = Response::new(full(""));
                *r.status_mut() = StatusCode::PERMANENT_REDIRECT;
                r.headers_mut()
                    .insert(header::LOCATION, HeaderValue::from_static("/admin/"));
                r
            }
            (true, _) => html(PAGE),
        };
    }

    if sub == "/api/windows" {
        // Each model's effective window and where it came from.
        return match method {
            Method::GET => {
                let models: Vec<serde_json::Value> = state
                    .models_seen()
                    .into_iter()
                    .map(|(model, window, source)| {
                        serde_json::json!({"model": model, "context_window": window, "source": source})
                    })
                    .collect();
                crate::error::json_response(StatusCode::OK, &serde_json::json!({"models": models}))
            }
            _ => method_not_allowed("GET"),
        };
    }
    if sub == "/api/prune" {
        return match method {
            Method::POST => match query_param(req.uri().query(), "older_than_secs")
                .and_then(|v| v.parse().ok())
            {
                Some(secs) => api::prune(state, secs).await,
                None => ProxyError::from(crate::error::InvalidField::missing_query(
                    "older_than_secs",
                    "prune needs older_than_secs=N (conversations last seen longer ago go)",
                ))
                .into_response(),
            },
            _ => method_not_allowed("POST"),
        };
    }
    if sub == "/api/savings" {
        return match method {
            Method::GET => api::savings(state).await,
            _ => method_not_allowed("GET"),
        };
    }
    let Some(api_path) = sub.strip_prefix("/api/conversations") else {
        return not_found(&method, &path);
    };
    // A conversation is named by its id or by an id its client sent,
    // which may hold any character (percent-encoded in the path).
    let decoded: Vec<String> = api_path
        .split('/')
        .skip(1)
        .map(|p| {
            percent_encoding::percent_decode_str(p)
                .decode_utf8_lossy()
                .into_owned()
        })
        .collect();
    let parts: Vec<&str> = decoded.iter().map(String::as_str).collect();
    match parts.as_slice() {
        [] | [""] => match method {
            Method::GET => {
                let limit = query_param(req.uri().query(), "limit")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(api::DEFAULT_LIMIT);
                api::list(state, limit).await
            }
            _ => method_not_allowed("GET"),
        },
        [id] if valid_id(id) => match method {
            Method::GET => api::show(state, id.to_string()).await,
            Method::DELETE => api::delete(state, id.to_string()).await,
            _ => method_not_allowed("GET, DELETE"),
        },
        [id, "export"] if valid_id(id) => match method {
            Method::GET => api::export(state, id.to_string()).await,
            _ => method_not_allowed("GET"),
        },
        [id, "compact"] if valid_id(id) => match method {
            Method::POST => api::compact(state, id.to_string()).await,
            Method::GET => api::compact_status(state, id.to_string()).await,
            _ => method_not_allowed("GET, POST"),
        },
        [id, "attempts"] if valid_id(id) => match method {
            Method::GET => api::attempts(state, id.to_string()).await,
            _ => method_not_allowed("GET"),
        },
        _ => not_found(&method, &path),
    }
}

/// A name a conversation may go by: its id or a client's (bounded as the
/// store bounds those), without control characters.
fn valid_id(id: &str) -> bool {
    !id.trim().is_empty()
        && id.chars().count() <= crate::store::MAX_CLIENT_ID_CHARS
        && !id.chars().any(char::is_control)
}

fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

fn not_found(method: &Method, path: &str) -> Response<ProxyBody> {
    ProxyError::NotFound {
        method: method.to_string(),
        path: path.to_string(),
    }
    .into_response()
}

fn method_not_allowed(allow: &'static str) -> Response<ProxyBody> {
    ProxyError::MethodNotAllowed { allow }.into_response()
}

fn html(page: &'static str) -> Response<ProxyBody> {
    let mut r = Response::new(full(page));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:",
        ),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(listen: &str, peer: &str, host: Option<&'a str>) -> AccessRequest<'a> {
        AccessRequest {
            listen: listen.parse().unwrap(),
            peer: peer.parse().unwrap(),
            host,
            origin: None,
            token: None,
        }
    }

    #[test]
    fn hosts() {
        for h in [
            "localhost",
            "localhost:8787",
            "127.0.0.1:1",
            "[::1]:8787",
            "a.localhost",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "evil.example:8787",
            "10.0.0.1:80",
            "[2001:db8::1]:1",
            "localhost.evil",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn mapped_loopback_peer_is_loopback() {
        let r = req("[::]:8787", "[::ffff:127.0.0.1]:5000", None);
        assert!(is_loopback(r.peer.ip()));
        assert_eq!(authorize(&r, None), Err(Denial::NoTokenConfigured));
    }
}
