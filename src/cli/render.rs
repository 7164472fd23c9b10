//! The read-only views (`compactor conversations …`): the store read,
//! and tables and details rendered for a terminal or as JSON.

use std::process::ExitCode;

use super::args::ConversationsCommand;
use super::audit;
use super::layered::{layered_config, with_database_url};
use super::maintain::delete;
use super::out::{print_out, said, to_json, unsafe_for_terminal, EXIT_USAGE};
use crate::demo::thousands;
use crate::store::query::{self, CompactionRow, ConversationDetail, ConversationSummary};

pub(super) fn conversations(cmd: ConversationsCommand) -> ExitCode {
    let store = match &cmd {
        ConversationsCommand::Delete { id, target } => return delete(id, target),
        ConversationsCommand::List { store, .. }
        | ConversationsCommand::Show { store, .. }
        | ConversationsCommand::Export { store, .. } => store,
    };
    let config = match layered_config(store.config.as_deref(), None, None, store.db.as_deref())
        .and_then(|c| with_database_url(c, store.database_url.as_deref()))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("compactor: configuration error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let conn = match crate::store::views(&config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("compactor: {}", said(&e));
            return ExitCode::FAILURE;
        }
    };
    let path = config.store_path();
    if let Some((kept, bytes)) = (!config.store.is_postgres())
        .then(|| crate::store::journal::quarantined(&path))
        .flatten()
    {
        // On stderr, so that --json output stays one document.
        eprintln!(
            "compactor: warning: {bytes} bytes of the journal could not be read and are kept in {}; \
             the exchanges they held are not in the store (each piece there follows a line that \
             says where it was; remove the file once it is looked at)",
            kept.display()
        );
    }
    let json = store.json;
    let out = match &cmd {
        ConversationsCommand::List { limit, .. } => {
            query::list_conversations(&*conn, &config, *limit).map(|list| {
                if json {
                    to_json(&serde_json::json!({ "conversations": list }), false)
                } else {
                    terminal_safe(&render_list(&list))
                }
            })
        }
        ConversationsCommand::Show {
            id,
            compaction: Some(n),
            ..
        } => {
            let shown = query::show(&*conn, &config, id)
                .map_err(anyhow::Error::from)
                .and_then(|d| {
                    audit::pick(&d, *n).map(|k| {
                        if json {
                            to_json(k, false)
                        } else {
                            terminal_safe(&audit::render(k, &render_compaction(*n, k)))
                        }
                    })
                });
            return match shown {
                Ok(text) => print_out(&text),
                Err(e) => {
                    eprintln!("compactor: {}", said(&e));
                    ExitCode::FAILURE
                }
            };
        }
        ConversationsCommand::Show { id, .. } => query::show(&*conn, &config, id).map(|d| {
            if json {
                to_json(&d, false)
            } else {
                // The history is read only to find the provider's boundary.
                let history = query::export(&*conn, &config, id)
                    .map(|e| e.original_items)
                    .unwrap_or_default();
                let text = render_show(&d);
                let (head, rest) = text.split_once('\n').unwrap_or((&text, ""));
                let boundary = render_boundary(&history, d.compactions.len());
                terminal_safe(&format!("{head}\n{boundary}{rest}"))
            }
        }),
        // Export is JSON either way; --json makes it one line.
        ConversationsCommand::Export { id, .. } => {
            query::export(&*conn, &config, id).map(|e| to_json(&e, !json))
        }
        ConversationsCommand::Delete { .. } => return ExitCode::FAILURE,
    };
    match out {
        Ok(text) => print_out(&text),
        Err(e) => {
            eprintln!("compactor: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Text for the terminal: every character a terminal could act on (see
/// [`unsafe_for_terminal`]) but the line breaks the rendering makes itself
/// shown as an escape (`\u{1b}`). Stored client strings (ids, previews,
/// models, summaries) reach the views as the client sent them.
pub(super) fn terminal_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        if ch != '\n' && unsafe_for_terminal(ch) {
            out.push_str(&format!("\\u{{{:x}}}", ch as u32));
        } else {
            out.push(ch);
        }
    }
    out
}

pub(super) fn opt_thousands(n: Option<u64>) -> String {
    n.map(thousands).unwrap_or_else(|| "-".into())
}

pub(super) fn percent(part: Option<u64>, whole: u64) -> String {
    match part {
        Some(p) if whole > 0 => format!("{:.0}%", 100.0 * p as f64 / whole as f64),
        _ => "-".into(),
    }
}

/// Unix ms → `YYYY-MM-DD HH:MM:SS` (UTC).
pub fn utc_time(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Left-aligned columns except those marked numeric (right-aligned).
pub(super) fn table(header: &[(&str, bool)], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let pad = widths[i].saturating_sub(cell.chars().count());
            if i > 0 {
                out.push_str("  ");
            }
            if header[i].1 {
                out.push_str(&" ".repeat(pad));
                out.push_str(cell);
            } else {
                out.push_str(cell);
                if i + 1 < cells.len() {
                    out.push_str(&" ".repeat(pad));
                }
            }
        }
        let mut out = out.trim_end().to_string();
        out.push('\n');
        out
    };
    let mut out = line(header.iter().map(|(h, _)| *h).collect());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

pub(super) fn last_tokens(c: &ConversationSummary) -> String {
    match c.last_tokens {
        Some(t) => format!(
            "{} / {} ({})",
            thousands(t),
            thousands(c.context_window),
            percent(Some(t), c.context_window)
        ),
        None => format!("- / {}", thousands(c.context_window)),
    }
}

/// Characters of a preview or a client id a table cell shows.
pub(super) const CELL_CHARS: usize = 40;

/// A table cell: one line, at most [`CELL_CHARS`].
pub(super) fn cell(text: &str) -> String {
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    terminal_safe(&crate::store::bounded_text(&line, CELL_CHARS))
}

pub(super) fn render_list(list: &[ConversationSummary]) -> String {
    if list.is_empty() {
        return "no conversations recorded\n".into();
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|c| {
            vec![
                c.id.clone(),
                c.client_ids.first().map(|id| cell(id)).unwrap_or_default(),
                c.tenant.clone(),
                c.client.as_deref().map(cell).unwrap_or_default(),
                terminal_safe(&c.model),
                thousands(c.exchanges),
                thousands(c.compactions),
                last_tokens(c),
                utc_time(c.last_seen_ms),
                c.preview.as_deref().map(cell).unwrap_or_default(),
            ]
        })
        .collect();
    table(
        &[
            ("CONVERSATION", false),
            ("CLIENT ID", false),
            ("TENANT", false),
            ("CLIENT", false),
            ("MODEL", false),
            ("EXCHANGES", true),
            ("COMPACTIONS", true),
            ("LAST TOKENS / WINDOW", true),
            ("LAST SEEN (UTC)", false),
            ("FIRST MESSAGE", false),
        ],
        &rows,
    )
}

pub(super) fn render_compaction(n: usize, k: &CompactionRow) -> String {
    let saved = if k.tokens_before > 0 {
        100.0 * (k.tokens_before as f64 - k.tokens_after as f64) / k.tokens_before as f64
    } else {
        0.0
    };
    // A summary's own header says how many earlier items it stands for
    // (items an earlier summary covered included): the count shown here.
    let compacted = match k.summarized_items {
        Some(n) => format!("summary of {} earlier items", thousands(n)),
        None => format!("{} items compacted", thousands(k.items_removed)),
    };
    let mut out = format!(
        "  ── compaction {n} {} · rung {} · {} UTC\n     tokens {} → {} (−{saved:.0}%), {compacted}, {} kept verbatim\n     reason: {}\n",
        k.id,
        k.rung,
        utc_time(k.created_ms),
        thousands(k.tokens_before),
        thousands(k.tokens_after),
        thousands(k.items_kept),
        k.reason,
    );
    out.extend(audit::summary_line(k));
    match &k.summary {
        Some(text) => {
            out.push_str("     summary:\n");
            for line in text.lines() {
                out.push_str("       │ ");
                out.push_str(line);
                out.push('\n');
            }
        }
        None => {
            out.push_str("     (no summary: older tool outputs replaced; originals in `export`)\n")
        }
    }
    out
}

/// The `conversations show` line naming the provider's newest compaction
/// item in the history, if the client's provider compacted: the provider
/// reads from it on, and the record keeps what came before it.
fn render_boundary(history: &[serde_json::Value], compactions: usize) -> String {
    let Some(b) = crate::compaction::boundary::newest(history) else {
        return String::new();
    };
    let facts = if compactions > 0 {
        "; the facts the proxy extracted are in its compactions' summaries below"
    } else {
        ""
    };
    format!(
        "  provider    compacted: item {} of {} is its newest compaction item, which the provider reads from; the {} items before it stay in the record (`conversations export`){facts}\n",
        thousands(b as u64 + 1),
        thousands(history.len() as u64),
        thousands(b as u64),
    )
}

/// Dollars as shown: `$0.1234`, `-$0.0100`.
pub(super) fn dollars(v: f64) -> String {
    let sign = if v < 0.0 { "-" } else { "" };
    format!("{sign}${:.4}", v.abs())
}

/// The savings lines of `conversations show`: tokens, the cache, the bill.
pub(super) fn render_savings(s: &crate::store::savings::Savings) -> String {
    let pct = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{:.0}%", r * 100.0));
    let mut out = format!(
        "  savings     {} input tokens received, {} without compaction; summarizer {} in + {} out; net {}\n",
        thousands(s.input_tokens),
        thousands(s.input_tokens_uncompacted),
        thousands(s.summarizer_input_tokens),
        thousands(s.summarizer_output_tokens),
        s.net_tokens_saved,
    );
    if s.tokens_saved_potential > 0 {
        out.push_str(&format!(
            "  observe     compaction would have saved {} input tokens\n",
            thousands(s.tokens_saved_potential)
        ));
    }
    out.push_str(&format!(
        "  cache       {} read, {} written ({} for an hour): {} of input read from the upstream's cache ({} at best without compaction)\n",
        thousands(s.cached_tokens),
        thousands(s.cache_write_tokens),
        thousands(s.cache_write_1h_tokens),
        pct(s.cache_reuse),
        pct(s.cache_reuse_uncompacted)
    ));
    if s.exchanges_without_cache_fields > 0 {
        out.push_str(&format!(
            "              the upstream reported no cache fields for {} of {} exchanges: taken as uncached\n",
            thousands(s.exchanges_without_cache_fields),
            thousands(s.exchanges_with_usage),
        ));
    }
    match (s.cost, s.cost_uncompacted, s.money_saved) {
        (Some(cost), Some(uncompacted), Some(saved)) => {
            let verdict = if saved < 0.0 {
                "compaction cost more"
            } else {
                "saved"
            };
            out.push_str(&format!(
                "  bill        paid {} (summaries {}), {} without compaction: {} {verdict}\n",
                dollars(cost),
                dollars(s.cost_summaries.unwrap_or(0.0)),
                dollars(uncompacted),
                dollars(saved),
            ));
        }
        _ if !s.unpriced_models.is_empty() => {
            let models: Vec<&str> = s.unpriced_models.iter().map(String::as_str).collect();
            out.push_str(&format!(
                "  bill        no dollars: no price known for {} (tokens only; a [[models]] entry's input_price_per_mtok gives one)\n",
                models.join(", ")
            ));
        }
        _ => {}
    }
    out.push('\n');
    out
}

pub(super) fn render_show(d: &ConversationDetail) -> String {
    let c = &d.conversation;
    let mut out = format!("conversation {}\n", c.id);
    if !c.client_ids.is_empty() {
        out.push_str(&format!("  client ids  {}\n", c.client_ids.join(", ")));
    }
    if let Some(client) = &c.client {
        out.push_str(&format!("  client      {client}\n"));
    }
    if let Some(preview) = &c.preview {
        out.push_str(&format!("  first       {}\n", cell(preview)));
    }
    out += &format!(
        "  tenant      {}\n  model       {} (window {} from {}, trigger {})\n  first seen  {} UTC\n  last seen   {} UTC\n  exchanges   {}, compactions {}, last tokens {}\n",
        c.tenant,
        c.model,
        thousands(c.context_window),
        c.window_source,
        thousands(c.trigger_tokens),
        utc_time(c.created_ms),
        utc_time(c.last_seen_ms),
        thousands(c.exchanges),
        thousands(c.compactions),
        last_tokens(c),
    );
    if d.held_out {
        out.push_str(
            "  holdout     held out of compaction (compaction.holdout_ratio): served in observe mode\n",
        );
    }
    out.push_str(&render_savings(&d.savings));
    // Each compaction goes just before the first request it rewrote, or
    // after the last exchange that started before it.
    let position = |k: &CompactionRow| {
        d.exchanges
            .iter()
            .position(|e| Some(e.id) == k.first_applied_exchange)
            .unwrap_or_else(|| {
                d.exchanges
                    .iter()
                    .filter(|e| e.started_ms <= k.created_ms)
                    .count()
            })
    };
    let rows: Vec<Vec<String>> = d
        .exchanges
        .iter()
        .enumerate()
        .map(|(i, e)| {
            vec![
                (i + 1).to_string(),
                e.id.to_string(),
                utc_time(e.started_ms),
                format!("{}{}", e.status, if e.partial { " partial" } else { "" }),
                opt_thousands(e.input_tokens),
                opt_thousands(e.output_tokens),
                cache_cell(e.cached_tokens, e.cache_write_tokens),
                percent(
                    e.input_tokens.map(|i| i + e.output_tokens.unwrap_or(0)),
                    e.context_window.unwrap_or(c.context_window),
                ),
                e.compaction.clone().unwrap_or_default(),
            ]
        })
        .collect();
    let rendered = table(
        &[
            ("#", true),
            ("EXCHANGE", true),
            ("STARTED (UTC)", false),
            ("STATUS", false),
            ("INPUT", true),
            ("OUTPUT", true),
            ("CACHE READ/WRITTEN", true),
            ("IN+OUT OF WINDOW", true),
            ("COMPACTION APPLIED", false),
        ],
        &rows,
    );
    let mut lines = rendered.lines();
    if let Some(head) = lines.next() {
        out.push_str(&format!("  {head}\n"));
    }
    let positions: Vec<usize> = d.compactions.iter().map(position).collect();
    for (i, line) in lines.enumerate() {
        for (n, k) in d.compactions.iter().enumerate() {
            if positions[n] == i {
                out.push_str(&render_compaction(n + 1, k));
            }
        }
        out.push_str(&format!("  {line}\n"));
    }
    for (n, k) in d.compactions.iter().enumerate() {
        if positions[n] >= d.exchanges.len() {
            out.push_str(&render_compaction(n + 1, k));
        }
    }
    out
}

/// An exchange's cache figures as reported: `read/written`, `-` for none.
fn cache_cell(read: Option<u64>, written: Option<u64>) -> String {
    match (read, written) {
        (None, None) => "-".into(),
        (r, w) => format!("{}/{}", opt_thousands(r), opt_thousands(w)),
    }
}

// ---------------------------------------------------------------------------
// compactor compact ID, conversations delete ID, prune

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::thousands;
    #[test]
    fn utc_times() {
        assert_eq!(utc_time(0), "1970-01-01 00:00:00");
        assert_eq!(utc_time(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(utc_time(1_700_000_000_123), "2023-11-14 22:13:20");
    }

    #[test]
    fn numbers() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(percent(Some(750), 1000), "75%");
        assert_eq!(percent(None, 1000), "-");
    }
}
