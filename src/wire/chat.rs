//! Chat Completions: `messages[]` as items, the answer's message, stream deltas.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::format::{text_of, First, Format, Start, ToolCall};
use super::raw::RawMembers;
use super::usage::Usage;
use crate::error::InvalidField;

/// `messages` must be a list of objects.
pub fn validate(obj: &Map<String, Value>) -> Result<(), InvalidField> {
    match obj.get("messages") {
        None => Err(InvalidField::missing("messages")),
        Some(Value::Array(msgs)) => match msgs.iter().position(|m| !m.is_object()) {
            Some(i) => Err(InvalidField::wrong_type(
                format!("messages[{i}]"),
                "an object",
            )),
            None => Ok(()),
        },
        Some(_) => Err(InvalidField::wrong_type("messages", "an array")),
    }
}

/// The message of each choice of a complete answer.
pub fn response_items(body: &Value) -> Vec<Value> {
    body.get("choices")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c.get("message").cloned())
                .collect()
        })
        .unwrap_or_default()
}

/// An answer's message as a client usually sends it back: without the
/// members that say nothing (`"refusal": null`, `"annotations": []`,
/// `"content": null` beside tool calls) and without `reasoning_content`,
/// which the servers that return it ask clients not to send. `None` when
/// the message has none of them (it comes back as it is).
pub fn echoed(message: &Value) -> Option<Value> {
    let obj = message.as_object()?;
    let dropped = |k: &str, v: &Value| {
        v.is_null() || v.as_array().is_some_and(Vec::is_empty) || k == "reasoning_content"
    };
    if !obj.iter().any(|(k, v)| dropped(k, v)) {
        return None;
    }
    let kept = obj.iter().filter(|(k, v)| !dropped(k, v));
    Some(Value::Object(
        kept.map(|(k, v)| (k.clone(), v.clone())).collect(),
    ))
}

/// Whether a request streams without asking for usage ([`ensure_stream_usage`]
/// would change it).
pub fn lacks_stream_usage(body: &Value) -> bool {
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        return false;
    }
    match body.get("stream_options") {
        None | Some(Value::Null) => true,
        Some(Value::Object(o)) => o.get("include_usage").and_then(Value::as_bool) != Some(true),
        Some(_) => false,
    }
}

/// For a streamed request that did not ask for usage, asks for it. Returns
/// true when the body was changed (the usage chunk must then be hidden from
/// the client again).
pub fn ensure_stream_usage(body: &mut Value) -> bool {
    let Some(obj) = body.as_object_mut() else {
        return false;
    };
    if obj.get("stream").and_then(Value::as_bool) != Some(true) {
        return false;
    }
    let opts = obj
        .entry("stream_options")
        .or_insert_with(|| Value::Object(Map::new()));
    if opts.is_null() {
        *opts = Value::Object(Map::new());
    }
    let Some(opts) = opts.as_object_mut() else {
        return false;
    };
    if opts.get("include_usage").and_then(Value::as_bool) == Some(true) {
        return false;
    }
    opts.insert("include_usage".into(), Value::Bool(true));
    true
}

/// The client's bytes with `"stream_options":{"include_usage":true}` added
/// as the first member, for a body that had no `stream_options` at all:
/// cheaper than serialising a long history again. In two pieces, the bytes
/// up to the member and the rest of the client's, not copied into one.
pub fn splice_stream_usage(raw: &bytes::Bytes) -> Option<(bytes::Bytes, bytes::Bytes)> {
    let open = raw.iter().position(|b| !b.is_ascii_whitespace())?;
    if raw[open] != b'{' {
        return None;
    }
    const MEMBER: &[u8] = br#""stream_options":{"include_usage":true},"#;
    let mut head = Vec::with_capacity(open + 1 + MEMBER.len());
    head.extend_from_slice(&raw[..=open]);
    head.extend_from_slice(MEMBER);
    Some((head.into(), raw.slice(open + 1..)))
}

/// What to do with one streamed chunk when the client did not ask for usage.
#[derive(Debug, PartialEq)]
pub enum Strip {
    /// Forward unchanged.
    Keep,
    /// Drop: the usage-only chunk the client would not have received.
    Drop,
    /// Forward this re-serialised data instead (`"usage": null` removed).
    Replace(String),
}

/// Decides how a chunk's `data` must change so the client sees what it would
/// have seen without `include_usage`.
pub fn strip_usage(data: &str) -> Strip {
    if !data.contains("\"usage\"") {
        return Strip::Keep;
    }
    // The chunk's members as raw JSON: the others are forwarded byte for
    // byte, and nothing is parsed into a tree.
    let Ok(RawMembers(members)) = serde_json::from_str::<RawMembers>(data) else {
        return Strip::Keep;
    };
    let Some(usage) = members.iter().position(|(k, _)| k == "usage") else {
        return Strip::Keep;
    };
    let no_choices = match members.iter().find(|(k, _)| k == "choices") {
        None => true,
        Some((_, raw)) => {
            let text = raw.get();
            text == "null" || (text.starts_with('[') && text[1..].trim_start().starts_with(']'))
        }
    };
    if members[usage].1.get() != "null" && no_choices {
        return Strip::Drop;
    }
    // `"usage": null`, or usage riding on a content chunk (some servers do
    // this): keep the rest, hide the usage.
    let mut out = String::with_capacity(data.len());
    out.push('{');
    for (i, (key, raw)) in members.iter().enumerate() {
        if i == usage {
            continue;
        }
        if out.len() > 1 {
            out.push(',');
        }
        out.push_str(&Value::from(key.as_str()).to_string());
        out.push(':');
        out.push_str(raw.get());
    }
    out.push('}');
    Strip::Replace(out)
}

/// Rebuilds the assistant message(s) and usage from a chat stream's chunks.
#[derive(Debug, Default)]
pub struct ChatCollector {
    choices: Vec<ChoiceAcc>,
    /// Usage from the usage chunk, when one came.
    pub usage: Option<Usage>,
    /// The raw usage object.
    pub usage_raw: Option<Value>,
    /// An `error` object sent inside the stream.
    pub error: Option<Value>,
    /// The `[DONE]` sentinel was seen.
    pub done: bool,
    /// The upstream's completion id.
    pub id: Option<String>,
    /// Past what is collected of an answer: text and arguments are no
    /// longer kept, the rest is.
    pub capped: bool,
}

#[derive(Debug, Default)]
struct ChoiceAcc {
    role: Option<String>,
    content: Option<String>,
    reasoning: Option<String>,
    refusal: Option<String>,
    tool_calls: Vec<ToolCallAcc>,
    finish_reason: Option<String>,
}

#[derive(Debug, Default)]
struct ToolCallAcc {
    id: Option<String>,
    kind: Option<String>,
    name: String,
    arguments: String,
}

impl ChatCollector {
    /// Feeds one event's `data`.
    ///
    /// Returns whether `data` is JSON (`[DONE]` is not).
    pub fn push(&mut self, data: &str) -> bool {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return false;
        }
        // A chunk reads into borrowed fields, with no tree built; one with
        // a member of another type than OpenAI's is read as a tree, and
        // what does not fit is ignored.
        match serde_json::from_str::<ChunkView>(data) {
            Ok(view) => self.push_view(view),
            Err(_) => match serde_json::from_str::<Value>(data) {
                Ok(v) => self.push_view(ChunkView::lenient(&v)),
                Err(_) => return false,
            },
        }
        true
    }

    fn push_view(&mut self, chunk: ChunkView<'_>) {
        if let Some(e) = chunk.error {
            self.error = Some(e);
        }
        if self.id.is_none() {
            self.id = chunk.id.map(Cow::into_owned);
        }
        if let Some(u) = chunk.usage {
            self.usage = Usage::from_value(&u);
            self.usage_raw = Some(u);
        }
        for c in chunk.choices.into_iter().flatten() {
            let idx = c.index.unwrap_or(0) as usize;
            if idx > 1024 {
                continue;
            }
            if self.choices.len() <= idx {
                self.choices.resize_with(idx + 1, ChoiceAcc::default);
            }
            let acc = &mut self.choices[idx];
            if let Some(f) = c.finish_reason {
                acc.finish_reason = Some(f.into_owned());
            }
            let Some(d) = c.delta else { continue };
            if let Some(r) = d.role {
                acc.role = Some(r.into_owned());
            }
            if self.capped {
                continue;
            }
            append(&mut acc.content, d.content);
            append(&mut acc.reasoning, d.reasoning_content);
            append(&mut acc.refusal, d.refusal);
            for tc in d.tool_calls.into_iter().flatten() {
                let ti = tc.index.unwrap_or(0) as usize;
                if ti > 1024 {
                    continue;
                }
                if acc.tool_calls.len() <= ti {
                    acc.tool_calls.resize_with(ti + 1, ToolCallAcc::default);
                }
                let t = &mut acc.tool_calls[ti];
                if let Some(id) = tc.id {
                    t.id = Some(id.into_owned());
                }
                if let Some(k) = tc.kind {
                    t.kind = Some(k.into_owned());
                }
                if let Some(f) = tc.function {
                    if let Some(n) = f.name {
                        t.name.push_str(&n);
                    }
                    if let Some(a) = f.arguments {
                        t.arguments.push_str(&a);
                    }
                }
            }
        }
    }

    /// The assistant message of each choice, shaped like a non-streamed answer's.
    pub fn items(&self) -> Vec<Value> {
        self.choices
            .iter()
            .map(|c| {
                let mut m = Map::new();
                m.insert(
                    "role".into(),
                    Value::String(c.role.clone().unwrap_or_else(|| "assistant".into())),
                );
                m.insert(
                    "content".into(),
                    c.content.clone().map(Value::String).unwrap_or(Value::Null),
                );
                if let Some(r) = &c.reasoning {
                    m.insert("reasoning_content".into(), Value::String(r.clone()));
                }
                if let Some(r) = &c.refusal {
                    m.insert("refusal".into(), Value::String(r.clone()));
                }
                if !c.tool_calls.is_empty() {
                    let calls = c
                        .tool_calls
                        .iter()
                        .map(|t| {
                            serde_json::json!({
                                "id": t.id.clone().unwrap_or_default(),
                                "type": t.kind.clone().unwrap_or_else(|| "function".into()),
                                "function": {"name": t.name, "arguments": t.arguments},
                            })
                        })
                        .collect();
                    m.insert("tool_calls".into(), Value::Array(calls));
                }
                Value::Object(m)
            })
            .collect()
    }

    /// The stream reached its end marker.
    pub fn finished(&self) -> bool {
        self.done
    }
}

fn append(acc: &mut Option<String>, piece: Option<Cow<'_, str>>) {
    if let Some(s) = piece {
        acc.get_or_insert_with(String::new).push_str(&s);
    }
}

/// What [`ChatCollector`] reads of a chunk. `null` reads as absent.
#[derive(Deserialize)]
struct ChunkView<'a> {
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    error: Option<Value>,
    usage: Option<Value>,
    #[serde(borrow)]
    choices: Option<Vec<ChoiceView<'a>>>,
}

#[derive(Deserialize)]
struct ChoiceView<'a> {
    index: Option<u64>,
    #[serde(borrow)]
    finish_reason: Option<Cow<'a, str>>,
    #[serde(borrow)]
    delta: Option<DeltaView<'a>>,
}

#[derive(Deserialize)]
struct DeltaView<'a> {
    #[serde(borrow)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow)]
    refusal: Option<Cow<'a, str>>,
    #[serde(borrow)]
    tool_calls: Option<Vec<ToolCallView<'a>>>,
}

#[derive(Deserialize)]
struct ToolCallView<'a> {
    index: Option<u64>,
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    function: Option<FunctionView<'a>>,
}

#[derive(Deserialize)]
struct FunctionView<'a> {
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    arguments: Option<Cow<'a, str>>,
}

impl<'a> ChunkView<'a> {
    /// The same view of a chunk parsed as a tree, each member taken only if
    /// it has the expected type.
    fn lenient(v: &'a Value) -> Self {
        let text = |v: &'a Value, key: &str| v.get(key).and_then(Value::as_str).map(Cow::Borrowed);
        let index = |v: &Value| Some(v.get("index").and_then(Value::as_u64).unwrap_or(0));
        let list = |v: &'a Value, key: &str| v.get(key).and_then(Value::as_array);
        ChunkView {
            id: text(v, "id"),
            error: v.get("error").filter(|e| !e.is_null()).cloned(),
            usage: v.get("usage").filter(|u| !u.is_null()).cloned(),
            choices: list(v, "choices").map(|cs| {
                cs.iter()
                    .map(|c| ChoiceView {
                        index: index(c),
                        finish_reason: text(c, "finish_reason"),
                        delta: c.get("delta").map(|d| DeltaView {
                            role: text(d, "role"),
                            content: text(d, "content"),
                            reasoning_content: text(d, "reasoning_content"),
                            refusal: text(d, "refusal"),
                            tool_calls: list(d, "tool_calls").map(|tcs| {
                                tcs.iter()
                                    .map(|tc| ToolCallView {
                                        index: index(tc),
                                        id: text(tc, "id"),
                                        kind: text(tc, "type"),
                                        function: tc.get("function").map(|f| FunctionView {
                                            name: text(f, "name"),
                                            arguments: text(f, "arguments"),
                                        }),
                                    })
                                    .collect()
                            }),
                        }),
                    })
                    .collect()
            }),
        }
    }
}

/// Chat Completions' answers to what the phases ask ([`Format`]).
pub struct Chat;

impl Format for Chat {
    fn tool(&self, name: &str, description: &str, parameters: Value) -> Value {
        json!({"type": "function", "function": {
            "name": name, "description": description, "parameters": parameters}})
    }

    fn stream_start(&self, _name: &str, data: &str) -> Start {
        stream_start(data)
    }

    fn starts_reasoning(&self, _name: &str, data: &str) -> bool {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return false;
        };
        v.pointer("/choices/0/delta").is_some_and(|d| {
            ["reasoning_content", "reasoning"].iter().any(|k| {
                d.get(*k)
                    .and_then(Value::as_str)
                    .is_some_and(|s| !s.is_empty())
            })
        })
    }

    fn first_output(&self, _name: &str, data: &str) -> Option<First> {
        let v: Value = serde_json::from_str(data).ok()?;
        let delta = v.pointer("/choices/0/delta")?;
        if delta.get("tool_calls").is_some_and(|t| !t.is_null()) {
            Some(First::ToolCall)
        } else if delta
            .get("content")
            .and_then(Value::as_str)
            .is_some_and(|c| !c.is_empty())
        {
            Some(First::Text)
        } else {
            None
        }
    }

    fn answer_of(&self, items: Vec<Value>) -> Value {
        json!({"choices": [{"message": items.into_iter().next().unwrap_or(Value::Null)}]})
    }

    fn tool_calls(&self, answer: &Value) -> Vec<ToolCall> {
        answer
            .pointer("/choices/0/message/tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|c| {
                let f = c.get("function").cloned().unwrap_or(Value::Null);
                ToolCall {
                    id: text_of(c, "id"),
                    name: text_of(&f, "name"),
                    arguments: text_of(&f, "arguments"),
                }
            })
            .collect()
    }

    fn continuation(
        &self,
        answer: &Value,
        results: &[(String, String)],
        arguments: &mut dyn FnMut(&str, &mut Value),
    ) -> Vec<Value> {
        let mut out: Vec<Value> = answer
            .pointer("/choices/0/message")
            .cloned()
            .into_iter()
            .collect();
        for call in out
            .iter_mut()
            .filter_map(|m| m.get_mut("tool_calls").and_then(Value::as_array_mut))
            .flatten()
        {
            let name = call
                .pointer("/function/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            if let Some(args) = call.pointer_mut("/function/arguments") {
                arguments(&name, args);
            }
        }
        out.extend(
            results
                .iter()
                .map(|(id, text)| json!({"role": "tool", "tool_call_id": id, "content": text})),
        );
        out
    }

    fn lacks_stream_usage(&self, body: &Value) -> bool {
        lacks_stream_usage(body)
    }
}

/// What a chat stream's chunk says of the answer's start: an error chunk
/// (`{"error": …}`, as LiteLLM- and OpenRouter-style servers send a
/// failure inside a 200 stream) failed it; content, a tool call,
/// reasoning, its end, or a chunk the proxy cannot read committed it; the
/// role, empty content, a keep-alive are its prelude.
fn stream_start(data: &str) -> Start {
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return Start::Committed;
    };
    if v.get("error").is_some_and(|e| !e.is_null()) {
        return Start::Failed;
    }
    let Some(choice) = v.pointer("/choices/0") else {
        return Start::Prelude;
    };
    let delta = choice.get("delta");
    let has = |k: &str| {
        delta.and_then(|d| d.get(k)).is_some_and(|x| match x {
            Value::Null => false,
            Value::String(s) => !s.is_empty(),
            _ => true,
        })
    };
    let ended = choice.get("finish_reason").is_some_and(|f| !f.is_null());
    if ended
        || [
            "content",
            "tool_calls",
            "reasoning_content",
            "reasoning",
            "refusal",
        ]
        .iter()
        .any(|k| has(k))
    {
        Start::Committed
    } else {
        Start::Prelude
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_requested_only_when_missing() {
        let mut b = json!({"stream": true, "messages": []});
        assert!(ensure_stream_usage(&mut b));
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert!(!ensure_stream_usage(&mut b));
        let mut b = json!({"messages": []});
        assert!(!ensure_stream_usage(&mut b));
        let mut b = json!({"stream": true, "stream_options": {"include_obfuscation": false}});
        assert!(ensure_stream_usage(&mut b));
        assert_eq!(b["stream_options"]["include_obfuscation"], false);
        // The check says what the change would do, without changing.
        for body in [
            json!({"stream": true}),
            json!({"stream": true, "stream_options": null}),
            json!({"stream": true, "stream_options": {"include_usage": false}}),
            json!({"stream": true, "stream_options": {"include_usage": true}}),
            json!({"stream": true, "stream_options": "odd"}),
            json!({"stream": false}),
            json!([]),
        ] {
            let lacks = lacks_stream_usage(&body);
            assert_eq!(lacks, ensure_stream_usage(&mut body.clone()), "{body}");
        }
    }

    #[test]
    fn usage_is_spliced_into_the_clients_bytes() {
        let raw = bytes::Bytes::from_static(
            br#" {"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}"#,
        );
        let (head, rest) = splice_stream_usage(&raw).unwrap();
        let v: Value = serde_json::from_slice(&[&head[..], &rest[..]].concat()).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["messages"][0]["content"], "x");
        assert_eq!(&rest[..], &raw[2..], "the client's bytes, not a copy");
        assert!(splice_stream_usage(&bytes::Bytes::from_static(b"[1]")).is_none());
    }

    #[test]
    fn strip_rules() {
        assert_eq!(
            strip_usage(r#"{"choices":[{"delta":{"content":"a"}}]}"#),
            Strip::Keep
        );
        assert_eq!(
            strip_usage(r#"{"id":"x","choices":[],"usage":{"prompt_tokens":1}}"#),
            Strip::Drop
        );
        assert_eq!(
            strip_usage(r#"{"id":"x","choices":[{"delta":{}}],"usage":null}"#),
            Strip::Replace(r#"{"id":"x","choices":[{"delta":{}}]}"#.into())
        );
        // The other members go on byte for byte, wherever usage was.
        assert_eq!(
            strip_usage(r#"{"usage":null, "id":"x\u00e9", "n": 1.50, "choices": [ ]}"#),
            Strip::Replace(r#"{"id":"x\u00e9","n":1.50,"choices":[ ]}"#.into())
        );
        assert_eq!(
            strip_usage(r#"{"choices": [ ], "usage": {"prompt_tokens": 1}}"#),
            Strip::Drop
        );
        assert_eq!(
            strip_usage(r#"{"choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":1}}"#),
            Strip::Replace(r#"{"choices":[{"delta":{"content":"a"}}]}"#.into())
        );
        // Only the chunk's own usage counts, and text that merely mentions it.
        assert_eq!(
            strip_usage(r#"{"choices":[{"delta":{"content":"\"usage\""},"usage":null}]}"#),
            Strip::Keep
        );
        assert_eq!(strip_usage("not json \"usage\""), Strip::Keep);
    }

    #[test]
    fn collects_content_and_tool_calls() {
        let mut c = ChatCollector::default();
        c.push(
            r#"{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]}"#,
        );
        c.push(r#"{"choices":[{"index":0,"delta":{"content":"lo"}}]}"#);
        c.push(r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"sh","arguments":"{\"cmd\":"}}]}}]}"#);
        c.push(r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"ls\"}"}}]},"finish_reason":"tool_calls"}]}"#);
        c.push(r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}"#);
        c.push("[DONE]");
        assert!(c.finished());
        assert_eq!(c.usage.unwrap().total(), 7);
        let items = c.items();
        assert_eq!(items[0]["content"], "Hello");
        assert_eq!(
            items[0]["tool_calls"][0]["function"]["arguments"],
            "{\"cmd\":\"ls\"}"
        );
        assert_eq!(items[0]["tool_calls"][0]["id"], "call_1");
    }

    /// The borrowed read and the tree read collect the same, including what
    /// only the tree read can take (members of other types are ignored).
    #[test]
    fn chunks_read_alike_either_way() {
        let chunks = [
            r#"{"id":"c1","error":null,"usage":null,"choices":[{"index":0,"delta":{"role":"assistant","content":"a\u00e9\"b"},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":1,"delta":{"content":"second","refusal":"no"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"hm","tool_calls":[{"index":0,"id":"t","type":"function","function":{"name":"sh","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":5,"role":"assistant"},"finish_reason":"stop"}]}"#,
            r#"{"id":7,"choices":null,"usage":{"prompt_tokens":3,"completion_tokens":1}}"#,
            r#"{"choices":[{"index":-1,"delta":{"content":"x"}}]}"#,
            r#"{"error":{"message":"overloaded"}}"#,
            "[1,2]",
        ];
        let mut typed = ChatCollector::default();
        let mut tree = ChatCollector::default();
        for c in chunks {
            typed.push(c);
            let v: Value = serde_json::from_str(c).unwrap();
            tree.push_view(ChunkView::lenient(&v));
        }
        assert_eq!(typed.items(), tree.items());
        assert_eq!(typed.usage, tree.usage);
        assert_eq!(typed.usage_raw, tree.usage_raw);
        assert_eq!(typed.error, tree.error);
        assert_eq!(typed.id.as_deref(), Some("c1"));
        let items = typed.items();
        // (An index that is no unsigned number counts as 0.)
        assert_eq!(items[0]["content"], "aé\"bx");
        assert_eq!(items[0]["reasoning_content"], "hm");
        assert_eq!(items[1]["refusal"], "no");
        assert_eq!(typed.usage.unwrap().total(), 4);
        assert_eq!(
            typed.error,
            Some(serde_json::json!({"message": "overloaded"}))
        );
        // `"error": null` is no error.
        let mut c = ChatCollector::default();
        c.push(r#"{"error":null,"choices":[]}"#);
        assert_eq!(c.error, None);
    }

    #[test]
    fn a_chat_stream_commits_at_its_first_output_or_fails_on_an_error_chunk() {
        for prelude in [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}"#,
            r#"{"id":"x","choices":[]}"#,
        ] {
            assert_eq!(stream_start(prelude), Start::Prelude, "{prelude}");
        }
        for committed in [
            r#"{"choices":[{"delta":{"content":"Hi"}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#,
            r#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
            "[DONE]",
        ] {
            assert_eq!(stream_start(committed), Start::Committed, "{committed}");
        }
        assert_eq!(
            stream_start(r#"{"error":{"message":"maximum context length is 4096 tokens"}}"#),
            Start::Failed
        );
    }
}
