//! After an exchange: the idle watch, then the threshold.

use std::sync::Arc;

use super::context::Context;
use super::input::Input;
use super::{idle, jobs};

/// After an exchange: the idle watch notes it (a conversation that goes
/// quiet is compacted while its cache is still warm), and the decision from
/// its usage may start a background compaction the next request will find.
pub fn after_exchange<S: Context>(state: &Arc<S>, input: Input, used: u64, estimated: bool) {
    idle::after_exchange(state, &input, used);
    jobs::after_exchange(state, input, used, estimated);
}
