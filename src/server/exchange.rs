//! The exchange under way, the value every phase after the read passes on:
//! the request as read (moved in whole: [`super::request::ReadRequest`]),
//! and the exchange's own parts ([`parts`]): what its items hash to, its
//! conversation, what goes upstream (the view, the compaction applied),
//! the proxy's tools it goes with, and when it arrived; what goes upstream
//! is made in [`outgoing`] (the body, an attempt's headers, the hashes of
//! what is sent). All are private:
//! the phases read them through its methods and change them only through
//! the methods named for what they do; the record's making is among them
//! ([`PendingExchange::finish`], committed by [`super::record`]). Not a
//! phase: any phase may use it.
//!
//! This file only declares the children and hands their names on: the
//! exchange itself is [`pending`], how it ended [`outcome`], what its
//! record holds [`recorded`], and the accounting after it [`account`]; the
//! children name each other, never this file.

mod account;
mod outcome;
mod outgoing;
mod parts;
mod pending;
mod preview;
mod recorded;
mod unanswered;
mod view;

pub use outcome::Outcome;
pub(super) use parts::{Digest, Rounds, Timing};
pub use pending::{PendingExchange, Recorder};
pub(super) use unanswered::Unanswered;
