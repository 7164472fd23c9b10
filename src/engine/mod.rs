//! The compaction engine: the I/O around the pure layer. Keeps the
//! per-tenant index of stored compactions, runs background jobs after a
//! triggering answer, computes reactive compactions on overflow, calls the
//! summarizer, stores results, and backs off from clients whose edits keep
//! compactions from ever matching.
//!
//! This file only declares the children and hands their names on: what
//! they share is a child of its own (the [`Input`], the [`Context`], the
//! token counts, the registry's parts), which they name.

mod after;
mod attempt;
mod check;
mod compute;
mod context;
mod count;
mod counted;
mod error;
mod guard;
mod handoff;
mod heard;
mod idle;
mod index;
mod input;
mod jobs;
mod learned;
pub mod provider;
pub mod rebuild;
mod repeats;
mod rungs;
mod running;
mod stored;
mod summarizer;
mod turns;

pub use after::after_exchange;
pub use attempt::Attempt;
pub use check::{check_fit, Fit, FitCheck};
pub use compute::compact;
pub use context::Context;
pub use count::estimate_view;
pub use error::CompactError;
pub use handoff::{after_client_compaction, handoff_under, Handoffs};
pub use idle::{is_cold, thread as idle_thread};
pub use index::Compactions;
pub use input::{Ask, Goal, Input, Request, Sent, Serving, Who};
pub use jobs::schedule_agent;
pub use learned::Reported;
pub use repeats::{Repeat, FEW_REQUESTS};
pub use stored::LoadCompaction;
pub use summarizer::{auth_headers, chunk_lines, provider_headers, SummarizerError};
