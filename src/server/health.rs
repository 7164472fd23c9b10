//! `/healthz` and `/readyz`. Liveness says the process serves; readiness
//! says a request would get through: the store takes writes, and the
//! upstream answered lately or answers now.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use serde_json::json;

use crate::app::AppState;
use crate::error::{json_response, ProxyBody};

/// An exchange the upstream answered whole within this long makes it
/// ready without asking it again.
pub const UPSTREAM_RECENT: Duration = Duration::from_secs(60);

/// Longest a readiness probe of the upstream (`GET /v1/models`) may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest the store may take to show its writer is alive.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /healthz`: the process is up and serving.
pub fn healthz() -> http::Response<ProxyBody> {
    json_response(StatusCode::OK, &json!({"status": "ok"}))
}

/// `GET /readyz`: 200 with `"status": "ready"` when the store takes
/// writes and the upstream is reachable; 503 with `"status": "not_ready"`
/// and each check's finding otherwise.
pub async fn readyz(state: &Arc<AppState>) -> http::Response<ProxyBody> {
    let (store_ok, store) = store_check(state).await;
    let (upstream_ok, upstream) = upstream_check(state).await;
    let ready = store_ok && upstream_ok;
    json_response(
        if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        &json!({
            "status": if ready { "ready" } else { "not_ready" },
            "checks": {"store": store, "upstream": upstream},
        }),
    )
}

/// The writer thread commits (a flush, bounded) and the database file
/// opens for writing.
async fn store_check(state: &AppState) -> (bool, serde_json::Value) {
    if let Err(e) = state.store.available() {
        return (false, json!({"ok": false, "error": e.to_string()}));
    }
    match tokio::time::timeout(STORE_TIMEOUT, state.store.flush()).await {
        Err(_) => {
            return (
                false,
                json!({"ok": false, "error": "the store writer did not answer in time"}),
            )
        }
        Ok(Err(e)) => return (false, json!({"ok": false, "error": e.to_string()})),
        Ok(Ok(())) => {}
    }
    if let Some(pg) = state.postgres.clone() {
        let ping = tokio::task::spawn_blocking(move || pg.ping());
        return match tokio::time::timeout(STORE_TIMEOUT, ping).await {
            Ok(Ok(Ok(()))) => (true, json!({"ok": true})),
            Ok(Ok(Err(e))) => (false, json!({"ok": false, "error": e.to_string()})),
            _ => (
                false,
                json!({"ok": false, "error": "the database did not answer in time"}),
            ),
        };
    }
    let path = state.config.store_path();
    match std::fs::OpenOptions::new().append(true).open(&path) {
        Ok(_) => (true, json!({"ok": true})),
        Err(e) => (
            false,
            json!({"ok": false, "error": format!("the database is not writable: {e}")}),
        ),
    }
}

/// Reached within [`UPSTREAM_RECENT`], or answering a `GET /v1/models` now
/// (any answer below 500: a refused key still shows the upstream is there).
async fn upstream_check(state: &Arc<AppState>) -> (bool, serde_json::Value) {
    let recent = |state: &AppState| {
        let at = state.upstream_reached_at();
        let age = crate::ids::now_ms() - at;
        (at > 0 && age <= UPSTREAM_RECENT.as_millis() as i64).then_some(age)
    };
    if let Some(age) = recent(state) {
        return (true, json!({"ok": true, "reached_ms_ago": age}));
    }
    // One probe at a time; those that waited take its outcome, whichever
    // it was: probing again behind a hanging upstream would queue each
    // probe behind the last one's timeout.
    let arrived = crate::ids::now_ms();
    let mut last = state.probing.lock().await;
    if let Some((finished, ok, finding)) = last.as_ref() {
        if *finished >= arrived {
            return (*ok, finding.clone());
        }
    }
    if let Some(age) = recent(state) {
        return (true, json!({"ok": true, "reached_ms_ago": age}));
    }
    let (ok, finding) = probe(state).await;
    *last = Some((crate::ids::now_ms(), ok, finding.clone()));
    (ok, finding)
}

/// One `GET /v1/models` of the upstream within [`PROBE_TIMEOUT`].
async fn probe(state: &AppState) -> (bool, serde_json::Value) {
    let probe = async {
        let url = state.upstream.url("/models", None)?;
        let headers = state
            .upstream
            .request_headers(&http::HeaderMap::new(), true);
        state
            .upstream
            .send_bodyless(http::Method::GET, &url, headers)
            .await
            .map(|r| r.status())
    };
    match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
        Ok(Ok(status)) if status.as_u16() < 500 => {
            state.upstream_reached();
            (true, json!({"ok": true, "probe_status": status.as_u16()}))
        }
        Ok(Ok(status)) => (
            false,
            json!({"ok": false, "error": format!("the upstream answered {status}")}),
        ),
        Ok(Err(e)) => (false, json!({"ok": false, "error": e.to_string()})),
        Err(_) => (
            false,
            json!({"ok": false, "error": format!("the upstream did not answer within {} s", PROBE_TIMEOUT.as_secs())}),
        ),
    }
}
