//! The summary rung delegated to the provider, the I/O half: whether a
//! compaction asks the provider (`compaction.summarizer`, and for `auto`
//! what was learned of the upstream), the call itself within
//! `compaction.provider_timeout_secs`, and why it failed, which decides the
//! fallback to the local summarizer (always in the same request: a failed
//! provider compaction is never the client's error).
//!
//! The calls follow the providers' rules: a Responses upstream is sent
//! `POST /responses/compact` with the items to compact; a Messages upstream
//! an ordinary `/messages` request with `compaction: {"type": "summarize"}`
//! under its beta, never with `context_management` beside it, and never
//! ending in a tool call it does not answer (the part is cut before it,
//! see [`crate::compaction::provider::closed_len`]).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::context::Context;
use super::input::Input;
use super::summarizer::{SummaryCost, ANTHROPIC_VERSION, MAX_LOGGED_ERROR};
use crate::compaction::provider::{self as pure, COMPACT_BETA};
use crate::compaction::summary::Facts;
use crate::compaction::{fit, Compaction, Params};
use crate::config::Summarizer;
use crate::wire::Api;
use crate::wire::ItemHash;

/// Why the provider's compaction gave nothing to use.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The upstream has no such compaction (404, 405, or a 400 naming it).
    #[error("provider compaction unsupported: {status}: {shown}")]
    Unsupported {
        /// The answer's status.
        status: http::StatusCode,
        /// The start of its body, credentials redacted.
        shown: String,
    },
    /// Another error status.
    #[error("provider compaction answered {status}: {shown}")]
    Status {
        /// The answer's status.
        status: http::StatusCode,
        /// The start of its body, credentials redacted.
        shown: String,
    },
    /// No whole answer within the bound.
    #[error("provider compaction took longer than {0} s")]
    Timeout(u64),
    /// The call could not be made or its answer read.
    #[error("provider compaction call failed: {0}")]
    Call(String),
    /// An answer that is not a compaction.
    #[error("provider compaction answer unusable: {0}")]
    Invalid(String),
}

impl Failure {
    /// The reason label of `compactor_provider_compaction_fallbacks_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Failure::Unsupported { .. } => "unsupported",
            Failure::Status { .. } => "status",
            Failure::Timeout(_) => "timeout",
            Failure::Call(_) => "other",
            Failure::Invalid(_) => "invalid",
        }
    }
}

fn support_key<S: Context>(state: &Arc<S>, input: &Input) -> (String, String) {
    (
        state.summarizer().base().to_string(),
        input.who.model.clone(),
    )
}

/// Whether this compaction asks the provider: `provider`, or `auto` where
/// the upstream was not seen to lack it, on an API that has one.
pub fn wanted<S: Context>(state: &Arc<S>, input: &Input) -> bool {
    if !matches!(input.who.api, Api::Responses | Api::Messages) {
        return false;
    }
    let key = (input.who.tenant.clone(), input.who.conversation.clone());
    if state.compactions().learned().provider_refused(&key) {
        return false;
    }
    match state
        .config()
        .summarizer_for(&input.who.tenant, &input.who.model)
    {
        Summarizer::Local => false,
        Summarizer::Provider => true,
        Summarizer::Auto => {
            state
                .compactions()
                .learned()
                .offered(&support_key(state, input))
                != Some(false)
        }
    }
}

/// What the provider's compaction gave.
pub struct Compacted {
    /// The compacted window, as it came.
    pub window: Vec<Value>,
    /// Tokens of the call, as reported (0 when not).
    pub tokens: u64,
    /// Of those, the answer's.
    pub output_tokens: u64,
    /// What its prompt read from and wrote to the cache, as reported.
    pub cache: crate::compaction::SummaryCache,
}

/// Asks the provider to compact `part` (the items after the leading ones,
/// up to the cut). `auto` learns from the answer whether the upstream
/// offers it.
pub async fn compact<S: Context>(
    state: &Arc<S>,
    input: &Input,
    part: &[Value],
    max_output: u64,
) -> Result<Compacted, Failure> {
    let secs = state.config().compaction.provider_timeout_secs;
    let result = match tokio::time::timeout(
        Duration::from_secs(secs),
        call(state, input, part, max_output),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => Err(Failure::Timeout(secs)),
    };
    let learned = match &result {
        Ok(_) => Some(true),
        Err(Failure::Unsupported { .. }) => Some(false),
        Err(_) => None,
    };
    if let Some(offered) = learned {
        state
            .compactions()
            .learned()
            .learn_offered(support_key(state, input), offered);
    }
    result
}

/// Whether a refusal says the upstream has no such compaction: the
/// endpoint is missing, or the request's compaction field is refused by
/// name.
fn unsupported(status: http::StatusCode, body: &str) -> bool {
    match status.as_u16() {
        404 | 405 | 501 => true,
        400 | 422 => {
            let lower = body.to_ascii_lowercase();
            lower.contains("compaction")
                || lower.contains("/compact")
                || lower.contains(COMPACT_BETA)
        }
        _ => false,
    }
}

async fn call<S: Context>(
    state: &Arc<S>,
    input: &Input,
    part: &[Value],
    max_output: u64,
) -> Result<Compacted, Failure> {
    let up = state.summarizer();
    let mut headers = input.who.auth.clone();
    let (endpoint, body) = match input.who.api {
        Api::Messages => {
            headers
                .entry("anthropic-version")
                .or_insert(http::HeaderValue::from_static(ANTHROPIC_VERSION));
            headers.insert(
                "anthropic-beta",
                http::HeaderValue::from_static(COMPACT_BETA),
            );
            up.key_as_x_api_key(&mut headers);
            // The system prompt and tools go with it, as the documentation
            // asks: the summarizer reads them, and the thinking of the
            // turns kept after the block stays valid only if they match. No `context_management`: the API
            // refuses it beside `compaction`.
            let mut body = json!({
                "model": input.who.model,
                "max_tokens": max_output,
                "messages": part,
                "compaction": {"type": "summarize"},
            });
            if let Some(tools) = &input.request.tools {
                body["tools"] = tools.value().clone();
            }
            if let Some(system) = &input.request.system {
                body["system"] = system.clone();
            }
            ("/messages", body)
        }
        _ => (
            "/responses/compact",
            json!({"model": input.who.model, "input": part}),
        ),
    };
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    headers.insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
    let url = up
        .url(endpoint, None)
        .map_err(|e| Failure::Call(e.to_string()))?;
    let bytes = serde_json::to_vec(&body).map_err(|e| Failure::Call(e.to_string()))?;
    let resp = up
        .send_bytes(http::Method::POST, &url, headers, bytes::Bytes::from(bytes))
        .await
        .map_err(|e| Failure::Call(e.to_string()))?;
    let status = resp.status();
    let answer = up
        .read_body(resp)
        .await
        .map_err(|e| Failure::Call(e.to_string()))?;
    if !status.is_success() {
        // Redacted whole, then cut: a cut first could leave part of a key.
        let text = String::from_utf8_lossy(&answer);
        let text = up.redact(&text, &input.who.auth);
        let shown =
            text[..crate::compaction::items::floor_boundary(&text, MAX_LOGGED_ERROR)].to_string();
        return Err(if unsupported(status, &text) {
            Failure::Unsupported { status, shown }
        } else {
            Failure::Status { status, shown }
        });
    }
    let v: Value =
        serde_json::from_slice(&answer).map_err(|e| Failure::Invalid(format!("not JSON: {e}")))?;
    let window = match input.who.api {
        Api::Messages => pure::messages_window(&v),
        _ => pure::responses_window(&v),
    }
    .map_err(|e| Failure::Invalid(e.to_string()))?;
    let usage = input.who.api.usage(&v);
    let (tokens, output_tokens) = usage
        .map(|u| (u.total(), u.output_tokens))
        .unwrap_or((0, 0));
    let mut cache = crate::compaction::SummaryCache::default();
    if let Some(u) = &usage {
        cache.add(u);
    }
    Ok(Compacted {
        window,
        tokens,
        output_tokens: output_tokens.min(tokens),
        cache,
    })
}

/// The summary rung's result when the provider compacted.
pub(super) struct Delegated {
    /// The replacement and its figures.
    pub applied: fit::Applied,
    /// The facts text the newest user message carries.
    pub facts_text: String,
    /// The call's cost.
    pub cost: SummaryCost,
}

/// What the summary rung starts from, when it asks the provider.
pub(super) struct Rung<'a> {
    /// The request's items as they would go upstream.
    pub view: &'a [Value],
    /// Their tokens.
    pub tokens: &'a [u64],
    /// Their hashes.
    pub hashes: &'a [ItemHash],
    /// The plan the local summary would follow (its cut, its tail).
    pub plan: &'a fit::Plan,
    /// The compaction's budgets.
    pub params: &'a Params,
    /// The facts of the compacted part.
    pub facts: &'a Facts,
    /// What the items may take at most.
    pub limit: u64,
    /// The compaction already applied to the view.
    pub base: Option<&'a Compaction>,
}

/// The summary rung by the provider: its compacted window in the
/// summary's place and the proxy's facts in the newest user message.
/// `None` when it failed (logged and counted): the local summarizer then
/// writes the summary.
pub(super) async fn summary_rung<S: Context, F: Fn(&Value) -> u64 + Sync>(
    state: &Arc<S>,
    input: &Input,
    r: Rung<'_>,
    count: &F,
) -> Option<Delegated> {
    let p = &r.plan.prepared;
    // A Messages history that holds the provider's earlier compaction
    // block goes to it from that block on: the API starts a history there
    // (its first message must otherwise be the user's), and folds the
    // earlier block into the new one, which then takes its place.
    let lead = match input.who.api {
        Api::Messages => crate::compaction::boundary::newest(&r.view[..p.lead])
            .filter(|&b| pure::carries_block(&r.view[b..=b]))
            .unwrap_or(p.lead),
        _ => p.lead,
    };
    let part = &r.view[lead..p.cut];
    let sent = lead
        + match input.who.api {
            Api::Messages => pure::closed_len(part),
            _ => part.len(),
        };
    // Nothing past what the earlier block already covers: nothing new.
    if sent <= p.lead {
        fell_back(
            state,
            input,
            "other",
            "nothing before the cut the provider would take",
        );
        return None;
    }
    let got = match compact(
        state,
        input,
        &r.view[lead..sent],
        r.params.summary_output_tokens,
    )
    .await
    {
        Ok(got) => got,
        Err(e) => {
            fell_back(state, input, e.reason(), &e.to_string());
            return None;
        }
    };
    let facts_text = fit::fitted_summary(
        r.facts,
        None,
        p.covered_len,
        r.params.summary_max_bytes,
        r.plan.summary_budget,
        count,
    );
    let truncated_tail = r.plan.tail_truncate.map(|level| {
        crate::compaction::ladder::truncate_outputs(&r.view[p.cut..], &r.hashes[p.cut..], level).0
    });
    let placed = pure::place(pure::Window {
        api: input.who.api,
        view: r.view,
        lead,
        sent,
        cut: p.cut,
        truncated_tail,
        window: got.window,
        facts: &facts_text,
    });
    let after = placed.replacement.iter().map(count).sum::<u64>()
        + r.tokens[placed.view_end..].iter().sum::<u64>();
    if after > r.limit || after >= p.before {
        fell_back(
            state,
            input,
            "too_large",
            &format!(
                "{after} tokens with the provider's window, limit {}",
                r.limit
            ),
        );
        return None;
    }
    let Some(covered_len) = crate::compaction::rewrite::view_to_original(placed.view_end, r.base)
    else {
        fell_back(
            state,
            input,
            "other",
            "the provider's window ends inside the compaction it extends",
        );
        return None;
    };
    Some(Delegated {
        applied: fit::Applied {
            covered_len,
            tail_len: r.view.len() - p.cut,
            replacement: placed.replacement,
            after,
            kept_users: 0,
        },
        facts_text,
        cost: SummaryCost {
            calls: 1,
            tokens: got.tokens,
            output_tokens: got.output_tokens,
            cache: got.cache,
            ..SummaryCost::default()
        },
    })
}

/// The upstream refused (a 4xx) the request compacted with `c`, whose
/// summary was the provider's: `c` no longer applies to the tenant's
/// requests (the record keeps it), the conversation's summary rung is
/// local from now on, and the fallback is counted. False when `c` was no
/// provider compaction.
pub fn refused<S: Context>(
    state: &Arc<S>,
    tenant: &str,
    conversation: &str,
    c: &Compaction,
    status: http::StatusCode,
) -> bool {
    if !pure::by_provider(&c.reason) {
        return false;
    }
    state
        .compactions()
        .learned()
        .refuse_provider((tenant.to_string(), conversation.to_string()));
    state
        .compactions()
        .forget(tenant, std::slice::from_ref(&c.id));
    state.metrics().provider_fallback("refused");
    tracing::warn!(
        conversation, compaction = %c.id, %status,
        "request compacted by the provider refused; the local summarizer compacts it again"
    );
    true
}

/// The one log line and the metric of a fallback to the local summarizer.
pub fn fell_back<S: Context>(state: &Arc<S>, input: &Input, reason: &'static str, why: &str) {
    state.metrics().provider_fallback(reason);
    tracing::warn!(
        conversation = %input.who.conversation, model = %input.who.model, reason, error = %why,
        "provider compaction failed; the local summarizer writes the summary"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_that_name_the_compaction_mean_unsupported() {
        let s = |n| http::StatusCode::from_u16(n).unwrap();
        assert!(unsupported(s(404), "Not Found"));
        assert!(unsupported(
            s(400),
            r#"{"error":{"message":"Unrecognized request argument supplied: compaction"}}"#
        ));
        assert!(!unsupported(s(400), r#"{"error":{"message":"bad model"}}"#));
        assert!(!unsupported(s(500), "compaction crashed"));
        assert!(!unsupported(s(429), "slow down"));
    }
}
