//! An exchange whose answer has not been handed to the client yet, and
//! what is recorded of it when the client leaves before then.

use std::sync::Arc;

use super::outcome::Outcome;
use super::pending::PendingExchange;
use crate::app::AppState;

/// An exchange whose answer has not been handed to the client yet. A
/// client that leaves before then (a timeout while the model thinks, say)
/// makes hyper drop the request's future, and this with it: the exchange
/// is recorded with status 499 (as nginx logs a client that closed the
/// request), and the upstream request, dropped with the future, is
/// cancelled. Every path that answers takes the exchange out first.
pub(in crate::server) struct Unanswered {
    state: Arc<AppState>,
    /// Always here until [`Unanswered::into_inner`] or the drop.
    pending: Option<PendingExchange>,
}

/// The status recorded for an exchange whose client left before its answer.
pub const CLIENT_CLOSED: u16 = 499;

impl Unanswered {
    pub(in crate::server) fn new(state: &Arc<AppState>, pending: PendingExchange) -> Self {
        Self {
            state: state.clone(),
            pending: Some(pending),
        }
    }

    /// The exchange, for the path that answers (and records) it.
    #[expect(
        clippy::expect_used,
        reason = "`pending` is Some from `new` until `into_inner` consumes the value"
    )]
    pub(in crate::server) fn into_inner(mut self) -> PendingExchange {
        self.pending.take().expect("present until taken")
    }
}

impl std::ops::Deref for Unanswered {
    type Target = PendingExchange;
    #[expect(
        clippy::expect_used,
        reason = "`pending` is Some from `new` until `into_inner` consumes the value"
    )]
    fn deref(&self) -> &PendingExchange {
        self.pending.as_ref().expect("present until taken")
    }
}

impl std::ops::DerefMut for Unanswered {
    #[expect(
        clippy::expect_used,
        reason = "`pending` is Some from `new` until `into_inner` consumes the value"
    )]
    fn deref_mut(&mut self) -> &mut PendingExchange {
        self.pending.as_mut().expect("present until taken")
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            let outcome = Outcome {
                status: CLIENT_CLOSED,
                error: Some(format!("{} before the answer", self.state.cut_reason())),
                ..Outcome::default()
            };
            p.finish_detached(&self.state, outcome);
        }
    }
}
