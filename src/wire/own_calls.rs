//! The proxy's own tool calls taken out of an answer the client gets. Past
//! the rounds the proxy answers, and once it sent the request again without
//! its tools, a model may still call `compactor_recall` or
//! `compactor_compact` (from the calls earlier rounds left in the
//! request): the client, which never declared them, gets the rest of the
//! answer, with the stop reason of an answer that calls none of them (its
//! own calls, if any, kept and numbered as if the proxy's were never
//! there).
//!
//! A stream is rewritten event by event: an event the calls do not touch
//! keeps its bytes, so what a splice already relayed of it (the reasoning
//! before the calls) stays a prefix of the rewritten stream.

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value};

use super::api::Api;
use super::sse::{event_bytes, Block, Framer};

/// Whether a call's name is one of `names`.
fn ours<S: AsRef<str>>(names: &[S], name: Option<&str>) -> bool {
    name.is_some_and(|n| names.iter().any(|m| m.as_ref() == n))
}

/// Adds `name` to `removed` once.
fn note(removed: &mut Vec<String>, name: Option<&str>) {
    if let Some(n) = name {
        if !removed.iter().any(|r| r == n) {
            removed.push(n.to_string());
        }
    }
}

/// Takes the calls of the tools `names` out of a complete JSON answer;
/// returns the names of those taken out (none: the answer is unchanged).
pub fn from_json(api: Api, names: &[&str], v: &mut Value) -> Vec<String> {
    let mut removed = Vec::new();
    match api {
        Api::Chat => {
            let choices = v.get_mut("choices").and_then(Value::as_array_mut);
            for choice in choices.into_iter().flatten() {
                let Some(message) = choice.get_mut("message").and_then(Value::as_object_mut) else {
                    continue;
                };
                let Some(Value::Array(calls)) = message.get_mut("tool_calls") else {
                    continue;
                };
                let before = calls.len();
                calls.retain(|c| {
                    let name = c.pointer("/function/name").and_then(Value::as_str);
                    let drop = ours(names, name);
                    if drop {
                        note(&mut removed, name);
                    }
                    !drop
                });
                if calls.len() == before || !calls.is_empty() {
                    continue;
                }
                message.remove("tool_calls");
                if message.get("content").is_none_or(Value::is_null) {
                    message.insert("content".into(), Value::from(""));
                }
                if choice.get("finish_reason").and_then(Value::as_str) == Some("tool_calls") {
                    choice["finish_reason"] = Value::from("stop");
                }
            }
        }
        Api::Responses => {
            if let Some(Value::Array(output)) = v.get_mut("output") {
                retain_items(names, output, &mut removed);
            }
        }
        Api::Messages => {
            if let Some(Value::Array(content)) = v.get_mut("content") {
                content.retain(|b| {
                    let name = b.get("name").and_then(Value::as_str);
                    let drop = b.get("type").and_then(Value::as_str) == Some("tool_use")
                        && ours(names, name);
                    if drop {
                        note(&mut removed, name);
                    }
                    !drop
                });
                let calls_left = content
                    .iter()
                    .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"));
                if !removed.is_empty()
                    && !calls_left
                    && v.get("stop_reason").and_then(Value::as_str) == Some("tool_use")
                {
                    v["stop_reason"] = Value::from("end_turn");
                }
            }
        }
        Api::Gemini => {
            for name in super::gemini::drop_calls(v, |n| ours(names, Some(n))) {
                note(&mut removed, Some(&name));
            }
        }
    }
    removed
}

/// Responses output items without the `function_call`s of `names`.
fn retain_items<S: AsRef<str>>(names: &[S], output: &mut Vec<Value>, removed: &mut Vec<String>) {
    output.retain(|item| {
        let name = item.get("name").and_then(Value::as_str);
        let drop =
            item.get("type").and_then(Value::as_str) == Some("function_call") && ours(names, name);
        if drop {
            note(removed, name);
        }
        !drop
    });
}

/// A complete SSE answer without the calls of the tools `names`, with the
/// names of those taken out; `None` when it calls none of them.
pub fn from_stream(api: Api, names: &[&str], body: &[u8]) -> Option<(Bytes, Vec<String>)> {
    let mut framer = Framer::new();
    framer.push(body);
    let mut strip = OwnCalls::new(api, names);
    let mut out = BytesMut::with_capacity(body.len());
    while let Some(block) = framer.next_block() {
        if let Some(bytes) = strip.block(&block) {
            out.extend_from_slice(&bytes);
        }
    }
    out.extend_from_slice(&framer.rest());
    (!strip.removed.is_empty()).then(|| (out.freeze(), strip.removed))
}

/// Takes the calls of the proxy's tools out of a stream, event by event,
/// as it is relayed: what it showed so far of the calls taken out.
#[derive(Default, Debug)]
pub struct OwnCalls {
    api: Option<Api>,
    names: Vec<String>,
    removed: Vec<String>,
    /// Chat: each call's index as the upstream numbered it, and as the
    /// client gets it (`None`: taken out).
    chat_calls: Vec<(u64, Option<u64>)>,
    /// Responses output indices, Messages content block indices, taken out.
    dropped: Vec<u64>,
    /// A call of the client's own was kept.
    kept_call: bool,
    /// Responses: events with a sequence number taken out so far.
    seq_dropped: u64,
}

/// What becomes of one event.
enum Fate {
    Keep,
    Drop,
    Rewrite,
}

impl super::sse::Rewrite for OwnCalls {
    fn block(&mut self, block: &Block) -> Option<Bytes> {
        OwnCalls::block(self, block)
    }

    fn removed(&self) -> &[String] {
        &self.removed
    }
}

/// A tee's [`Rewrite`](super::sse::Rewrite) taking the calls of the tools
/// `names` out of a stream of `api`; none when there are none to take.
pub fn rewrite(api: Api, names: &[&str]) -> Option<Box<dyn super::sse::Rewrite>> {
    (!names.is_empty()).then(|| Box::new(OwnCalls::new(api, names)) as Box<dyn super::sse::Rewrite>)
}

impl OwnCalls {
    /// Takes out the calls of the tools `names` from a stream of `api`.
    pub fn new(api: Api, names: &[&str]) -> OwnCalls {
        OwnCalls {
            api: Some(api),
            names: names.iter().map(|n| n.to_string()).collect(),
            ..OwnCalls::default()
        }
    }

    /// The bytes the client gets for `block`, if any.
    pub fn block(&mut self, block: &Block) -> Option<Bytes> {
        let Some(ev) = &block.event else {
            return Some(block.raw.clone());
        };
        let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(&ev.data) else {
            return Some(block.raw.clone());
        };
        let fate = match self.api {
            Some(Api::Chat) => self.chat(&mut v),
            Some(Api::Responses) => self.responses(&ev.name, &mut v),
            Some(Api::Messages) => self.messages(&mut v),
            Some(Api::Gemini) => self.gemini(&mut v),
            None => Fate::Keep,
        };
        match fate {
            Fate::Keep => Some(block.raw.clone()),
            Fate::Drop => None,
            Fate::Rewrite => Some(event_bytes(&ev.name, &Value::Object(v))),
        }
    }

    /// A Gemini chunk: the proxy's calls' parts out (each chunk holds whole
    /// parts); a chunk left with nothing but an empty candidate is kept,
    /// as it may carry the answer's end and usage.
    fn gemini(&mut self, v: &mut Map<String, Value>) -> Fate {
        let mut chunk = Value::Object(std::mem::take(v));
        let names = &self.names;
        let removed = super::gemini::drop_calls(&mut chunk, |n| ours(names, Some(n)));
        if let Value::Object(back) = chunk {
            *v = back;
        }
        for name in &removed {
            note(&mut self.removed, Some(name));
        }
        if removed.is_empty() {
            Fate::Keep
        } else {
            Fate::Rewrite
        }
    }

    /// A chat chunk: the proxy's calls' deltas out, the client's renumbered,
    /// `tool_calls` as the finish reason only if one of the client's is left.
    fn chat(&mut self, v: &mut Map<String, Value>) -> Fate {
        let mut changed = false;
        let Some(choice) = v
            .get_mut("choices")
            .and_then(Value::as_array_mut)
            .and_then(|c| c.first_mut())
            .and_then(Value::as_object_mut)
        else {
            return Fate::Keep;
        };
        if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
            if let Some(Value::Array(calls)) = delta.get_mut("tool_calls") {
                let before = calls.len();
                calls.retain_mut(|call| {
                    let index = call.get("index").and_then(Value::as_u64).unwrap_or(0);
                    let name = call.pointer("/function/name").and_then(Value::as_str);
                    let known = self.chat_calls.iter().find(|(i, _)| *i == index);
                    let to = match (known, name) {
                        (Some(&(_, to)), _) => to,
                        (None, name) if ours(&self.names, name) => {
                            note(&mut self.removed, name);
                            self.chat_calls.push((index, None));
                            None
                        }
                        (None, _) => {
                            let next = self.chat_calls.iter().filter(|(_, to)| to.is_some());
                            let to = Some(next.count() as u64);
                            self.chat_calls.push((index, to));
                            self.kept_call = true;
                            to
                        }
                    };
                    match to {
                        Some(to) if to != index => {
                            call["index"] = Value::from(to);
                            changed = true;
                            true
                        }
                        Some(_) => true,
                        None => false,
                    }
                });
                changed |= calls.len() != before;
                if calls.is_empty() && before > 0 {
                    delta.remove("tool_calls");
                }
            }
        }
        if !self.removed.is_empty()
            && !self.kept_call
            && choice.get("finish_reason").and_then(Value::as_str) == Some("tool_calls")
        {
            choice.insert("finish_reason".into(), Value::from("stop"));
            changed = true;
        }
        if !changed {
            return Fate::Keep;
        }
        let empty = choice
            .get("delta")
            .and_then(Value::as_object)
            .is_none_or(|d| {
                d.values()
                    .all(|x| x.is_null() || x.as_str().is_some_and(str::is_empty))
            });
        let finish = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        let usage = v.get("usage").is_some_and(|u| !u.is_null());
        if empty && !finish && !usage {
            Fate::Drop
        } else {
            Fate::Rewrite
        }
    }

    /// Where an index the upstream gave lands once the `dropped` ones below
    /// it are out; `None` if it is one of them.
    fn shifted(&self, index: u64) -> Option<u64> {
        if self.dropped.contains(&index) {
            return None;
        }
        Some(index - self.dropped.iter().filter(|d| **d < index).count() as u64)
    }

    /// A Responses event: the proxy's `function_call` items out, later
    /// output indices and sequence numbers closing the gap, the final
    /// response's `output` without them.
    fn responses(&mut self, name: &str, v: &mut Map<String, Value>) -> Fate {
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(name)
            .to_string();
        let mut changed = false;
        if let Some(i) = v.get("output_index").and_then(Value::as_u64) {
            let item = v.get("item");
            let call =
                item.and_then(|i| i.get("type")).and_then(Value::as_str) == Some("function_call");
            let called = item.and_then(|i| i.get("name")).and_then(Value::as_str);
            if kind == "response.output_item.added" && call && ours(&self.names, called) {
                note(&mut self.removed, called);
                self.dropped.push(i);
            }
            match self.shifted(i) {
                None => {
                    if v.get("sequence_number").is_some() {
                        self.seq_dropped += 1;
                    }
                    return Fate::Drop;
                }
                Some(to) if to != i => {
                    v.insert("output_index".into(), Value::from(to));
                    changed = true;
                }
                Some(_) => {}
            }
        }
        if let Some(Value::Array(output)) = v.get_mut("response").and_then(|r| r.get_mut("output"))
        {
            let before = output.len();
            retain_items(&self.names, output, &mut self.removed);
            changed |= output.len() != before;
        }
        if let Some(n) = v.get("sequence_number").and_then(Value::as_u64) {
            if self.seq_dropped > 0 {
                v.insert(
                    "sequence_number".into(),
                    Value::from(n.saturating_sub(self.seq_dropped)),
                );
                changed = true;
            }
        }
        if changed {
            Fate::Rewrite
        } else {
            Fate::Keep
        }
    }

    /// A Messages event: the proxy's `tool_use` blocks out, later blocks
    /// renumbered, `end_turn` for a `tool_use` stop with none of the
    /// client's calls left.
    fn messages(&mut self, v: &mut Map<String, Value>) -> Fate {
        let kind = v.get("type").and_then(Value::as_str).unwrap_or_default();
        if kind == "message_delta" {
            let stop = v
                .get("delta")
                .and_then(|d| d.get("stop_reason"))
                .and_then(Value::as_str);
            if stop == Some("tool_use") && !self.removed.is_empty() && !self.kept_call {
                if let Some(Value::Object(delta)) = v.get_mut("delta") {
                    delta.insert("stop_reason".into(), Value::from("end_turn"));
                }
                return Fate::Rewrite;
            }
            return Fate::Keep;
        }
        let Some(i) = v.get("index").and_then(Value::as_u64) else {
            return Fate::Keep;
        };
        if kind == "content_block_start" {
            let block = v.get("content_block");
            let called = block.and_then(|b| b.get("name")).and_then(Value::as_str);
            if block.and_then(|b| b.get("type")).and_then(Value::as_str) == Some("tool_use") {
                if ours(&self.names, called) {
                    note(&mut self.removed, called);
                    self.dropped.push(i);
                } else {
                    self.kept_call = true;
                }
            }
        }
        match self.shifted(i) {
            None => Fate::Drop,
            Some(to) if to != i => {
                v.insert("index".into(), Value::from(to));
                Fate::Rewrite
            }
            Some(_) => Fate::Keep,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NAMES: &[&str] = &["compactor_recall", "compactor_compact"];

    fn sse(events: &[(&str, Value)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, data) in events {
            out.extend_from_slice(&event_bytes(name, data));
        }
        out
    }

    fn events(body: &[u8]) -> Vec<Value> {
        let mut framer = Framer::new();
        framer.push(body);
        std::iter::from_fn(|| framer.next_block())
            .filter_map(|b| b.event)
            .filter_map(|e| serde_json::from_str(&e.data).ok())
            .collect()
    }

    #[test]
    fn a_json_answer_keeps_the_clients_calls_and_text() {
        let mut chat = json!({"choices": [{"message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "a", "function": {"name": "compactor_compact", "arguments": "{}"}}]},
            "finish_reason": "tool_calls"}]});
        assert_eq!(
            from_json(Api::Chat, NAMES, &mut chat),
            ["compactor_compact"]
        );
        assert_eq!(chat["choices"][0]["finish_reason"], "stop");
        assert_eq!(chat["choices"][0]["message"]["content"], "");
        assert!(chat["choices"][0]["message"].get("tool_calls").is_none());

        let mut msg = json!({"content": [{"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "a", "name": "compactor_recall", "input": {}},
            {"type": "tool_use", "id": "b", "name": "shell", "input": {}}],
            "stop_reason": "tool_use"});
        assert_eq!(
            from_json(Api::Messages, NAMES, &mut msg),
            ["compactor_recall"]
        );
        assert_eq!(msg["stop_reason"], "tool_use", "the client's call is left");
        assert_eq!(msg["content"].as_array().unwrap().len(), 2);

        let mut resp = json!({"output": [{"type": "function_call", "name": "compactor_compact"},
            {"type": "message", "content": []}]});
        assert_eq!(
            from_json(Api::Responses, NAMES, &mut resp),
            ["compactor_compact"]
        );
        assert_eq!(resp["output"].as_array().unwrap().len(), 1);
        let mut plain = json!({"output": [{"type": "function_call", "name": "shell"}]});
        assert!(from_json(Api::Responses, NAMES, &mut plain).is_empty());
    }

    #[test]
    fn a_chat_stream_renumbers_the_clients_calls_and_stops_normally() {
        let chunk = |delta: Value, finish: Value| json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        let body = sse(&[
            (
                "message",
                chunk(json!({"role": "assistant", "content": null}), Value::Null),
            ),
            (
                "message",
                chunk(
                    json!({"tool_calls": [{"index": 0, "id": "p", "function": {"name": "compactor_compact", "arguments": ""}}]}),
                    Value::Null,
                ),
            ),
            (
                "message",
                chunk(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
                    Value::Null,
                ),
            ),
            (
                "message",
                chunk(
                    json!({"tool_calls": [{"index": 1, "id": "c", "function": {"name": "shell", "arguments": "{}"}}]}),
                    Value::Null,
                ),
            ),
            ("message", chunk(json!({}), json!("tool_calls"))),
        ]);
        let (out, removed) = from_stream(Api::Chat, NAMES, &body).unwrap();
        assert_eq!(removed, ["compactor_compact"]);
        let got = events(&out);
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[1]["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
        assert_eq!(got[2]["choices"][0]["finish_reason"], "tool_calls");
        assert!(from_stream(Api::Chat, &["other"], &body).is_none());
    }
}
