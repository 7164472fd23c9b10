//! A Gemini answer's chunk read without building its tree: what a
//! stream's start and its collector need of it, the candidate's parts
//! built alone (they are kept as they came). A chunk with a member of
//! another type than the API's fails the read and is read as a tree, as
//! before, so both readings agree on every chunk this one takes.

use std::borrow::Cow;

use serde::de::IgnoredAny;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use super::super::format::Start;
use super::super::usage::Usage;

/// What the stream's collector reads of a chunk (a `GenerateContentResponse`).
#[derive(Deserialize)]
pub(super) struct ChunkView<'a> {
    /// Present, even `null`: the stream failed.
    #[serde(default, deserialize_with = "present")]
    pub error: Option<Value>,
    #[serde(rename = "responseId", borrow)]
    pub response_id: Option<Cow<'a, str>>,
    #[serde(rename = "usageMetadata")]
    pub usage: Option<UsageView>,
    #[serde(borrow)]
    pub candidates: Option<Vec<Option<CandidateView<'a>>>>,
}

/// A candidate: why it ended, and its content's parts.
#[derive(Deserialize)]
pub(super) struct CandidateView<'a> {
    #[serde(rename = "finishReason", borrow)]
    pub finish: Option<Cow<'a, str>>,
    pub content: Option<ContentView>,
}

/// A content's parts, each built, to be kept as it came.
#[derive(Deserialize)]
pub(super) struct ContentView {
    pub parts: Option<Vec<Value>>,
}

/// `usageMetadata`'s counts.
#[derive(Deserialize)]
pub(super) struct UsageView {
    #[serde(rename = "promptTokenCount")]
    prompt: Option<u64>,
    #[serde(rename = "toolUsePromptTokenCount")]
    tool_use: Option<u64>,
    #[serde(rename = "candidatesTokenCount")]
    candidates: Option<u64>,
    #[serde(rename = "thoughtsTokenCount")]
    thoughts: Option<u64>,
    #[serde(rename = "cachedContentTokenCount")]
    cached: Option<u64>,
}

impl UsageView {
    pub fn usage(&self) -> Option<Usage> {
        usage_of(
            self.prompt,
            self.tool_use,
            self.candidates,
            self.thoughts,
            self.cached,
        )
    }
}

/// What a stream's start needs of a chunk (the format's `stream_start`): whether it is an error, and whether its first
/// candidate has parts or ended; nothing of it is built.
#[derive(Deserialize)]
pub(super) struct StartView {
    #[serde(default, deserialize_with = "present")]
    pub error: Option<IgnoredAny>,
    pub candidates: Option<Vec<Option<StartCandidate>>>,
}

impl StartView {
    /// What the reading of the same chunk's tree says.
    pub fn start(self) -> Start {
        if self.error.is_some() {
            return Start::Failed;
        }
        let first = self.candidates.and_then(|c| c.into_iter().next()).flatten();
        let has_parts = first
            .as_ref()
            .and_then(|c| c.content.as_ref()?.parts.as_ref())
            .is_some_and(|p| !p.is_empty());
        let ended = first.is_some_and(|c| c.finish.is_some());
        if has_parts || ended {
            Start::Committed
        } else {
            Start::Prelude
        }
    }
}

/// A candidate, as [`StartView`] reads it.
#[derive(Deserialize)]
pub(super) struct StartCandidate {
    pub content: Option<StartContent>,
    /// Present, even `null`.
    #[serde(rename = "finishReason", default, deserialize_with = "present")]
    pub finish: Option<IgnoredAny>,
}

/// A content, as [`StartView`] reads it.
#[derive(Deserialize)]
pub(super) struct StartContent {
    pub parts: Option<Vec<IgnoredAny>>,
}

/// A member that is present, `null` included, is `Some`.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// Usage of `usageMetadata`'s counts: none without the prompt's.
pub(super) fn usage_of(
    prompt: Option<u64>,
    tool_use: Option<u64>,
    candidates: Option<u64>,
    thoughts: Option<u64>,
    cached: Option<u64>,
) -> Option<Usage> {
    Some(Usage {
        input_tokens: prompt? + tool_use.unwrap_or(0),
        output_tokens: candidates.unwrap_or(0) + thoughts.unwrap_or(0),
        cached_tokens: cached,
        cache_write_tokens: None,
        cache_write_1h_tokens: None,
    })
}
