//! What an item is, by its `role` and `type` members, in either wire
//! format: the one classification compaction and token accounting share.
//!
//! Chat items carry a `role`; Responses items a `type` (messages may carry
//! only a `role`). Both members are looked at whatever the API, so a caller
//! that has read them from the bytes and one holding the parsed item agree.

/// System or developer text, or the Responses `instructions` pseudo-item.
pub fn is_system(role: &str, kind: &str) -> bool {
    matches!(role, "system" | "developer") || kind == "instructions"
}

/// A tool's answer to a call: a chat `tool` message or a Responses
/// `*_call_output` item.
pub fn is_tool_output(role: &str, kind: &str) -> bool {
    role == "tool" || kind.ends_with("_call_output")
}

/// What the model wrote: an assistant message (a Gemini `model` content), a Responses call or
/// reasoning item (not a tool's output).
pub fn is_model_output(role: &str, kind: &str) -> bool {
    matches!(role, "assistant" | "model")
        || kind == "reasoning"
        || (kind.ends_with("_call") && role.is_empty())
}
