//! The one lock of each part of the registry (see `engine::index`).

use std::sync::{Mutex, MutexGuard};

/// A part's state under its lock. A panic while it was held leaves the
/// state as the panic found it, which every part can go on with: the lock
/// is taken again regardless.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
