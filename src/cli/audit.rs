//! `compactor conversations show ID --compaction N`: one compaction with
//! its facts checklist, what it forgot, and the items it removed. The text
//! holds client strings as stored; the caller makes it terminal-safe.

use crate::compaction::summary::{AuditedFact, FactState};
use crate::store::query::{CompactionRow, ConversationDetail};

/// Removed refs listed before the rest are only counted.
const REFS_SHOWN: usize = 20;

/// The compaction `n` (1-based, as `show` numbers them) of `d`, or why
/// there is none.
pub fn pick(d: &ConversationDetail, n: usize) -> anyhow::Result<&CompactionRow> {
    let count = d.compactions.len();
    n.checked_sub(1)
        .and_then(|i| d.compactions.get(i))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "conversation {} has {count} compaction{}: --compaction takes 1 to {count}",
                d.conversation.id,
                if count == 1 { "" } else { "s" }
            )
        })
}

/// The timeline's line for `k`'s audit: how many facts it kept, repaired
/// and forgot (`None` for a compaction stored before audits were kept).
pub fn summary_line(k: &CompactionRow) -> Option<String> {
    let a = k.audit.as_ref()?;
    let count = |s: FactState| a.facts.iter().filter(|f| f.state == s).count();
    Some(format!(
        "     facts: {} kept, {} repaired, {} forgotten (the checklist: --compaction N)\n",
        count(FactState::Present),
        count(FactState::Repaired),
        count(FactState::Forgotten),
    ))
}

/// One fact as a checklist line (a multi-line fact, a failure block, with
/// its further lines indented under it).
fn fact_line(f: &AuditedFact) -> String {
    let mut lines = f.fact.lines();
    let mut out = format!(
        "    {:<9}  {:<10}  {}\n",
        f.state.as_str(),
        f.kind.as_str(),
        lines.next().unwrap_or("")
    );
    for l in lines {
        out.push_str(&format!("    {:<9}  {:<10}  │ {l}\n", "", ""));
    }
    out
}

/// The checklist, what was forgotten and the removed refs of `k`, after
/// its `header` (the timeline's block for it).
pub fn render(k: &CompactionRow, header: &str) -> String {
    let mut out = header.to_string();
    let Some(a) = &k.audit else {
        out.push_str(
            "\n  facts checklist: not recorded (stored before compactions kept an audit)\n",
        );
        return out;
    };
    let count = |s: FactState| a.facts.iter().filter(|f| f.state == s).count();
    out.push_str(&format!(
        "\n  facts checklist ({} extracted: {} kept, {} repaired, {} forgotten), checked against the compacted request (its replacement and the items sent after it):\n",
        a.facts.len(),
        count(FactState::Present),
        count(FactState::Repaired),
        count(FactState::Forgotten),
    ));
    if a.facts.is_empty() {
        out.push_str("    (no facts extracted from the compacted items)\n");
    }
    for f in &a.facts {
        out.push_str(&fact_line(f));
    }
    out.push_str("\n  what was forgotten:\n");
    let forgotten: Vec<&AuditedFact> = a.forgotten().collect();
    if forgotten.is_empty() {
        out.push_str("    nothing: every extracted fact reached the compacted request\n");
    }
    for f in forgotten {
        out.push_str(&fact_line(f));
    }
    out.push_str(&format!(
        "\n  removed: {} item{}",
        a.removed_count,
        if a.removed_count == 1 { "" } else { "s" }
    ));
    let shown = &a.removed[..a.removed.len().min(REFS_SHOWN)];
    if !shown.is_empty() {
        out.push_str(&format!(" ({})", shown.join(", ")));
        if a.removed_count > shown.len() {
            out.push_str(&format!(", and {} more", a.removed_count - shown.len()));
        }
    }
    out.push_str("; originals in `export`\n");
    out
}
