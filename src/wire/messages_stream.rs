//! Anthropic Messages streams: the events of an answer collected into its
//! assistant message, usage and end (what the tee records).

use serde_json::{json, Map, Value};

use super::usage::Usage;

/// Collects the assistant message, usage and the end of a Messages stream.
#[derive(Debug, Default)]
pub struct MessagesCollector {
    /// The content blocks, by index, as far as they arrived.
    blocks: Vec<BlockAcc>,
    /// The message id from `message_start`.
    pub id: Option<String>,
    /// Usage: `message_start`'s, updated by each (cumulative) `message_delta`.
    usage_raw: Map<String, Value>,
    /// Usage normalised, once any was reported.
    pub usage: Option<Usage>,
    /// The `stop_reason` of the last `message_delta`.
    pub stop_reason: Option<String>,
    /// An `error` event's `error` object.
    pub error: Option<Value>,
    /// `message_stop` was seen.
    pub done: bool,
    /// Past what is collected of an answer: no more content is kept, the
    /// usage and the end still are.
    pub capped: bool,
}

#[derive(Debug, Default)]
struct BlockAcc {
    /// The block as `content_block_start` gave it.
    block: Map<String, Value>,
    /// Text, thinking and signature deltas, by field.
    text: Map<String, Value>,
    /// `input_json_delta` pieces.
    json: String,
}

/// Most content blocks one answer may open (an index past it is ignored).
const MAX_BLOCKS: usize = 4096;

impl MessagesCollector {
    /// Feeds one event: its `event:` name (may be empty) and `data`.
    pub fn push(&mut self, event: &str, data: &str) {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        let kind = v.get("type").and_then(Value::as_str).unwrap_or(event);
        if self.capped && kind.starts_with("content_block_") {
            return;
        }
        match kind {
            "message_start" => {
                if let Some(m) = v.get("message") {
                    self.id = m.get("id").and_then(Value::as_str).map(String::from);
                    if let Some(u) = m.get("usage") {
                        self.merge_usage(u);
                    }
                }
            }
            "content_block_start" => {
                if let (Some(i), Some(Value::Object(b))) = (index(&v), v.get("content_block")) {
                    let acc = self.block(i);
                    acc.block = b.clone();
                }
            }
            "content_block_delta" => {
                let (Some(i), Some(d)) = (index(&v), v.get("delta")) else {
                    return;
                };
                let acc = self.block(i);
                let piece = |k: &str| d.get(k).and_then(Value::as_str);
                match d.get("type").and_then(Value::as_str).unwrap_or("") {
                    "input_json_delta" => acc.json.push_str(piece("partial_json").unwrap_or("")),
                    "text_delta" => acc.append("text", piece("text")),
                    "thinking_delta" => acc.append("thinking", piece("thinking")),
                    "signature_delta" => acc.append("signature", piece("signature")),
                    "citations_delta" => {
                        if let Some(c) = d.get("citation") {
                            let list = acc
                                .text
                                .entry("citations")
                                .or_insert_with(|| Value::Array(Vec::new()));
                            if let Value::Array(l) = list {
                                l.push(c.clone());
                            }
                        }
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(u) = v.get("usage") {
                    self.merge_usage(u);
                }
                if let Some(r) = v.pointer("/delta/stop_reason").and_then(Value::as_str) {
                    self.stop_reason = Some(r.to_string());
                }
            }
            "message_stop" => self.done = true,
            "error" => self.error = Some(v.get("error").cloned().unwrap_or(v)),
            _ => {}
        }
    }

    fn block(&mut self, i: usize) -> &mut BlockAcc {
        if self.blocks.len() <= i {
            self.blocks.resize_with(i + 1, BlockAcc::default);
        }
        &mut self.blocks[i]
    }

    /// `message_delta`'s usage is cumulative: its figures replace
    /// `message_start`'s, and those it leaves out stay.
    fn merge_usage(&mut self, u: &Value) {
        if let Some(o) = u.as_object() {
            for (k, v) in o {
                if !v.is_null() {
                    self.usage_raw.insert(k.clone(), v.clone());
                }
            }
        }
        self.usage = usage_of(&Value::Object(self.usage_raw.clone()));
    }

    /// The assistant message, shaped like a non-streamed answer's.
    pub fn items(&self) -> Vec<Value> {
        if self.blocks.is_empty() {
            return Vec::new();
        }
        let content: Vec<Value> = self
            .blocks
            .iter()
            .filter(|b| !b.block.is_empty())
            .map(BlockAcc::finish)
            .collect();
        vec![json!({"role": "assistant", "content": content})]
    }

    /// The stream reached `message_stop`.
    pub fn finished(&self) -> bool {
        self.done
    }
}

impl BlockAcc {
    fn append(&mut self, field: &str, piece: Option<&str>) {
        if let Some(p) = piece {
            let entry = self
                .text
                .entry(field)
                .or_insert_with(|| Value::String(String::new()));
            if let Value::String(s) = entry {
                s.push_str(p);
            }
        }
    }

    fn finish(&self) -> Value {
        let mut b = self.block.clone();
        for (k, v) in &self.text {
            match (b.get_mut(k), v) {
                (Some(Value::String(s)), Value::String(more)) => s.push_str(more),
                (Some(Value::Array(l)), Value::Array(more)) => l.extend(more.iter().cloned()),
                _ => {
                    b.insert(k.clone(), v.clone());
                }
            }
        }
        if !self.json.is_empty() {
            let input =
                serde_json::from_str(&self.json).unwrap_or(Value::String(self.json.clone()));
            b.insert("input".into(), input);
        }
        Value::Object(b)
    }
}

fn index(v: &Value) -> Option<usize> {
    let i = v.get("index")?.as_u64()? as usize;
    (i < MAX_BLOCKS).then_some(i)
}

/// Usage of a Messages answer or stream event: the prompt is
/// `input_tokens` plus the parts served from or written to the cache,
/// which Anthropic (and llama.cpp on this endpoint) report apart.
///
/// An answer that compacted reports each sampling iteration apart in
/// `iterations` (`type` `compaction` or `message`): the compaction's read
/// the history before it was compacted, so the prompt the conversation now
/// has is the one the last `message` iteration saw, not a sum.
pub fn usage_of(v: &Value) -> Option<Usage> {
    let last_message = v.get("iterations").and_then(Value::as_array).and_then(|l| {
        l.iter()
            .rev()
            .find(|i| i.get("type").and_then(Value::as_str) == Some("message"))
    });
    let obj = last_message.unwrap_or(v).as_object()?;
    let get = |k: &str| obj.get(k).and_then(Value::as_u64);
    let read = get("cache_read_input_tokens");
    let written = get("cache_creation_input_tokens");
    let input = get("input_tokens")?;
    // The write's split by lifetime; without it, all five minutes.
    let hour = obj
        .get("cache_creation")
        .and_then(|c| c.get("ephemeral_1h_input_tokens"))
        .and_then(Value::as_u64);
    Some(Usage {
        input_tokens: input + read.unwrap_or(0) + written.unwrap_or(0),
        output_tokens: get("output_tokens").unwrap_or(0),
        cached_tokens: read,
        cache_write_tokens: written,
        cache_write_1h_tokens: hour.map(|h| h.min(written.unwrap_or(0))),
    })
}
