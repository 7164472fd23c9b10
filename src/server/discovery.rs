//! Asking the upstream for a model's window, and remembering what it told:
//! the I/O around [`crate::windows`], which holds the registry and the
//! parsing and imports nothing above it.

use serde_json::Value;

use crate::app::AppState;
use crate::upstream::Upstream;
use crate::windows::{window_in_models, window_in_props, Source, DISCOVERY_TIMEOUT};

/// Asks the upstream for `model`'s window, the first time the model is
/// seen: `/v1/models` (vLLM, llama.cpp), then llama.cpp's `/props`. At most
/// [`DISCOVERY_TIMEOUT`]; an upstream that cannot say (or fails) is simply
/// not asked again, and the request goes on either way.
pub async fn discover(state: &std::sync::Arc<AppState>, model: &str, auth: &http::HeaderMap) {
    if !state.config.upstream.discover_windows
        || model.is_empty()
        || !state.windows.first_ask(model)
    {
        return;
    }
    let asked = tokio::time::timeout(DISCOVERY_TIMEOUT, ask(state, model, auth)).await;
    let Ok(Some(window)) = asked else {
        tracing::debug!(model, "the upstream did not report a context window");
        return;
    };
    tell(state, model, window, Source::Discovered).await;
}

/// Remembers (and stores) a window the upstream told for `model`.
pub async fn tell(state: &std::sync::Arc<AppState>, model: &str, window: u64, source: Source) {
    // Stored with the record: the URL as shown, never its password.
    let upstream = crate::config::shown_url(state.upstream.base());
    let Some(told) = state
        .windows
        .tell(&upstream, model, window, source, crate::ids::now_ms())
    else {
        return;
    };
    tracing::info!(
        model,
        window,
        source = source.as_str(),
        "context window told by the upstream"
    );
    if let Err(e) = state.store.record_window(told).await {
        tracing::warn!(error = %e, "context window not stored");
    }
}

async fn ask(state: &AppState, model: &str, auth: &http::HeaderMap) -> Option<u64> {
    // The client's credential, or the proxy's own key when one is set.
    let headers = state.upstream.request_headers(auth, true);
    ask_upstream(&state.upstream, model, headers).await
}

/// What `up` says `model`'s window is, asked with `headers`: `/v1/models`
/// (vLLM, llama.cpp), then llama.cpp's `/props`. Not time-boxed: the
/// caller bounds it (`compactor doctor` and `connect` ask through it too).
pub async fn ask_upstream(up: &Upstream, model: &str, headers: http::HeaderMap) -> Option<u64> {
    let get = |url: reqwest::Url| {
        let headers = headers.clone();
        async move {
            let resp = up
                .send_bodyless(http::Method::GET, &url, headers)
                .await
                .ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let body = up.read_body(resp).await.ok()?;
            serde_json::from_slice::<Value>(&body).ok()
        }
    };
    // A fixed path of the proxy's own: it cannot leave the base path.
    let models = up.url("/models", None).ok()?;
    if let Some(w) = get(models.clone())
        .await
        .and_then(|b| window_in_models(&b, model))
    {
        return Some(w);
    }
    // llama.cpp serves `/props` beside its API prefix, not under it: the
    // one URL the proxy builds outside the base path, from no client input.
    let mut props = models;
    let root = props
        .path()
        .trim_end_matches("/models")
        .trim_end_matches('/');
    let root = root.strip_suffix("/v1").unwrap_or(root).to_string();
    props.set_path(&format!("{root}/props"));
    get(props).await.and_then(|b| window_in_props(&b))
}
