//! The fixed words of a summary: the narrative sections the model writes,
//! the marker of a summarizer prompt, and the labels the proxy writes.

/// The narrative sections the model must write, as headings.
pub const NARRATIVE_SECTIONS: [&str; 6] = [
    "PLAN STATE",
    "DECISIONS",
    "FILE/WORKSPACE STATE",
    "CONSTRAINTS & PREFERENCES",
    "ERRORS & FIXES",
    "OPEN ITEMS / NEXT STEP",
];

/// A marker present in every summarizer system prompt (lets fakes and logs
/// recognise summary requests).
pub const SUMMARIZER_MARKER: &str = "[compactor-summarizer v1]";

/// Label that opens every block of proxy-recorded facts in an assembled
/// summary ([`previous_narrative`](super::assemble::previous_narrative)
/// cuts sections there).
pub(super) const FACTS_LABEL: &str = "Recorded by the proxy";
/// Body of a narrative section in the deterministic fallback.
pub(super) const UNAVAILABLE: &str = "(narrative unavailable)";
/// Body of a narrative section the model left out.
pub(super) const NOT_PROVIDED: &str = "(not provided by the summarizer)";
