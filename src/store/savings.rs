//! What compaction saved, from the records: per conversation, per tenant
//! and in total, in tokens and, where prices are known, on the bill.
//!
//! For each exchange whose upstream reported usage: the input tokens it
//! received, and those it would have received without the compaction
//! applied (received + the compaction's saving on the client's own items,
//! recorded with the exchange). The summarizer calls' own tokens are
//! subtracted from the saving: net is what the upstream was spared in all.
//! Observe mode's exchanges carry the saving the proxy would have made.
//!
//! # The bill
//!
//! What was paid: every exchange priced from the usage its upstream
//! reported (input neither read nor written at the input price, cache
//! reads at the read price, cache writes at the five-minute or one-hour
//! write price, output at the output price), the `compactor_recall`
//! rounds' tokens (read from the cache in the share the exchange's own
//! prompt was), and every summarizer and provider-compaction call of the
//! conversation's compactions, at the summarizer model's prices, their
//! prompts read from and written to the cache as their upstream reported
//! it (recorded with each compaction: a summary call that repeats the
//! conversation's request reads its history from the cache); a summary
//! recorded without those figures (an upstream that reports none, or one
//! stored before they were kept) is priced uncached.
//!
//! What the uncompacted request would have cost, the counterfactual: an
//! exchange no compaction applied to is its own counterfactual (the same
//! request, the same cache). For a compacted one, the client's own request
//! (received + saved tokens) is priced with the cache it would have had:
//! - it reads the whole previous request of the conversation from the
//!   cache (the best an upstream does for a client whose requests repeat
//!   the previous one), when the conversation's upstream reported any
//!   cache read or write at all and the request came within the cache's
//!   lifetime of the previous answer's end (five minutes; an hour once the
//!   conversation's upstream reported an hour's writes);
//! - the rest is written to the cache when the upstream bills writes (it
//!   reported any: Anthropic), at the lifetimes in the shares the
//!   conversation's reported writes had, else it is uncached input;
//! - its output is the answer's.
//!
//! So the counterfactual's cache is at its best (no 1,024-token minimum,
//! no breakpoint placement, no eviction), its cost a lower bound, and the
//! money saved (`cost_uncompacted − cost`) a lower bound too; it is
//! negative when compaction cost more. It does not count what the
//! uncompacted request might not have been able to do at all (a prompt
//! past the window), nor the client's own compaction in its place.
//!
//! An upstream that reports no cache fields (an older server) is treated
//! as uncached, both ways, and said so (`exchanges_without_cache_fields`).
//! A model with no price known (see [`crate::prices`]) gets no dollar
//! figure at all, for its conversation and for any sum that includes it
//! (`unpriced_models` names it): tokens are shown, dollars never invented.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::error::StoreError;
use super::records::TENANT_PREFIX;
use super::sql::Sql;
use crate::config::Config;
use crate::prices::{CacheSeen, Previous, Prices, Tokens};

/// Savings of a set of exchanges (a conversation, a tenant, all).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Savings {
    /// Exchanges recorded.
    pub exchanges: u64,
    /// Of those, the ones whose upstream reported usage (the figures below
    /// are theirs).
    pub exchanges_with_usage: u64,
    /// Of those, the ones whose usage had no cache field at all: taken as
    /// uncached.
    pub exchanges_without_cache_fields: u64,
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
    /// Of their input tokens, those read from the upstream's prompt cache
    /// (as reported).
    pub summarizer_cached_tokens: u64,
    /// `tokens_saved` less the summarizer's tokens.
    pub net_tokens_saved: i64,
    /// Observe mode: input tokens compaction would have saved.
    pub tokens_saved_potential: u64,
    /// Input tokens the upstream read from its prompt cache (as reported).
    pub cached_tokens: u64,
    /// Input tokens it wrote to its prompt cache (as reported).
    pub cache_write_tokens: u64,
    /// Of those, the ones written for an hour.
    pub cache_write_1h_tokens: u64,
    /// `cached_tokens` over `input_tokens` (when the upstream reports them).
    pub cache_reuse: Option<f64>,
    /// Without compaction, at best (see the module's documentation).
    pub cache_reuse_uncompacted: Option<f64>,
    /// What was paid: the exchanges, their recall rounds and the
    /// summarizer calls, when every model involved has prices.
    pub cost: Option<f64>,
    /// Of `cost`, the summarizer's and the provider's compaction calls.
    pub cost_summaries: Option<f64>,
    /// What the exchanges would have cost without compaction, with the
    /// cache they would have had (see the module's documentation).
    pub cost_uncompacted: Option<f64>,
    /// `cost_uncompacted − cost`: negative when compaction cost more.
    pub money_saved: Option<f64>,
    /// The models with no price known: why there is no dollar figure.
    pub unpriced_models: BTreeSet<String>,
    /// Cache tokens seen reported at all (whether `cache_reuse` means
    /// anything).
    #[serde(skip)]
    cache_reported: bool,
    /// Cache tokens the uncompacted run would have read, at best.
    #[serde(skip)]
    cached_uncompacted: u64,
}

impl Savings {
    fn add(&mut self, o: &Savings) {
        self.exchanges += o.exchanges;
        self.exchanges_with_usage += o.exchanges_with_usage;
        self.exchanges_without_cache_fields += o.exchanges_without_cache_fields;
        self.exchanges_compacted += o.exchanges_compacted;
        self.input_tokens += o.input_tokens;
        self.input_tokens_uncompacted += o.input_tokens_uncompacted;
        self.output_tokens += o.output_tokens;
        self.summarizer_calls += o.summarizer_calls;
        self.summarizer_input_tokens += o.summarizer_input_tokens;
        self.summarizer_output_tokens += o.summarizer_output_tokens;
        self.summarizer_cached_tokens += o.summarizer_cached_tokens;
        self.tokens_saved_potential += o.tokens_saved_potential;
        self.cached_tokens += o.cached_tokens;
        self.cache_write_tokens += o.cache_write_tokens;
        self.cache_write_1h_tokens += o.cache_write_1h_tokens;
        self.cached_uncompacted += o.cached_uncompacted;
        self.cache_reported |= o.cache_reported;
        self.unpriced_models
            .extend(o.unpriced_models.iter().cloned());
        let add = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.cost = add(self.cost, o.cost);
        self.cost_summaries = add(self.cost_summaries, o.cost_summaries);
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
        if !self.unpriced_models.is_empty() {
            self.cost = None;
            self.cost_summaries = None;
            self.cost_uncompacted = None;
        }
        self.money_saved = self.cost_uncompacted.zip(self.cost).map(|(u, c)| u - c);
        self
    }

    /// Prices `tokens` at `model`'s prices into `cost` (or notes the model
    /// unpriced).
    fn pay(
        &mut self,
        prices: Option<Prices>,
        model: &str,
        paid: Tokens,
        uncompacted: Option<Tokens>,
    ) {
        match prices {
            Some(p) => {
                *self.cost.get_or_insert(0.0) += p.cost(&paid);
                if let Some(u) = uncompacted {
                    *self.cost_uncompacted.get_or_insert(0.0) += p.cost(&u);
                }
            }
            None => {
                self.unpriced_models.insert(model.to_string());
            }
        }
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
    /// The date of the built-in price list.
    pub prices_as_of: &'static str,
    /// Compacted against held-out conversations, when
    /// `compaction.holdout_ratio` holds some out.
    pub holdout: Option<Holdout>,
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
    /// Whether it is held out (`compaction.holdout_ratio`): served in
    /// observe mode, never compacted.
    pub held_out: bool,
    /// Its figures.
    #[serde(flatten)]
    pub savings: Savings,
}

/// The holdout's comparison: conversations served compacting (auto mode)
/// against those held out of compaction (observe mode), each a share of
/// the new conversations drawn from their ids.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Holdout {
    /// `compaction.holdout_ratio`.
    pub ratio: f64,
    /// Auto-mode conversations not held out.
    pub compacted: Group,
    /// Held-out conversations.
    pub held_out: Group,
}

/// One side of the holdout.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Group {
    /// Conversations.
    pub conversations: u64,
    /// Their exchanges (turns).
    pub turns: u64,
    /// Exchanges the client got an error for (status 400 or more, but
    /// 499: the client gone).
    pub errors: u64,
    /// Upstream "too long" answers: relayed to the client, or answered by
    /// a compaction and a retry.
    pub too_long: u64,
    /// What was paid (`None`: a model without prices).
    pub cost: Option<f64>,
    /// `cost` over `turns`.
    pub cost_per_turn: Option<f64>,
    /// Models without prices among them.
    #[serde(skip)]
    unpriced: bool,
}

impl Group {
    fn add(&mut self, s: &Savings, errors: u64, too_long: u64) {
        self.conversations += 1;
        self.turns += s.exchanges;
        self.errors += errors;
        self.too_long += too_long;
        self.unpriced |= !s.unpriced_models.is_empty();
        if let Some(c) = s.cost {
            *self.cost.get_or_insert(0.0) += c;
        }
    }

    fn finish(mut self) -> Group {
        if self.unpriced {
            self.cost = None;
        }
        self.cost_per_turn = self
            .cost
            .filter(|_| self.turns > 0)
            .map(|c| c / self.turns as f64);
        self
    }
}

/// One exchange, as the bill reads it.
struct Exchange {
    model: String,
    tokens: Option<Tokens>,
    /// Whether its usage had any cache field.
    cache_fields: bool,
    saved: u64,
    potential: u64,
    compacted: bool,
    started_ms: i64,
    ended_ms: i64,
    recall: Tokens,
    mode: String,
    error: bool,
    too_long: bool,
}

/// One conversation's exchanges and what the bill needs of it.
#[derive(Default)]
struct Conversation {
    tenant: String,
    model: String,
    exchanges: Vec<Exchange>,
    /// Compactions the upstream's "too long" answers made.
    overflows: u64,
}

/// The savings of one conversation (`None`: all of them).
pub fn report(
    conn: &dyn Sql,
    config: &Config,
    conversation: Option<&str>,
) -> Result<Report, StoreError> {
    let mut conversations: BTreeMap<String, Conversation> = BTreeMap::new();
    let rows = conn.rows(
        "SELECT conversation_id, tenant, model, input_tokens, output_tokens, cached_tokens,
                cache_write_tokens, cache_write_1h_tokens, tokens_saved, tokens_saved_potential,
                compaction_id, started_ms, latency_ms, recall_input_tokens, recall_output_tokens,
                mode, status, error
         FROM exchanges WHERE CAST(?1 AS TEXT) IS NULL OR conversation_id = ?1
         ORDER BY conversation_id, started_ms, id",
        &[conversation.into()],
    )?;
    for r in &rows {
        let id: String = r.get(0)?;
        let get = |i: usize| -> Result<Option<u64>, StoreError> {
            Ok(r.get::<Option<i64>>(i)?.map(|v| v.max(0) as u64))
        };
        let (input, output) = (get(3)?, get(4)?.unwrap_or(0));
        let (read, write, hour) = (get(5)?, get(6)?, get(7)?);
        let tokens = input.map(|input| Tokens {
            input,
            cache_read: read.unwrap_or(0),
            cache_write: write.unwrap_or(0),
            cache_write_1h: hour.unwrap_or(0),
            output,
        });
        // The rounds resend the exchange's prompt.
        let recall = tokens
            .unwrap_or_default()
            .resent(r.count(13)?, r.count(14)?);
        let status: i64 = r.get(16)?;
        let error: Option<String> = r.get(17)?;
        let status = status.clamp(0, u16::MAX as i64) as u16;
        let too_long = error
            .as_deref()
            .is_some_and(|e| crate::compaction::policy::is_context_overflow(status, e.as_bytes()));
        let started_ms: i64 = r.get(11)?;
        let latency: f64 = r.get(12)?;
        let c = conversations.entry(id).or_default();
        let model: String = r.get(2)?;
        c.tenant = r.get(1)?;
        c.model = model.clone();
        c.exchanges.push(Exchange {
            model,
            tokens,
            cache_fields: read.is_some() || write.is_some(),
            saved: get(8)?.unwrap_or(0),
            potential: get(9)?.unwrap_or(0),
            compacted: r.get::<Option<String>>(10)?.is_some(),
            started_ms,
            ended_ms: started_ms + latency.max(0.0) as i64,
            recall,
            mode: r.get(15)?,
            error: status >= 400 && status != 499,
            too_long,
        });
    }
    let mut bills: BTreeMap<String, Savings> = conversations
        .iter()
        .map(|(id, c)| (id.clone(), bill(config, c)))
        .collect();
    let rows = conn.rows(
        "SELECT conversation_id, summary_calls, summary_tokens, summary_output_tokens, reason,
                observed, summary_cached_tokens, summary_cache_write_tokens,
                summary_cache_write_1h_tokens
         FROM compactions WHERE CAST(?1 AS TEXT) IS NULL OR conversation_id = ?1",
        &[conversation.into()],
    )?;
    for r in &rows {
        let id: String = r.get(0)?;
        let (Some(c), Some(s)) = (conversations.get_mut(&id), bills.get_mut(&id)) else {
            continue;
        };
        let reason: String = r.get(4)?;
        let observed: bool = r.get(5)?;
        if !observed && crate::metrics::reason_kind(&reason) == "overflow" {
            c.overflows += 1;
        }
        let calls = r.count(1)?;
        let total = r.count(2)?;
        let output = r.count(3)?.min(total);
        s.summarizer_calls += calls;
        s.summarizer_input_tokens += total - output;
        s.summarizer_output_tokens += output;
        let (read, write, hour) = (r.count(6)?, r.count(7)?, r.count(8)?);
        s.summarizer_cached_tokens += read;
        if total > 0 {
            let model = config.summarizer_model_for(&c.model).to_string();
            let prices = crate::prices::of(config, &model);
            let call = Tokens {
                input: total - output,
                cache_read: read,
                cache_write: write,
                cache_write_1h: hour,
                output,
            };
            s.pay(prices, &model, call, None);
            if let Some(p) = prices {
                *s.cost_summaries.get_or_insert(0.0) += p.cost(&call);
            }
        }
    }
    let ratio = config.compaction.holdout_ratio;
    let mut holdout = Holdout {
        ratio,
        ..Holdout::default()
    };
    let mut report = Report {
        prices_as_of: crate::prices::AS_OF,
        ..Report::default()
    };
    for (id, s) in bills {
        let c = &conversations[&id];
        let held_out = config.held_out(&id) && c.exchanges.iter().any(|e| e.mode == "observe");
        let errors = c.exchanges.iter().filter(|e| e.error).count() as u64;
        let too_long = c.exchanges.iter().filter(|e| e.too_long).count() as u64 + c.overflows;
        if held_out {
            holdout.held_out.add(&s, errors, too_long);
        } else if !config.held_out(&id)
            && c.exchanges
                .iter()
                .all(|e| e.mode == "auto" || e.mode == "manual")
        {
            holdout.compacted.add(&s, errors, too_long);
        }
        let tenant: String = c.tenant.chars().take(TENANT_PREFIX).collect();
        report.tenants.entry(tenant.clone()).or_default().add(&s);
        report.total.add(&s);
        report.conversations.push(ConversationSavings {
            id,
            tenant,
            model: c.model.clone(),
            held_out,
            savings: s.finish(),
        });
    }
    report.total = report.total.finish();
    for s in report.tenants.values_mut() {
        *s = std::mem::take(s).finish();
    }
    if ratio > 0.0 {
        holdout.compacted = holdout.compacted.finish();
        holdout.held_out = holdout.held_out.finish();
        report.holdout = Some(holdout);
    }
    Ok(report)
}

/// One conversation's bill, its summarizer calls aside.
fn bill(config: &Config, c: &Conversation) -> Savings {
    let mut s = Savings::default();
    // What its upstream showed of its cache, over the whole conversation.
    let mut cache = CacheSeen::default();
    for t in c.exchanges.iter().filter_map(|e| e.tokens.as_ref()) {
        cache.add(t);
    }
    s.cache_reported = cache.caches();
    let mut previous: Option<Previous> = None;
    for e in &c.exchanges {
        s.exchanges += 1;
        s.exchanges_compacted += e.compacted as u64;
        let Some(t) = e.tokens else { continue };
        s.exchanges_with_usage += 1;
        s.exchanges_without_cache_fields += !e.cache_fields as u64;
        s.input_tokens += t.input;
        s.input_tokens_uncompacted += t.input + e.saved;
        s.output_tokens += t.output;
        s.tokens_saved_potential += e.potential;
        s.cached_tokens += t.cache_read;
        s.cache_write_tokens += t.cache_write;
        s.cache_write_1h_tokens += t.cache_write_1h;
        let saved = if e.compacted { e.saved } else { 0 };
        let uncompacted = crate::prices::uncompacted(t, saved, e.started_ms, previous, &cache);
        s.cached_uncompacted += uncompacted.cache_read;
        let prices = crate::prices::of(config, &e.model);
        s.pay(prices, &e.model, t, Some(uncompacted));
        if e.recall.input + e.recall.output > 0 {
            s.pay(prices, &e.model, e.recall, None);
        }
        previous = Some(Previous {
            whole: t.input + e.saved,
            ended_ms: e.ended_ms,
        });
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::journal::tests::record;
    use crate::store::sqlite::SqliteBackend;
    use crate::store::{Backend, ExchangeSavings, Record};
    use crate::wire::Usage;

    /// One reported figure set: (input, read, written, of those for an
    /// hour) and 100 output tokens.
    type Reported = (u64, u64, u64, u64);

    /// An exchange of `conv` at `at_ms` (1 s long), `saved` fewer tokens
    /// than uncompacted (compacted when some), its usage `reported`
    /// (`None`: no cache fields).
    fn exchange(
        id: i64,
        conv: &str,
        model: &str,
        at_ms: i64,
        reported: Option<Reported>,
        saved: u64,
    ) -> Record {
        let mut r = record(id);
        r.conversation = conv.into();
        r.new_conversation = !matches!(id, 2 | 3 | 12);
        r.model = model.into();
        r.started_ms = at_ms;
        r.latency_ms = 1000.0;
        r.usage = Some(match reported {
            Some((input, read, write, hour)) => Usage {
                input_tokens: input,
                output_tokens: 100,
                cached_tokens: Some(read),
                cache_write_tokens: Some(write),
                cache_write_1h_tokens: Some(hour),
            },
            None => Usage {
                input_tokens: 2000,
                output_tokens: 100,
                ..Usage::default()
            },
        });
        r.compaction = (saved > 0).then(|| "cmp_x".to_string());
        r.savings = ExchangeSavings {
            tokens_saved: saved,
            ..Default::default()
        };
        Record::Exchange(Box::new(r))
    }

    const SONNET: &str = "claude-sonnet-4-5";
    const MIN: i64 = 60_000;

    fn close(x: Option<f64>, y: f64) -> bool {
        x.is_some_and(|x| (x - y).abs() < 1e-9)
    }

    #[test]
    fn the_bill_prices_the_cache_both_ways_and_the_summaries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        let mut db = SqliteBackend::open(&path).unwrap();
        let mut c = crate::compaction::test_compaction("cmp_x", "t", 3, [0; 32], vec![]);
        c.conversation = "conv_a".into();
        (c.summary_calls, c.summary_tokens, c.summary_output_tokens) = (1, 3000, 500);
        // Its summary call read 2,000 of its 2,500 prompt tokens from the
        // cache and wrote 300 of them.
        c.summary_cache = crate::compaction::SummaryCache {
            read: 2_000,
            write: 300,
            write_1h: 0,
        };
        db.write(&[
            // Written whole; then compacted (8,000 fewer) a minute later,
            // its prefix read; then compacted again after 10 idle minutes.
            exchange(1, "conv_a", SONNET, 0, Some((10_000, 0, 10_000, 0)), 0),
            exchange(
                2,
                "conv_a",
                SONNET,
                MIN,
                Some((4_000, 2_000, 2_000, 0)),
                8_000,
            ),
            exchange(
                3,
                "conv_a",
                SONNET,
                11 * MIN,
                Some((5_000, 4_000, 1_000, 0)),
                8_000,
            ),
            // An upstream without cache fields, a model without prices.
            exchange(11, "conv_b", "local-llama", 0, None, 0),
            exchange(12, "conv_b", "local-llama", MIN, None, 500),
            Record::Compaction(Box::new(c)),
        ])
        .unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        let r = report(&conn, &Config::default(), None).unwrap();
        assert_eq!(r.prices_as_of, crate::prices::AS_OF);
        let a = &r.conversations[0].savings;
        assert_eq!(r.conversations[0].id, "conv_a");
        assert_eq!(
            (a.input_tokens, a.input_tokens_uncompacted),
            (19_000, 35_000)
        );
        assert_eq!(
            (a.cached_tokens, a.cache_write_tokens, a.exchanges_compacted),
            (6_000, 13_000, 2)
        );
        assert_eq!(a.exchanges_without_cache_fields, 0);
        // Sonnet: input 3, write 3.75, read 0.3, output 15 per million.
        let m = |uncached: f64, read: f64, write: f64| {
            (uncached * 3.0 + read * 0.3 + write * 3.75 + 100.0 * 15.0) / 1e6
        };
        let paid = m(0.0, 0.0, 10_000.0) + m(0.0, 2_000.0, 2_000.0) + m(0.0, 4_000.0, 1_000.0);
        let summaries = (200.0 * 3.0 + 2_000.0 * 0.3 + 300.0 * 3.75 + 500.0 * 15.0) / 1e6;
        assert_eq!(
            (a.summarizer_input_tokens, a.summarizer_cached_tokens),
            (2_500, 2_000)
        );
        // Uncompacted: the first exchange as it was; the second reads the
        // first's 10,000 of its 12,000 and writes the other 2,000; the
        // third came after the cache's five minutes, so writes all 13,000.
        let uncompacted = m(0.0, 0.0, 10_000.0) + m(0.0, 10_000.0, 2_000.0) + m(0.0, 0.0, 13_000.0);
        assert!(close(a.cost, paid + summaries), "{:?}", a.cost);
        assert!(close(a.cost_summaries, summaries));
        assert!(
            close(a.cost_uncompacted, uncompacted),
            "{:?}",
            a.cost_uncompacted
        );
        assert!(close(a.money_saved, uncompacted - paid - summaries));
        assert!(a.unpriced_models.is_empty());
        // Tokens, never dollars, for the model without prices; taken as
        // uncached, and said so.
        let b = &r.conversations[1].savings;
        assert_eq!(
            (b.cost, b.cost_uncompacted, b.money_saved),
            (None, None, None)
        );
        assert_eq!(
            b.unpriced_models.iter().collect::<Vec<_>>(),
            ["local-llama"]
        );
        assert_eq!((b.exchanges_without_cache_fields, b.tokens_saved), (2, 500));
        assert_eq!((b.cache_reuse, b.cache_reuse_uncompacted), (None, None));
        // A sum with an unpriced conversation in it has no dollars either.
        assert_eq!((r.total.input_tokens, r.total.cost), (23_000, None));
        assert_eq!(r.tenants["t"].exchanges, 5);
        assert_eq!(r.holdout, None);
        // Priced by a [[models]] entry, it has.
        let config = Config::from_toml(
            "[[models]]\nmatch = \"local-llama\"\ncontext_window = 8000\ninput_price_per_mtok = 1.0\n",
        )
        .unwrap();
        let r = report(&conn, &config, Some("conv_b")).unwrap();
        assert!(close(r.total.cost, (4_000.0 + 200.0) / 1e6));
        assert!(close(r.total.cost_uncompacted, (4_500.0 + 200.0) / 1e6));
    }

    #[test]
    fn a_compaction_that_busts_the_cache_saves_less_than_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        let mut db = SqliteBackend::open(&path).unwrap();
        db.write(&[
            exchange(1, "conv_a", SONNET, 0, Some((10_000, 0, 10_000, 10_000)), 0),
            // 100 tokens fewer, but its whole prompt written again (an
            // hour's writes, as the conversation's were).
            exchange(
                2,
                "conv_a",
                SONNET,
                MIN,
                Some((10_000, 0, 10_000, 10_000)),
                100,
            ),
        ])
        .unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        let a = report(&conn, &Config::default(), None).unwrap().total;
        let m = |read: f64, write_1h: f64| (read * 0.3 + write_1h * 6.0 + 100.0 * 15.0) / 1e6;
        assert!(close(a.cost, 2.0 * m(0.0, 10_000.0)));
        assert!(close(
            a.cost_uncompacted,
            m(0.0, 10_000.0) + m(10_000.0, 100.0)
        ));
        assert!(a.money_saved.unwrap() < 0.0, "{:?}", a.money_saved);
    }

    #[test]
    fn the_holdout_compares_held_out_conversations_with_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        let mut db = SqliteBackend::open(&path).unwrap();
        let config = Config::from_toml("[compaction]\nholdout_ratio = 0.5\n").unwrap();
        // One id held out and one not, found by drawing.
        let ids: Vec<String> = (0..64).map(|i| format!("conv_{i:04}")).collect();
        let held = ids.iter().find(|id| config.held_out(id)).unwrap();
        let kept = ids.iter().find(|id| !config.held_out(id)).unwrap();
        let mut records = vec![];
        for (n, (conv, mode)) in [(held, "observe"), (held, "observe"), (kept, "auto")]
            .into_iter()
            .enumerate()
        {
            let Record::Exchange(mut e) = exchange(
                n as i64 + 1,
                conv,
                SONNET,
                n as i64 * MIN,
                Some((1_000, 0, 1_000, 0)),
                0,
            ) else {
                unreachable!()
            };
            e.savings.mode = crate::config::Mode::parse(mode).unwrap();
            e.new_conversation = n != 1;
            if n == 1 {
                // The upstream said too long, and the client got it.
                e.usage = None;
                e.status = 400;
                e.error = Some(r#"{"error":{"message":"prompt is too long"}}"#.into());
            }
            records.push(Record::Exchange(e));
        }
        db.write(&records).unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        let r = report(&conn, &config, None).unwrap();
        let h = r.holdout.unwrap();
        assert_eq!(h.ratio, 0.5);
        assert_eq!(
            (
                h.held_out.conversations,
                h.held_out.turns,
                h.held_out.errors,
                h.held_out.too_long
            ),
            (1, 2, 1, 1)
        );
        assert_eq!(
            (
                h.compacted.conversations,
                h.compacted.turns,
                h.compacted.errors
            ),
            (1, 1, 0)
        );
        let one = (1_000.0 * 3.75 + 100.0 * 15.0) / 1e6;
        assert!(close(h.held_out.cost_per_turn, one / 2.0));
        assert!(close(h.compacted.cost_per_turn, one));
        assert!(r.conversations.iter().any(|c| c.held_out && &c.id == held));
        // A held-out conversation of a model without prices: that side has
        // no dollars, the other keeps its own.
        let other = ids
            .iter()
            .find(|id| config.held_out(id) && *id != held)
            .unwrap();
        let Record::Exchange(mut e) = exchange(9, other, SONNET, 0, Some((1_000, 0, 1_000, 0)), 0)
        else {
            unreachable!()
        };
        e.model = "unpriced".into();
        e.savings.mode = crate::config::Mode::Observe;
        // Its tokens come after a priced exchange of the same conversation.
        let Record::Exchange(mut first) =
            exchange(8, other, SONNET, -MIN, Some((1_000, 0, 1_000, 0)), 0)
        else {
            unreachable!()
        };
        first.savings.mode = crate::config::Mode::Observe;
        db.write(&[Record::Exchange(first), Record::Exchange(e)])
            .unwrap();
        let h = report(&conn, &config, None).unwrap().holdout.unwrap();
        assert_eq!(h.held_out.conversations, 2);
        assert_eq!((h.held_out.cost, h.held_out.cost_per_turn), (None, None));
        assert!(close(h.compacted.cost_per_turn, one));
    }
}
