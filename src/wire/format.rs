//! What the request's phases ask of a wire format, answered once per API:
//! the phases hold an [`Api`](super::Api) and ask its [`Format`] rather than match on
//! it. A new wire format is a file of `wire/` that implements [`Format`],
//! and an arm in [`Api::format`](super::Api::format).

use serde_json::Value;

/// How a stream's event stands before the upstream commits to an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// No output yet (the prelude, a keep-alive): held back.
    Prelude,
    /// A failure before any output: held, for the send to judge.
    Failed,
    /// The answer began, or an event the proxy cannot read: relayed as it
    /// comes.
    Committed,
}

/// How a stream's first output begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum First {
    /// Text for the client.
    Text,
    /// A tool call.
    ToolCall,
}

/// A tool call of a complete answer: its id, the tool's name, and its
/// arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The call's id, which its result names.
    pub id: String,
    /// The tool called.
    pub name: String,
    /// The arguments, as JSON text.
    pub arguments: String,
}

/// One API's answers to what the phases ask of its wire format.
pub trait Format: Sync {
    /// A tool's definition in this format's shape.
    fn tool(&self, name: &str, description: &str, parameters: Value) -> Value;

    /// What a stream's event (`name`, `data`) says of the answer's start.
    fn stream_start(&self, name: &str, data: &str) -> Start;

    /// Whether a stream's event opens reasoning: a stream that begins so
    /// is relayed as it comes, recall rounds spliced onto it.
    fn starts_reasoning(&self, name: &str, data: &str) -> bool;

    /// The kind of output a stream's event starts, if it starts one.
    fn first_output(&self, name: &str, data: &str) -> Option<First>;

    /// A complete answer body holding a stream's output `items` (what the
    /// tee collected), as far as its tool calls are read from it.
    fn answer_of(&self, items: Vec<Value>) -> Value;

    /// The tool calls of a complete answer, in order.
    fn tool_calls(&self, answer: &Value) -> Vec<ToolCall>;

    /// The items that continue a request after the proxy answered the tool
    /// calls of `answer`: the answer's own output, then a result per
    /// `(call id, text)`. `arguments` may rewrite the (JSON text)
    /// arguments of each call the output repeats, given the tool's name;
    /// a format whose arguments are no text leaves them as they came.
    fn continuation(
        &self,
        answer: &Value,
        results: &[(String, String)],
        arguments: &mut dyn FnMut(&str, &mut Value),
    ) -> Vec<Value>;

    /// Whether a request streams without asking for the usage the proxy
    /// needs, which the proxy then asks for (and hides from the client).
    fn lacks_stream_usage(&self, _body: &Value) -> bool {
        false
    }

    /// Whether a request's items may stand for others, which the proxy
    /// expands: a response the upstream stored (`previous_response_id`),
    /// from the proxy's record; the proxy's own compaction items.
    fn expands_items(&self) -> bool {
        false
    }

    /// Whether this format edits a compacted view past the compaction's
    /// replacement ([`Format::finish_view`]): its body is then rebuilt,
    /// never spliced from the client's bytes.
    fn edits_view(&self) -> bool {
        false
    }

    /// Edits a compacted view (`view`, the replacement's `replaced` items
    /// first) as the API needs it, for a request with `body` and `tools`;
    /// true when the request must let the API drop a thinking block.
    fn finish_view(
        &self,
        _view: &mut Vec<Value>,
        _replaced: usize,
        _body: &Value,
        _tools: Option<&Value>,
    ) -> bool {
        false
    }

    /// A compaction's replacement in this API's shape: the messages the
    /// compaction wrote (`{"role", "content": text}`, a summary, restored
    /// facts) made the API's own; the client's items kept as they came.
    fn finish_replacement(&self, replacement: Vec<Value>) -> Vec<Value> {
        replacement
    }

    /// The body's system prompt, where it is a field of its own beside the
    /// items (a summary call repeats it).
    fn system(&self, _body: &Value) -> Option<Value> {
        None
    }

    /// Whether `last`, a request's last item, asks for the client's own
    /// compaction (a summary of the conversation so far).
    fn is_client_compaction(&self, _last: &Value) -> bool {
        false
    }

    /// Whether a request's thinking is signed against its prefix, so that
    /// hiding rounds or compacting the prefix invalidates it.
    fn signs_thinking(&self, _body: &Value) -> bool {
        false
    }
}

/// `s` of a JSON object's member `k`, or empty.
pub(super) fn text_of(v: &Value, k: &str) -> String {
    v.get(k).and_then(Value::as_str).unwrap_or("").to_string()
}

/// A tool definition's name, in any API's shape (a Gemini tool's first
/// function declaration's).
pub fn tool_name(tool: &Value) -> Option<&str> {
    tool_names(tool).next()
}

/// The names a tool definition declares: one, or a Gemini tool's
/// `functionDeclarations`, each.
fn tool_names(tool: &Value) -> impl Iterator<Item = &str> {
    let one = tool
        .pointer("/function/name")
        .or_else(|| tool.get("name"))
        .and_then(Value::as_str);
    let declared = tool
        .get("functionDeclarations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|d| d.get("name").and_then(Value::as_str));
    one.into_iter().chain(declared)
}

/// Whether the proxy may add its tool `name` to a request (`body`, with
/// `tools`): it has tools of its own, none of them named `name` (the
/// client's own tool of that name wins, and its calls go to the client),
/// does not forbid calling them, asks for one choice (a call in another
/// choice could not be answered without answering them all), and
/// continues no upstream-stored response (a continuation would have to
/// name the proxy's round).
pub fn may_add_tool(body: &Value, tools: Option<&Value>, name: &str) -> bool {
    let list = tools.and_then(Value::as_array);
    let has_tools = list.is_some_and(|t| !t.is_empty());
    let taken = list.is_some_and(|t| t.iter().flat_map(tool_names).any(|n| n == name));
    let allowed = body.get("tool_choice").and_then(Value::as_str) != Some("none")
        && body
            .pointer("/toolConfig/functionCallingConfig/mode")
            .and_then(Value::as_str)
            != Some("NONE");
    let one = |n: Option<&Value>| n.is_none_or(|n| n.is_null() || n.as_u64() == Some(1));
    let one_choice = one(body.get("n")) && one(body.pointer("/generationConfig/candidateCount"));
    let stateless = body.get("previous_response_id").is_none_or(Value::is_null);
    has_tools && !taken && allowed && one_choice && stateless
}
