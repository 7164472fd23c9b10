//! Between send and relay, when the request offers `compactor_recall` (see
//! [`crate::compaction::recall`]) or `compactor_compact`: runs on each
//! answer the send hands on. Reads as much of the answer as it takes to
//! know whether the model called the tool; if it did, answers the calls
//! from the request's own items and says so ([`Settled::Round`]): the
//! driver sends the continued request, so the client gets the final answer
//! alone. It must not send the request, answer the client or record the
//! exchange.
//!
//! A JSON answer is read whole. A stream is read until its first output:
//! text flows as before (the model answers, it does not recall); a tool
//! call is held back with the rest of the stream (tool calls are short), and
//! relayed untouched when none of its calls is a recall. A recall beside
//! the client's own tool calls, or past `compaction.recall_max_rounds` (or
//! a compact call past its rounds), is sent again once without the proxy's
//! tools; a call of them in the answer to that is taken out of what the
//! client gets (`wire::own_calls`), with the stop reason it would have had without
//! it: the client never gets a call it cannot answer, nor loses one of its
//! own, and a model that keeps calling them cannot fail the request.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::Value;

use super::answer::{is_sse, Answer, Held};
use super::exchange::{Rounds, Unanswered};
use super::gather::UpstreamStream;
use crate::app::AppState;
use crate::compaction::agent_tool;
use crate::compaction::recall::{self, Round};
use crate::error::ProxyError;
use crate::wire::format::First;
use crate::wire::sse::{Framer, SseTee};
use crate::wire::{own_calls, Api, Usage};

/// Most bytes of a streamed tool-call answer held back to look at it;
/// past this it is relayed as it is.
const MAX_HELD_BYTES: usize = 1 << 20;

/// What the start of an answer showed.
enum Seen {
    /// Relay it (text first, an error, a tool call not worth holding).
    Relay(Answer),
    /// A complete answer with tool calls: the answer as JSON, its usage,
    /// and how to relay it if no recall is made of it.
    Calls(Value, Option<Usage>, Answer),
    /// A stream that began with reasoning, read up to it: relayed as it
    /// comes (`server::splice`).
    Live(Held),
}

/// What the answer is, for the driver in `server::proxy`.
// Returned and matched at once, never kept: the empty variant's size
// costs nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum Settled {
    /// The client's: relay it.
    Answer(Answer),
    /// A round: the exchange carries the calls and their answers (or no
    /// longer offers the tool); send it again.
    Round,
}

/// Looks at an answer for calls of the proxy's tools: the client's answer
/// is handed on; calls are answered (at most `compaction.recall_max_rounds`
/// recall rounds, [`MAX_AGENT_ROUNDS`] compact ones) for the driver to
/// send the request again. Calls no round answers send the request once
/// more without the proxy's tools; after that they are taken out of the
/// answer the client gets.
pub(super) async fn settle(
    state: &Arc<AppState>,
    pending: &mut Unanswered,
    answer: Answer,
) -> Result<Settled, ProxyError> {
    // Once offered, every answer is looked at: a model may call the
    // tool after it is withdrawn, from the calls earlier rounds left.
    if !pending.recall_offered() && !pending.agent_offered() {
        return Ok(Settled::Answer(answer));
    }
    let mut rounds = pending.rounds();
    let settled = decide(state, pending, answer, &mut rounds).await;
    pending.set_rounds(rounds);
    settled
}

/// [`settle`], with the rounds answered so far.
async fn decide(
    state: &Arc<AppState>,
    pending: &mut Unanswered,
    answer: Answer,
    rounds: &mut Rounds,
) -> Result<Settled, ProxyError> {
    let max = pending.recall_rounds();
    let (v, usage, relay) = match inspect(state, pending.request().api(), answer).await? {
        Seen::Relay(a) => {
            note_hidden_rounds(state, pending);
            return Ok(Settled::Answer(a));
        }
        Seen::Live(held) => return Ok(Settled::Answer(Answer::Live(held))),
        Seen::Calls(v, usage, a) => (v, usage, a),
    };
    let round = recall::round_of(
        pending.request().api(),
        &v,
        pending.recall_offered(),
        pending.agent_offered(),
    );
    if !matches!(round, Round::Final) {
        pending.count_round(usage);
    }
    match round {
        Round::Final => {
            note_hidden_rounds(state, pending);
            return Ok(Settled::Answer(relay));
        }
        Round::Recall(calls) if pending.offers_recall() && rounds.recall < max => {
            rounds.recall += 1;
            let room = room_bytes(state, pending).await;
            let originals = pending.request().items().values();
            let results = recall::answers(&calls, &originals, pending.hashes(), room);
            tracing::info!(
                round = rounds.recall,
                calls = calls.len(),
                room,
                "recall answered by the proxy"
            );
            let cont = recall::continuation(pending.request().api(), &v, &results);
            pending.continue_with(cont);
        }
        Round::Compact(recalls, compacts)
            if pending.offers_agent_tool()
                && rounds.agent < MAX_AGENT_ROUNDS
                && (recalls.is_empty() || (pending.offers_recall() && rounds.recall < max)) =>
        {
            rounds.agent += 1;
            let mut results = Vec::new();
            if !recalls.is_empty() {
                rounds.recall += 1;
                let room = room_bytes(state, pending).await;
                let originals = pending.request().items().values();
                results = recall::answers(&recalls, &originals, pending.hashes(), room);
            }
            results.extend(answer_compacts(state, pending, &compacts));
            tracing::info!(
                calls = compacts.len(),
                "compactor_compact answered by the proxy"
            );
            let cont = recall::continuation(pending.request().api(), &v, &results);
            pending.continue_with(cont);
        }
        _ => return Ok(unanswered_calls(state, pending, *rounds, &v, relay)),
    }
    Ok(Settled::Round)
}

/// An answer calling the proxy's tools that no round answers: past the
/// rounds, beside the client's own calls, or after the tools were taken
/// away. While the request still offers them, it is sent once more
/// without them (the rounds' calls and answers kept); after that the
/// answer goes to the client without the proxy's calls.
fn unanswered_calls(
    state: &AppState,
    pending: &mut Unanswered,
    rounds: Rounds,
    v: &Value,
    relay: Answer,
) -> Settled {
    let api = pending.request().api();
    let names = pending.own_tools();
    let called = own_calls::from_json(api, &names, &mut v.clone()).join(", ");
    if pending.offers_recall() || pending.offers_agent_tool() {
        tracing::info!(
            tool = %called,
            recall_rounds = rounds.recall,
            compact_rounds = rounds.agent,
            "{called} called past the rounds the proxy answers, or beside the client's own calls: sent again without the proxy's tools"
        );
        pending.withdraw_recall(false);
        pending.withdraw_agent_tool();
        return Settled::Round;
    }
    tracing::info!(
        tool = %called,
        "{called} called again without the proxy's tools: the answer goes to the client without those calls"
    );
    note_hidden_rounds(state, pending);
    Settled::Answer(without_calls(api, &names, relay))
}

/// `answer` (a JSON answer read whole, or a stream held to its end)
/// without the calls of the tools `names`.
fn without_calls(api: Api, names: &[&str], answer: Answer) -> Answer {
    match answer {
        Answer::Read(status, mut headers, bytes) => {
            let Ok(mut v) = serde_json::from_slice::<Value>(&bytes) else {
                return Answer::Read(status, headers, bytes);
            };
            if own_calls::from_json(api, names, &mut v).is_empty() {
                return Answer::Read(status, headers, bytes);
            }
            headers.remove(http::header::CONTENT_LENGTH);
            Answer::Read(status, headers, Bytes::from(v.to_string()))
        }
        Answer::Held(mut held) => {
            let body = super::gather::concat(std::mem::take(&mut held.chunks)).unwrap_or_default();
            held.chunks = match own_calls::from_stream(api, names, &body) {
                Some((stripped, _)) => vec![stripped],
                None if body.is_empty() => Vec::new(),
                None => vec![body],
            };
            Answer::Held(held)
        }
        other => other,
    }
}

/// The answer relayed after hidden rounds, on Anthropic Messages with
/// thinking on, carries thinking signed against those rounds, which the
/// client's next request will lack: the conversation's later requests let
/// the API drop such blocks.
fn note_hidden_rounds(state: &AppState, pending: &Unanswered) {
    let request = pending.request();
    if !pending.extra().is_empty() && request.api().format().signs_thinking(request.body()) {
        state
            .compactions
            .mark_hidden_round(request.tenant(), pending.conversation());
    }
}

/// Most answers of one request in which the proxy answers
/// `compactor_compact` calls; past them the tool is withdrawn.
const MAX_AGENT_ROUNDS: u32 = 2;

/// The proxy's answers to the model's `compactor_compact` calls: the first
/// call of a turn schedules the compaction (computed now in the
/// background, applied at the next turn boundary, the calls' `keep` notes
/// a section of its summary); any other is told it is already scheduled.
fn answer_compacts(
    state: &Arc<AppState>,
    pending: &Unanswered,
    calls: &[agent_tool::Call],
) -> Vec<(String, String)> {
    let items = pending.request().items().values();
    let first = agent_tool::turn_of(&items, pending.chains()).is_some_and(|turn| {
        state.compactions.schedule_agent_turn(
            pending.request().tenant(),
            pending.conversation(),
            turn,
        )
    });
    if first {
        let mut input = pending.input(agent_tool::reason(calls), false);
        input.ask.keep = agent_tool::notes(calls);
        if !crate::engine::schedule_agent(state, input) {
            tracing::info!(
                "compactor_compact: a compaction of the conversation is under way already"
            );
        }
    }
    agent_tool::answers(calls, !first)
}

/// Bytes a round's recall answers may take: the room the window leaves
/// once the request as it stands (view, earlier rounds, tools) and the
/// answer's own budget (the request's `max_tokens`-like field, else the
/// model's largest output) are taken out, at a conservative two bytes a
/// token.
async fn room_bytes(state: &Arc<AppState>, pending: &Unanswered) -> usize {
    let request = pending.request();
    let limits = state.model_limits(request.model());
    let asked = ["max_output_tokens", "max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| request.body().get(*k).and_then(Value::as_u64));
    let budget = asked.unwrap_or(limits.max_output_tokens);
    let (api, view, extra) = (
        request.api(),
        pending.view().clone(),
        pending.extra().to_vec(),
    );
    let tools = request.tools().cloned();
    let counter = state.clone();
    // Tokenizing stays off the async threads.
    let used = tokio::task::spawn_blocking(move || {
        let hashes = view.hashes();
        let mut used = counter
            .tokens
            .estimate(api, &view, &hashes, tools.as_ref())
            .total();
        for item in &extra {
            used += counter.tokens.count_text(&item.to_string());
        }
        used + counter
            .tokens
            .count_text(&recall::definition(api).to_string())
    })
    .await
    .unwrap_or(u64::MAX);
    let room = limits
        .context_window
        .saturating_sub(used)
        .saturating_sub(budget);
    // A tenth kept back for what the estimate misses.
    let room = room - room / 10;
    usize::try_from(room.saturating_mul(2)).unwrap_or(usize::MAX)
}

/// Reads the start of `answer` (see the module's documentation).
async fn inspect(state: &AppState, api: Api, answer: Answer) -> Result<Seen, ProxyError> {
    match answer {
        Answer::Upstream(resp) if !is_sse(resp.headers()) => {
            let (status, headers) = (resp.status(), resp.headers().clone());
            let bytes = state.upstream.read_body(resp).await?;
            let read = Answer::Read(status, headers, bytes.clone());
            let v: Value = match serde_json::from_slice(&bytes) {
                Ok(v) if status.is_success() => v,
                _ => return Ok(Seen::Relay(read)),
            };
            let usage = api.usage(&v);
            Ok(Seen::Calls(v, usage, read))
        }
        Answer::Upstream(resp) => inspect_stream(state, api, Held::unread(resp)).await,
        Answer::Held(held) => inspect_stream(state, api, held).await,
        other => Ok(Seen::Relay(other)),
    }
}

/// Reads a stream until its first output; a tool call, to its end.
async fn inspect_stream(state: &AppState, api: Api, mut held: Held) -> Result<Seen, ProxyError> {
    let idle = state.upstream.idle_timeout;
    let mut framer = Framer::new();
    let mut size = 0;
    for chunk in &held.chunks {
        framer.push(chunk);
        size += chunk.len();
    }
    let mut first = None;
    let mut ended = held.end.is_some();
    // A stream the splice has not read yet that begins with reasoning is
    // relayed as it comes.
    let may_splice = held.relayed.is_none();
    loop {
        while first.is_none() {
            let Some(block) = framer.next_block() else {
                break;
            };
            let Some(ev) = block.event else {
                continue;
            };
            if may_splice && api.format().starts_reasoning(&ev.name, &ev.data) {
                return Ok(Seen::Live(held));
            }
            first = api.format().first_output(&ev.name, &ev.data);
        }
        if first == Some(First::Text) || ended || size > MAX_HELD_BYTES {
            break;
        }
        match tokio::time::timeout(idle, held.rest.next()).await {
            Err(_) => return Err(crate::upstream::Error::silent(idle).into()),
            Ok(None) => ended = true,
            Ok(Some(Err(e))) => return Err(crate::upstream::Error::broke(e).into()),
            Ok(Some(Ok(chunk))) => {
                if first.is_none() {
                    framer.push(&chunk);
                }
                size += chunk.len();
                held.chunks.push(chunk);
            }
        }
    }
    if ended && held.end.is_none() {
        held.end = Some(None);
        held.rest = Box::pin(futures_util::stream::empty()) as UpstreamStream;
    }
    if first != Some(First::ToolCall) || !ended {
        return Ok(Seen::Relay(Answer::Held(held)));
    }
    let mut tee = SseTee::new(api, false);
    for chunk in &held.chunks {
        tee.push(chunk.clone());
    }
    tee.finish();
    let items = tee.items();
    let v = api.format().answer_of(items);
    Ok(Seen::Calls(v, tee.usage(), Answer::Held(held)))
}
