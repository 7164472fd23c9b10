//! Prometheus metrics on `prometheus-client`, the Prometheus project's Rust
//! client: counters and histograms updated on the request path, gauges
//! gathered at scrape time, and the text exposition format (version 0.0.4)
//! served on `GET /metrics`.
//!
//! Every label comes from a small closed set (endpoints, rungs, reasons,
//! goals) or a bounded range (HTTP status codes), so the number of series
//! is bounded whatever clients send; the one open label, a model's name,
//! is built at scrape time from the bounded table of models seen. Only the
//! "active conversations" map is this module's own data structure.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::encoding::{prometheus_text, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::prices::{CacheSeen, Previous, Prices, Tokens};
use label_sets::{
    BillLabels, CompactionLabels, FactLabels, FallbackLabels, GoalLabels, InputLabels,
    RequestLabels, RungLabels, TriggerLabels, WindowLabels,
};

mod label_sets;
mod labels;
mod storms;
pub use storms::Storms;

pub use labels::{
    reason_kind, trigger_of, BILL_KINDS, ENDPOINTS, FACT_KINDS, FACT_STATES, GOALS, INPUT_KINDS,
    PROVIDER_FALLBACK_REASONS, REASONS, RUNGS, TRIGGERS,
};

/// Content type of the text exposition format.
pub const CONTENT_TYPE_TEXT: &str = prometheus_text::CONTENT_TYPE;

/// A conversation counts as active this long after its last request.
pub const ACTIVE_WINDOW: Duration = Duration::from_secs(15 * 60);

/// Most conversations tracked for the active gauge (bounds memory; past it,
/// the least recently seen are forgotten).
pub const MAX_TRACKED_CONVERSATIONS: usize = 100_000;

/// Bucket upper bounds (seconds) of the upstream latency histogram: whole
/// exchanges, from a cached short answer to a long agent turn.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Bucket upper bounds (seconds) of the time-to-first-byte histogram.
pub const TTFB_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Lowest and highest status code counted separately (others are clamped).
const STATUS_MIN: u16 = 100;
const STATUS_MAX: u16 = 599;

/// Bounds of `compactor_store_commit_seconds`: a local commit takes well
/// under a millisecond, one across a network or behind a busy disk tens.
pub const COMMIT_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// Room reserved for one exposition, so a scrape grows its buffer rarely.
const RENDER_CAPACITY: usize = 8 * 1024;

/// Figures gathered at scrape time rather than recorded as they happen.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gauges {
    /// Bytes of the store on disk (database file + `-wal`).
    pub store_bytes: Option<u64>,
    /// Conversations with a request in the last [`ACTIVE_WINDOW`].
    pub active_conversations: Option<u64>,
    /// Compactions held in memory (all tenants).
    pub compactions_stored: Option<u64>,
    /// Effective window of each model seen: (model, tokens, source).
    pub windows: Vec<(String, u64, &'static str)>,
    /// The PostgreSQL pool, when the store is there: connections open,
    /// idle, and callers waiting for one.
    pub db_pool: Option<(usize, usize, usize)>,
    /// Round trips the request path's reads of PostgreSQL made, when the
    /// store is there.
    pub db_reads: Option<u64>,
}

/// All of the proxy's metrics. One per process, in [`crate::app::AppState`].
///
/// The registry holds every metric recorded as it happens, in the order of
/// the exposition; the fields are handles on the same metrics (clones share
/// their value), so recording never looks a name up.
pub struct Metrics {
    /// What `render` encodes, besides the scrape-time gauges.
    registry: Registry,
    /// By endpoint and status; a series appears on its first request.
    requests: Family<RequestLabels, Counter>,
    /// Seconds from sending a request upstream to the end of its answer.
    upstream_latency: Histogram,
    /// Seconds from a request's arrival to the first byte sent to the client.
    ttfb: Histogram,
    /// Seconds the store's commits take (one per batch of records).
    commits: Histogram,
    /// `[rung][reason]`, every pair present from the start.
    compactions: Box<[Counter]>,
    /// `[rung]`, every rung present from the start.
    tokens_saved: Box<[Counter]>,
    /// `[trigger]` of [`TRIGGERS`].
    triggers: Box<[Counter]>,
    /// Failed or invalid summarizer answers.
    summary_failures: Counter,
    /// Compactions stored with the deterministic fallback.
    summary_fallbacks: Counter,
    /// Summaries appended after the earlier ones, their bytes kept.
    summaries_appended: Counter,
    /// Summaries that rewrote the earlier ones, past their budget.
    summaries_rewritten: Counter,
    /// Compaction storms held back or seen, the proxy's and clients'.
    storms: storms::Storms,
    /// Requests retried compacted after an upstream overflow.
    reactive_retries: Counter,
    /// Summarizer calls made by stored compactions.
    summary_calls: Counter,
    /// Tokens of those calls.
    summary_tokens: Counter,
    /// Of those, the answers'.
    summary_output_tokens: Counter,
    /// `[kind]` of [`INPUT_KINDS`].
    input_tokens: Box<[Counter]>,
    /// `[goal]`: compactions declined because nothing could fit.
    unfittable: Box<[Counter]>,
    /// `[reason]`: provider compactions the local summarizer replaced.
    provider_fallbacks: Box<[Counter]>,
    /// Conversation → last request.
    seen: Mutex<Seen>,
    /// `[kind][state]` of the facts compactions' audits checked.
    facts: Box<[Counter]>,
    /// `[kind]` of [`BILL_KINDS`], dollars.
    bill: Box<[Counter<f64, AtomicU64>]>,
    /// Calls no price is known for.
    unpriced: Counter,
}

/// When each conversation last sent a request, keyed by a 64-bit hash of
/// its id under a seed drawn per process (no copy of the id, no
/// allocation per new conversation). With [`MAX_TRACKED_CONVERSATIONS`]
/// tracked, a new conversation is taken for one of them (and the gauge is
/// one short) with a probability of about 2^-47.
#[derive(Default)]
struct Seen {
    seed: foldhash::quality::RandomState,
    at: HashMap<u64, Instant, foldhash::fast::RandomState>,
    /// Per conversation, what the bill's counterfactual needs of it: its
    /// previous exchange and what its upstream reported of its cache.
    bills: HashMap<u64, (Previous, CacheSeen), foldhash::fast::RandomState>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn index_of(set: &[&'static str], label: &str) -> usize {
    set.iter()
        .position(|&s| s == label)
        .unwrap_or(set.len() - 1)
}

/// `label` if it is in `set`, else the set's last entry (`other`).
fn bounded(set: &[&'static str], label: &str) -> &'static str {
    set[index_of(set, label)]
}

/// A family with one series per label set in `labels`, created now so a
/// closed set is exposed whole (at zero) from the first scrape; returns it
/// with a handle on each series, in the order of `labels`.
fn closed_family<S>(labels: impl IntoIterator<Item = S>) -> (Family<S, Counter>, Box<[Counter]>)
where
    S: Clone + std::hash::Hash + Eq,
{
    let family = Family::<S, Counter>::default();
    let handles = labels
        .into_iter()
        .map(|l| family.get_or_create_owned(&l))
        .collect();
    (family, handles)
}

/// A family whose HELP and TYPE lines are exposed before its first series
/// too (the library leaves an empty family out), so that every metric the
/// proxy has is named from the first scrape on, as dashboards and alert
/// rules are checked against.
#[derive(Debug)]
struct Declared<F>(F);

impl<F: EncodeMetric> EncodeMetric for Declared<F> {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }
}

/// Records one observation; negative and NaN values (a clock gone
/// backwards) are left out rather than skewing the lowest bucket.
fn observe(histogram: &Histogram, seconds: f64) {
    if seconds >= 0.0 {
        histogram.observe(seconds);
    }
}

impl Metrics {
    /// Empty metrics.
    ///
    /// Help texts are given without their final period: the registry adds it.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        registry.register(
            "compactor_build",
            "Version of the running compactor",
            Info::new([("version", env!("CARGO_PKG_VERSION"))]),
        );

        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "compactor_requests",
            "Client requests answered, by endpoint and status",
            Declared(requests.clone()),
        );

        let upstream_latency = Histogram::new(LATENCY_BUCKETS.iter().copied());
        registry.register(
            "compactor_upstream_latency_seconds",
            "Time from sending a request upstream to the end of its answer",
            upstream_latency.clone(),
        );
        let ttfb = Histogram::new(TTFB_BUCKETS.iter().copied());
        registry.register(
            "compactor_ttfb_seconds",
            "Time from a request's arrival to the first byte of the answer sent to the client",
            ttfb.clone(),
        );

        let commits = Histogram::new(COMMIT_BUCKETS.iter().copied());
        registry.register(
            "compactor_store_commit_seconds",
            "Time the store takes to commit one batch of records (exchanges ending together share one)",
            commits.clone(),
        );

        let (family, compactions) = closed_family(RUNGS.iter().flat_map(|&rung| {
            REASONS
                .iter()
                .map(move |&reason| CompactionLabels { rung, reason })
        }));
        registry.register(
            "compactor_compactions",
            "Compactions stored, by rung and reason",
            family,
        );
        let (family, tokens_saved) = closed_family(RUNGS.iter().map(|&rung| RungLabels { rung }));
        registry.register(
            "compactor_compaction_tokens_saved",
            "Estimated tokens removed from requests by compactions, by rung",
            family,
        );

        let (family, triggers) =
            closed_family(TRIGGERS.iter().map(|&trigger| TriggerLabels { trigger }));
        registry.register(
            "compactor_compaction_triggers",
            "Compactions by what triggered them: threshold (background, past the trigger), boundary (a waiting compaction first applied under the hard limit: a threshold one on the next request, the model's at a turn boundary), hard (a request over the hard limit cut inside a turn), reactive (the upstream said too long), agent (the model's compactor_compact), manual (CLI, admin API, request header), provider (the provider compacted)",
            family,
        );

        let mut counter = |name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let summary_failures = counter(
            "compactor_summary_failures",
            "Summarizer calls that failed or returned an invalid summary",
        );
        let summary_fallbacks = counter(
            "compactor_summary_fallbacks",
            "Compactions that fell back to the deterministic summary",
        );
        let summaries_appended = counter(
            "compactor_summaries_appended",
            "Summary compactions that kept the earlier summaries as the upstream cached them and appended theirs",
        );
        let summaries_rewritten = counter(
            "compactor_summaries_rewritten",
            "Summary compactions that rewrote the earlier summaries into one: with the new one they would have passed their budget",
        );
        let storms = storms::Storms::new(&mut counter);
        let reactive_retries = counter(
            "compactor_reactive_retries",
            "Requests retried compacted after the upstream said the prompt was too long",
        );
        let summary_calls = counter(
            "compactor_summary_calls",
            "Summarizer calls made by stored compactions",
        );
        let summary_tokens = counter(
            "compactor_summary_tokens",
            "Tokens (prompt and answer) of those summarizer calls",
        );

        let summary_output_tokens = counter(
            "compactor_summary_output_tokens",
            "Of those tokens, the summarizer's answers'",
        );
        let (family, input_tokens) =
            closed_family(INPUT_KINDS.iter().map(|&kind| InputLabels { kind }));
        registry.register(
            "compactor_input_tokens",
            "Input tokens of the exchanges that reported usage: received by the upstream, uncompacted (what it would have received without compaction), cached (reported read from its prompt cache), potential_saved (observe mode: what compaction would have saved). Net savings: uncompacted - received - compactor_summary_tokens_total",
            family,
        );

        let (family, unfittable) = closed_family(GOALS.iter().map(|&goal| GoalLabels { goal }));
        registry.register(
            "compactor_unfittable",
            "Compactions declined before any summarizer call: not even the system items, tools, newest user message and pending tool batch fit the limit. By the limit sought",
            family,
        );

        let (family, provider_fallbacks) = closed_family(
            PROVIDER_FALLBACK_REASONS
                .iter()
                .map(|&reason| FallbackLabels { reason }),
        );
        registry.register(
            "compactor_provider_compaction_fallbacks",
            "Summary rungs the provider's compaction was asked for and the local summarizer wrote instead, by why",
            family,
        );

        let (family, facts) = closed_family(FACT_KINDS.iter().flat_map(|&kind| {
            FACT_STATES
                .iter()
                .map(move |&state| FactLabels { kind, state })
        }));
        registry.register(
            "compactor_compaction_facts",
            "Facts the proxy extracted from the items compactions replaced, by kind and by what became of them: kept (in the compacted request), repaired (added to its facts message before it was used), forgotten (no room within the request's limit)",
            family,
        );

        let bill_family = Family::<BillLabels, Counter<f64, AtomicU64>>::default();
        let bill = BILL_KINDS
            .iter()
            .map(|&kind| bill_family.get_or_create_owned(&BillLabels { kind }))
            .collect();
        registry.register(
            "compactor_bill_dollars",
            "Dollars at the models' prices (built-in list or proxy.toml): paid (exchanges from the cache figures they reported, recall rounds, summarizer and provider-compaction calls), of it the summaries, and what the exchanges would have cost without compaction with the cache they would have had. Saved: uncompacted - paid. Calls of models without a known price are left out (compactor_bill_unpriced_calls_total)",
            bill_family,
        );
        let unpriced = Counter::default();
        registry.register(
            "compactor_bill_unpriced_calls",
            "Exchanges and summarizer calls of a model with no price known: in tokens only, never in dollars",
            unpriced.clone(),
        );

        Metrics {
            registry,
            requests,
            upstream_latency,
            ttfb,
            commits,
            compactions,
            tokens_saved,
            triggers,
            summary_failures,
            summary_fallbacks,
            summaries_appended,
            summaries_rewritten,
            storms,
            reactive_retries,
            summary_calls,
            summary_tokens,
            summary_output_tokens,
            input_tokens,
            unfittable,
            provider_fallbacks,
            seen: Mutex::default(),
            facts,
            bill,
            unpriced,
        }
    }

    /// A request answered: call once per client request when its status is
    /// known (for streams: when the head is sent), with the endpoint label
    /// (one of [`ENDPOINTS`]: `chat`, `responses`, `passthrough`, `admin`…;
    /// others count as `other`) and the status the client received.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&request_labels(endpoint, status))
            .inc();
    }

    /// Requests counted for `endpoint` and `status` so far.
    pub fn requests(&self, endpoint: &str, status: u16) -> u64 {
        self.requests
            .get(&request_labels(endpoint, status))
            .map_or(0, |c| c.get())
    }

    /// The upstream exchange is over: call once per proxied request with the
    /// seconds from sending the request upstream to the end of its answer
    /// (the whole body, or the end of the stream).
    pub fn upstream_latency(&self, seconds: f64) {
        observe(&self.upstream_latency, seconds);
    }

    /// The first byte of the answer goes to the client: call once per
    /// proxied request with the seconds since the request arrived.
    pub fn ttfb(&self, seconds: f64) {
        observe(&self.ttfb, seconds);
    }

    /// What the store calls after each commit, with its duration: a handle
    /// on the commit histogram, for the store's writer thread.
    pub fn commit_observer(&self) -> impl Fn(std::time::Duration) + Send + Sync + 'static {
        let commits = self.commits.clone();
        move |d| observe(&commits, d.as_secs_f64())
    }

    /// A compaction was stored: call from the engine when it records one,
    /// with its rung ([`crate::compaction::Rung::as_str`]), the kind of its
    /// reason (`threshold`, `overflow` or `manual`; [`reason_kind`] derives
    /// it from the reason string) and `tokens_before - tokens_after`.
    pub fn compaction(&self, rung: &str, reason_kind: &str, tokens_saved: u64) {
        let r = index_of(RUNGS, rung);
        let k = index_of(REASONS, reason_kind);
        self.compactions[r * REASONS.len() + k].inc();
        self.tokens_saved[r].inc_by(tokens_saved);
    }

    /// A compaction triggered (`trigger`: one of [`TRIGGERS`]; others are
    /// not counted): call once per compaction made, and once when a waiting
    /// one is first applied (`boundary`, `hard`).
    pub fn compaction_trigger(&self, trigger: &str) {
        if let Some(i) = TRIGGERS.iter().position(|&t| t == trigger) {
            self.triggers[i].inc();
        }
    }

    /// The provider compacted a conversation (a compaction item or block
    /// it returned, or the summary rung it wrote): call once per such
    /// compaction.
    pub fn provider_compaction(&self) {
        self.compaction_trigger("provider");
    }

    /// Compactions counted for `trigger` so far.
    pub fn triggers(&self, trigger: &str) -> u64 {
        TRIGGERS
            .iter()
            .position(|&t| t == trigger)
            .map_or(0, |i| self.triggers[i].get())
    }

    /// A summarizer call failed or returned an invalid summary: call once
    /// per failed attempt (a retried call that fails twice counts twice).
    pub fn summary_failure(&self) {
        self.summary_failures.inc();
    }

    /// The summarizer gave up and the deterministic fallback was used: call
    /// once per compaction stored with the `fallback` rung.
    pub fn summary_fallback(&self) {
        self.summary_fallbacks.inc();
    }

    /// A summary compaction appended after the earlier summaries (`true`)
    /// or rewrote them past their budget: call once per such compaction
    /// stored (not observed).
    pub fn summaries(&self, appended: bool) {
        if appended {
            self.summaries_appended.inc();
        } else {
            self.summaries_rewritten.inc();
        }
    }

    /// The storm counters, the proxy's and its clients'.
    pub fn storms(&self) -> &Storms {
        &self.storms
    }

    /// A stored compaction's audit: call once per compaction applied to
    /// requests (not observed), counting each fact of its checklist.
    pub fn facts_audited(&self, audit: &crate::compaction::summary::Audit) {
        for f in &audit.facts {
            let k = index_of(FACT_KINDS, f.kind.as_str());
            let s = index_of(FACT_STATES, f.state.as_str());
            self.facts[k * FACT_STATES.len() + s].inc();
        }
    }

    /// The upstream said the prompt did not fit and the proxy retried with a
    /// compacted request: call once per such retry.
    pub fn reactive_retry(&self) {
        self.reactive_retries.inc();
    }

    /// A compaction's summarizer calls and their tokens: call once per
    /// compaction stored.
    pub fn summary_cost(&self, calls: u32, tokens: u64, output_tokens: u64) {
        self.summary_calls.inc_by(u64::from(calls));
        self.summary_tokens.inc_by(tokens);
        self.summary_output_tokens.inc_by(output_tokens);
    }

    /// An exchange that reported usage: the input tokens the upstream
    /// received (`cached` of them from its cache), those compaction saved,
    /// and (observe mode) those it would have saved.
    pub fn exchange_input(&self, received: u64, cached: u64, saved: u64, potential: u64) {
        for (kind, n) in [
            ("received", received),
            ("uncompacted", received + saved),
            ("cached", cached),
            ("potential_saved", potential),
        ] {
            self.input_tokens[index_of(INPUT_KINDS, kind)].inc_by(n);
        }
    }

    /// An exchange of `conversation` that reported usage, on the bill:
    /// what it paid (its `tokens`, its recall rounds' `recall`) at
    /// `prices`, and what it would have without the `saved` tokens of its
    /// compaction (see `store::savings` for the assumptions; here the
    /// conversation's cache as reported so far). It started and ended at
    /// those Unix ms.
    #[allow(clippy::too_many_arguments)]
    pub fn exchange_bill(
        &self,
        conversation: &str,
        prices: Option<Prices>,
        tokens: Tokens,
        recall: Tokens,
        saved: u64,
        started_ms: i64,
        ended_ms: i64,
    ) {
        self.input_tokens[index_of(INPUT_KINDS, "cache_written")].inc_by(tokens.cache_write);
        let uncompacted = {
            let mut guard = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            let key = guard.seed.hash_one(conversation);
            if guard.bills.len() >= MAX_TRACKED_CONVERSATIONS && !guard.bills.contains_key(&key) {
                // Keep the active conversations' (rare; amortized O(1)).
                let Seen { at, bills, .. } = &mut *guard;
                bills.retain(|k, _| at.contains_key(k));
                if bills.len() >= MAX_TRACKED_CONVERSATIONS {
                    bills.clear();
                }
            }
            let (previous, mut cache) = guard
                .bills
                .get(&key)
                .map_or((None, CacheSeen::default()), |(p, c)| (Some(*p), *c));
            cache.add(&tokens);
            let next = Previous {
                whole: tokens.input + saved,
                ended_ms,
            };
            guard.bills.insert(key, (next, cache));
            crate::prices::uncompacted(tokens, saved, started_ms, previous, &cache)
        };
        let Some(p) = prices else {
            self.unpriced.inc();
            return;
        };
        self.bill_add("paid", p.cost(&tokens) + p.cost(&recall));
        self.bill_add("uncompacted", p.cost(&uncompacted));
    }

    /// A compaction's summarizer (or provider) calls on the bill: their
    /// prompts and answers, `call` (its cache reads and writes as the
    /// upstream reported them), at `prices`.
    pub fn summary_bill(&self, prices: Option<Prices>, call: Tokens) {
        if call.input + call.output == 0 {
            return;
        }
        let Some(p) = prices else {
            self.unpriced.inc();
            return;
        };
        let dollars = p.cost(&call);
        self.bill_add("paid", dollars);
        self.bill_add("summaries", dollars);
    }

    fn bill_add(&self, kind: &str, dollars: f64) {
        if dollars.is_finite() && dollars > 0.0 {
            self.bill[index_of(BILL_KINDS, kind)].inc_by(dollars);
        }
    }

    /// A compaction declined from the token counts, before any summarizer
    /// call, because not even the irreducible core fits (`goal`: one of
    /// [`GOALS`]): call once per such decision.
    pub fn unfittable(&self, goal: &str) {
        self.unfittable[index_of(GOALS, goal)].inc();
    }

    /// The provider's compaction failed and the local summarizer took
    /// over (`reason`: one of [`PROVIDER_FALLBACK_REASONS`]).
    pub fn provider_fallback(&self, reason: &str) {
        self.provider_fallbacks[index_of(PROVIDER_FALLBACK_REASONS, reason)].inc();
    }

    /// A request of `conversation` arrived: call once per proxied request
    /// after the conversation is identified (feeds the active gauge).
    pub fn conversation_seen(&self, conversation: &str) {
        self.conversation_seen_at(conversation, Instant::now());
    }

    fn conversation_seen_at(&self, conversation: &str, now: Instant) {
        let mut guard = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let key = guard.seed.hash_one(conversation);
        let seen = &mut guard.at;
        if let Some(t) = seen.get_mut(&key) {
            *t = now;
            return;
        }
        if seen.len() >= MAX_TRACKED_CONVERSATIONS {
            prune(seen, now);
        }
        if seen.len() >= MAX_TRACKED_CONVERSATIONS {
            // All recent: forget the older half (rare; keeps inserts amortized O(1)).
            let mut times: Vec<Instant> = seen.values().copied().collect();
            let mid = times.len() / 2;
            let (_, median, _) = times.select_nth_unstable(mid);
            let median = *median;
            seen.retain(|_, t| *t > median);
        }
        seen.insert(key, now);
    }

    /// Conversations seen within [`ACTIVE_WINDOW`] (forgets older ones).
    pub fn active_conversations(&self) -> u64 {
        self.active_at(Instant::now())
    }

    fn active_at(&self, now: Instant) -> u64 {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        prune(&mut seen.at, now);
        seen.at.len() as u64
    }

    /// The scrape-time figures: the size of the store at `db` (file +
    /// `-wal`), the active conversations, and `compactions_stored` if known.
    pub fn gauges(&self, db: &Path, compactions_stored: Option<u64>) -> Gauges {
        Gauges {
            store_bytes: store_bytes(db),
            active_conversations: Some(self.active_conversations()),
            compactions_stored,
            windows: Vec::new(),
            db_pool: None,
            db_reads: None,
        }
    }

    /// The text exposition of everything, with the scrape-time `extra`
    /// gauges (those that are `None` are left out).
    pub fn render(&self, extra: &Gauges) -> String {
        let mut out = String::with_capacity(RENDER_CAPACITY);
        // Encoding into a String fails only if a label set fails to encode,
        // which none of these can; a scrape still gets what was written.
        for registry in [&self.registry, &scrape_registry(extra)] {
            if let Err(e) = prometheus_text::encode(&mut out, registry) {
                tracing::warn!(error = %e, "encoding /metrics");
            }
        }
        out
    }
}

fn request_labels(endpoint: &str, status: u16) -> RequestLabels {
    RequestLabels {
        endpoint: bounded(ENDPOINTS, endpoint),
        status: status.clamp(STATUS_MIN, STATUS_MAX),
    }
}

/// The gauges known only at scrape time, in a registry of their own built
/// per scrape (a few small allocations, on a path that runs every few
/// seconds at most), encoded after the recorded metrics.
fn scrape_registry(extra: &Gauges) -> Registry {
    let mut registry = Registry::default();
    let windows = Family::<WindowLabels, Gauge<u64, AtomicU64>>::default();
    for (model, window, source) in &extra.windows {
        windows
            .get_or_create(&WindowLabels {
                model: model.clone(),
                source,
            })
            .set(*window);
    }
    registry.register(
        "compactor_model_context_window",
        "Effective context window of each model seen, tokens, by where it came from (table, config, learned, discovered)",
        Declared(windows),
    );
    for (name, help, v) in [
        (
            "compactor_store_bytes",
            "Bytes of the store on disk (database file and write-ahead log)",
            extra.store_bytes,
        ),
        (
            "compactor_active_conversations",
            "Conversations with a request in the last 15 minutes",
            extra.active_conversations,
        ),
        (
            "compactor_compactions_stored",
            "Compactions held in memory, ready to apply",
            extra.compactions_stored,
        ),
        (
            "compactor_db_pool_connections",
            "PostgreSQL connections the pool holds open",
            extra.db_pool.map(|p| p.0 as u64),
        ),
        (
            "compactor_db_pool_idle",
            "PostgreSQL connections idle in the pool",
            extra.db_pool.map(|p| p.1 as u64),
        ),
        (
            "compactor_db_pool_waiting",
            "Callers waiting for a PostgreSQL connection",
            extra.db_pool.map(|p| p.2 as u64),
        ),
    ] {
        if let Some(v) = v {
            registry.register(name, help, ConstGauge::new(v));
        }
    }
    if let Some(reads) = extra.db_reads {
        registry.register(
            "compactor_store_reads",
            "Round trips the request path's reads of the shared store made (PostgreSQL)",
            ConstCounter::new(reads),
        );
    }
    registry
}

/// Drops entries older than [`ACTIVE_WINDOW`].
fn prune<S>(seen: &mut HashMap<u64, Instant, S>, now: Instant) {
    seen.retain(|_, t| now.saturating_duration_since(*t) < ACTIVE_WINDOW);
}

/// Bytes of the SQLite database at `db` plus its `-wal` file and the
/// exchange journal; `None` when the database file cannot be read.
pub fn store_bytes(db: &Path) -> Option<u64> {
    let main = std::fs::metadata(db).ok()?.len();
    let beside = ["-wal", "-exchanges", "-exchanges.old"].map(|suffix| {
        let mut p = db.as_os_str().to_owned();
        p.push(suffix);
        std::fs::metadata(Path::new(&p))
            .map(|m| m.len())
            .unwrap_or(0)
    });
    Some(main + beside.iter().sum::<u64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One parsed sample line.
    #[derive(Debug, PartialEq)]
    struct Sample {
        name: String,
        labels: Vec<(String, String)>,
        value: f64,
    }

    /// Parses the exposition back, checking its grammar line by line:
    /// every sample's family has HELP then TYPE before it, exactly once.
    fn parse(text: &str) -> Vec<Sample> {
        let mut samples = Vec::new();
        let mut typed: HashMap<String, String> = HashMap::new();
        let mut helped = std::collections::HashSet::new();
        assert!(text.ends_with('\n'), "ends with a newline");
        for line in text.lines() {
            assert!(!line.is_empty(), "no blank lines");
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').expect("HELP name text");
                assert!(!help.is_empty());
                assert!(helped.insert(name.to_string()), "one HELP for {name}");
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
                assert!(helped.contains(name), "HELP before TYPE for {name}");
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{kind}");
                assert!(
                    typed.insert(name.into(), kind.into()).is_none(),
                    "one TYPE for {name}"
                );
                continue;
            }
            assert!(!line.starts_with('#'), "unexpected comment {line}");
            let (series, value) = line.rsplit_once(' ').expect("series value");
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("value of {line}")),
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => {
                    let body = rest.strip_suffix('}').expect("closing brace");
                    let labels = body
                        .split(',')
                        .map(|kv| {
                            let (k, v) = kv.split_once('=').expect("label k=v");
                            let v = v
                                .strip_prefix('"')
                                .and_then(|v| v.strip_suffix('"'))
                                .expect("quoted label value");
                            (k.to_string(), v.to_string())
                        })
                        .collect();
                    (n.to_string(), labels)
                }
                None => (series.to_string(), Vec::new()),
            };
            assert!(name.starts_with("compactor_"), "{name}");
            assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|f| typed.get(*f).map(String::as_str) == Some("histogram"))
                })
                .unwrap_or(&name)
                .to_string();
            assert!(typed.contains_key(&family), "TYPE before sample {name}");
            samples.push(Sample {
                name,
                labels,
                value,
            });
        }
        samples
    }

    fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        samples
            .iter()
            .find(|s| {
                s.name == name
                    && s.labels.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.iter().any(|(a, b)| a == k && b == v))
            })
            .map(|s| s.value)
    }

    #[test]
    fn counters_render_with_labels_and_parse_back() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.request("chat", 200);
        }
        m.request("chat", 502);
        m.request("responses", 200);
        m.request("something-new", 404);
        m.request("admin", 42); // out of range: clamped, still counted
        m.compaction("summary", "threshold", 4000);
        m.compaction("prune", "overflow", 1000);
        m.compaction("summary", "threshold", 500);
        m.compaction("weird", "because", 1);
        m.summary_failure();
        m.summary_failure();
        m.summary_fallback();
        m.reactive_retry();
        let s = parse(&m.render(&Gauges::default()));
        let req = "compactor_requests_total";
        assert_eq!(
            value(&s, req, &[("endpoint", "chat"), ("status", "200")]),
            Some(3.0)
        );
        assert_eq!(
            value(&s, req, &[("endpoint", "chat"), ("status", "502")]),
            Some(1.0)
        );
        assert_eq!(
            value(&s, req, &[("endpoint", "responses"), ("status", "200")]),
            Some(1.0)
        );
        assert_eq!(
            value(&s, req, &[("endpoint", "other"), ("status", "404")]),
            Some(1.0)
        );
        assert_eq!(
            value(&s, req, &[("endpoint", "admin"), ("status", "100")]),
            Some(1.0)
        );
        assert_eq!(
            value(&s, req, &[("endpoint", "passthrough"), ("status", "200")]),
            None,
            "zero request series are left out"
        );
        assert_eq!(m.requests("chat", 200), 3);
        let c = "compactor_compactions_total";
        assert_eq!(
            value(&s, c, &[("rung", "summary"), ("reason", "threshold")]),
            Some(2.0)
        );
        assert_eq!(
            value(&s, c, &[("rung", "prune"), ("reason", "overflow")]),
            Some(1.0)
        );
        assert_eq!(
            value(&s, c, &[("rung", "other"), ("reason", "other")]),
            Some(1.0)
        );
        assert_eq!(
            value(&s, c, &[("rung", "truncate"), ("reason", "manual")]),
            Some(0.0),
            "the closed set is always there"
        );
        let saved = "compactor_compaction_tokens_saved_total";
        assert_eq!(value(&s, saved, &[("rung", "summary")]), Some(4500.0));
        assert_eq!(
            value(&s, "compactor_summary_failures_total", &[]),
            Some(2.0)
        );
        assert_eq!(
            value(&s, "compactor_summary_fallbacks_total", &[]),
            Some(1.0)
        );
        assert_eq!(
            value(&s, "compactor_reactive_retries_total", &[]),
            Some(1.0)
        );
        assert_eq!(
            value(
                &s,
                "compactor_build_info",
                &[("version", env!("CARGO_PKG_VERSION"))]
            ),
            Some(1.0)
        );
        assert_eq!(
            value(&s, "compactor_store_bytes", &[]),
            None,
            "None gauges left out"
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative_with_sum_and_count() {
        let m = Metrics::new();
        for v in [0.003, 0.004, 0.02, 0.7, 0.7, 12.0, 1000.0] {
            m.upstream_latency(v);
        }
        m.upstream_latency(-1.0);
        m.upstream_latency(f64::NAN);
        m.ttfb(0.001); // on a bound: `le` is inclusive
        let s = parse(&m.render(&Gauges::default()));
        let name = "compactor_upstream_latency_seconds";
        let buckets: Vec<(f64, f64)> = s
            .iter()
            .filter(|x| x.name == format!("{name}_bucket"))
            .map(|x| {
                let le = &x.labels.iter().find(|(k, _)| k == "le").unwrap().1;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (le, x.value)
            })
            .collect();
        assert_eq!(buckets.len(), LATENCY_BUCKETS.len() + 1);
        assert!(buckets.windows(2).all(|w| w[0].0 < w[1].0), "le increasing");
        assert!(
            buckets.windows(2).all(|w| w[0].1 <= w[1].1),
            "counts cumulative"
        );
        let at = |le: f64| buckets.iter().find(|b| b.0 == le).unwrap().1;
        assert_eq!(at(0.005), 2.0);
        assert_eq!(at(0.025), 3.0);
        assert_eq!(at(1.0), 5.0);
        assert_eq!(at(30.0), 6.0);
        assert_eq!(at(300.0), 6.0);
        assert_eq!(at(f64::INFINITY), 7.0);
        assert_eq!(value(&s, &format!("{name}_count"), &[]), Some(7.0));
        let sum = value(&s, &format!("{name}_sum"), &[]).unwrap();
        assert!((sum - 1013.427).abs() < 1e-9, "{sum}");
        let t = "compactor_ttfb_seconds";
        assert_eq!(
            value(&s, &format!("{t}_bucket"), &[("le", "0.001")]),
            Some(1.0)
        );
        assert_eq!(value(&s, &format!("{t}_count"), &[]), Some(1.0));
        assert_eq!(value(&s, &format!("{t}_sum"), &[]), Some(0.001));
    }

    #[test]
    fn gauges_from_the_store_file_and_recent_conversations() {
        let dir = std::env::temp_dir().join(format!(
            "compactor-metrics-test-{}-{}",
            std::process::id(),
            crate::ids::now_ms()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let db = dir.join("x.db");
        assert_eq!(store_bytes(&db), None);
        std::fs::write(&db, vec![0u8; 1000]).unwrap();
        assert_eq!(store_bytes(&db), Some(1000));
        std::fs::write(dir.join("x.db-wal"), vec![0u8; 24]).unwrap();
        assert_eq!(store_bytes(&db), Some(1024));

        let m = Metrics::new();
        let t0 = Instant::now();
        m.conversation_seen_at("a", t0);
        m.conversation_seen_at("b", t0);
        m.conversation_seen_at("a", t0 + Duration::from_secs(600));
        assert_eq!(m.active_at(t0 + Duration::from_secs(60)), 2);
        assert_eq!(
            m.active_at(t0 + Duration::from_secs(16 * 60)),
            1,
            "b expired"
        );
        let g = m.gauges(&db, Some(3));
        assert_eq!(g.store_bytes, Some(1024));
        let s = parse(&m.render(&g));
        assert_eq!(value(&s, "compactor_store_bytes", &[]), Some(1024.0));
        assert_eq!(value(&s, "compactor_compactions_stored", &[]), Some(3.0));
        assert!(value(&s, "compactor_active_conversations", &[]).is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_conversation_map_stays_bounded() {
        let m = Metrics::new();
        let t0 = Instant::now();
        for i in 0..MAX_TRACKED_CONVERSATIONS + 10 {
            m.conversation_seen_at(&format!("c{i}"), t0 + Duration::from_millis(i as u64));
        }
        let n = m.active_at(t0 + Duration::from_secs(200));
        assert!(n <= MAX_TRACKED_CONVERSATIONS as u64 && n > 0, "{n}");
    }

    #[test]
    fn reason_kinds() {
        assert_eq!(
            reason_kind("threshold: reported 6100 tokens of 8000 window"),
            "threshold"
        );
        assert_eq!(
            reason_kind("overflow: upstream answered 400 Bad Request"),
            "overflow"
        );
        assert_eq!(reason_kind("manual"), "manual");
        assert_eq!(reason_kind("manual: compactor compact"), "manual");
        assert_eq!(reason_kind(""), "other");
        assert_eq!(reason_kind("because"), "other");
    }
}
