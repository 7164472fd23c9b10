//! Gemini `generateContent`: `contents[]` as items (`systemInstruction`
//! stays a body field, like every other parameter), the model from the
//! request's path, the answer's candidate as one `model` item, stream
//! chunks, `usageMetadata` with its cached and thinking parts.
//!
//! Parts the proxy does not know are kept as they came (a `thoughtSignature`
//! with the part that carries it): nothing here rebuilds a content from
//! fields it read. A `functionCall` pairs with the `functionResponse` of
//! the same `id` when the client sends ids, else with the next one of the
//! same name ([`call_ids`], [`output_ids`]).

use std::borrow::Cow;

use serde_json::{json, Map, Value};

use super::format::{First, Format, Start, ToolCall};
use super::usage::Usage;
use crate::error::InvalidField;

mod chunk;

/// What a Gemini path asks of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `:generateContent`
    Generate,
    /// `:streamGenerateContent` (SSE with `alt=sse`, else a JSON array)
    Stream,
    /// `:countTokens`
    CountTokens,
}

/// A Gemini request's path, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The model named in the path.
    pub model: String,
    /// What is asked of it.
    pub method: Method,
    /// The path below its version prefix (`/models/{model}:{method}`),
    /// which goes upstream below the configured base.
    pub below: String,
}

/// The version prefixes a Gemini path may start with.
const VERSIONS: &[&str] = &["/v1beta", "/v1"];

/// Reads `/v1beta/models/{model}:{method}` (or `/v1/…`). `None` for any
/// other path, and for a model name that is not one path segment of
/// letters, digits, `-`, `_` and `.` (so nothing a client sends leaves the
/// upstream's base path).
pub fn route(path: &str) -> Option<Route> {
    let (model, method, below) = read_route(path)?;
    Some(Route {
        model: model.to_string(),
        method,
        below: below.to_string(),
    })
}

/// The path below the version prefix of a Gemini path [`route`] reads,
/// borrowed from it.
pub fn route_below(path: &str) -> Option<&str> {
    read_route(path).map(|(_, _, below)| below)
}

/// What [`route`] reads of a path, borrowed from it: the model, the
/// method, the path below the version prefix.
fn read_route(path: &str) -> Option<(&str, Method, &str)> {
    let below = VERSIONS
        .iter()
        .find_map(|v| path.strip_prefix(v).filter(|r| r.starts_with("/models/")))?;
    let (model, method) = below["/models/".len()..].rsplit_once(':')?;
    let method = match method {
        "generateContent" => Method::Generate,
        "streamGenerateContent" => Method::Stream,
        "countTokens" => Method::CountTokens,
        _ => return None,
    };
    let plain = model
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if model.is_empty() || !plain || model.bytes().all(|b| b == b'.') {
        return None;
    }
    Some((model, method, below))
}

/// The path below the version prefix that asks `model` for `method`
/// (what a summary call sends to).
pub fn model_path(model: &str, method: &str) -> String {
    format!("/models/{model}:{method}")
}

/// Whether a query asks for SSE (`alt=sse`).
pub fn asks_sse(query: Option<&str>) -> bool {
    query.is_some_and(|q| q.split('&').any(|p| p == "alt=sse"))
}

/// The query parameter Gemini takes a key in.
pub const KEY_PARAM: &str = "key";

/// The header Gemini takes a key in.
pub const KEY_HEADER: &str = "x-goog-api-key";

/// A query without its `key` parameter, and the key: the proxy carries a
/// key given in the query as [`KEY_HEADER`] (which the API takes too), so
/// that it names the tenant and is redacted like every other credential,
/// and no query the proxy keeps, logs or records holds it.
pub fn take_key(query: &str) -> (Option<String>, Option<String>) {
    let mut key = None;
    let rest: Vec<&str> = query
        .split('&')
        .filter(|p| {
            let (name, value) = p.split_once('=').unwrap_or((p, ""));
            if name == KEY_PARAM {
                if key.is_none() {
                    key = Some(
                        percent_encoding::percent_decode_str(value)
                            .decode_utf8_lossy()
                            .into_owned(),
                    );
                }
                return false;
            }
            !p.is_empty()
        })
        .collect();
    let rest = (!rest.is_empty()).then(|| rest.join("&"));
    (key, rest)
}

/// A query with the value of each `key` parameter replaced by
/// [`crate::redact::REDACTED`]: how a query is printed.
pub fn redacted_query(query: &str) -> String {
    query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((KEY_PARAM, _)) => format!("{KEY_PARAM}={}", crate::redact::REDACTED),
            _ => p.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// `contents` must be a list of objects, each with a list of `parts` and,
/// if any, a string `role`; `systemInstruction` an object or a string.
pub fn validate(obj: &Map<String, Value>) -> Result<(), InvalidField> {
    let contents = match obj.get("contents") {
        None => return Err(InvalidField::missing("contents")),
        Some(Value::Array(c)) => c,
        Some(_) => return Err(InvalidField::wrong_type("contents", "an array")),
    };
    for (i, c) in contents.iter().enumerate() {
        let Some(c) = c.as_object() else {
            return Err(InvalidField::wrong_type(
                format!("contents[{i}]"),
                "an object",
            ));
        };
        if !matches!(c.get("role"), None | Some(Value::String(_))) {
            return Err(InvalidField::wrong_type(
                format!("contents[{i}].role"),
                "a string",
            ));
        }
        if !matches!(c.get("parts"), Some(Value::Array(_))) {
            return Err(InvalidField::wrong_type(
                format!("contents[{i}].parts"),
                "an array",
            ));
        }
    }
    match obj.get("systemInstruction") {
        None | Some(Value::Null | Value::Object(_) | Value::String(_)) => Ok(()),
        Some(_) => Err(InvalidField::wrong_type("systemInstruction", "an object")),
    }
}

/// Usage of an answer (or of the last chunk that reported any, for a
/// streamed answer sent as a JSON array): the prompt with its cached part
/// (`cachedContentTokenCount` is part of `promptTokenCount`) and what a
/// tool use added to it, the output with its thinking.
pub fn usage(body: &Value) -> Option<Usage> {
    if let Value::Array(chunks) = body {
        return chunks.iter().rev().find_map(usage);
    }
    let meta = body.get("usageMetadata")?.as_object()?;
    // One pass over the members, not a hashed look-up for each count.
    let (mut prompt, mut tool_use, mut candidates, mut thoughts, mut cached) =
        (None, None, None, None, None);
    for (k, v) in meta {
        let count = match k.as_str() {
            "promptTokenCount" => &mut prompt,
            "toolUsePromptTokenCount" => &mut tool_use,
            "candidatesTokenCount" => &mut candidates,
            "thoughtsTokenCount" => &mut thoughts,
            "cachedContentTokenCount" => &mut cached,
            _ => continue,
        };
        *count = v.as_u64();
    }
    chunk::usage_of(prompt, tool_use, candidates, thoughts, cached)
}

/// An answer's first candidate, as the pointer `/candidates/0` reads it
/// (without the pointer's copy of each step it unescapes).
fn first_candidate(v: &Value) -> Option<&Value> {
    match v.get("candidates")? {
        Value::Array(a) => a.first(),
        Value::Object(m) => m.get("0"),
        _ => None,
    }
}

/// A candidate's parts (`/content/parts`), when they are a list.
fn candidate_parts(candidate: &Value) -> Option<&Vec<Value>> {
    candidate.get("content")?.get("parts")?.as_array()
}

/// What a stream's chunk says of the answer's start: an `error` failed it;
/// parts or a finish reason of its first candidate committed it; anything
/// else is its prelude.
fn start_of(chunk: &Value) -> Start {
    if chunk.get("error").is_some() {
        return Start::Failed;
    }
    let first = first_candidate(chunk);
    let has_parts = first
        .and_then(candidate_parts)
        .is_some_and(|p| !p.is_empty());
    let ended = first.is_some_and(|c| c.get("finishReason").is_some());
    if has_parts || ended {
        Start::Committed
    } else {
        Start::Prelude
    }
}

/// The first candidate's content as one `model` item (the parts of every
/// chunk, for a streamed answer sent as a JSON array).
pub fn response_items(body: &Value) -> Vec<Value> {
    let mut acc = Collector::default();
    match body {
        Value::Array(chunks) => chunks.iter().for_each(|c| acc.chunk(c)),
        v => acc.chunk(v),
    }
    acc.into_items()
}

/// The text of a complete answer: its text parts that are no thoughts.
pub fn answer_text(body: &Value) -> Option<String> {
    let parts = body.pointer("/candidates/0/content/parts")?.as_array()?;
    let texts: Vec<&str> = parts
        .iter()
        .filter(|p| p.get("thought").and_then(Value::as_bool) != Some(true))
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .collect();
    (!texts.is_empty()).then(|| texts.join(""))
}

/// The parts of a content.
pub fn parts(item: &Value) -> &[Value] {
    item.get("parts")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

fn role(item: &Value) -> &str {
    item.get("role").and_then(Value::as_str).unwrap_or("")
}

/// Whether an item is a Gemini content (it has `parts`).
pub fn is_content(item: &Value) -> bool {
    item.get("parts").is_some_and(Value::is_array)
}

/// The `functionCall` parts of a `model` content.
pub fn function_calls(item: &Value) -> impl Iterator<Item = &Value> {
    let model = role(item) == "model";
    parts(item)
        .iter()
        .filter(move |_| model)
        .filter_map(|p| p.get("functionCall"))
}

/// The `functionResponse` parts of a content.
pub fn function_responses(item: &Value) -> impl Iterator<Item = &Value> {
    parts(item).iter().filter_map(|p| p.get("functionResponse"))
}

/// Whether a content answers function calls.
pub fn is_function_response(item: &Value) -> bool {
    role(item) != "model" && function_responses(item).next().is_some()
}

/// What pairs a call and its response: the `id` when given, else the
/// function's name (the next response of that name answers the call).
fn pairing(call: &Value) -> Option<&str> {
    call.get("id")
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty())
        .or_else(|| call.get("name").and_then(Value::as_str))
}

/// The keys of the calls a `model` content opens: the `id` when given, else the name.
pub fn call_ids(item: &Value) -> Vec<&str> {
    function_calls(item).filter_map(pairing).collect()
}

/// The keys of the calls a content answers: the `id` when given, else the name.
pub fn output_ids(item: &Value) -> Vec<&str> {
    if role(item) == "model" {
        return Vec::new();
    }
    function_responses(item).filter_map(pairing).collect()
}

/// A `functionResponse`'s payload as text: its `response` object's
/// `output` or `error` string, else the object as JSON.
pub fn response_text(response: &Value) -> String {
    let payload = response.get("response");
    for key in ["output", "content", "error"] {
        if let Some(s) = payload.and_then(|p| p.get(key)).and_then(Value::as_str) {
            return s.to_string();
        }
    }
    payload.map(Value::to_string).unwrap_or_default()
}

/// Whether a `functionResponse` reports a failure (an `error` member).
pub fn response_failed(response: &Value) -> bool {
    response
        .pointer("/response/error")
        .is_some_and(|e| !e.is_null())
}

/// The outputs a content carries: (pairing key, text, failed) per
/// `functionResponse` part.
pub fn outputs(item: &Value) -> Vec<(&str, String, bool)> {
    function_responses(item)
        .map(|r| {
            (
                pairing(r).unwrap_or(""),
                response_text(r),
                response_failed(r),
            )
        })
        .collect()
}

/// The text of a content: its text parts, then its responses' text.
pub fn text_of(item: &Value) -> String {
    parts(item)
        .iter()
        .filter_map(|p| match p.get("text").and_then(Value::as_str) {
            Some(t) => Some(t.to_string()),
            None => p.get("functionResponse").map(response_text),
        })
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Replaces the payload of each `functionResponse` of a content for which
/// `new_text` returns one (its name and id kept), the payload becoming
/// `{"output": text}`; how many it replaced.
pub fn rewrite_responses(
    item: &mut Value,
    mut new_text: impl FnMut(&str) -> Option<String>,
) -> usize {
    let mut changed = 0;
    if let Some(Value::Array(parts)) = item.get_mut("parts") {
        for p in parts.iter_mut() {
            let Some(r) = p.get_mut("functionResponse") else {
                continue;
            };
            if let Some(t) = new_text(&response_text(r)) {
                r["response"] = json!({ "output": t });
                changed += 1;
            }
        }
    }
    changed
}

/// An item the compaction layer wrote (`{"role", "content": text}`) in
/// Gemini's shape; a Gemini content as it is.
pub fn as_content(item: Value) -> Value {
    if is_content(&item) {
        return item;
    }
    let role = match role(&item) {
        "assistant" | "model" => "model",
        _ => "user",
    };
    // A string, or the text of each block: read as a result's content is.
    let text = super::messages::tool_result_text(&item);
    json!({"role": role, "parts": [{"text": text}]})
}

/// Whether `last`, a request's last content, is Gemini CLI's own
/// compression asking for its `<state_snapshot>` of the history before it
/// (after "First, reason in your scratchpad"), or its second call, which
/// asks the model to check the snapshot it just wrote: the answer to that
/// one is the summary Gemini CLI goes on from.
pub fn is_client_compaction(last: &Value) -> bool {
    if role(last) != "user" {
        return false;
    }
    let text = text_of(last);
    text.contains("<state_snapshot>")
        && (text.contains("scratchpad")
            || text.contains("Critically evaluate the <state_snapshot>"))
}

/// Takes the `functionCall` parts `drop` names (given the call's name) out
/// of an answer or a stream's chunk, each candidate's; the names of those
/// taken out, in order.
pub fn drop_calls(v: &mut Value, drop: impl Fn(&str) -> bool) -> Vec<String> {
    let mut removed = Vec::new();
    let candidates = v.get_mut("candidates").and_then(Value::as_array_mut);
    for cand in candidates.into_iter().flatten() {
        let Some(Value::Array(parts)) = cand.pointer_mut("/content/parts") else {
            continue;
        };
        parts.retain(|p| {
            let name = p.pointer("/functionCall/name").and_then(Value::as_str);
            match name {
                Some(n) if drop(n) => {
                    removed.push(n.to_string());
                    false
                }
                _ => true,
            }
        });
    }
    removed
}

/// Collects a candidate's content from an answer's chunks: text parts that
/// follow each other are joined, every other part is kept as it came.
#[derive(Debug, Default)]
pub struct Collector {
    parts: Vec<Value>,
    /// The upstream's `responseId`.
    pub id: Option<String>,
    /// The usage of the last chunk that reported any.
    pub usage: Option<Usage>,
    /// The candidate's `finishReason`, once given.
    pub finish: Option<String>,
    /// An `error` object sent inside the stream.
    pub error: Option<Value>,
    /// Past what is collected of an answer: no more parts are kept.
    pub capped: bool,
}

/// A `model` content of `parts` (none without parts), the parts moved in,
/// not written out and read again as `json!` would.
fn model_content(parts: Vec<Value>) -> Vec<Value> {
    if parts.is_empty() {
        return Vec::new();
    }
    let mut content = Map::new();
    content.insert("role".into(), "model".into());
    content.insert("parts".into(), Value::Array(parts));
    vec![Value::Object(content)]
}

/// Most parts one answer may collect (more are ignored).
const MAX_PARTS: usize = 4096;

impl Collector {
    /// Feeds one SSE event's data: read into borrowed fields and the parts
    /// alone, with no tree built of the rest; a chunk with a member of
    /// another type than the API's is read as a tree.
    pub fn push(&mut self, data: &str) {
        match serde_json::from_str::<chunk::ChunkView>(data) {
            Ok(view) => self.view(view),
            Err(_) => {
                if let Ok(v) = serde_json::from_str::<Value>(data) {
                    self.chunk(&v);
                }
            }
        }
    }

    /// Feeds one chunk read as a [`chunk::ChunkView`]: what
    /// [`Collector::chunk`] does with its tree.
    fn view(&mut self, v: chunk::ChunkView) {
        if let Some(e) = v.error {
            self.error = Some(e);
            return;
        }
        if self.id.is_none() {
            self.id = v.response_id.map(Cow::into_owned);
        }
        if let Some(u) = v.usage.and_then(|u| u.usage()) {
            self.usage = Some(u);
        }
        let first = v.candidates.and_then(|c| c.into_iter().next());
        let Some(cand) = first.flatten() else {
            return;
        };
        if let Some(f) = cand.finish {
            self.finish = Some(f.into_owned());
        }
        if self.capped {
            return;
        }
        for p in cand.content.and_then(|c| c.parts).into_iter().flatten() {
            self.part(p);
        }
    }

    /// Feeds one chunk (a `GenerateContentResponse`).
    pub fn chunk(&mut self, v: &Value) {
        if let Some(e) = v.get("error") {
            self.error = Some(e.clone());
            return;
        }
        if self.id.is_none() {
            self.id = v
                .get("responseId")
                .and_then(Value::as_str)
                .map(String::from);
        }
        if let Some(u) = usage(v) {
            self.usage = Some(u);
        }
        let Some(cand) = first_candidate(v) else {
            return;
        };
        if let Some(f) = cand.get("finishReason").and_then(Value::as_str) {
            self.finish = Some(f.to_string());
        }
        if self.capped {
            return;
        }
        for p in candidate_parts(cand).into_iter().flatten() {
            self.part(p.clone());
        }
    }

    fn part(&mut self, p: Value) {
        let plain = |p: &Value| {
            p.as_object().is_some_and(|o| {
                o.get("text").is_some_and(Value::is_string)
                    && o.keys().all(|k| k == "text" || k == "thought")
            })
        };
        let thought = |p: &Value| p.get("thought").and_then(Value::as_bool) == Some(true);
        if let Some(last) = self.parts.last_mut() {
            if plain(&p) && plain(last) && thought(&p) == thought(last) {
                let more = p.get("text").and_then(Value::as_str).unwrap_or("");
                if let Some(Value::String(t)) = last.get_mut("text") {
                    t.push_str(more);
                }
                return;
            }
        }
        if self.parts.len() < MAX_PARTS {
            self.parts.push(p);
        }
    }

    /// The answer's content as one `model` item (none if it had no parts).
    pub fn items(&self) -> Vec<Value> {
        model_content(self.parts.clone())
    }

    /// [`Collector::items`], its parts moved into the item.
    pub fn into_items(self) -> Vec<Value> {
        model_content(self.parts)
    }

    /// The answer ended: a `finishReason` came, or an error (which ends a
    /// stream).
    pub fn finished(&self) -> bool {
        self.finish.is_some() || self.error.is_some()
    }
}

/// Gemini's answers to what the phases ask ([`Format`]).
pub struct Gemini;

impl Format for Gemini {
    fn tool(&self, name: &str, description: &str, parameters: Value) -> Value {
        json!({"functionDeclarations": [
            {"name": name, "description": description, "parameters": parameters}
        ]})
    }

    /// Read into a `chunk::StartView`, nothing built; a chunk with a
    /// member of another type than the API's is read as a tree.
    fn stream_start(&self, _name: &str, data: &str) -> Start {
        match serde_json::from_str::<chunk::StartView>(data) {
            Ok(v) => v.start(),
            Err(_) => {
                serde_json::from_str::<Value>(data).map_or(Start::Committed, |v| start_of(&v))
            }
        }
    }

    /// Never: a thought's signature is bound to the request that produced
    /// it (as Anthropic's thinking is), so a stream stays held.
    fn starts_reasoning(&self, _name: &str, _data: &str) -> bool {
        false
    }

    fn first_output(&self, _name: &str, data: &str) -> Option<First> {
        let v: Value = serde_json::from_str(data).ok()?;
        let first = v.pointer("/candidates/0/content/parts/0")?;
        if first.get("functionCall").is_some() {
            Some(First::ToolCall)
        } else if first.get("text").is_some() && first.get("thought").is_none() {
            Some(First::Text)
        } else {
            None
        }
    }

    fn answer_of(&self, items: Vec<Value>) -> Value {
        let content = items.into_iter().next().unwrap_or(Value::Null);
        json!({"candidates": [{"content": content}]})
    }

    fn tool_calls(&self, answer: &Value) -> Vec<ToolCall> {
        let content = answer
            .pointer("/candidates/0/content")
            .unwrap_or(&Value::Null);
        function_calls(content)
            .map(|c| ToolCall {
                id: pairing(c).unwrap_or("").to_string(),
                name: super::format::text_of(c, "name"),
                arguments: c.get("args").cloned().unwrap_or(json!({})).to_string(),
            })
            .collect()
    }

    /// The answer's content, then the results as one `user` content of
    /// `functionResponse` parts, each naming its call (and its id, when
    /// the call had one); a call's `args` is no text, and is kept.
    fn continuation(
        &self,
        answer: &Value,
        results: &[(String, String)],
        _arguments: &mut dyn FnMut(&str, &mut Value),
    ) -> Vec<Value> {
        let content = answer
            .pointer("/candidates/0/content")
            .cloned()
            .unwrap_or_else(|| json!({"role": "model", "parts": []}));
        let calls: Vec<&Value> = function_calls(&content).collect();
        let responses: Vec<Value> = results
            .iter()
            .map(|(key, text)| {
                let call = calls.iter().find(|c| pairing(c) == Some(key.as_str()));
                let name = call
                    .and_then(|c| c.get("name"))
                    .cloned()
                    .unwrap_or_else(|| json!(key));
                let mut r = json!({"name": name, "response": {"output": text}});
                if let Some(id) = call.and_then(|c| c.get("id")) {
                    r["id"] = id.clone();
                }
                json!({ "functionResponse": r })
            })
            .collect();
        vec![content, json!({"role": "user", "parts": responses})]
    }

    fn system(&self, body: &Value) -> Option<Value> {
        body.get("systemInstruction").cloned()
    }

    fn finish_replacement(&self, replacement: Vec<Value>) -> Vec<Value> {
        replacement.into_iter().map(as_content).collect()
    }

    fn is_client_compaction(&self, last: &Value) -> bool {
        is_client_compaction(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_a_model_and_a_method() {
        let r = route("/v1beta/models/gemini-2.5-pro:streamGenerateContent").unwrap();
        assert_eq!(r.model, "gemini-2.5-pro");
        assert_eq!(r.method, Method::Stream);
        assert_eq!(r.below, "/models/gemini-2.5-pro:streamGenerateContent");
        assert_eq!(
            route_below("/v1beta/models/gemini-2.5-pro:streamGenerateContent"),
            Some(r.below.as_str())
        );
        assert_eq!(
            route("/v1/models/gemini-2.0-flash:countTokens").map(|r| r.method),
            Some(Method::CountTokens)
        );
        for bad in [
            "/v1beta/models/..:generateContent",
            "/v1beta/models/a/b:generateContent",
            "/v1beta/models/%2e%2e:generateContent",
            "/v1beta/models/:generateContent",
            "/v1beta/models/m:embedContent",
            "/v1beta/tunedModels/m:generateContent",
            "/v2/models/m:generateContent",
        ] {
            assert_eq!(route(bad), None, "{bad}");
            assert_eq!(route_below(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_key_leaves_the_query() {
        let (key, rest) = take_key("alt=sse&key=AIza%2Bsecret");
        assert_eq!(key.as_deref(), Some("AIza+secret"));
        assert_eq!(rest.as_deref(), Some("alt=sse"));
        assert_eq!(take_key("key=k"), (Some("k".into()), None));
        assert_eq!(redacted_query("key=abc&alt=sse"), "key=[REDACTED]&alt=sse");
        assert!(asks_sse(Some("key=x&alt=sse")));
        assert!(!asks_sse(Some("alt=json")));
    }

    #[test]
    fn usage_counts_cached_and_thinking_tokens() {
        let body = json!({"usageMetadata": {"promptTokenCount": 1000,
            "cachedContentTokenCount": 600, "candidatesTokenCount": 40,
            "thoughtsTokenCount": 60, "totalTokenCount": 1100}});
        let u = usage(&body).unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (1000, 100));
        assert_eq!(u.cached_tokens, Some(600));
        assert_eq!(
            usage(&json!([{"usageMetadata": {"promptTokenCount": 5}}, {}]))
                .unwrap()
                .input_tokens,
            5
        );
    }

    #[test]
    fn calls_pair_by_id_else_by_name() {
        let model = json!({"role": "model", "parts": [
            {"functionCall": {"name": "ls", "args": {}}, "thoughtSignature": "sig"},
            {"functionCall": {"name": "cat", "id": "c1", "args": {"path": "a"}}}]});
        assert_eq!(call_ids(&model), ["ls", "c1"]);
        let user = json!({"role": "user", "parts": [
            {"functionResponse": {"name": "ls", "response": {"output": "a b"}}},
            {"functionResponse": {"name": "cat", "id": "c1", "response": {"error": "gone"}}}]});
        assert_eq!(output_ids(&user), ["ls", "c1"]);
        assert_eq!(
            outputs(&user),
            [
                ("ls", "a b".to_string(), false),
                ("c1", "gone".to_string(), true)
            ]
        );
        assert!(is_function_response(&user) && !is_function_response(&model));
    }

    /// A chunk read into its view is collected, and judged at a stream's
    /// start, as its tree is; a chunk the view does not take (a member of
    /// another type) is read as a tree.
    #[test]
    fn a_chunk_read_unbuilt_is_read_as_its_tree() {
        let chunks = [
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"Hel"}]},"index":0}],"usageMetadata":{"promptTokenCount":9,"totalTokenCount":9,"promptTokensDetails":[{"modality":"TEXT","tokenCount":9}]},"modelVersion":"m","responseId":"r1"}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"lo","thought":false}]}}],"responseId":"r2"}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"functionCall":{"name":"ls","args":{}},"thoughtSignature":"s"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":3,"thoughtsTokenCount":2,"cachedContentTokenCount":4,"toolUsePromptTokenCount":1}}"#,
            r#"{"candidates":[{"content":{"role":"model"}}]}"#,
            r#"{"candidates":[{"content":{"parts":[]},"finishReason":null}]}"#,
            r#"{"candidates":[null]}"#,
            r#"{"candidates":[],"usageMetadata":{"candidatesTokenCount":3}}"#,
            r#"{"candidates":null,"usageMetadata":null,"responseId":null}"#,
            r#"{"error":null}"#,
            r#"{"error":{"code":429,"message":"quota"},"candidates":[{"content":{"parts":[{"text":"x"}]}}]}"#,
            // Not the API's types: read as a tree.
            r#"{"candidates":{"0":{"content":{"parts":[{"text":"x"}]},"finishReason":"STOP"}}}"#,
            r#"{"candidates":[{"content":{"parts":{"text":"x"}},"finishReason":7}]}"#,
            r#"{"candidates":[{"content":[{"text":"x"}]}],"responseId":5}"#,
            r#"{"usageMetadata":{"promptTokenCount":1.5,"candidatesTokenCount":-1}}"#,
            r#"{"usageMetadata":{"promptTokenCount":3},"usageMetadata":{"promptTokenCount":4}}"#,
            r#"[{"usageMetadata":{"promptTokenCount":5}}]"#,
            r#"{"candidates":[{"content":{"parts":[{"text":"unterminated"#,
        ];
        for (i, data) in chunks.iter().enumerate() {
            let tree = serde_json::from_str::<Value>(data).ok();
            assert_eq!(
                Gemini.stream_start("message", data),
                tree.as_ref().map_or(Start::Committed, start_of),
                "{data}"
            );
            // The chunk alone, and after those before it.
            for from in [i, 0] {
                let (mut read, mut built) = (Collector::default(), Collector::default());
                for d in &chunks[from..=i] {
                    read.push(d);
                    if let Ok(v) = serde_json::from_str::<Value>(d) {
                        built.chunk(&v);
                    }
                }
                assert_eq!(read.parts, built.parts, "{data}");
                assert_eq!(read.id, built.id, "{data}");
                assert_eq!(read.usage, built.usage, "{data}");
                assert_eq!(read.finish, built.finish, "{data}");
                assert_eq!(read.error, built.error, "{data}");
            }
        }
        let mut c = Collector::default();
        chunks[..3].iter().for_each(|d| c.push(d));
        assert_eq!(c.items()[0]["parts"][0], json!({"text": "Hello"}));
        assert_eq!(
            c.usage.map(|u| (u.input_tokens, u.output_tokens)),
            Some((10, 5))
        );
        assert_eq!(c.id.as_deref(), Some("r1"));
    }

    #[test]
    fn stream_chunks_join_text_and_keep_other_parts() {
        let mut c = Collector::default();
        for d in [
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"Hel"}]}}],"responseId":"r1"}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"lo"}]}}]}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"functionCall":{"name":"ls","args":{}},"thoughtSignature":"s"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":3}}"#,
        ] {
            c.push(d);
        }
        assert!(c.finished());
        assert_eq!(c.id.as_deref(), Some("r1"));
        assert_eq!(c.usage.unwrap().total(), 12);
        let items = c.items();
        assert_eq!(items[0]["parts"][0]["text"], "Hello");
        assert_eq!(items[0]["parts"][1]["thoughtSignature"], "s");
    }

    #[test]
    fn gemini_clis_compression_is_its_two_asks_for_a_snapshot() {
        let ask = |text: &str| json!({"role": "user", "parts": [{"text": text}]});
        assert!(is_client_compaction(&ask(
            "Generate a new <state_snapshot> based on the provided history.\n\nFirst, reason in \
             your scratchpad. Then, generate the updated <state_snapshot>."
        )));
        assert!(is_client_compaction(&ask(
            "Critically evaluate the <state_snapshot> you just generated. Did you omit any \
             specific technical details?"
        )));
        assert!(!is_client_compaction(&ask("What is a <state_snapshot>?")));
        let answer = json!({"role": "model", "parts": [{"text": "First, reason in your scratchpad. <state_snapshot>"}]});
        assert!(!is_client_compaction(&answer));
    }
}
