//! Whether a send to the upstream got a connection of its own: a
//! connector layer ([`NoteOpened`]) notes it for the send being watched
//! ([`watched`]), which tells a pooled connection the upstream had closed
//! from a fresh one that failed.

use std::cell::Cell;
use std::future::Future;
use std::task::{Context, Poll};

/// `send`'s output, and whether a new connection was made for it.
pub(super) async fn watched<F: Future>(send: F) -> (F::Output, bool) {
    OPENED
        .scope(Cell::new(false), async {
            let sent = send.await;
            (sent, OPENED.with(Cell::get))
        })
        .await
}

tokio::task_local! {
    /// Within [`watched`]: whether its send got a new connection.
    static OPENED: Cell<bool>;
}

/// A connector layer that notes, for the send being made, that it got a new
/// connection. When no idle connection is at hand the pool connects within
/// the send's own task while it waits for one to come back; a connection
/// that comes back first is taken instead and the connecting goes on in a
/// task of its own, so the note is made only when a connection is made
/// within the send's task.
#[derive(Clone, Copy)]
pub(super) struct NoteOpened;

impl<S> tower_layer::Layer<S> for NoteOpened {
    type Service = Noted<S>;
    fn layer(&self, inner: S) -> Noted<S> {
        Noted(inner)
    }
}

#[derive(Clone)]
pub(super) struct Noted<S>(S);

impl<S: tower_service::Service<R>, R> tower_service::Service<R> for Noted<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures_util::future::Map<S::Future, fn(Connecting<S, R>) -> Connecting<S, R>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, dst: R) -> Self::Future {
        fn note<T, E>(made: Result<T, E>) -> Result<T, E> {
            if made.is_ok() {
                let _ = OPENED.try_with(|o| o.set(true));
            }
            made
        }
        futures_util::FutureExt::map(self.0.call(dst), note as fn(_) -> _)
    }
}

type Connecting<S, R> =
    Result<<S as tower_service::Service<R>>::Response, <S as tower_service::Service<R>>::Error>;
