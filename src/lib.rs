//! compactor: a transparent, OpenAI-compatible reverse proxy that records
//! each conversation and keeps long ones alive by compacting them.
//!
//! # Layout
//!
//! - [`admin`]: the admin page and JSON API (`/admin/`): conversations,
//!   their compactions and token figures, manual compaction.
//! - [`app`]: the composition root, `AppState` (what every handler shares)
//!   and its construction.
//! - [`config`]: `proxy.toml` schema, defaults, layering, the models table.
//! - [`cli`]: the `compactor` command line; [`cli::doctor`] checks a setup,
//!   [`cli::connect`] configures clients for the proxy.
//! - [`compaction`]: when, where and how a history is compacted (the pure
//!   layer: it imports only `config`, `wire` and itself).
//! - [`engine`]: the I/O around the pure layer (stored compactions, summary
//!   calls, background jobs, the hard-limit check), over a narrow
//!   `engine::Context`.
//! - [`ids`]: conversation and compaction ids, the clock.
//! - [`server`]: accept loop, graceful shutdown, routing, the proxied endpoints.
//! - [`upstream`]: the pooled client to the real API, header hygiene, credentials.
//! - [`wire`]: the item view of Chat Completions and Responses (taking and
//!   setting a body's items), what an item is (`wire::class`), content
//!   hashes, usage, the SSE tee.
//! - [`conversation`]: tenants and matching a request to its conversation.
//! - [`store`]: records (conversations, exchanges, content-addressed items):
//!   the writer's `Backend`, the point `Reads` and the views' `Queries`,
//!   each implemented for SQLite and for PostgreSQL (the views' SQL written
//!   once over `store::sql::Sql`); it imports nothing above it.
//! - [`tokens`]: tiktoken estimates by section.
//! - [`windows`]: the upstream's real context windows, learned from its
//!   overflow answers or discovered by asking it, and remembered.
//! - [`background`]: the accounting thread (token estimates and the
//!   per-exchange line, off the request path).
//! - [`bounded`]: a map that keeps recent entries within a fixed size: the
//!   one bound of every cache and index that would otherwise grow with
//!   every request.
//! - [`error`]: the error type of every answer the proxy gives itself (the
//!   admin API's included) and its one OpenAI-style JSON mapping.
//! - [`redact`]: credentials out of whatever is logged, recorded or relayed.
//! - [`fake_upstream`]: a scriptable OpenAI-compatible server for tests,
//!   benchmarks and the offline demo.
//! - [`metrics`]: Prometheus counters, histograms and scrape-time gauges
//!   (`GET /metrics`).
//! - [`demo`]: `compactor demo`, a scripted agent session through the proxy
//!   against the fake upstream, offline.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod app;
pub mod background;
pub mod bounded;
pub mod cli;
pub mod compaction;
pub mod config;
pub mod conversation;
pub mod demo;
pub mod engine;
pub mod error;
pub mod fake_upstream;
pub mod ids;
pub mod metrics;
pub mod prices;
pub mod redact;
pub mod server;
pub mod store;
pub mod tokens;
pub mod upstream;
pub mod windows;
pub mod wire;

/// Cases a property test or fuzz target runs: `default` (sized so that the
/// whole set stays within seconds in the normal test run), or the
/// `COMPACTOR_FUZZ_CASES` environment variable's number, for a longer run.
#[doc(hidden)]
pub fn fuzz_cases(default: u32) -> u32 {
    std::env::var("COMPACTOR_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
