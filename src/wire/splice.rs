//! Joining streams into one: a stream relayed as it came (its reasoning),
//! then the continuations of the recall rounds its tool calls asked for,
//! each rewritten to follow what the client already has (see
//! `server::splice`, which relays them).

use bytes::Bytes;
use serde_json::{Map, Value};

use super::api::Api;
use super::sse::Block;

/// How a continuation's events follow what the client already has.
#[derive(Debug, Default)]
pub struct Splice {
    api: Option<Api>,
    /// Answers begun before this one.
    answer: u32,
    /// The first answer's id (chat chunk, response).
    id: Option<String>,
    /// Output items (Responses) earlier answers showed the client, and
    /// this one so far.
    before: u64,
    now: u64,
    /// Responses: the items earlier answers showed done, and this one.
    done_before: Vec<Value>,
    done_now: Vec<Value>,
    /// Responses: the last sequence number sent.
    seq: Option<u64>,
}

impl Splice {
    /// The splice of `api`'s streams, before any answer.
    pub fn new(api: Api) -> Splice {
        Splice {
            api: Some(api),
            ..Splice::default()
        }
    }

    /// Whether the answer under way is the first.
    pub fn first_answer(&self) -> bool {
        self.answer == 0
    }

    /// The answer under way was a recall round.
    pub fn next_answer(&mut self) {
        self.answer += 1;
        self.before += std::mem::take(&mut self.now);
        self.done_before.append(&mut self.done_now);
    }

    /// The bytes the client gets for `block`, if any.
    pub fn rewrite(&mut self, block: &Block) -> Option<Bytes> {
        let Some(ev) = &block.event else {
            return Some(block.raw.clone());
        };
        let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(&ev.data) else {
            return Some(block.raw.clone());
        };
        let first = self.answer == 0;
        let keep = match self.api {
            Some(Api::Chat) => self.chat(&mut v, first),
            Some(Api::Responses) => self.responses(&ev.name, &mut v, first),
            // Not spliced: see `Format::starts_reasoning`.
            Some(Api::Messages | Api::Gemini) | None => true,
        };
        if !keep {
            return None;
        }
        if first {
            return Some(block.raw.clone());
        }
        Some(super::sse::event_bytes(&ev.name, &Value::Object(v)))
    }

    /// A chat chunk: the continuation's take the first answer's id, and
    /// lose their role (the client had it); one left with nothing is dropped.
    fn chat(&mut self, v: &mut Map<String, Value>, first: bool) -> bool {
        if first {
            if self.id.is_none() {
                self.id = v.get("id").and_then(Value::as_str).map(String::from);
            }
            return true;
        }
        if let (Some(id), Some(slot)) = (&self.id, v.get_mut("id")) {
            *slot = Value::String(id.clone());
        }
        let Some(choice) = v
            .get_mut("choices")
            .and_then(Value::as_array_mut)
            .and_then(|c| c.first_mut())
        else {
            return true;
        };
        let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) else {
            return true;
        };
        delta.remove("role");
        let empty = delta
            .iter()
            .all(|(_, d)| d.is_null() || d.as_str().is_some_and(str::is_empty));
        let finish = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        let usage = v.get("usage").is_some_and(|u| !u.is_null());
        !(empty && !finish && !usage)
    }

    /// A Responses event: the continuation's prelude dropped, indices and
    /// sequence numbers following what was sent, the final response with
    /// the first id and every item the client saw.
    fn responses(&mut self, name: &str, v: &mut Map<String, Value>, first: bool) -> bool {
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(name)
            .to_string();
        if first && self.id.is_none() {
            self.id = v
                .get("response")
                .and_then(|r| r.get("id"))
                .and_then(Value::as_str)
                .map(String::from);
        }
        if !first
            && matches!(
                kind.as_str(),
                "response.created" | "response.in_progress" | "response.queued"
            )
        {
            return false;
        }
        if let Some(i) = v.get("output_index").and_then(Value::as_u64) {
            self.now = self.now.max(i + 1);
            if !first {
                v.insert("output_index".into(), Value::from(i + self.before));
            }
        }
        if kind == "response.output_item.done" {
            if let Some(item) = v.get("item") {
                self.done_now.push(item.clone());
            }
        }
        if let Some(n) = v.get("sequence_number").and_then(Value::as_u64) {
            if first {
                self.seq = Some(n);
            } else {
                let next = self.seq.map_or(n, |s| s + 1);
                self.seq = Some(next);
                v.insert("sequence_number".into(), Value::from(next));
            }
        }
        if !first {
            if let Some(Value::Object(r)) = v.get_mut("response") {
                if let Some(id) = &self.id {
                    r.insert("id".into(), Value::String(id.clone()));
                }
                if let Some(Value::Array(out)) = r.get_mut("output") {
                    let mut all = self.done_before.clone();
                    all.append(out);
                    *out = all;
                }
            }
        }
        true
    }
}
