//! What compaction saved, from the records: per conversation, per tenant
//! and in total.
//!
//! For each exchange whose upstream reported usage: the input tokens it
//! received, and those it would have received without the compaction
//! applied (received + the compaction's saving on the client's own items,
//! recorded with the exchange). The summarizer calls' own tokens are
//! subtracted from the saving: net is what the upstream was spared in all.
//! Observe mode's exchanges carry the saving the proxy would have made.
//!
//! Prompt-cache reuse is the share of input tokens the upstream reported as
//! `cached_tokens`. Without compaction nobody measured it; the figure given
//! for it assumes the best an upstream can do for an agent whose requests
//! repeat the previous one: each request reads from the cache all the
//! previous request of its conversation sent (when the upstream reported
//! any cache reads in that conversation, else none). So the uncompacted
//! run's cache reuse is an upper bound and the money saved a lower bound.
//!
//! Money needs prices: a `[[models]]` entry's `input_price_per_mtok` (and
//! the cached-input and output prices). The summarizer's calls are priced
//! at the summarizer model's.

use std::collections::BTreeMap;

use serde::Serialize;

use super::sql::Sql;
use super::{StoreError, TENANT_PREFIX};
use crate::config::{Config, Prices};

/// Savings of a set of exchanges (a conversation, a tenant, all).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Savings {
    /// Exchanges recorded.
    pub exchanges: u64,
    /// Of those, the ones whose upstream reported usage (the figures below
    /// are theirs).
    pub exchanges_with_usage: u64,
    /// Exchanges a compaction applied to.
    pub exchanges_compacted: u64,
    /// Input tokens the upstream received.
    pub input_tokens: u64,
    /// Input tokens it would have received without compaction.
    pub input_tokens_uncompacted: u64,
    /// The difference.
    pub tokens_saved: u64,
    /// Output tokens of the answers.
    pub output_tokens: u64,
    /// Summarizer calls made.
    pub summarizer_calls: u64,
    /// Their input tokens.
    pub summarizer_input_tokens: u64,
    /// Their output tokens.
    pub summarizer_output_tokens: u64,
    /// `tokens_saved` less the summarizer's tokens.
    pub net_tokens_saved: i64,
    /// Observe mode: input tokens compaction would have saved.
    pub tokens_saved_potential: u64,
    /// Input tokens the upstream read from its prompt cache (as reported).
    pub cached_tokens: u64,
    /// `cached_tokens` over `input_tokens` (when the upstream reports them).
    pub cache_reuse: Option<f64>,
    /// Without compaction, at best (see the module's documentation).
    pub cache_reuse_uncompacted: Option<f64>,
    /// What the exchanges and the summarizer calls cost, when every model
    /// involved has prices.
    pub cost: Option<f64>,
    /// What the exchanges would have cost without compaction (at the best
    /// cache reuse above).
    pub cost_uncompacted: Option<f64>,
    /// `cost_uncompacted − cost`.
    pub money_saved: Option<f64>,
    /// Cache tokens seen reported at all (whether `cache_reuse` means
    /// anything).
    #[serde(skip)]
    cache_reported: bool,
    /// Cache tokens the uncompacted run would have read, at best.
    #[serde(skip)]
    cached_uncompacted: u64,
    /// Every cost seen had prices.
    #[serde(skip)]
    unpriced: bool,
}

impl Savings {
    fn add(&mut self, o: &Savings) {
        self.exchanges += o.exchanges;
        self.exchanges_with_usage += o.exchanges_with_usage;
        self.exchanges_compacted += o.exchanges_compacted;
        self.input_tokens += o.input_tokens;
        self.input_tokens_uncompacted += o.input_tokens_uncompacted;
        self.output_tokens += o.output_tokens;
        self.summarizer_calls += o.summarizer_calls;
        self.summarizer_input_tokens += o.summarizer_input_tokens;
        self.summarizer_output_tokens += o.summarizer_output_tokens;
        self.tokens_saved_potential += o.tokens_saved_potential;
        self.cached_tokens += o.cached_tokens;
        self.cached_uncompacted += o.cached_uncompacted;
        self.cache_reported |= o.cache_reported;
        self.unpriced |= o.unpriced;
        let add = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.cost = add(self.cost, o.cost);
        self.cost_uncompacted = add(self.cost_uncompacted, o.cost_uncompacted);
    }

    /// Derives the differences and ratios from the sums.
    fn finish(mut self) -> Savings {
        self.tokens_saved = self
            .input_tokens_uncompacted
            .saturating_sub(self.input_tokens);
        self.net_tokens_saved = self.tokens_saved as i64
            - (self.summarizer_input_tokens + self.summarizer_output_tokens) as i64;
        let ratio = |part: u64, whole: u64| (whole > 0).then(|| part as f64 / whole as f64);
        if self.cache_reported {
            self.cache_reuse = ratio(self.cached_tokens, self.input_tokens);
            self.cache_reuse_uncompacted =
                ratio(self.cached_uncompacted, self.input_tokens_uncompacted);
        }
        if self.unpriced {
            self.cost = None;
            self.cost_uncompacted = None;
        }
        self.money_saved = self.cost_uncompacted.zip(self.cost).map(|(u, c)| u - c);
        self
    }
}

/// [`Savings`] per conversation, per tenant and in total.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// All conversations.
    pub total: Savings,
    /// By tenant (its first characters, as listed).
    pub tenants: BTreeMap<String, Savings>,
    /// By conversation, with its tenant and model.
    pub conversations: Vec<ConversationSavings>,
}

/// One conversation's savings.
#[derive(Debug, Clone, Serialize)]
pub struct ConversationSavings {
    /// `conv_…`
    pub id: String,
    /// First characters of the tenant hash.
    pub tenant: String,
    /// The model of its latest exchange.
    pub model: String,
    /// Its figures.
    #[serde(flatten)]
    pub savings: Savings,
}

/// The savings of one conversation (`None`: all of them).
pub fn report(
    conn: &dyn Sql,
    config: &Config,
    conversation: Option<&str>,
) -> Result<Report, StoreError> {
    let mut by_conversation: BTreeMap<String, (String, String, Savings)> = BTreeMap::new();
    // Per conversation: the previous exchange's uncompacted input, the
    // cache the uncompacted run would have read.
    let mut previous: BTreeMap<String, u64> = BTreeMap::new();
    let rows = conn.rows(
        "SELECT conversation_id, tenant, model, input_tokens, output_tokens, cached_tokens,
                tokens_saved, tokens_saved_potential, compaction_id
         FROM exchanges WHERE CAST(?1 AS TEXT) IS NULL OR conversation_id = ?1
         ORDER BY conversation_id, started_ms, id",
        &[conversation.into()],
    )?;
    // Per conversation, each exchange's (uncompacted input, the cache it
    // would have read at best, output, prices).
    type Uncompacted = Vec<(u64, u64, u64, Option<Prices>)>;
    let mut uncompacted: BTreeMap<String, Uncompacted> = BTreeMap::new();
    for r in &rows {
        let id: String = r.get(0)?;
        let tenant: String = r.get(1)?;
        let model: String = r.get(2)?;
        let get = |i: usize| -> Result<Option<u64>, StoreError> {
            Ok(r.get::<Option<i64>>(i)?.map(|v| v.max(0) as u64))
        };
        let (input, output, cached) = (get(3)?, get(4)?, get(5)?);
        let saved = get(6)?.unwrap_or(0);
        let potential = get(7)?.unwrap_or(0);
        let compacted = r.get::<Option<String>>(8)?.is_some();
        let entry = by_conversation
            .entry(id.clone())
            .or_insert_with(|| (tenant.clone(), model.clone(), Savings::default()));
        entry.1 = model.clone();
        let s = &mut entry.2;
        s.exchanges += 1;
        s.exchanges_compacted += compacted as u64;
        let Some(input) = input else { continue };
        let output = output.unwrap_or(0);
        s.exchanges_with_usage += 1;
        s.input_tokens += input;
        s.input_tokens_uncompacted += input + saved;
        s.output_tokens += output;
        s.tokens_saved_potential += potential;
        s.cache_reported |= cached.is_some_and(|c| c > 0);
        s.cached_tokens += cached.unwrap_or(0);
        let prices = config.prices(&model);
        match prices {
            Some(p) => {
                *s.cost.get_or_insert(0.0) += p.cost(input, cached.unwrap_or(0), output);
            }
            None => s.unpriced = true,
        }
        let whole = input + saved;
        let before = previous.insert(id.clone(), whole).unwrap_or(0);
        uncompacted
            .entry(id)
            .or_default()
            .push((whole, before.min(whole), output, prices));
    }
    // The uncompacted run's cache, once it is known whether the upstream
    // caches at all for the conversation.
    for (id, list) in uncompacted {
        let Some((_, _, s)) = by_conversation.get_mut(&id) else {
            continue;
        };
        for (input, best, output, prices) in list {
            let cached = if s.cache_reported { best } else { 0 };
            s.cached_uncompacted += cached;
            if let Some(p) = prices {
                *s.cost_uncompacted.get_or_insert(0.0) += p.cost(input, cached, output);
            }
        }
    }
    let rows = conn.rows(
        "SELECT conversation_id, summary_calls, summary_tokens, summary_output_tokens
         FROM compactions WHERE CAST(?1 AS TEXT) IS NULL OR conversation_id = ?1",
        &[conversation.into()],
    )?;
    for r in &rows {
        let id: String = r.get(0)?;
        let Some((_, model, s)) = by_conversation.get_mut(&id) else {
            continue;
        };
        let calls = r.count(1)?;
        let total = r.count(2)?;
        let output = r.count(3)?.min(total);
        s.summarizer_calls += calls;
        s.summarizer_input_tokens += total - output;
        s.summarizer_output_tokens += output;
        if total > 0 {
            let summarizer = match config.compaction.summarizer_model.as_str() {
                "" => model.as_str(),
                m => m,
            };
            match config.prices(summarizer) {
                Some(p) => *s.cost.get_or_insert(0.0) += p.cost(total - output, 0, output),
                None => s.unpriced = true,
            }
        }
    }
    let mut report = Report::default();
    for (id, (tenant, model, s)) in by_conversation {
        let tenant: String = tenant.chars().take(TENANT_PREFIX).collect();
        report.tenants.entry(tenant.clone()).or_default().add(&s);
        report.total.add(&s);
        report.conversations.push(ConversationSavings {
            id,
            tenant,
            model,
            savings: s.finish(),
        });
    }
    report.total = report.total.finish();
    for s in report.tenants.values_mut() {
        *s = std::mem::take(s).finish();
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::journal::tests::record;
    use crate::store::sqlite::SqliteBackend;
    use crate::store::{Backend, ExchangeSavings, Record};
    use crate::wire::Usage;

    /// An exchange of `conv` that reported `input` (`cached` of them from
    /// the cache) and 10 output tokens, `saved` fewer than uncompacted.
    fn exchange(id: i64, conv: &str, input: u64, cached: u64, saved: u64) -> Record {
        let mut r = record(id);
        r.conversation = conv.into();
        r.new_conversation = id == 1 || conv == "conv_b" && id == 3;
        r.model = "priced".into();
        r.usage = Some(Usage {
            input_tokens: input,
            output_tokens: 10,
            cached_tokens: Some(cached),
        });
        r.compaction = (saved > 0).then(|| "cmp_x".to_string());
        r.savings = ExchangeSavings {
            tokens_saved: saved,
            ..Default::default()
        };
        Record::Exchange(Box::new(r))
    }

    #[test]
    fn net_savings_subtract_the_summarizer_and_price_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        let mut db = SqliteBackend::open(&path).unwrap();
        let mut c = crate::compaction::test_compaction("cmp_x", "t", 3, [0; 32], vec![]);
        c.conversation = "conv_a".into();
        (c.summary_tokens, c.summary_output_tokens) = (300, 100);
        db.write(&[
            exchange(1, "conv_a", 1000, 0, 0),
            exchange(2, "conv_a", 400, 0, 1000),
            exchange(4, "conv_a", 500, 400, 1000),
            exchange(3, "conv_b", 50, 0, 0),
            Record::Compaction(Box::new(c)),
        ])
        .unwrap();
        let config = Config::from_toml(
            "[[models]]\nmatch = \"priced\"\ncontext_window = 4000\n\
             input_price_per_mtok = 2.0\ncached_input_price_per_mtok = 1.0\n\
             output_price_per_mtok = 8.0\n",
        )
        .unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        let r = report(&conn, &config, None).unwrap();
        let a = &r.conversations[0].savings;
        assert_eq!(r.conversations[0].id, "conv_a");
        assert_eq!((a.input_tokens, a.input_tokens_uncompacted), (1900, 3900));
        assert_eq!(a.tokens_saved, 2000);
        assert_eq!(
            (a.summarizer_input_tokens, a.summarizer_output_tokens),
            (200, 100)
        );
        assert_eq!(a.net_tokens_saved, 1700);
        assert_eq!(a.exchanges_compacted, 2);
        // Reported: 400 of 1900. Uncompacted at best: each request reads
        // the previous one whole, 1000 + 1400 of 3900.
        assert_eq!(a.cache_reuse, Some(400.0 / 1900.0));
        assert_eq!(a.cache_reuse_uncompacted, Some(2400.0 / 3900.0));
        let m = |input: f64, cached: f64, output: f64| (input * 2.0 + cached + output * 8.0) / 1e6;
        let cost = m(1500.0, 400.0, 30.0) + m(200.0, 0.0, 100.0);
        let uncompacted = m(1500.0, 2400.0, 30.0);
        let close = |x: Option<f64>, y: f64| (x.unwrap() - y).abs() < 1e-12;
        assert!(close(a.cost, cost), "{:?} {cost}", a.cost);
        assert!(close(a.cost_uncompacted, uncompacted));
        assert!(close(a.money_saved, uncompacted - cost));
        // A conversation that never read the cache: none assumed for it.
        let b = &r.conversations[1].savings;
        assert_eq!((b.cache_reuse, b.cache_reuse_uncompacted), (None, None));
        assert_eq!(r.total.input_tokens, 1950);
        assert_eq!(r.total.net_tokens_saved, 1700);
        assert_eq!(r.tenants["t"].exchanges, 4);
        // Without prices there is no money figure, only tokens.
        let r = report(&conn, &Config::default(), Some("conv_a")).unwrap();
        assert_eq!(r.total.tokens_saved, 2000);
        assert_eq!((r.total.cost, r.total.money_saved), (None, None));
    }
}
