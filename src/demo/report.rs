//! What the demo session showed: its figures per request and per
//! compaction, and the report they make.

use std::path::PathBuf;

/// Completion tokens the fake reports for an ordinary answer.
pub(super) const FAKE_COMPLETION_TOKENS: u64 = 7;

/// One request of the session, as the client and the upstream saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestFigures {
    /// 1-based number.
    pub n: usize,
    /// Messages the client sent.
    pub client_items: usize,
    /// Messages the upstream received.
    pub sent_items: usize,
    /// Input tokens of the client's full request (bytes / 4, the fake's rule).
    pub uncompacted_tokens: u64,
    /// Input tokens the upstream reported.
    pub prompt_tokens: u64,
    /// Input + output tokens the upstream reported (what the trigger uses).
    pub total_tokens: u64,
    /// The compaction applied to the request, if any.
    pub compaction: Option<String>,
}

/// A compaction, as first applied to a request.
#[derive(Debug, Clone, PartialEq)]
pub struct CompactionEvent {
    /// `cmp_…`
    pub id: String,
    /// The first request it rewrote.
    pub first_request: usize,
    /// Rung used (`truncate`, `prune`, `summary`, `fallback`).
    pub rung: String,
    /// Why it ran.
    pub reason: String,
    /// Messages the client sent in that request.
    pub items_before: usize,
    /// Messages that went upstream instead.
    pub items_after: usize,
    /// Estimated tokens of the request it was computed from.
    pub tokens_before: u64,
    /// Estimated tokens after.
    pub tokens_after: u64,
}

/// What the session showed.
#[derive(Debug, Clone, Default)]
pub struct DemoReport {
    /// The model's window.
    pub window: u64,
    /// Per request.
    pub requests: Vec<RequestFigures>,
    /// Compactions, in order of first use.
    pub compactions: Vec<CompactionEvent>,
    /// Summarizer calls the proxy made.
    pub summarizer_calls: usize,
    /// Input tokens of those calls (bytes / 4).
    pub summarizer_input_tokens: u64,
    /// Of those, the tokens that repeat the request the upstream had just
    /// been sent (a summary call asked of it appends its instruction): a
    /// prompt-cache read on an upstream that caches.
    pub summarizer_repeated_tokens: u64,
    /// Where the store was kept, if it was.
    pub store: Option<PathBuf>,
    /// The savings as the proxy accounts them (admin page, `/metrics`).
    pub savings: crate::store::savings::Savings,
}

impl DemoReport {
    /// Input tokens the client's requests would have cost uncompacted.
    pub fn uncompacted_input_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.uncompacted_tokens).sum()
    }

    /// Input tokens the upstream received for the client's requests.
    pub fn compacted_input_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.prompt_tokens).sum()
    }
}
