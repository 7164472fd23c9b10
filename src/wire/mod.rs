//! Wire formats: an *item* view over the four APIs, what the phases ask of each ([`mod@format`]), content hashes, usage.
//!
//! Owns the knowledge of where the history lives in a request body
//! (`messages` for Chat Completions and Anthropic Messages, `instructions` +
//! `input` for Responses, `contents` for Gemini) and where usage and output live in an answer. Works on `serde_json::Value`
//! so nothing the proxy does not understand is ever dropped.
//!
//! This file only declares the children and hands their names on: what
//! they share is a child of its own (the [`Api`] in `api`, the [`Usage`] in
//! `usage`, the [`RawMembers`] reader in `raw`, the hashes in [`hash`]),
//! which they name; what a client says of itself (its credential, its
//! conversation's ids and key) is in `client`.

mod api;
pub mod chat;
pub mod class;
mod client;
pub mod format;
pub mod gemini;
pub mod hash;
pub mod items;
pub mod messages;
mod messages_stream;
pub mod own_calls;
mod raw;
pub mod responses;
pub mod splice;
pub mod sse;
mod usage;

pub use api::Api;
pub use client::{
    bounded_text, client_ids, credential, explicit_conversation_key, ClientIds,
    MAX_CLIENT_ID_CHARS, MAX_KEY_BYTES, SESSION_HEADERS,
};
pub use hash::{chain_extend, chain_hashes, item_hash, ItemHash};
pub use raw::RawMembers;
pub use usage::Usage;
