//! What the demo prints: the summary table, token figures, the bar.

use std::io::Write;

use super::report::{DemoReport, FAKE_COMPLETION_TOKENS};

pub(super) fn print_table(r: &DemoReport, out: &mut (dyn Write + Send)) -> std::io::Result<()> {
    let un = r.uncompacted_input_tokens();
    let co = r.compacted_input_tokens();
    let total = co + r.summarizer_input_tokens;
    let peak_un = r
        .requests
        .iter()
        .map(|q| q.uncompacted_tokens + FAKE_COMPLETION_TOKENS)
        .max()
        .unwrap_or(0);
    let peak_co = r.requests.iter().map(|q| q.total_tokens).max().unwrap_or(0);
    let over_un = r
        .requests
        .iter()
        .filter(|q| q.uncompacted_tokens + FAKE_COMPLETION_TOKENS > r.window)
        .count();
    let over_co = r
        .requests
        .iter()
        .filter(|q| q.total_tokens > r.window)
        .count();
    let pct = |a: u64| format!("{:.0}%", 100.0 * a as f64 / un.max(1) as f64);
    writeln!(out)?;
    writeln!(
        out,
        "{} requests, {} compactions ({})",
        r.requests.len(),
        r.compactions.len(),
        rungs(r)
    )?;
    writeln!(
        out,
        "{:<30}{:>20}{:>18}",
        "tokens", "without compaction", "with compaction"
    )?;
    let rows: [(String, String, String, String); 5] = [
        (
            "input tokens, client requests".into(),
            thousands(un),
            thousands(co),
            pct(co),
        ),
        (
            format!("+ summarizer calls ({})", r.summarizer_calls),
            "-".into(),
            thousands(r.summarizer_input_tokens),
            String::new(),
        ),
        (
            "= input tokens, total".into(),
            thousands(un),
            thousands(total),
            pct(total),
        ),
        (
            "largest request".into(),
            thousands(peak_un),
            thousands(peak_co),
            format!("window {}", thousands(r.window)),
        ),
        (
            "requests over the window".into(),
            over_un.to_string(),
            over_co.to_string(),
            String::new(),
        ),
    ];
    for (label, a, b, note) in rows {
        let line = format!("{label:<30}{a:>20}{b:>18}  {note}");
        writeln!(out, "{}", line.trim_end())?;
    }
    let s = &r.savings;
    writeln!(
        out,
        "\nas compactor accounts it (admin page, /metrics): {} input tokens received, {} without \
         compaction (its own estimate: the upstream never saw those requests, so this differs \
         a little from the measured column above); summarizer {} in + {} out; net saved {}",
        thousands(s.input_tokens),
        thousands(s.input_tokens_uncompacted),
        thousands(s.summarizer_input_tokens),
        thousands(s.summarizer_output_tokens),
        thousands(s.net_tokens_saved.max(0) as u64),
    )?;
    if let Some(db) = &r.store {
        writeln!(
            out,
            "\nstore kept at {}: try `compactor conversations list --db {}`",
            db.display(),
            db.display()
        )?;
    }
    out.flush()
}

fn rungs(r: &DemoReport) -> String {
    let mut counts: Vec<(String, usize)> = Vec::new();
    for c in &r.compactions {
        match counts.iter_mut().find(|(k, _)| *k == c.rung) {
            Some((_, n)) => *n += 1,
            None => counts.push((c.rung.clone(), 1)),
        }
    }
    if counts.is_empty() {
        return "none".into();
    }
    counts
        .iter()
        .map(|(k, n)| format!("{n} {k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `12,345`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `6.1k` (or the plain number under 1,000).
pub fn kilo(n: u64) -> String {
    if n < 1000 {
        n.to_string()
    } else {
        format!("{:.1}k", n as f64 / 1000.0)
    }
}

/// A 20-cell gauge of `used` against `window`.
pub(super) fn bar(used: u64, window: u64) -> String {
    let cells = 20u64;
    let full = (used * cells).div_ceil(window.max(1)).min(cells);
    let mut s = String::from("▕");
    for i in 0..cells {
        s.push(if i < full { '█' } else { '░' });
    }
    s.push('▏');
    s
}

// ---------------------------------------------------------------------------
// The scripted session.

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_formats() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(kilo(950), "950");
        assert_eq!(kilo(6140), "6.1k");
        assert_eq!(bar(0, 100).chars().filter(|&c| c == '█').count(), 0);
        assert_eq!(bar(50, 100).chars().filter(|&c| c == '█').count(), 10);
        assert_eq!(bar(500, 100).chars().filter(|&c| c == '█').count(), 20);
    }
}
