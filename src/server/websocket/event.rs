//! The client events of a Responses WebSocket: what a `response.create`
//! (or a warm-up) asks, read without parsing its items, and the body of the
//! `POST /v1/responses` it stands for.

use serde_json::value::RawValue;

use crate::wire::RawMembers;

/// A warm-up the session answered: its response id, and its input items
/// (the JSON of an array's members).
pub(super) struct Warmed {
    pub(super) id: String,
    pub(super) input: String,
}

/// What a client event asks.
pub(super) enum ClientEvent {
    /// A response: the body of its request.
    Create(Vec<u8>),
    /// A warm-up: its model and input items.
    WarmUp { model: String, input: String },
    /// Nothing.
    Nothing,
}

/// A client event: the request a `response.create` stands for (with the
/// input of the warm-up it continues, if it continues `warmed`), or why it
/// is refused.
pub(super) fn read_event(
    text: &str,
    warmed: Option<&Warmed>,
) -> Result<ClientEvent, (&'static str, String)> {
    let members = parse_members(text).map_err(|e| {
        (
            "invalid_json",
            format!("the message is not a JSON object: {e}"),
        )
    })?;
    let member = |name: &str| members.iter().find(|(k, _)| k == name).map(|(_, v)| *v);
    let kind = member("type").and_then(|v| serde_json::from_str::<String>(v.get()).ok());
    match kind.as_deref() {
        Some("response.create") => {}
        // Codex's acknowledgement of an answer it has read: nothing to do.
        Some("response.processed") => return Ok(ClientEvent::Nothing),
        Some(t) => {
            return Err((
                "unsupported_event",
                format!("unsupported event type `{t}`: this socket takes `response.create`"),
            ))
        }
        None => {
            return Err((
                "unsupported_event",
                "the event has no `type`: this socket takes `response.create`".into(),
            ))
        }
    }
    if member("generate").is_some_and(|v| v.get() == "false") {
        let model = member("model")
            .and_then(|v| serde_json::from_str::<String>(v.get()).ok())
            .unwrap_or_default();
        let input = member("input").map_or_else(String::new, |v| items_of(v.get()));
        return Ok(ClientEvent::WarmUp { model, input });
    }
    let continues = warmed.filter(|w| {
        member("previous_response_id")
            .and_then(|v| serde_json::from_str::<String>(v.get()).ok())
            .is_some_and(|p| p == w.id)
    });
    Ok(ClientEvent::Create(request_body(
        text.len(),
        &members,
        continues,
    )))
}

/// The items of an `input` (JSON): an array's members, or a string as the
/// user message it stands for.
fn items_of(input: &str) -> String {
    let input = input.trim();
    if let Some(inner) = input.strip_prefix('[').and_then(|i| i.strip_suffix(']')) {
        return inner.trim().to_string();
    }
    if input.starts_with('"') {
        return format!(r#"{{"role":"user","content":{input}}}"#);
    }
    input.to_string()
}

/// The members of a JSON object in their order, values unparsed.
fn parse_members(text: &str) -> Result<Vec<(String, &RawValue)>, serde_json::Error> {
    serde_json::from_str::<RawMembers<'_>>(text).map(|m| m.0)
}

/// The body of the `POST /v1/responses` a `response.create` stands for:
/// its members but `type`, streamed.
fn request_body(len: usize, members: &[(String, &RawValue)], warmed: Option<&Warmed>) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + warmed.map_or(0, |w| w.input.len()) + 16);
    out.push(b'{');
    for (k, v) in members {
        let skip = match k.as_str() {
            "type" | "stream" | "generate" => true,
            // The warm-up's id, which nobody upstream knows.
            "previous_response_id" => warmed.is_some(),
            _ => false,
        };
        if skip {
            continue;
        }
        if out.len() > 1 {
            out.push(b',');
        }
        // A key that came from JSON serializes back.
        let _ = serde_json::to_writer(&mut out, k);
        out.push(b':');
        match warmed {
            Some(w) if k == "input" => {
                let own = items_of(v.get());
                out.push(b'[');
                out.extend_from_slice(w.input.as_bytes());
                if !w.input.is_empty() && !own.is_empty() {
                    out.push(b',');
                }
                out.extend_from_slice(own.as_bytes());
                out.push(b']');
            }
            _ => out.extend_from_slice(v.get().as_bytes()),
        }
    }
    if out.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(b"\"stream\":true}");
    out
}

/// Whether an event ends a response.
pub(super) fn is_final(name: &str, data: &str) -> bool {
    const FINAL: [&str; 4] = [
        "response.completed",
        "response.failed",
        "response.incomplete",
        "error",
    ];
    if FINAL.contains(&name) {
        return true;
    }
    // Named by its `type` alone (no `event:` line).
    name == "message"
        && serde_json::from_str::<TypeOnly>(data).is_ok_and(|t| FINAL.contains(&t.kind.as_str()))
}

#[derive(serde::Deserialize)]
struct TypeOnly {
    #[serde(rename = "type")]
    kind: String,
}
