//! Compaction the client asks for, in OpenAI's remote form: the
//! `/v1/responses/compact` endpoint and Codex's in-band
//! `{"type":"compaction_trigger"}`. The proxy answers with a `compaction`
//! item whose `encrypted_content` is an opaque token of its own, and expands
//! that item back into its stored summary on every later request, so the
//! upstream never sees the token (and needs no support for it).

use serde_json::{json, Value};

use super::computed::Compaction;
use super::items::{is_summary, leading_system};

const TOKEN_PREFIX: &str = "compactor.v1.";

/// How a token expands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// From `/v1/responses/compact`: the answer's `output` also carries the
    /// kept user messages, so the item stands for the summary alone.
    Summary,
    /// From an in-band trigger, answered with this one item: it stands for
    /// the summary and the kept user messages.
    Full,
}

impl Form {
    fn tag(self) -> &'static str {
        match self {
            Form::Summary => "s",
            Form::Full => "f",
        }
    }
}

/// The opaque token naming a compaction.
pub fn token(c: &Compaction, form: Form) -> String {
    format!("{TOKEN_PREFIX}{}.{}", form.tag(), c.id)
}

/// Parses a token of ours: (form, compaction id).
pub fn parse_token(s: &str) -> Option<(Form, &str)> {
    let rest = s.strip_prefix(TOKEN_PREFIX)?;
    let (tag, id) = rest.split_once('.')?;
    let form = match tag {
        "s" => Form::Summary,
        "f" => Form::Full,
        _ => return None,
    };
    Some((form, id))
}

/// The `compaction` item standing for `c`.
pub fn compaction_item(c: &Compaction, form: Form) -> Value {
    json!({"type": "compaction", "id": c.id, "encrypted_content": token(c, form)})
}

/// The replacement after its leading system items: the summary message and
/// the user messages kept verbatim.
fn body_of(c: &Compaction) -> &[Value] {
    &c.replacement[leading_system(&c.replacement)..]
}

/// The `output` of `/v1/responses/compact`: the compaction item in place of
/// the summary message, then the kept user messages.
pub fn endpoint_output(c: &Compaction) -> Vec<Value> {
    body_of(c)
        .iter()
        .map(|i| {
            if is_summary(i) {
                compaction_item(c, Form::Summary)
            } else {
                i.clone()
            }
        })
        .collect()
}

/// What a compaction item of ours expands into.
pub fn expansion(c: &Compaction, form: Form) -> Vec<Value> {
    match form {
        Form::Summary => body_of(c)
            .iter()
            .filter(|i| is_summary(i))
            .cloned()
            .collect(),
        Form::Full => body_of(c).to_vec(),
    }
}

/// Whether the input ends with Codex's in-band compaction request.
pub fn ends_with_trigger(items: &[Value]) -> bool {
    items
        .last()
        .and_then(|i| i.get("type"))
        .and_then(Value::as_str)
        == Some("compaction_trigger")
}

/// Replaces each `compaction` item carrying a token of ours with what it
/// stands for; `lookup` finds a compaction by id (for the request's tenant
/// only). Items it cannot resolve are left as they are. Returns whether
/// anything was expanded.
pub fn expand_items(
    items: &mut Vec<Value>,
    lookup: impl Fn(&str) -> Option<std::sync::Arc<Compaction>>,
) -> bool {
    if !items.iter().any(is_compaction_item) {
        return false;
    }
    let mut changed = false;
    let mut out = Vec::with_capacity(items.len());
    for item in items.drain(..) {
        let resolved = is_compaction_item(&item)
            .then(|| {
                item.get("encrypted_content")
                    .and_then(Value::as_str)
                    .and_then(parse_token)
            })
            .flatten()
            .and_then(|(form, id)| lookup(id).map(|c| (form, c)));
        match resolved {
            Some((form, c)) => {
                out.extend(expansion(&c, form));
                changed = true;
            }
            None => out.push(item),
        }
    }
    *items = out;
    changed
}

fn is_compaction_item(item: &Value) -> bool {
    item.get("type").and_then(Value::as_str) == Some("compaction")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::items::user_message;
    use std::sync::Arc;

    fn comp() -> Compaction {
        crate::compaction::test_compaction(
            "cmp_1",
            "t",
            5,
            [0; 32],
            vec![
                json!({"role": "developer", "content": "dev"}),
                user_message("[compactor summary of 4 earlier items]\n## TASK\nx".into()),
                json!({"role": "user", "content": "kept"}),
            ],
        )
    }

    #[test]
    fn tokens_round_trip_and_expand() {
        let c = Arc::new(comp());
        assert_eq!(
            parse_token(&token(&c, Form::Full)),
            Some((Form::Full, "cmp_1"))
        );
        assert_eq!(parse_token("gAAAAB-upstream-blob"), None);
        let out = endpoint_output(&c);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0]["type"], "compaction");
        assert_eq!(out[1]["content"], "kept");
        // A later request: developer item, the endpoint's output, a new message.
        let mut items = vec![
            c.replacement[0].clone(),
            out[0].clone(),
            out[1].clone(),
            json!({"role": "user", "content": "next"}),
        ];
        let lookup = |id: &str| (id == "cmp_1").then(|| c.clone());
        assert!(expand_items(&mut items, lookup));
        assert_eq!(items[1], c.replacement[1]);
        assert_eq!(items.len(), 4);
        // The in-band form stands for the summary and the kept messages.
        let mut items = vec![
            compaction_item(&c, Form::Full),
            json!({"role": "user", "content": "next"}),
        ];
        assert!(expand_items(&mut items, lookup));
        assert_eq!(
            items,
            vec![
                c.replacement[1].clone(),
                c.replacement[2].clone(),
                json!({"role": "user", "content": "next"})
            ]
        );
        // Someone else's token, or the upstream's own, is left alone.
        let mut items =
            vec![json!({"type": "compaction", "encrypted_content": "compactor.v1.f.cmp_other"})];
        assert!(!expand_items(&mut items, lookup));
        assert!(ends_with_trigger(&[json!({"type": "compaction_trigger"})]));
    }
}
