//! What a tool call does to one file, and the two readings of a command
//! line that `edits` and `shell` both make: a path as written, and the
//! words of a shell line.

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Op {
    Read,
    Write(String),
    /// One file's section of a patch (apply_patch envelope or unified
    /// diff) as written, and its hunks in apply_patch form.
    Patch {
        section: String,
        body: Vec<String>,
    },
    /// An old/new string replacement (`old` empty: not applicable, e.g. insert).
    Edit {
        old: String,
        new: String,
        all: bool,
        rendered: String,
    },
    Delete,
    /// Moved to another path (`mv`, `git mv`, a patch's `*** Move to`).
    Rename(String),
}

pub(super) fn clean_path(p: &str) -> String {
    let p = p.trim().trim_matches(|c| c == '"' || c == '\'');
    p.strip_prefix("./").unwrap_or(p).to_string()
}

/// The words of a shell command line, quotes removed (no expansion);
/// `;`, `|` and `&` are words of their own.
pub(super) fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut started = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') => cur.extend(chars.next()),
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                started = true;
            }
            (None, '\\') => {
                cur.extend(chars.next());
                started = true;
            }
            (None, c) if c.is_whitespace() || ";|&".contains(c) => {
                if started {
                    words.push(std::mem::take(&mut cur));
                }
                started = false;
                if ";|&".contains(c) {
                    words.push(c.to_string());
                }
            }
            (None, c) => {
                cur.push(c);
                started = true;
            }
        }
    }
    if started {
        words.push(cur);
    }
    words
}
