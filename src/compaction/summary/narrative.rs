//! Reading the model's answer: headings in the styles models write, the
//! body of each narrative section, and validation.

use super::NARRATIVE_SECTIONS;

/// Uppercase words, `&`/`and` and leading numbering dropped, joined.
fn normalize(s: &str) -> String {
    let upper = s.to_uppercase();
    let words: Vec<&str> = upper
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty() && *w != "AND")
        .collect();
    let skip = words
        .iter()
        .take_while(|w| w.chars().all(|c| c.is_ascii_digit()))
        .count();
    words[skip..].concat()
}

/// The narrative section a line opens, with any text written on the same
/// line (`**PLAN STATE:** done`). Headings are `#`…`######` lines, bold
/// lines, or a line that is just the heading (case-insensitive).
pub(super) fn heading_of(line: &str) -> Option<(usize, String)> {
    let t = line.trim();
    let hashes = t.starts_with('#');
    let bold = t.starts_with("**") || t.starts_with("__");
    let norm = normalize(t);
    NARRATIVE_SECTIONS
        .iter()
        .position(|h| {
            let h = normalize(h);
            if hashes || bold {
                norm.starts_with(&h)
            } else {
                norm == h
            }
        })
        .map(|i| {
            let rest = if bold {
                t[2..]
                    .find(&t[..2])
                    .map(|e| {
                        t[2 + e + 2..]
                            .trim()
                            .trim_start_matches(':')
                            .trim()
                            .to_string()
                    })
                    .unwrap_or_default()
            } else {
                String::new()
            };
            (i, rest)
        })
}

pub(super) fn is_fence(line: &str) -> bool {
    let t = line.trim_start();
    t.starts_with("```") || t.starts_with("~~~")
}

/// Small models sometimes wrap their whole answer in a code fence.
fn unwrap_outer_fence(text: &str) -> &str {
    let t = text.trim();
    if !is_fence(t) {
        return text;
    }
    let Some((_, inner)) = t.split_once('\n') else {
        return text;
    };
    match inner.trim_end().rsplit_once('\n') {
        Some((body, last)) if is_fence(last) && last.trim().len() <= 4 => body,
        _ => text,
    }
}

/// The bodies of the narrative sections in `text` (`None` = heading absent).
/// Text before the first section is dropped; headings inside code fences are
/// not headings.
pub(super) fn split_sections(text: &str) -> [Option<String>; 6] {
    let text = unwrap_outer_fence(text);
    let mut out: [Option<String>; 6] = Default::default();
    let mut current: Option<usize> = None;
    let mut fence = false;
    for line in text.lines() {
        if is_fence(line) {
            fence = !fence;
        } else if !fence {
            if let Some((i, rest)) = heading_of(line) {
                current = Some(i);
                let body = out[i].get_or_insert_with(String::new);
                if !rest.is_empty() {
                    body.push_str(&rest);
                    body.push('\n');
                }
                continue;
            }
        }
        if let Some(i) = current {
            let body = out[i].get_or_insert_with(String::new);
            body.push_str(line);
            body.push('\n');
        }
    }
    out.map(|b| b.map(|b| b.trim().to_string()))
}

/// Checks the model's answer: `Ok` if every [`NARRATIVE_SECTIONS`] heading is
/// present (`#`…`######`, bold, a bare line, any case, `and` for `&`,
/// numbering, trailing `:` all tolerated), else the missing headings.
pub fn validate(narrative: &str) -> Result<(), Vec<&'static str>> {
    let sections = split_sections(narrative);
    let missing: Vec<&'static str> = NARRATIVE_SECTIONS
        .iter()
        .zip(sections.iter())
        .filter(|(_, s)| s.is_none())
        .map(|(h, _)| *h)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::summary::testing::GOOD;

    #[test]
    fn validate_accepts_varied_heading_styles() {
        assert_eq!(validate(GOOD), Ok(()));
        let varied = "Here is the summary.\n### 1. Plan state\nx\n**Decisions:** chose y\n# file / workspace state\nz\n__Constraints and Preferences__\nnone\nERRORS & FIXES:\nnone\n## Open items / next steps\nrun it\n";
        assert_eq!(validate(varied), Ok(()));
        assert_eq!(validate(&format!("```markdown\n{GOOD}```\n")), Ok(()));
        let sections = split_sections(varied);
        assert_eq!(sections[1].as_deref(), Some("chose y"));
        assert_eq!(sections[5].as_deref(), Some("run it"));
    }

    #[test]
    fn validate_reports_missing_headings() {
        let partial = "## PLAN STATE\nx\n## DECISIONS\ny\n- errors & fixes are discussed here\n```\n## OPEN ITEMS / NEXT STEP\n```\n";
        assert_eq!(
            validate(partial),
            Err(vec![
                "FILE/WORKSPACE STATE",
                "CONSTRAINTS & PREFERENCES",
                "ERRORS & FIXES",
                "OPEN ITEMS / NEXT STEP"
            ])
        );
        assert_eq!(validate(""), Err(NARRATIVE_SECTIONS.to_vec()));
    }
}
