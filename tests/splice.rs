//! The compacted request spliced from the client's bytes: for Chat
//! Completions and Responses bodies of any layout (items anywhere among the
//! other members, tools before or after them, pretty-printed or compact,
//! escapes and non-ASCII text, instructions or none, stream usage asked for
//! by the proxy or by the client), with any prefix of the items replaced by
//! any replacement and the proxy's tools added after the client's or not,
//! the bytes the splice sends are, as JSON, the body the proxy would
//! otherwise rebuild from its parts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use compactor::compaction::replacement::Made;
use compactor::compaction::{agent_tool, recall};
use compactor::upstream::Payload;
use compactor::wire::items::{split_body, ItemCaches, Tools};
use compactor::wire::{chat, Api};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// A message-like item with text that needs escaping now and then.
fn item(i: usize, text: &str) -> Value {
    json!({"role": if i.is_multiple_of(2) { "user" } else { "assistant" }, "content": text, "n": i})
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z ]{0,12}",
        Just("quote \" back\\slash \n newline".to_string()),
        Just("é ü 漢字 🙂".to_string()),
        Just("[{\"not\": \"an item\"}],".to_string()),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    api: Api,
    items: Vec<String>,
    replacement: Vec<String>,
    instructions_first: bool,
    instructions: bool,
    tools_first: bool,
    tools: bool,
    stream: bool,
    client_usage: bool,
    pretty: bool,
    covered: usize,
    /// The agent's compaction tool and the recall tool added (when the
    /// body has tools).
    added: [bool; 2],
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(Api::Chat), Just(Api::Responses)],
        prop::collection::vec(text(), 1..7),
        prop::collection::vec(text(), 0..4),
        any::<[bool; 7]>(),
        0usize..9,
        any::<[bool; 2]>(),
    )
        .prop_map(|(api, items, replacement, flags, covered, added)| {
            let [instructions_first, instructions, tools_first, tools, stream, client_usage, pretty] =
                flags;
            Case {
                api,
                items,
                replacement,
                instructions_first,
                instructions,
                tools_first,
                tools,
                stream,
                client_usage,
                pretty,
                covered,
                added,
            }
        })
}

/// The client's body: its members in an order the case picks.
fn body(case: &Case) -> Vec<u8> {
    let key = case.api.items_key();
    let items: Vec<Value> = case
        .items
        .iter()
        .enumerate()
        .map(|(i, t)| item(i, t))
        .collect();
    let mut obj = Map::new();
    obj.insert("model".into(), json!("m"));
    let tools = json!([{"type": "function", "name": "bash", "parameters": {"type": "object"}}]);
    if case.tools && case.tools_first {
        obj.insert("tools".into(), tools.clone());
    }
    if case.api == Api::Responses && case.instructions {
        obj.insert("instructions".into(), json!("be brief \"always\""));
    }
    obj.insert(key.into(), Value::Array(items));
    if case.tools && !case.tools_first {
        obj.insert("tools".into(), tools);
    }
    obj.insert("stream".into(), json!(case.stream));
    if case.client_usage {
        obj.insert("stream_options".into(), json!({"include_usage": true}));
    }
    obj.insert("temperature".into(), json!(0.5));
    let v = Value::Object(obj);
    if case.pretty {
        serde_json::to_vec_pretty(&v).unwrap()
    } else {
        serde_json::to_vec(&v).unwrap()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_spliced_body_is_the_rebuilt_one(case in case()) {
        let api = case.api;
        let raw = Bytes::from(body(&case));
        let caches = ItemCaches::default();
        let split = split_body(&raw, api.items_key()).expect("the body splits");
        let mut parsed = split.body;
        let tools = split
            .tools
            .map(|(span, key)| Tools::raw(raw.clone(), span, key, &caches));
        let items = api.item_list(&mut parsed, raw.clone(), split.spans);
        // What the read makes of the client's bytes: as they came, or with
        // the stream-usage member the proxy asks for put in front.
        let original = if api == Api::Chat && chat::lacks_stream_usage(&parsed) {
            let (head, rest) = chat::splice_stream_usage(&raw).expect("an object");
            Payload::joined(head, rest)
        } else {
            Payload::from(raw.clone())
        };
        let mut replacement: Vec<Value> =
            case.replacement.iter().enumerate().map(|(i, t)| item(100 + i, t)).collect();
        if case.instructions_first && api == Api::Responses {
            replacement.insert(0, json!({"type": "instructions", "content": "be brief \"always\""}));
        }
        let covered = case.covered.min(items.len());
        let view = items.with_prefix_replaced(covered, &replacement);
        let [compact, with_recall] = case.added;
        let adds = tools.is_some() && (compact || with_recall);
        let listed = adds.then(|| {
            let tools = tools.as_ref().expect("has tools").value();
            let listed = agent_tool::with_tools(api, tools, compact, with_recall.then(|| recall::definition(api)));
            Tools::take(&mut json!({ "tools": listed }))
        });
        let sent_tools = listed.as_ref().map_or(tools.as_ref(), Option::as_ref);
        let rebuilt = api
            .rebuild_body(&parsed, &view.values(), sent_tools)
            .expect("serialises");
        let rebuilt: Value = serde_json::from_slice(&rebuilt).unwrap();
        let Some((cut, follow)) = items.covered_span(covered) else {
            // Only a prefix that ends inside the proxy's own pseudo-items
            // has no span: the instructions of a Responses body.
            prop_assert!(api == Api::Responses && case.instructions && covered == 0);
            return Ok(());
        };
        let made = Made::default();
        let mut edits = vec![(cut, made.array_json(api, &replacement, follow))];
        if adds {
            let added: Vec<Value> = [
                compact.then(|| agent_tool::definition(api)),
                with_recall.then(|| recall::definition(api)),
            ]
            .into_iter()
            .flatten()
            .collect();
            let tools = tools.as_ref().expect("has tools");
            edits.push(tools.appended(&raw, &added).expect("the client's tools"));
        }
        let spliced = original
            .with_cuts_replaced(items.body_bytes(), edits)
            .expect("the client's bytes are the payload's");
        let spliced: Value = serde_json::from_slice(&spliced.to_bytes())
            .expect("the spliced body is JSON");
        prop_assert_eq!(spliced, rebuilt);
        // Made once: a second request gets the same bytes.
        prop_assert_eq!(
            made.array_json(api, &replacement, follow),
            made.array_json(api, &replacement, follow)
        );
    }
}

#[test]
fn bytes_that_are_not_the_clients_are_not_spliced() {
    let raw = Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"a"}]}"#);
    let other = Bytes::copy_from_slice(&raw);
    let split = split_body(&raw, "messages").unwrap();
    let mut body = split.body;
    let items = Api::Chat.item_list(&mut body, raw.clone(), split.spans);
    let (cut, _) = items.covered_span(1).unwrap();
    // A payload of other memory (a body the read rewrote) is never cut.
    let rewritten = Payload::from(other);
    assert!(rewritten
        .with_cut_replaced(items.body_bytes(), cut.clone(), Bytes::from_static(b"{}"))
        .is_none());
    let own = Payload::from(raw.clone());
    let spliced = own
        .with_cut_replaced(
            items.body_bytes(),
            cut,
            Bytes::from_static(br#"{"role":"user","content":"b"}"#),
        )
        .unwrap();
    assert_eq!(
        &spliced.to_bytes()[..],
        br#"{"model":"m","messages":[{"role":"user","content":"b"}]}"#
    );
}
