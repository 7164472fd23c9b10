//! compactor: a transparent reverse proxy for the OpenAI Chat Completions
//! and Responses APIs (over HTTP, and Responses over a WebSocket), the
//! Anthropic Messages API and Gemini's generateContent. It records each
//! conversation and keeps long ones alive by compacting what goes upstream.
//!
//! # Layout
//!
//! The modules, from the bottom layer up (`tests/module_graph.rs` keeps a
//! module from using a layer above its own):
//!
//! - foundations: [`config`] (`proxy.toml`: schema, defaults, layering, the
//!   models table), [`bounded`] (a map kept within a fixed size: the bound
//!   of every cache), [`error`] (the error of every answer the proxy gives
//!   itself and its one OpenAI-style JSON mapping), [`ids`] (ids and the
//!   clock), [`redact`] (credentials out of whatever is logged, recorded or
//!   relayed), [`background`] (the accounting thread), [`windows`] (the
//!   upstream's real context windows, learned and remembered), [`prices`]
//!   (what tokens cost).
//! - [`wire`]: the four APIs' bodies as items (taken and set as the
//!   client's bytes), what the phases ask of each API ([`wire::format`]),
//!   content hashes, usage, the SSE framer and tee.
//! - [`tokens`] (tiktoken estimates by section, media priced as billed) and
//!   [`upstream`] (the pooled client to the real API, header hygiene,
//!   credentials).
//! - [`compaction`]: when, where and how a history is compacted; pure, no
//!   I/O.
//! - [`store`] (records: conversations, exchanges, content-addressed items,
//!   on SQLite or PostgreSQL behind one door, [`store::open`]),
//!   [`conversation`] (tenants, and matching a request to its
//!   conversation), [`metrics`] (Prometheus, `GET /metrics`).
//! - [`engine`]: the I/O around the pure layer (stored compactions, summary
//!   calls, background jobs, the hard-limit check), over a narrow
//!   [`engine::Context`].
//! - [`app`]: the composition root, `AppState`, what every handler shares.
//! - the edges: [`server`] (accept loop, routing, the request's phases),
//!   [`admin`] (the page and JSON API under `/admin/`), [`cli`] (the
//!   `compactor` command line), [`demo`] (an offline scripted session),
//!   [`fake_upstream`] (a scriptable upstream on a real socket, for tests,
//!   benchmarks and the demo).
//!
//! `docs/ARCHITECTURE.md` walks one request through them.

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
