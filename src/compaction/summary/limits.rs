//! How much of each kind of fact a summary keeps, and how long a line of
//! it may be.

/// Most failures kept in [`Facts::errors`](super::facts::Facts::errors) (newest kept).
pub const MAX_ERRORS: usize = 20;
/// Most lines kept in [`Facts::tool_log`](super::facts::Facts::tool_log) (newest kept).
pub const MAX_TOOL_LOG: usize = 40;
/// Most files kept in [`Facts::files`](super::facts::Facts::files) (the rest counted).
pub const MAX_FILES: usize = 200;
/// Most commands kept in [`Facts::commands`](super::facts::Facts::commands)
/// (newest kept, the rest counted).
pub const MAX_COMMANDS: usize = 40;
/// Most standing rules kept in [`Facts::rules`](super::facts::Facts::rules)
/// (newest kept, the rest counted).
pub const MAX_RULES: usize = 24;
/// Most system messages kept in [`Facts::system`](super::facts::Facts::system)
/// (newest kept, the rest counted).
pub const MAX_SYSTEM_NOTES: usize = 12;
/// Longest system message kept (longer ones are clipped with `…`).
pub const MAX_SYSTEM_NOTE: usize = 2_000;
/// Largest full file content kept per file (head and tail kept beyond it).
pub const MAX_FILE_CONTENT: usize = 32 * 1024;
/// Largest chain of patches/edits kept per file (newest kept).
pub const MAX_CHANGE_CHAIN: usize = 8 * 1024;
/// Longest error line kept (longer ones are clipped with `…`).
pub(super) const MAX_ERROR_LINE: usize = 400;
/// Longest `name(args)` part of a tool-log line.
pub(super) const MAX_LOG_CALL: usize = 150;
/// Longest outcome part of a tool-log line.
pub(super) const MAX_LOG_OUTCOME: usize = 150;
