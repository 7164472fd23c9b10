//! The counters of compaction storms, on both sides: the proxy's own
//! threshold compactions held back because the last one bought no room
//! (see `engine::jobs`), and a client's own compaction requests that came
//! again before the last one bought any turns (see `engine::repeats`).

use prometheus_client::metrics::counter::Counter;

/// Both storm counters (see `Metrics::storms`).
pub struct Storms {
    /// Threshold compactions held back because the last one bought no room.
    avoided: Counter,
    /// Client compaction requests repeated over an unchanged history.
    client_repeats: Counter,
}

impl Storms {
    /// The counters, registered through `counter` (name, help).
    pub(super) fn new(mut counter: impl FnMut(&str, &str) -> Counter) -> Self {
        Storms {
            avoided: counter(
                "compactor_compaction_storms_avoided",
                "Threshold compactions not started because the conversation's last compaction left it at its trigger and it has not grown since",
            ),
            client_repeats: counter(
                "compactor_client_compaction_repeats",
                "Client compaction requests (Claude Code's, Codex's) sent again over the same history, or within a few requests of the conversation's last answered one",
            ),
        }
    }

    /// A threshold compaction not started because the one the request was
    /// built on bought no room (see `engine::jobs`): call once per request.
    pub fn storm_avoided(&self) {
        self.avoided.inc();
    }

    /// Threshold compactions held back so far.
    pub fn storms_avoided(&self) -> u64 {
        self.avoided.get()
    }

    /// A client's own compaction request repeated one before it bought any
    /// turns (see `engine::repeats`): call once per request.
    pub fn client_compaction_repeated(&self) {
        self.client_repeats.inc();
    }

    /// Client compaction requests repeated so far.
    pub fn client_compaction_repeats(&self) -> u64 {
        self.client_repeats.get()
    }
}
