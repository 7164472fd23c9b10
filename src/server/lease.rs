//! What a client connection holds of the server while it is open, the
//! WebSocket it may become included.

/// What a client connection holds of the server: its slot among the
/// [`connection_limit`](super::connection_limit) open ones, and the
/// server's shutdown. A connection upgraded to a WebSocket keeps it for as
/// long as the socket is open, so sockets count against the limit and are
/// drained at shutdown.
pub(crate) struct Lease {
    _slot: tokio::sync::OwnedSemaphorePermit,
    /// Set when the server stops accepting: finish what is under way.
    pub(crate) closing: tokio::sync::watch::Receiver<bool>,
    /// Set when the grace period is over: drop what is under way.
    pub(crate) cut: tokio::sync::watch::Receiver<bool>,
    /// Held until the lease is gone: the server waits for every one.
    _open: tokio::sync::mpsc::Sender<()>,
}

impl Lease {
    /// The lease of a connection given `slot`, watching the server's
    /// `closing` and `cut`, holding `open` until it is gone.
    pub(super) fn new(
        slot: tokio::sync::OwnedSemaphorePermit,
        closing: tokio::sync::watch::Receiver<bool>,
        cut: tokio::sync::watch::Receiver<bool>,
        open: tokio::sync::mpsc::Sender<()>,
    ) -> Self {
        Self {
            _slot: slot,
            closing,
            cut,
            _open: open,
        }
    }
}
