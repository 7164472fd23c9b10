//! How an exchange ended, as its record keeps it.

use serde_json::Value;

use crate::wire::Usage;

/// How an exchange ended.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Status the client received.
    pub status: u16,
    /// Reported usage.
    pub usage: Option<Usage>,
    /// Output items.
    pub response_items: Vec<Value>,
    /// Upstream's answer id.
    pub response_id: Option<String>,
    /// What went wrong, if anything.
    pub error: Option<String>,
    /// The answer was cut short.
    pub partial: bool,
    /// Time to upstream's response headers, ms.
    pub ttfb_ms: Option<f64>,
}

impl Outcome {
    /// The outcome of a streamed answer the tee read (`partial` and `error`
    /// as the stream ended): one longer than what the tee collects is
    /// recorded as cut, with what it collected.
    pub(in crate::server) fn streamed(
        status: u16,
        tee: &crate::wire::sse::SseTee,
        partial: bool,
        error: Option<String>,
        ttfb_ms: f64,
    ) -> Outcome {
        let cut = tee.cut();
        if !tee.calls_removed().is_empty() {
            tracing::info!(
                tool = %tee.calls_removed().join(", "),
                "the proxy's tools called in a stream relayed as it came: the calls taken out of it"
            );
        }
        Outcome {
            status,
            usage: tee.usage(),
            response_items: tee.items(),
            response_id: tee.response_id(),
            partial: partial || cut.is_some(),
            error: error.or_else(|| tee.error().map(|e| e.to_string())).or(cut),
            ttfb_ms: Some(ttfb_ms),
        }
    }
}
