//! Read-only queries over the store, shared by the CLI
//! (`compactor conversations …`) and the admin API (`/admin/api/…`).
//!
//! Functions over a [`Sql`] connection (SQLite's or PostgreSQL's) returning
//! serialisable structs. With SQLite they run on their own read-only
//! connection ([`super::sqlite::open_read_only`]), never on the writer
//! thread's; WAL lets them read while the proxy writes.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use serde_json::Value;

use super::error::StoreError;
use super::rows::{item_body, load_compactions, request_item_hashes, unpack_hashes};
use super::sql::{Param, Row, Sql};
use crate::compaction::{rewrite, Compaction};
use crate::config::Config;
use crate::wire::hash::hex;
use crate::wire::ItemHash;

pub use super::records::TENANT_PREFIX;

/// Most candidates an ambiguous name lists.
pub const MAX_CANDIDATES: usize = 10;

/// Fewest hex digits of an abbreviated conversation id: fewer would match
/// half the store.
pub const MIN_ABBREVIATION: usize = 4;

/// The id prefix every conversation id has.
pub(super) const ID_PREFIX: &str = "conv_";

/// Why a query gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// No conversation has this id (or id prefix).
    #[error("no conversation {0}")]
    NotFound(String),
    /// The name matches several conversations (listed, up to
    /// [`MAX_CANDIDATES`]).
    #[error("{0} names several conversations: {list}; give more of the id", list = candidate_list(.1))]
    Ambiguous(String, Vec<String>),
    /// The store could not be read.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The candidates of an ambiguous name, with an ellipsis when there may
/// be more.
fn candidate_list(found: &[String]) -> String {
    let mut list = found.join(", ");
    if found.len() >= MAX_CANDIDATES {
        list.push_str(", …");
    }
    list
}

impl From<rusqlite::Error> for QueryError {
    fn from(e: rusqlite::Error) -> Self {
        QueryError::Store(StoreError::Db(e))
    }
}

/// One line of the conversation list.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ConversationSummary {
    /// `conv_…`
    pub id: String,
    /// The ids the client sent for it (our header, a session id, a
    /// `prompt_cache_key`), each once: what people call it.
    pub client_ids: Vec<String>,
    /// Its first user message, redacted and cut short.
    pub preview: Option<String>,
    /// The client of its latest exchange, from its `user-agent`.
    pub client: Option<String>,
    /// First characters of the tenant hash.
    pub tenant: String,
    /// The model of the latest exchange.
    pub model: String,
    /// Unix ms of the first exchange.
    pub created_ms: i64,
    /// Unix ms of the latest exchange.
    pub last_seen_ms: i64,
    /// Exchanges recorded.
    pub exchanges: u64,
    /// Compactions computed.
    pub compactions: u64,
    /// Input tokens of the latest exchange that reported usage.
    pub last_input_tokens: Option<u64>,
    /// Output tokens of the same exchange.
    pub last_output_tokens: Option<u64>,
    /// Input + output: what the conversation occupied after it.
    pub last_tokens: Option<u64>,
    /// The context window of its latest exchange, as the proxy used it
    /// (for exchanges recorded before windows were, the one the config at
    /// hand gives).
    pub context_window: u64,
    /// Where it came from: `table`, `config`, `learned` (stated by the
    /// upstream in an overflow answer) or `discovered` (reported when asked).
    pub window_source: &'static str,
    /// Tokens at which compaction triggers.
    pub trigger_tokens: u64,
}

/// One exchange of a conversation's timeline.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ExchangeRow {
    /// Exchange id.
    pub id: i64,
    /// Unix ms the request arrived.
    pub started_ms: i64,
    /// `/chat/completions` or `/responses`.
    pub endpoint: String,
    /// Requested model.
    pub model: String,
    /// Status the client got.
    pub status: u16,
    /// Streamed answer.
    pub streamed: bool,
    /// Answer cut short.
    pub partial: bool,
    /// Items the client sent.
    pub request_items: u64,
    /// Items in the answer.
    pub response_items: u64,
    /// Reported input tokens.
    pub input_tokens: Option<u64>,
    /// Reported output tokens.
    pub output_tokens: Option<u64>,
    /// Reported cached input tokens.
    pub cached_tokens: Option<u64>,
    /// Reported input tokens written to the cache.
    pub cache_write_tokens: Option<u64>,
    /// Of those, the ones written for an hour.
    pub cache_write_1h_tokens: Option<u64>,
    /// Time to the last byte, ms.
    pub latency_ms: f64,
    /// The compaction applied to the request, if any.
    pub compaction: Option<String>,
    /// What went wrong, if anything.
    pub error: Option<String>,
    /// The context window the request was measured against (none for
    /// exchanges recorded before windows were).
    pub context_window: Option<u64>,
    /// Where that window came from.
    pub window_source: Option<String>,
    /// The mode it was served in (`auto`, `observe`, `off`).
    pub mode: String,
    /// Input tokens the compaction applied saved.
    pub tokens_saved: u64,
    /// Observe mode: input tokens the would-be compaction would have saved.
    pub tokens_saved_potential: u64,
}

/// A compaction as shown in a timeline.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompactionRow {
    /// `cmp_…`
    pub id: String,
    /// Unix ms it was stored.
    pub created_ms: i64,
    /// `truncate`, `prune`, `summary` or `fallback`.
    pub rung: String,
    /// Why it ran.
    pub reason: String,
    /// Estimated tokens of the request before.
    pub tokens_before: u64,
    /// Estimated tokens after.
    pub tokens_after: u64,
    /// Original items it replaces.
    pub covered_len: u64,
    /// Items compacted away.
    pub items_removed: u64,
    /// Items kept verbatim.
    pub items_kept: u64,
    /// The earlier items its summary says it stands for (its header's
    /// "summary of N earlier items"), for summary rungs: the count views
    /// show, so the two agree.
    pub summarized_items: Option<u64>,
    /// The summary text (summary rungs).
    pub summary: Option<String>,
    /// The compaction it extends.
    pub base: Option<String>,
    /// Summarizer calls made.
    pub summary_calls: u32,
    /// Tokens of those calls, prompt and answer.
    pub summary_tokens: u64,
    /// Of their prompt tokens, those the upstream reported read from its
    /// prompt cache.
    pub summary_cached_tokens: u64,
    /// Time to compute, ms.
    pub duration_ms: u64,
    /// The first exchange whose request it rewrote, if any yet.
    pub first_applied_exchange: Option<i64>,
    /// Exchanges whose request it rewrote.
    pub applied_exchanges: u64,
    /// Computed in observe mode: never applied.
    pub observed: bool,
    /// Estimated tokens fewer than the client's own items it covers.
    pub tokens_saved: u64,
    /// Cached tokens the upstream reported for the last request before it
    /// applied, and for the first it applied to: what it did to the
    /// prompt cache.
    pub cached_tokens_before: Option<u64>,
    /// See `cached_tokens_before`.
    pub cached_tokens_after: Option<u64>,
    /// Its facts checklist (each fact present, repaired or forgotten) and
    /// the refs of the items it removed; `null` for one stored before
    /// audits were kept.
    pub audit: Option<crate::compaction::summary::Audit>,
}

/// `show`: a conversation's timeline.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ConversationDetail {
    /// The list line.
    pub conversation: ConversationSummary,
    /// Every exchange, oldest first.
    pub exchanges: Vec<ExchangeRow>,
    /// Every compaction, oldest first.
    pub compactions: Vec<CompactionRow>,
    /// What compaction saved (or, in observe mode, would have).
    pub savings: super::savings::Savings,
    /// Held out of compaction (`compaction.holdout_ratio`): served in
    /// observe mode.
    pub held_out: bool,
}

/// A compaction in an export: the timeline row plus what it sends.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompactionExport {
    /// The timeline row.
    #[serde(flatten)]
    pub row: CompactionRow,
    /// Chain hash of the covered prefix (hex).
    pub covered_chain: String,
    /// What is sent in place of the covered prefix.
    pub replacement: Vec<Value>,
    /// Facts extracted by the proxy.
    pub facts: Option<Value>,
}

/// The request of one exchange as it went upstream.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RewrittenView {
    /// The exchange.
    pub exchange: i64,
    /// The compaction applied to it, if any.
    pub compaction: Option<String>,
    /// The items sent upstream.
    pub items: Vec<Value>,
}

/// `export`: everything recorded about a conversation.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ConversationExport {
    /// The list line.
    pub conversation: ConversationSummary,
    /// Every exchange, oldest first.
    pub exchanges: Vec<ExchangeRow>,
    /// The history as the client holds it: the latest exchange's request
    /// items followed by its answer's items.
    pub original_items: Vec<Value>,
    /// The latest exchange's request as it went upstream (derived:
    /// the original items rewritten by the compaction applied to it).
    pub rewritten_view: Option<RewrittenView>,
    /// Every compaction, oldest first.
    pub compactions: Vec<CompactionExport>,
    /// Originals of tool outputs the cheap rungs replaced, by the reference
    /// their stubs carry (`item:<first 16 hex of the item hash>`).
    pub archived: BTreeMap<String, Value>,
}

/// Resolves what a person calls a conversation: its id, an abbreviation
/// of its id, with or without the `conv_` prefix (at least
/// [`MIN_ABBREVIATION`] digits), or an id the client sent for it (our
/// header, a session id, a `prompt_cache_key`), in that order: a client
/// picks its own ids, so one of them must not shadow the id the proxy gave
/// another conversation. A name that fits several is refused with the
/// candidates.
pub fn resolve_id(conn: &dyn Sql, name: &str) -> Result<String, QueryError> {
    let name = name.trim();
    let exact = conn.first("SELECT id FROM conversations WHERE id = ?1", &[name.into()])?;
    if let Some(found) = exact {
        return Ok(found.get(0)?);
    }
    let digits = name.strip_prefix(ID_PREFIX).unwrap_or(name);
    let abbreviated = if digits.len() >= MIN_ABBREVIATION {
        candidates(
            conn,
            "SELECT id FROM conversations WHERE substr(id, 1, length(CAST(?1 AS TEXT))) = ?1
             ORDER BY last_seen_ms DESC LIMIT ?2",
            &format!("{ID_PREFIX}{digits}"),
        )?
    } else {
        Vec::new()
    };
    if abbreviated.len() == 1 {
        return one(name, abbreviated);
    }
    // A client's own id; conversations recorded before the ids had columns
    // have the explicit key, spelt `name:value`.
    let by_client = candidates(
        conn,
        "SELECT id FROM conversations
         WHERE conversation_header = ?1 OR session_id = ?1 OR prompt_cache_key = ?1
            OR explicit_key IN ('x-compactor-conversation:' || CAST(?1 AS TEXT),
                                'session-id:' || CAST(?1 AS TEXT),
                                'session_id:' || CAST(?1 AS TEXT))
         ORDER BY last_seen_ms DESC LIMIT ?2",
        name,
    )?;
    if abbreviated.is_empty() {
        return one(name, by_client);
    }
    // An abbreviation of several: all of them, and the conversations that
    // go by the name, are the candidates.
    let mut found = abbreviated;
    for id in by_client {
        if !found.contains(&id) && found.len() < MAX_CANDIDATES {
            found.push(id);
        }
    }
    one(name, found)
}

/// The conversations `sql` finds for `name` (bound as `?1`, the limit as
/// `?2`), at most [`MAX_CANDIDATES`].
fn candidates(conn: &dyn Sql, sql: &str, name: &str) -> Result<Vec<String>, QueryError> {
    let rows = conn.rows(sql, &[name.into(), (MAX_CANDIDATES as i64).into()])?;
    Ok(rows.iter().map(|r| r.get(0)).collect::<Result<_, _>>()?)
}

pub(super) fn one(name: &str, mut found: Vec<String>) -> Result<String, QueryError> {
    match found.len() {
        0 => Err(QueryError::NotFound(name.to_string())),
        1 => Ok(found.remove(0)),
        _ => Err(QueryError::Ambiguous(name.to_string(), found)),
    }
}

const SUMMARY_SELECT: &str = "
SELECT c.id, c.tenant, c.model, c.created_ms, c.last_seen_ms,
       (SELECT count(*) FROM exchanges e WHERE e.conversation_id = c.id),
       (SELECT count(*) FROM compactions k WHERE k.conversation_id = c.id),
       l.input_tokens, l.output_tokens,
       w.context_window, w.window_source,
       c.preview, c.client, c.conversation_header, c.session_id, c.prompt_cache_key,
       c.explicit_key
FROM conversations c
LEFT JOIN exchanges l ON l.id = (SELECT e2.id FROM exchanges e2
                                 WHERE e2.conversation_id = c.id AND e2.input_tokens IS NOT NULL
                                 ORDER BY e2.started_ms DESC, e2.id DESC LIMIT 1)
LEFT JOIN exchanges w ON w.id = (SELECT e3.id FROM exchanges e3
                                 WHERE e3.conversation_id = c.id
                                   AND e3.context_window IS NOT NULL
                                 ORDER BY e3.started_ms DESC, e3.id DESC LIMIT 1)";

/// The windows this config's upstream told, from the store.
fn told_windows(conn: &dyn Sql, config: &Config) -> Vec<crate::windows::Told> {
    super::rows::load_windows(conn)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.upstream == config.upstream.base_url)
        .collect()
}

fn summary_row(
    r: &Row,
    config: &Config,
    told: &[crate::windows::Told],
) -> Result<ConversationSummary, StoreError> {
    let tenant: String = r.get(1)?;
    let model: String = r.get(2)?;
    let input: Option<i64> = r.get(7)?;
    let output: Option<i64> = r.get(8)?;
    let (configured, user) = config.model_limits_sourced(&model);
    let source = if user {
        crate::windows::Source::Config
    } else {
        crate::windows::Source::Table
    };
    let (mut limits, mut source) =
        crate::windows::effective(configured, source, told.iter().find(|t| t.model == model));
    // The window the proxy used, where recorded.
    let recorded: Option<i64> = r.get(9)?;
    let recorded_source: Option<String> = r.get(10)?;
    if let Some(w) = recorded.filter(|&w| w > 0) {
        limits.context_window = w as u64;
        source = recorded_source
            .as_deref()
            .and_then(crate::windows::Source::parse)
            .unwrap_or(source);
    }
    let ids = crate::store::records::ClientIds {
        header: r.get(13)?,
        session: r.get(14)?,
        cache_key: r.get(15)?,
    };
    let mut client_ids: Vec<String> = ids.distinct().into_iter().map(String::from).collect();
    if client_ids.is_empty() {
        let key: Option<String> = r.get(16)?;
        client_ids.extend(key.and_then(|k| k.split_once(':').map(|(_, v)| v.to_string())));
    }
    Ok(ConversationSummary {
        id: r.get(0)?,
        client_ids,
        preview: r.get(11)?,
        client: r.get(12)?,
        tenant: tenant.chars().take(TENANT_PREFIX).collect(),
        created_ms: r.get(3)?,
        last_seen_ms: r.get(4)?,
        exchanges: r.count(5)?,
        compactions: r.count(6)?,
        last_input_tokens: input.map(|v| v as u64),
        last_output_tokens: output.map(|v| v as u64),
        last_tokens: input.map(|i| (i + output.unwrap_or(0)) as u64),
        context_window: limits.context_window,
        window_source: source.as_str(),
        trigger_tokens: crate::compaction::policy::trigger_tokens(&limits),
        model,
    })
}

/// Conversations, most recently seen first; at most `limit`.
pub fn list_conversations(
    conn: &dyn Sql,
    config: &Config,
    limit: usize,
) -> Result<Vec<ConversationSummary>, QueryError> {
    let sql = format!("{SUMMARY_SELECT} ORDER BY c.last_seen_ms DESC, c.id LIMIT ?1");
    let told = told_windows(conn, config);
    let limit = Param::Int(limit.min(i64::MAX as usize) as i64);
    Ok(conn
        .rows(&sql, &[limit])?
        .iter()
        .map(|r| summary_row(r, config, &told))
        .collect::<Result<_, _>>()?)
}

/// One conversation's list line (`id` exact or a unique prefix).
pub fn conversation(
    conn: &dyn Sql,
    config: &Config,
    id: &str,
) -> Result<ConversationSummary, QueryError> {
    let id = resolve_id(conn, id)?;
    let sql = format!("{SUMMARY_SELECT} WHERE c.id = ?1");
    let told = told_windows(conn, config);
    let row = conn
        .first(&sql, &[id.as_str().into()])?
        .ok_or_else(|| QueryError::NotFound(id.clone()))?;
    Ok(summary_row(&row, config, &told)?)
}

fn exchanges(conn: &dyn Sql, id: &str) -> Result<Vec<ExchangeRow>, QueryError> {
    let rows = conn.rows(
        "SELECT id, started_ms, endpoint, model, status, streamed, partial, request_len,
                length(response_items) / 32, input_tokens, output_tokens, cached_tokens,
                latency_ms, compaction_id, error, context_window, window_source, mode, tokens_saved,
                tokens_saved_potential, cache_write_tokens, cache_write_1h_tokens
         FROM exchanges WHERE conversation_id = ?1 ORDER BY started_ms, id",
        &[id.into()],
    )?;
    let opt = |v: Option<i64>| v.map(|x| x as u64);
    let rows = rows
        .iter()
        .map(|r| {
            Ok::<_, StoreError>(ExchangeRow {
                id: r.get(0)?,
                started_ms: r.get(1)?,
                endpoint: r.get(2)?,
                model: r.get(3)?,
                status: r.get(4)?,
                streamed: r.get(5)?,
                partial: r.get(6)?,
                request_items: r.count(7)?,
                response_items: r.count(8)?,
                input_tokens: opt(r.get(9)?),
                output_tokens: opt(r.get(10)?),
                cached_tokens: opt(r.get(11)?),
                latency_ms: r.get(12)?,
                compaction: r.get(13)?,
                error: r.get(14)?,
                context_window: opt(r.get(15)?),
                window_source: r.get(16)?,
                mode: r.get(17)?,
                tokens_saved: r.count(18)?,
                tokens_saved_potential: r.count(19)?,
                cache_write_tokens: opt(r.get(20)?),
                cache_write_1h_tokens: opt(r.get(21)?),
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(rows)
}

fn compaction_row(c: &Compaction, exchanges: &[ExchangeRow]) -> CompactionRow {
    let applied: Vec<i64> = exchanges
        .iter()
        .filter(|e| e.compaction.as_deref() == Some(c.id.as_str()))
        .map(|e| e.id)
        .collect();
    let first = applied
        .first()
        .and_then(|id| exchanges.iter().position(|e| e.id == *id));
    let cached_tokens_before = first
        .and_then(|i| {
            exchanges[..i]
                .iter()
                .rev()
                .find(|e| e.input_tokens.is_some())
        })
        .and_then(|e| e.cached_tokens);
    let cached_tokens_after = first.and_then(|i| exchanges[i].cached_tokens);
    CompactionRow {
        id: c.id.clone(),
        created_ms: c.created_ms,
        rung: c.rung.as_str().to_string(),
        reason: c.reason.clone(),
        tokens_before: c.tokens_before,
        tokens_after: c.tokens_after,
        covered_len: c.covered_len as u64,
        items_removed: c.items_removed as u64,
        items_kept: c.items_kept as u64,
        summarized_items: c.summary.as_deref().and_then(summarized_items),
        summary: c.summary.clone(),
        base: c.base.clone(),
        summary_calls: c.summary_calls,
        summary_tokens: c.summary_tokens,
        summary_cached_tokens: c.summary_cache.read,
        duration_ms: c.duration_ms,
        first_applied_exchange: applied.first().copied(),
        applied_exchanges: applied.len() as u64,
        observed: c.observed,
        tokens_saved: c.saved(),
        cached_tokens_before,
        cached_tokens_after,
        audit: c.audit.clone(),
    }
}

/// A conversation's timeline (`id` exact or a unique prefix).
pub fn show(conn: &dyn Sql, config: &Config, id: &str) -> Result<ConversationDetail, QueryError> {
    let conversation = conversation(conn, config, id)?;
    let exchanges = exchanges(conn, &conversation.id)?;
    let compactions = load_compactions(conn, Some(&conversation.id))?
        .iter()
        .map(|c| compaction_row(c, &exchanges))
        .collect();
    let shown = super::savings::report(conn, config, Some(&conversation.id))?
        .conversations
        .pop();
    let held_out = shown.as_ref().is_some_and(|c| c.held_out);
    let savings = shown.map(|c| c.savings).unwrap_or_default();
    Ok(ConversationDetail {
        conversation,
        exchanges,
        compactions,
        savings,
        held_out,
    })
}

/// Everything recorded about a conversation (`id` exact or a unique prefix).
pub fn export(conn: &dyn Sql, config: &Config, id: &str) -> Result<ConversationExport, QueryError> {
    let conversation = conversation(conn, config, id)?;
    let exchanges = exchanges(conn, &conversation.id)?;
    let stored = load_compactions(conn, Some(&conversation.id))?;
    let mut bodies = ItemCache::default();

    let (original_items, rewritten_view) = match exchanges.last() {
        None => (Vec::new(), None),
        Some(last) => {
            let request: Vec<Value> = request_item_hashes(conn, last.id)?
                .iter()
                .map(|h| bodies.get(conn, h))
                .collect::<Result<_, _>>()?;
            let applied = match &last.compaction {
                None => None,
                Some(cid) => match stored.iter().find(|c| &c.id == cid) {
                    Some(c) => Some(c.clone()),
                    // Applied from another conversation of the same tenant.
                    None => super::rows::load_compaction(conn, cid)?,
                },
            };
            let items = match &applied {
                Some(c) => rewrite::rewrite(&request, c),
                None => request.clone(),
            };
            let response: Vec<u8> = conn
                .first(
                    "SELECT response_items FROM exchanges WHERE id = ?1",
                    &[last.id.into()],
                )?
                .ok_or(StoreError::MissingExchange(last.id))?
                .get(0)?;
            let mut original = request;
            for h in unpack_hashes(&response) {
                original.push(bodies.get(conn, &h)?);
            }
            let view = RewrittenView {
                exchange: last.id,
                compaction: last.compaction.clone(),
                items,
            };
            (original, Some(view))
        }
    };

    let mut archived = BTreeMap::new();
    for c in &stored {
        let text = serde_json::to_string(&c.replacement).unwrap_or_default();
        for reference in archive_refs(&text) {
            if archived.contains_key(&reference) {
                continue;
            }
            if let Some(item) = archived_item(conn, &reference)? {
                archived.insert(reference, item);
            }
        }
    }
    let compactions = stored
        .iter()
        .map(|c| CompactionExport {
            row: compaction_row(c, &exchanges),
            covered_chain: hex(&c.covered_chain),
            replacement: c.replacement.clone(),
            facts: c.facts.as_ref().and_then(|f| serde_json::to_value(f).ok()),
        })
        .collect();
    Ok(ConversationExport {
        conversation,
        exchanges,
        original_items,
        rewritten_view,
        compactions,
        archived,
    })
}

/// N of a summary's header, `[compactor summary of N earlier items]`.
fn summarized_items(summary: &str) -> Option<u64> {
    let rest = summary.strip_prefix(crate::compaction::items::SUMMARY_MARKER)?;
    let n = rest.strip_prefix(" of ")?.split(' ').next()?;
    n.parse().ok()
}

/// Item bodies already read (a history repeats its items in every exchange).
#[derive(Default)]
struct ItemCache(HashMap<ItemHash, Value>);

impl ItemCache {
    fn get(&mut self, conn: &dyn Sql, hash: &ItemHash) -> Result<Value, QueryError> {
        if let Some(v) = self.0.get(hash) {
            return Ok(v.clone());
        }
        let v = match item_body(conn, hash)? {
            Some(body) => serde_json::from_str(&body).unwrap_or(Value::String(body)),
            None => Value::Null,
        };
        self.0.insert(*hash, v.clone());
        Ok(v)
    }
}

/// The `item:<16 hex>` references in `text`, in order, without repeats.
pub fn archive_refs(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("item:") {
        let after = &rest[at + 5..];
        let hexlen = after
            .bytes()
            .take_while(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
            .count();
        if hexlen == 16 {
            let r = format!("item:{}", &after[..16]);
            if !out.contains(&r) {
                out.push(r);
            }
        }
        rest = after;
    }
    out
}

/// The stored item an `item:<16 hex>` reference names, if any.
pub fn archived_item(conn: &dyn Sql, reference: &str) -> Result<Option<Value>, QueryError> {
    let Some(prefix) = reference.strip_prefix("item:").and_then(parse_hex8) else {
        return Ok(None);
    };
    // Range scan on the primary key: every hash starting with these 8 bytes.
    let mut low = prefix.to_vec();
    low.resize(32, 0);
    let mut high = prefix.to_vec();
    high.resize(32, 0xff);
    let body: Option<String> = conn
        .first(
            "SELECT body FROM items WHERE hash >= ?1 AND hash <= ?2 LIMIT 1",
            &[low.as_slice().into(), high.as_slice().into()],
        )?
        .map(|r| r.get(0))
        .transpose()?;
    Ok(body.map(|b| serde_json::from_str(&b).unwrap_or(Value::String(b))))
}

/// The 8 bytes 16 hex digits spell.
pub(crate) fn parse_hex8(s: &str) -> Option<[u8; 8]> {
    if s.len() != 16 {
        return None;
    }
    let mut out = [0u8; 8];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::SqliteBackend;
    use crate::store::{Backend, ClientIds, Record};

    /// A store holding `conversations` (id, client ids), one exchange each.
    fn store_of(conversations: &[(&str, ClientIds)]) -> (tempfile::TempDir, SqliteBackend) {
        let dir = tempfile::tempdir().unwrap();
        let mut b = SqliteBackend::open(&dir.path().join("s.db")).unwrap();
        let batch: Vec<Record> = conversations
            .iter()
            .enumerate()
            .map(|(i, (id, ids))| {
                let mut r = crate::store::journal::tests::record(i as i64 + 1);
                r.conversation = id.to_string();
                r.client_ids = ids.clone();
                Record::Exchange(Box::new(r))
            })
            .collect();
        b.write(&batch).unwrap();
        (dir, b)
    }

    fn header(id: &str) -> ClientIds {
        ClientIds {
            header: Some(id.into()),
            ..ClientIds::default()
        }
    }

    #[test]
    fn conversations_are_found_by_the_names_people_use() {
        let session = ClientIds {
            session: Some("0199a-codex".into()),
            cache_key: Some("0199a-codex".into()),
            ..ClientIds::default()
        };
        let (_dir, b) = store_of(&[
            ("conv_9bb4a1", header("my-session-42")),
            ("conv_9bb4c2", session),
            ("conv_77aa00", ClientIds::default()),
        ]);
        let conn = b.connection();
        let found = |name: &str| resolve_id(conn, name);
        assert_eq!(found("conv_77aa00").unwrap(), "conv_77aa00");
        assert_eq!(found("my-session-42").unwrap(), "conv_9bb4a1");
        assert_eq!(found("0199a-codex").unwrap(), "conv_9bb4c2");
        assert_eq!(found("conv_77aa").unwrap(), "conv_77aa00");
        assert_eq!(found("77aa").unwrap(), "conv_77aa00", "without the prefix");
        assert_eq!(found("9bb4a").unwrap(), "conv_9bb4a1");
        match found("9bb4") {
            Err(e @ QueryError::Ambiguous(..)) => {
                let text = e.to_string();
                assert!(
                    text.contains("conv_9bb4a1") && text.contains("conv_9bb4c2"),
                    "{text}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(found("77a"), Err(QueryError::NotFound(_))),
            "too short"
        );
        assert!(matches!(found("conv_"), Err(QueryError::NotFound(_))));
        assert!(matches!(found("nobody"), Err(QueryError::NotFound(_))));
        // The list names them as their clients do.
        let list = list_conversations(conn, &Config::default(), 10).unwrap();
        let named = list.iter().find(|c| c.id == "conv_9bb4c2").unwrap();
        assert_eq!(
            named.client_ids,
            ["0199a-codex"],
            "one id, though sent twice"
        );
        assert_eq!(named.client.as_deref(), Some("codex_cli_rs/0.1"));
        assert_eq!(named.preview.as_deref(), Some("Count to 2."));
        assert_eq!(
            (named.context_window, named.window_source),
            (4096, "discovered")
        );
    }

    #[test]
    fn a_client_id_two_conversations_share_is_ambiguous() {
        // The same session name under two credentials.
        let (_dir, b) = store_of(&[("conv_aaaa01", header("s")), ("conv_bbbb02", header("s"))]);
        b.connection()
            .execute("UPDATE conversations SET tenant = id", [])
            .unwrap();
        match resolve_id(b.connection(), "s") {
            Err(QueryError::Ambiguous(name, found)) => {
                assert_eq!(name, "s");
                assert_eq!(found.len(), 2);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_conversation_recorded_before_client_ids_is_found_by_its_key() {
        let (_dir, b) = store_of(&[("conv_cccc03", ClientIds::default())]);
        b.connection()
            .execute(
                "UPDATE conversations SET explicit_key = 'x-compactor-conversation:old-42'",
                [],
            )
            .unwrap();
        assert_eq!(resolve_id(b.connection(), "old-42").unwrap(), "conv_cccc03");
        let list = list_conversations(b.connection(), &Config::default(), 10).unwrap();
        assert_eq!(list[0].client_ids, ["old-42"]);
    }

    #[test]
    fn a_summary_header_gives_its_count() {
        assert_eq!(
            summarized_items("[compactor summary of 7 earlier items]\n## TASK"),
            Some(7)
        );
        assert_eq!(
            summarized_items("[compactor summary of 1 earlier item]"),
            Some(1)
        );
        assert_eq!(summarized_items("no header"), None);
    }

    #[test]
    fn finds_archive_references() {
        let text = "x [compactor: 10 bytes elided; original archived as item:0123456789abcdef]\
                    item:0123456789abcdef item:short item:fedcba9876543210";
        assert_eq!(
            archive_refs(text),
            vec!["item:0123456789abcdef", "item:fedcba9876543210"]
        );
        assert_eq!(
            parse_hex8("0123456789abcdef"),
            Some([0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef])
        );
        assert_eq!(parse_hex8("0123"), None);
    }
}
