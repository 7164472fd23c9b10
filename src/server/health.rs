//! `/healthz` and `/readyz`. Liveness says the process serves; readiness
//! says a request would get through: the store takes writes, and the
//! upstream answered lately or answers now.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use serde_json::json;

use crate::app::AppState;
use crate::error::{json_response, ProxyBody, ProxyError, Unready};

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
/// writes and the upstream is reachable; otherwise the 503 of
/// [`ProxyError::NotReady`], with each check's finding.
pub async fn readyz(state: &Arc<AppState>) -> http::Response<ProxyBody> {
    let (store_ok, store) = match store_check(state).await {
        Ok(()) => (true, json!({"ok": true})),
        Err(e) => (false, e.finding()),
    };
    let (upstream_ok, upstream) = upstream_check(state).await;
    let checks = json!({"store": store, "upstream": upstream});
    if store_ok && upstream_ok {
        json_response(
            StatusCode::OK,
            &json!({"status": "ready", "checks": checks}),
        )
    } else {
        ProxyError::NotReady { checks }.into_response()
    }
}

/// The writer thread commits (a flush, bounded) and the database file
/// opens for writing.
async fn store_check(state: &AppState) -> Result<(), Unready> {
    let store = |e: crate::store::StoreError| Unready::Store(e.into());
    state.store.available().map_err(store)?;
    tokio::time::timeout(STORE_TIMEOUT, state.store.flush())
        .await
        .map_err(|_| Unready::StoreSilent("the store writer"))?
        .map_err(store)?;
    if let Some(pg) = state.postgres.clone() {
        let ping = tokio::task::spawn_blocking(move || pg.ping());
        return match tokio::time::timeout(STORE_TIMEOUT, ping).await {
            Ok(Ok(pinged)) => pinged.map_err(store),
            _ => Err(Unready::StoreSilent("the database")),
        };
    }
    let path = state.config.store_path();
    match std::fs::OpenOptions::new().append(true).open(&path) {
        Ok(_) => Ok(()),
        Err(e) => Err(Unready::NotWritable(e)),
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
    let (ok, finding) = match probe(state).await {
        Ok(status) => (true, json!({"ok": true, "probe_status": status.as_u16()})),
        Err(e) => (false, e.finding()),
    };
    *last = Some((crate::ids::now_ms(), ok, finding.clone()));
    (ok, finding)
}

/// One `GET /v1/models` of the upstream within [`PROBE_TIMEOUT`]: the
/// status of an answer below 500.
async fn probe(state: &AppState) -> Result<StatusCode, Unready> {
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
            Ok(status)
        }
        Ok(Ok(status)) => Err(Unready::UpstreamStatus(status)),
        Ok(Err(e)) => Err(Unready::Request(e.into())),
        Err(_) => Err(Unready::UpstreamSilent(PROBE_TIMEOUT.as_secs())),
    }
}
