//! Fuzz targets, run for a bounded number of cases in every test run
//! (`COMPACTOR_FUZZ_CASES=N` runs each for N instead): the request-body
//! split of both endpoints, the proxy's answer to any body, and the SSE
//! tee on any chunking of any event stream, a Gemini stream's usage, text
//! and calls among them. (The journal reader's target
//! is with the reader, in `store::journal`.) Seeds: `tests/corpus/`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::ops::Range;
use std::path::PathBuf;

use bytes::Bytes;
use compactor::wire::items::{split_body, ItemCaches, ItemList};
use compactor::wire::sse::SseTee;
use compactor::wire::{item_hash, Api};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use serde_json::{json, Value};

/// The seed bodies: (file name, endpoint, bytes).
/// The caches the reusing split reads, shared by the cases as a proxy's
/// are by its requests.
fn caches() -> &'static std::sync::Arc<ItemCaches> {
    static CACHES: std::sync::OnceLock<std::sync::Arc<ItemCaches>> = std::sync::OnceLock::new();
    CACHES.get_or_init(Default::default)
}

fn corpus() -> &'static [(String, Api, Vec<u8>)] {
    static CORPUS: std::sync::OnceLock<Vec<(String, Api, Vec<u8>)>> = std::sync::OnceLock::new();
    CORPUS.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/requests");
        let mut out: Vec<_> = std::fs::read_dir(&dir)
            .expect("the corpus")
            .map(|e| e.expect("a corpus entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                let api = if name.starts_with("chat-") {
                    Api::Chat
                } else if name.starts_with("gemini-") {
                    Api::Gemini
                } else {
                    Api::Responses
                };
                (name, api, std::fs::read(&p).expect("a seed"))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        assert!(out.len() >= 10, "seeds in {}", dir.display());
        out
    })
}

/// JSON fragments a mutation splices in: what breaks or bends a parser.
const FRAGMENTS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "\\",
    "null",
    "true",
    "1e999",
    "-0",
    "0.1",
    "\"\\ud800\"",
    "\"\\u0000\"",
    "\"messages\":",
    "\"input\":",
    "\"tools\":",
    "[{}]",
    "{\"role\":\"user\",\"content\":\"x\"}",
    "é",
    "\u{1F600}",
    " ",
    "\n",
    "\t",
    "\"messages\":[{\"a\":1},{\"b\":[[[[[[]]]]]]}]",
    "\"input\":\"text\"",
];

/// One mutation of a body.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(f64, u8),
    Cut(f64),
    Insert(f64, usize),
    Remove(f64, f64),
    Garbage(f64, Vec<u8>),
}

fn any_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0.0..1.0f64, 1u8..=255).prop_map(|(at, b)| Mutation::Flip(at, b)),
        (0.0..1.0f64).prop_map(Mutation::Cut),
        (0.0..1.0f64, 0..FRAGMENTS.len()).prop_map(|(at, f)| Mutation::Insert(at, f)),
        (0.0..1.0f64, 0.0..0.05f64).prop_map(|(at, len)| Mutation::Remove(at, len)),
        (0.0..1.0f64, proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, g)| Mutation::Garbage(at, g)),
    ]
}

fn mutate(mut body: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    let at = |f: f64, len: usize| ((len as f64) * f) as usize;
    for m in mutations {
        let len = body.len();
        match m {
            Mutation::Flip(f, bits) if len > 0 => body[at(*f, len).min(len - 1)] ^= bits,
            Mutation::Flip(..) => {}
            Mutation::Cut(f) => body.truncate(at(*f, len)),
            Mutation::Insert(f, i) => {
                let at = at(*f, len);
                body.splice(at..at, FRAGMENTS[*i].bytes());
            }
            Mutation::Remove(f, n) => {
                let start = at(*f, len);
                let end = (start + at(*n, len)).min(len);
                body.drain(start..end);
            }
            Mutation::Garbage(f, g) => {
                let at = at(*f, len);
                body.splice(at..at, g.iter().copied());
            }
        }
    }
    body
}

/// The path below `/v1` a request of `api` is sent to.
fn path_of(api: Api) -> String {
    match api {
        Api::Gemini => "/models/gemini-2.5-pro:generateContent".into(),
        _ => api.endpoint().into(),
    }
}

/// A seed, mutated (or, a tenth of the time, as it is).
fn any_body() -> impl Strategy<Value = (Api, Vec<u8>)> {
    (
        0..corpus().len(),
        proptest::collection::vec(any_mutation(), 0..4),
    )
        .prop_map(|(seed, mutations)| {
            let (_, api, body) = &corpus()[seed];
            (*api, mutate(body.clone(), &mutations))
        })
}

fn in_order(spans: &[Range<usize>], len: usize) -> bool {
    spans.windows(2).all(|w| w[0].end <= w[1].start) && spans.iter().all(|s| s.end <= len)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: compactor::fuzz_cases(192),
        // The corpus makes large inputs; their shrinking is slow and
        // a mutation list is short already.
        max_shrink_iters: 256,
        ..ProptestConfig::default()
    })]

    /// The split of a body of either endpoint: never panics; what it splits
    /// is what the full parse reads (items at their byte ranges, each an
    /// object, the rest of the body as parsed), so putting the items back
    /// gives the client's request; and it refuses only what the full parse
    /// must report or take whole.
    #[test]
    fn request_bodies_split_as_they_parse((api, raw) in any_body(), scope in 0u8..4) {
        let key = api.items_key();
        let full: Option<Value> = serde_json::from_slice(&raw).ok();
        let split = split_body(&raw, key);
        // A scope with recent requests of the corpus: the reusing split
        // must split as the plain one.
        let scope = format!("fuzz-{scope}");
        let reused = caches().split_body_reusing(&raw, key, &scope);
        prop_assert_eq!(split.is_some(), reused.is_some());
        let splittable = full.as_ref().and_then(Value::as_object).is_some_and(|o| match o.get(key) {
            None => true,
            Some(Value::Array(items)) => items.iter().all(Value::is_object),
            Some(_) => false,
        });
        if let Some(s) = &split {
            let r = reused.as_ref().unwrap();
            prop_assert_eq!(&s.spans, &r.spans);
            prop_assert_eq!(s.body_key, r.body_key);
            prop_assert_eq!(&s.body, &r.body);
            let spans = s.spans.clone().unwrap_or_default();
            prop_assert!(in_order(&spans, raw.len()));
            for span in &spans {
                prop_assert_eq!(raw[span.start], b'{');
                prop_assert_eq!(raw[span.end - 1], b'}');
            }
            let list = ItemList::raw(Vec::new(), Bytes::from(raw.clone()), spans.clone())
                .with_caches(caches().clone());
            let (hashes, _, _) = list.hashes_and_chains(&scope);
            prop_assert_eq!(hashes.len(), spans.len());
            for (i, span) in spans.iter().enumerate() {
                let json = list.json(i);
                prop_assert_eq!(json.as_bytes(), &raw[span.clone()], "as the client sent it");
            }
            if let Some(full) = &full {
                // The body, its tools and items put back, is the request.
                let mut rebuilt = s.body.clone();
                if let (Some((span, _)), Some(obj)) = (&s.tools, rebuilt.as_object_mut()) {
                    let tools: Value = serde_json::from_slice(&raw[span.clone()]).unwrap();
                    obj.insert("tools".into(), tools);
                }
                if let (Some(_), Some(obj)) = (&s.spans, rebuilt.as_object_mut()) {
                    obj.insert(key.into(), Value::Array(list.values().to_vec()));
                }
                prop_assert_eq!(&rebuilt, full);
                let canonical: Vec<_> = list.values().iter().map(item_hash).collect();
                prop_assert_eq!(&hashes, &canonical);
            }
        } else {
            prop_assert!(!splittable, "a body the full parse splits was refused");
        }
        if let Some(v) = &full {
            // Errors name what is wrong; they never panic.
            let _ = api.validate(v);
        }
    }
}

/// The proxy's answer to any body on either parsed endpoint: the upstream's
/// (the fake answers all it gets), or an OpenAI-style JSON error; and it
/// keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_answers_any_body_with_json_errors() {
    let h = support::Harness::start().await;
    let client = support::client();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: compactor::fuzz_cases(48),
        ..ProptestConfig::default()
    });
    let mut cases = Vec::new();
    for _ in 0..runner.config().cases {
        let tree = any_body().new_tree(&mut runner).expect("a case");
        cases.push(tree.current());
    }
    let mut refused = 0;
    for (api, body) in cases {
        let url = format!("{}{}", h.url(), path_of(api));
        let resp = support::within(
            client
                .post(&url)
                .header("authorization", "Bearer fuzz-key-0123456789")
                .header("content-type", "application/json")
                .body(body.clone())
                .send(),
        )
        .await
        .expect("an answer");
        let status = resp.status().as_u16();
        let answer = support::within(resp.bytes()).await.expect("its body");
        if status == 200 {
            continue;
        }
        refused += 1;
        assert!(
            (400..500).contains(&status),
            "{status} for {}",
            String::from_utf8_lossy(&body)
        );
        let v: Value = serde_json::from_slice(&answer).expect("a JSON error");
        let e = &v["error"];
        // Gemini's errors are Google's shape: a `status`, no `type`.
        let kind = if api == Api::Gemini { "status" } else { "type" };
        assert!(e["message"].is_string() && e[kind].is_string(), "{v}");
        assert!(e.get("code").is_some(), "{v}");
    }
    // Mutations break most bodies; some must have been refused, or the
    // target tests nothing.
    assert!(refused > 0);
    let health = support::within(client.get(format!("http://{}/healthz", h.addr)).send())
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200);
}

/// An event of any of the APIs' streams, or something that is not one.
fn any_event() -> impl Strategy<Value = String> {
    let text = "[a-z \"\\\\é{}:,]{0,8}";
    prop_oneof![
        text.prop_map(|t| format!(
            "data: {{\"id\":\"chatcmpl-1\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}}}}],\"usage\":null}}\n\n",
            serde_json::to_string(&t).unwrap()
        )),
        (1u64..99, 1u64..99).prop_map(|(p, c)| format!(
            "data: {{\"id\":\"chatcmpl-1\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{p},\"completion_tokens\":{c}}}}}\n\n"
        )),
        Just("data: [DONE]\n\n".to_string()),
        text.prop_map(|t| format!(
            "event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"delta\":{}}}\n\n",
            serde_json::to_string(&t).unwrap()
        )),
        Just("event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\",\"item\":{\"type\":\"message\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"hi\"}]}}\n\n".to_string()),
        (1u64..99).prop_map(|n| format!(
            "event: response.completed\r\ndata: {{\"type\":\"response.completed\",\"response\":{{\"id\":\"resp_1\",\"output\":[],\"usage\":{{\"input_tokens\":{n},\"output_tokens\":2}}}}}}\r\n\r\n"
        )),
        Just("event: error\ndata: {\"error\":{\"message\":\"overloaded\"}}\n\n".to_string()),
        gemini_part().prop_map(|p| format!("data: {}\r\n\r\n", gemini_chunk(&p.json(), None))),
        (1u64..99, 0u64..9).prop_map(|(p, o)| format!(
            "data: {}\r\n\r\n",
            gemini_chunk(&[], Some(json!({"promptTokenCount": p, "candidatesTokenCount": o})))
        )),
        Just("data: {\"error\":{\"code\":503,\"message\":\"overloaded\",\"status\":\"UNAVAILABLE\"}}\r\n\r\n".to_string()),
        Just(": keep-alive\n\n".to_string()),
        Just("data: {\"half\": \n".to_string()),
        // Any bytes as text, lines and all.
        proptest::collection::vec(any::<u8>(), 0..24)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
}

/// Feeds `body` to `tee` cut at `cuts` (offsets, taken modulo the
/// length) and ends it: the client's bytes.
fn feed(tee: &mut SseTee, body: &[u8], cuts: &[usize]) -> Vec<u8> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::new();
    let mut at = 0;
    for cut in cuts.into_iter().chain([body.len()]) {
        out.extend_from_slice(&tee.push(Bytes::copy_from_slice(&body[at..cut])));
        at = cut;
    }
    out.extend_from_slice(&tee.finish());
    out
}

/// Runs `body` through a tee cut at `cuts`: the client's bytes and what
/// was collected.
fn tee(api: Api, strip: bool, body: &[u8], cuts: &[usize]) -> (Vec<u8>, String) {
    let mut tee = SseTee::new(api, strip);
    let out = feed(&mut tee, body, cuts);
    let collected = format!(
        "{:?} {:?} {:?} {:?} {}",
        tee.usage(),
        tee.items(),
        tee.response_id(),
        tee.error(),
        tee.finished()
    );
    (out, collected)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(compactor::fuzz_cases(256)))]

    /// The SSE tee on any chunking of any event stream of any API: never
    /// panics; passes every byte through unless it hides usage; and what
    /// the client gets and what is collected do not depend on how the
    /// upstream cut the stream.
    #[test]
    fn the_sse_tee_does_not_depend_on_chunking(
        events in proptest::collection::vec(any_event(), 0..10),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
        api in prop_oneof![Just(Api::Chat), Just(Api::Responses), Just(Api::Gemini)],
        strip in any::<bool>(),
    ) {
        let strip = strip && api == Api::Chat;
        let body = events.concat().into_bytes();
        let whole = tee(api, strip, &body, &[]);
        let cut = tee(api, strip, &body, &cuts);
        if !strip {
            prop_assert_eq!(&whole.0, &body);
        }
        prop_assert_eq!(whole, cut);
    }
}

/// A part of a streamed Gemini answer.
#[derive(Debug, Clone)]
enum GeminiPart {
    Text(String),
    Thought(String),
    /// A call of one of the client's tools, with its signature.
    Call(String),
    /// A call of the proxy's own tool, which a rewriting tee takes out.
    Own,
}

/// The proxy's tool whose calls a rewriting tee takes out.
const OWN_TOOL: &str = "compactor_recall";

impl GeminiPart {
    fn json(&self) -> Vec<Value> {
        let call = |name: &str| {
            json!({"functionCall": {"name": name, "args": {"path": "src/lib.rs"}},
                   "thoughtSignature": "c2lnbmF0dXJlLW9mLXRoZS1jYWxs"})
        };
        vec![match self {
            GeminiPart::Text(t) => json!({ "text": t }),
            GeminiPart::Thought(t) => json!({"text": t, "thought": true}),
            GeminiPart::Call(name) => call(name),
            GeminiPart::Own => call(OWN_TOOL),
        }]
    }
}

fn gemini_part() -> impl Strategy<Value = GeminiPart> {
    let text = "[a-z \"\\\\é€{}:,\n]{0,12}";
    prop_oneof![
        3 => text.prop_map(GeminiPart::Text),
        1 => text.prop_map(GeminiPart::Thought),
        1 => "(read_file|run_shell|list_dir)".prop_map(GeminiPart::Call),
        1 => Just(GeminiPart::Own),
    ]
}

/// A `GenerateContentResponse` of `parts`, with its `usageMetadata` when given.
fn gemini_chunk(parts: &[Value], usage: Option<Value>) -> Value {
    let mut chunk = json!({"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}],
                           "modelVersion": "gemini-2.5-flash", "responseId": "resp-gemini-1"});
    if let Some(u) = usage {
        chunk["usageMetadata"] = u;
    }
    chunk
}

/// A Gemini stream (`alt=sse`): a chunk per part, each with the prompt's
/// count as the API sends it, keep-alive comments between them when
/// asked, then the last chunk with the finish reason and the whole usage,
/// `(prompt, cached, candidates, thoughts, tool use prompt)`.
fn gemini_body(
    parts: &[GeminiPart],
    (prompt, cached, output, thoughts, tool): (u64, u64, u64, u64, u64),
    crlf: bool,
    comments: bool,
) -> Vec<u8> {
    let end = if crlf { "\r\n\r\n" } else { "\n\n" };
    let mut body = String::new();
    for (i, p) in parts.iter().enumerate() {
        if comments && i % 2 == 1 {
            body.push_str(&format!(": keep-alive{end}"));
        }
        let meta = json!({"promptTokenCount": prompt, "totalTokenCount": prompt});
        body.push_str(&format!(
            "data: {}{end}",
            gemini_chunk(&p.json(), Some(meta))
        ));
    }
    let meta = json!({"promptTokenCount": prompt, "cachedContentTokenCount": cached,
        "candidatesTokenCount": output, "thoughtsTokenCount": thoughts,
        "toolUsePromptTokenCount": tool,
        "totalTokenCount": prompt + output + thoughts + tool});
    let mut last = gemini_chunk(&[], Some(meta));
    last["candidates"][0]["finishReason"] = json!("STOP");
    body.push_str(&format!("data: {last}{end}"));
    body.into_bytes()
}

/// What a tee relayed and collected of a Gemini stream.
#[derive(Debug, PartialEq)]
struct GeminiTee {
    bytes: Vec<u8>,
    usage: Option<compactor::wire::Usage>,
    items: Vec<Value>,
    finished: bool,
}

/// Runs a Gemini stream through a tee cut at `cuts`, taking the calls of
/// `own` out when given.
fn gemini_tee(body: &[u8], cuts: &[usize], own: Option<&str>) -> GeminiTee {
    let names: Vec<&str> = own.into_iter().collect();
    let mut tee = SseTee::new(Api::Gemini, false)
        .rewritten(compactor::wire::own_calls::rewrite(Api::Gemini, &names));
    let bytes = feed(&mut tee, body, cuts);
    GeminiTee {
        bytes,
        usage: tee.usage(),
        items: tee.items(),
        finished: tee.finished(),
    }
}

/// The answer's text, its thoughts' text and its calls' names, as collected.
fn gemini_collected(items: &[Value]) -> (String, String, Vec<String>) {
    let (mut text, mut thoughts, mut calls) = (String::new(), String::new(), Vec::new());
    for part in items
        .iter()
        .flat_map(|i| i["parts"].as_array().cloned().unwrap_or_default())
    {
        if let Some(name) = part.pointer("/functionCall/name").and_then(Value::as_str) {
            calls.push(name.to_string());
        } else if part["thought"] == json!(true) {
            thoughts.push_str(part["text"].as_str().unwrap_or_default());
        } else {
            text.push_str(part["text"].as_str().unwrap_or_default());
        }
    }
    (text, thoughts, calls)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(compactor::fuzz_cases(256)))]

    /// A Gemini stream (`alt=sse`, a whole `GenerateContentResponse` an
    /// event, usage in each and whole in the last) cut anywhere gives what
    /// it gives whole: the client gets the upstream's bytes; the usage is
    /// the last chunk's (the prompt with the tool use's, the output with
    /// the thoughts, the cached part); the text, the thoughts and the calls
    /// are the chunks' in order; the answer is seen to end. Through a tee
    /// that takes the proxy's own calls out (whole events at a time), the
    /// same holds of what is left, and the client never sees those calls.
    #[test]
    fn a_gemini_stream_gives_the_same_usage_and_bytes_however_it_is_cut(
        parts in proptest::collection::vec(gemini_part(), 0..12),
        usage in (1u64..200_000, 0u64..1000, 0u64..5000, 0u64..5000, 0u64..300),
        crlf in any::<bool>(),
        comments in any::<bool>(),
        cuts in proptest::collection::vec(any::<usize>(), 0..16),
    ) {
        let body = gemini_body(&parts, usage, crlf, comments);
        let (prompt, cached, output, thoughts, tool) = usage;
        let expected = compactor::wire::Usage {
            input_tokens: prompt + tool,
            output_tokens: output + thoughts,
            cached_tokens: Some(cached),
            ..Default::default()
        };
        let of = |keep: &dyn Fn(&GeminiPart) -> Option<String>| -> Vec<String> {
            parts.iter().filter_map(keep).collect()
        };
        let text = of(&|p| match p { GeminiPart::Text(t) => Some(t.clone()), _ => None }).concat();
        let thought = of(&|p| match p { GeminiPart::Thought(t) => Some(t.clone()), _ => None }).concat();
        for own in [None, Some(OWN_TOOL)] {
            let whole = gemini_tee(&body, &[], own);
            let cut = gemini_tee(&body, &cuts, own);
            prop_assert_eq!(&cut, &whole);
            prop_assert_eq!(cut.usage, Some(expected));
            prop_assert!(cut.finished);
            let calls = of(&|p| match p {
                GeminiPart::Call(n) => Some(n.clone()),
                GeminiPart::Own if own.is_none() => Some(OWN_TOOL.to_string()),
                _ => None,
            });
            prop_assert_eq!(gemini_collected(&cut.items), (text.clone(), thought.clone(), calls));
            let has_own = parts.iter().any(|p| matches!(p, GeminiPart::Own));
            if own.is_none() || !has_own {
                prop_assert_eq!(&cut.bytes, &body);
            } else {
                let relayed = String::from_utf8(cut.bytes.clone()).unwrap();
                prop_assert!(!relayed.contains(OWN_TOOL), "{}", relayed);
            }
        }
    }
}

/// A JSON value of any shape, small: what a client may put where the
/// proxy reads its controls.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        "[a-zA-Z_ é\u{1b}\u{202e}]{0,12}".prop_map(Value::from),
        Just(Value::from("auto")),
        Just(Value::from("observe")),
        Just(Value::from("off")),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,14}", inner), 0..3)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A header value's bytes: the known words, text, non-ASCII UTF-8, and
/// bytes that are not UTF-8.
fn any_header_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"auto".to_vec()),
        Just(b"observe".to_vec()),
        Just(b"off".to_vec()),
        Just(b"now".to_vec()),
        "[ -~]{0,16}".prop_map(String::into_bytes),
        "[a-zé🚀]{1,6}".prop_map(String::into_bytes),
        prop::collection::vec(0x80u8..=0xff, 1..6),
    ]
}

/// One request's per-request controls: each header present or not, and
/// `metadata` (with or without `compactor_mode`).
#[derive(Debug, Clone)]
struct Controls {
    mode: Option<Vec<u8>>,
    compact: Option<Vec<u8>>,
    conversation: Option<Vec<u8>>,
    metadata: Option<Value>,
    metadata_mode: Option<Value>,
}

fn any_controls() -> impl Strategy<Value = Controls> {
    (
        prop::option::of(any_header_bytes()),
        prop::option::of(any_header_bytes()),
        prop::option::of(any_header_bytes()),
        prop::option::of(any_json()),
        prop::option::of(any_json()),
    )
        .prop_map(
            |(mode, compact, conversation, metadata, metadata_mode)| Controls {
                mode,
                compact,
                conversation,
                metadata,
                metadata_mode,
            },
        )
}

/// Sends `body` with `headers` (raw bytes as given) on a fresh connection;
/// the status and the body of the answer.
async fn raw_post(
    addr: std::net::SocketAddr,
    path: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> (u16, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer fuzz-controls\r\n\
         content-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    )
    .into_bytes();
    for (name, value) in headers {
        head.extend_from_slice(name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    head.extend_from_slice(body);
    let mut s = support::within(tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect");
    support::within(s.write_all(&head)).await.expect("send");
    let mut answer = Vec::new();
    support::within(s.read_to_end(&mut answer))
        .await
        .expect("answer");
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let at = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(answer.len(), |i| i + 4);
    (status, answer[at..].to_vec())
}

/// Any per-request controls on either endpoint: the answer is the
/// upstream's or an OpenAI-style 400 naming the control; nothing of the
/// controls reaches the upstream (no `x-compactor-*` header but the hop
/// header, no `compactor_mode` in the metadata); the proxy keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_per_request_controls_are_answered_and_never_forwarded() {
    let h = support::Harness::start_with(|c| c.server.client_control = true).await;
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: compactor::fuzz_cases(64),
        ..ProptestConfig::default()
    });
    let mut cases = Vec::new();
    for _ in 0..runner.config().cases {
        let tree = (0u8..4, any_controls())
            .new_tree(&mut runner)
            .expect("a case");
        let (which, controls) = tree.current();
        let api = [Api::Chat, Api::Responses, Api::Messages, Api::Gemini][which as usize];
        cases.push((api, controls));
    }
    let mut refused = 0;
    for (api, c) in cases {
        let mut body = match api {
            Api::Chat => {
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            }
            Api::Responses => serde_json::json!({"model": "m", "input": "hi"}),
            Api::Messages => serde_json::json!({"model": "m", "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}]}),
            Api::Gemini => {
                serde_json::json!({"contents": [{"role": "user", "parts": [{"text": "hi"}]}]})
            }
        };
        let mut metadata = c.metadata.clone();
        if let Some(mode) = &c.metadata_mode {
            let mut m = match metadata.take() {
                Some(Value::Object(m)) => m,
                _ => serde_json::Map::new(),
            };
            m.insert("compactor_mode".into(), mode.clone());
            metadata = Some(Value::Object(m));
        }
        if let Some(m) = metadata {
            body["metadata"] = m;
        }
        let mut headers: Vec<(&str, &[u8])> = Vec::new();
        for (name, v) in [
            ("x-compactor-mode", &c.mode),
            ("x-compactor-compact", &c.compact),
            ("x-compactor-conversation", &c.conversation),
        ] {
            if let Some(v) = v {
                headers.push((name, v));
            }
        }
        let before = h.fake.received().len();
        let raw = serde_json::to_vec(&body).unwrap();
        let (status, answer) =
            raw_post(h.addr, &format!("/v1{}", path_of(api)), &headers, &raw).await;
        if status != 200 {
            refused += 1;
            assert!((400..500).contains(&status), "{status} for {c:?}");
            let v: Value = serde_json::from_slice(&answer).expect("a JSON error");
            assert!(v["error"]["message"].is_string(), "{v}");
            continue;
        }
        let received = h.fake.received();
        assert_eq!(received.len(), before + 1, "{c:?}");
        let got = received.last().unwrap();
        for name in got.headers.keys() {
            assert!(
                !name.as_str().starts_with("x-compactor-") || name == "x-compactor-hop",
                "{name} forwarded for {c:?}"
            );
        }
        let sent = got.json();
        assert!(
            sent["metadata"].get("compactor_mode").is_none(),
            "the metadata key was forwarded: {sent} for {c:?}"
        );
    }
    // Unknown words and bytes are refused; the cases must have made some.
    assert!(refused > 0);
    assert_healthy(&h).await;
}

/// The proxy answers its health check.
async fn assert_healthy(h: &support::Harness) {
    let health = support::within(
        support::client()
            .get(format!("http://{}/healthz", h.addr))
            .send(),
    )
    .await
    .expect("healthz");
    assert_eq!(health.status(), 200);
}

/// One recall call's arguments as a model might write them: the real
/// reference, a made-up or huge one, another type, or no JSON at all.
fn any_recall_arguments(real: String) -> impl Strategy<Value = String> {
    prop_oneof![
        Just(serde_json::json!({"ref": real}).to_string()),
        "[ -~]{0,24}".prop_map(|r| serde_json::json!({"ref": r}).to_string()),
        (1usize..200_000).prop_map(|n| serde_json::json!({"ref": "f".repeat(n)}).to_string()),
        any::<i64>().prop_map(|n| serde_json::json!({"ref": n}).to_string()),
        Just("{}".to_string()),
        "[ -~]{0,16}",
    ]
}

/// Any answer of recall calls (many, repeated, made up, beside the
/// client's own): the client gets 200 and never a call of the recall tool;
/// no request upstream grows past twice the client's; the rounds end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_recall_calls_are_answered_bounded_and_never_relayed() {
    use compactor::compaction::recall::TOOL;
    use compactor::fake_upstream::Reply;
    let h = support::Harness::start_with(support::small_window).await;
    let log = format!(
        "error[E0308]: mismatched types in src/fuzz.rs\n{}test result: FAILED\n",
        "   compiling fuzz ... line of build output\n".repeat(260)
    );
    let output = serde_json::json!({"role": "tool", "tool_call_id": "call_build", "content": log});
    let reference = compactor::compaction::ladder::archive_ref(&item_hash(&output));
    let tools = serde_json::json!([{"type": "function", "function": {"name": "shell",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]);
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a careful coding agent."}),
        serde_json::json!({"role": "user", "content": "Build the project and fix what fails."}),
        serde_json::json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_build",
            "type": "function", "function": {"name": "shell", "arguments": "{\"cmd\":\"cargo build\"}"}}]}),
        output,
        serde_json::json!({"role": "assistant", "content": "The build failed."}),
    ];
    let url = format!("{}/chat/completions", h.url());
    let key = "sk-fuzz-recall";
    let first = serde_json::json!({"model": "tiny-test", "tools": tools, "messages": messages});
    assert_eq!(support::post(&url, key, &first).await.0, 200);
    support::wait_compactions(&h, 1).await;
    messages.push(serde_json::json!({"role": "user", "content": "What was the error?"}));
    let request = serde_json::json!({"model": "tiny-test", "tools": tools, "messages": messages});
    let client_bytes = serde_json::to_vec(&request).unwrap().len();

    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: compactor::fuzz_cases(24),
        ..ProptestConfig::default()
    });
    let calls = prop::collection::vec(
        (any_recall_arguments(reference.clone()), any::<bool>()),
        1..12,
    );
    let mut cases = Vec::new();
    for _ in 0..runner.config().cases {
        let tree = calls.new_tree(&mut runner).expect("a case");
        cases.push(tree.current());
    }
    for calls in cases {
        let ids: Vec<String> = (0..calls.len()).map(|i| format!("call_{i}")).collect();
        let scripted: Vec<(&str, &str, &str)> = calls
            .iter()
            .zip(&ids)
            .map(|((args, ours), id)| {
                (
                    id.as_str(),
                    if *ours { TOOL } else { "shell" },
                    args.as_str(),
                )
            })
            .collect();
        // What follows the scripted answer is the fake's own text answer.
        h.fake.push(Reply::chat_tool_calls(&scripted, 900, 10));
        let before = h.fake.received().len();
        let (status, _, body) = support::post(&url, key, &request).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let answer: Value = serde_json::from_slice(&body).expect("JSON");
        assert!(
            !answer["choices"][0]["message"]["tool_calls"]
                .to_string()
                .contains(TOOL),
            "the client got a recall call: {answer}"
        );
        let sent = &h.fake.received()[before..];
        assert!(
            sent[0].json()["tools"].to_string().contains(TOOL),
            "compacted, and offered recall"
        );
        assert!(sent.len() <= 3 + 3, "{} requests upstream", sent.len());
        for r in sent {
            assert!(
                r.body.len() <= client_bytes * 2,
                "{} bytes upstream for a {client_bytes}-byte request",
                r.body.len()
            );
        }
    }
}

/// A message of a WebSocket client: a `response.create` made of a mutated
/// seed body, any JSON event, any text, or any bytes.
#[derive(Debug, Clone)]
enum SocketMessage {
    Text(String),
    Binary(Vec<u8>),
}

fn any_socket_message() -> impl Strategy<Value = SocketMessage> {
    let create = any_body().prop_map(|(_, body)| {
        // The seed's members after the event's type, mutations and all.
        let text = String::from_utf8_lossy(&body).into_owned();
        SocketMessage::Text(match text.strip_prefix('{') {
            Some(rest) => format!("{{\"type\":\"response.create\",{rest}"),
            None => text,
        })
    });
    prop_oneof![
        6 => create,
        2 => any_json().prop_map(|mut v| {
            if let Value::Object(o) = &mut v {
                o.insert("type".into(), "response.create".into());
            }
            SocketMessage::Text(v.to_string())
        }),
        1 => any_json().prop_map(|v| SocketMessage::Text(v.to_string())),
        1 => "[ -~é]{0,40}".prop_map(SocketMessage::Text),
        1 => proptest::collection::vec(any::<u8>(), 0..64).prop_map(SocketMessage::Binary),
    ]
}

/// One frame as a client might garble it: any header bits and opcode,
/// masked or not, a length that says more or less than follows.
fn any_frame() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u8>(),
        any::<bool>(),
        prop_oneof![Just(None), (0u64..=u64::MAX).prop_map(Some)],
        proptest::collection::vec(any::<u8>(), 0..48),
    )
        .prop_map(|(head, masked, claimed, payload)| {
            let mut f = vec![head];
            let len = claimed.unwrap_or(payload.len() as u64);
            let mask_bit = if masked { 0x80 } else { 0 };
            match len {
                0..=125 => f.push(mask_bit | len as u8),
                126..=0xffff => {
                    f.push(mask_bit | 126);
                    f.extend_from_slice(&(len as u16).to_be_bytes());
                }
                _ => {
                    f.push(mask_bit | 127);
                    f.extend_from_slice(&len.to_be_bytes());
                }
            }
            if masked {
                f.extend_from_slice(&[0x37, 0xfa, 0x21, 0x3d]);
            }
            f.extend_from_slice(&payload);
            f
        })
}

/// Opens a WebSocket on the proxy's `/v1/responses` by hand: the stream
/// after the 101.
async fn raw_socket(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = support::within(tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect");
    let head = "GET /v1/responses HTTP/1.1\r\nhost: x\r\nauthorization: Bearer fuzz-socket\r\n\
                connection: Upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\n\
                sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";
    support::within(s.write_all(head.as_bytes()))
        .await
        .expect("send");
    let mut got = Vec::new();
    while !got.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        let n = support::within(s.read(&mut byte)).await.expect("read");
        assert_eq!(
            n,
            1,
            "the head of the 101: {}",
            String::from_utf8_lossy(&got)
        );
        got.push(byte[0]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    s
}

/// The server's frames in `bytes` (unmasked): (opcode, payload) each.
fn server_frames(mut bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while bytes.len() >= 2 {
        let opcode = bytes[0] & 0x0f;
        assert_eq!(bytes[1] & 0x80, 0, "server frames are not masked");
        let (len, at) = match bytes[1] & 0x7f {
            126 => (u16::from_be_bytes([bytes[2], bytes[3]]) as usize, 4),
            127 => (
                u64::from_be_bytes(bytes[2..10].try_into().unwrap()) as usize,
                10,
            ),
            n => (n as usize, 2),
        };
        assert!(bytes.len() >= at + len, "a whole frame");
        out.push((opcode, bytes[at..at + len].to_vec()));
        bytes = &bytes[at + len..];
    }
    assert!(bytes.is_empty(), "nothing but frames");
    out
}

/// An `error` event as the socket sends it: a status and an OpenAI-style
/// error object.
fn assert_error_event(e: &Value) {
    assert_eq!(e["type"], "error", "{e}");
    assert!(e["status"].is_u64(), "{e}");
    assert!(e["error"]["message"].is_string(), "{e}");
    assert!(e["error"]["type"].is_string(), "{e}");
}

/// Any message on the WebSocket endpoint: the upstream's answer, or an
/// `error` event with a status and an OpenAI-style error, the socket going
/// on; any garbled frames: error events, then a close frame with a code
/// that says why (or none, for a client gone without one), and the socket
/// ends; and the proxy keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_websocket_answers_any_message_and_any_frame() {
    use futures_util::{SinkExt, StreamExt};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_tungstenite::tungstenite::Message;
    let h = support::Harness::start().await;
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: compactor::fuzz_cases(64),
        ..ProptestConfig::default()
    });
    let connect = || async {
        let mut req =
            tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
                format!("ws://{}/v1/responses", h.addr),
            )
            .unwrap();
        req.headers_mut()
            .insert("authorization", "Bearer fuzz-socket".parse().unwrap());
        support::within(tokio_tungstenite::connect_async(req))
            .await
            .expect("upgrade")
            .0
    };
    let mut ws = connect().await;
    let (mut refused, mut answered) = (0, 0);
    for _ in 0..runner.config().cases {
        let case = any_socket_message()
            .new_tree(&mut runner)
            .expect("a case")
            .current();
        let message = match &case {
            SocketMessage::Text(t) => Message::Text(t.clone().into()),
            SocketMessage::Binary(b) => Message::Binary(b.clone().into()),
        };
        support::within(ws.send(message)).await.expect("sent");
        // The events of its answer, up to the final one.
        loop {
            let m = support::within(ws.next()).await;
            let Some(Ok(Message::Text(t))) = m else {
                panic!("an event for {case:?}, got {m:?}");
            };
            let e: Value = serde_json::from_str(&t).expect("a JSON event");
            match e["type"].as_str() {
                Some("error") => {
                    assert_error_event(&e);
                    let status = e["status"].as_u64().unwrap();
                    assert!((400..500).contains(&status), "{e} for {case:?}");
                    refused += 1;
                    break;
                }
                Some("response.completed" | "response.failed" | "response.incomplete") => {
                    answered += 1;
                    break;
                }
                Some(_) => {}
                None => panic!("an event without a type: {e}"),
            }
        }
    }
    assert!(refused > 0, "the cases must make some refusals");
    assert!(answered > 0, "and some answers");
    drop(ws);

    let mut closes = 0;
    for _ in 0..compactor::fuzz_cases(48) {
        let frames = proptest::collection::vec(any_frame(), 1..4)
            .new_tree(&mut runner)
            .expect("a case")
            .current();
        let mut s = raw_socket(h.addr).await;
        let bytes = frames.concat();
        // The server may close before it read it all.
        let _ = support::within(s.write_all(&bytes)).await;
        let _ = support::within(s.shutdown()).await;
        let mut back = Vec::new();
        let _ = support::within(s.read_to_end(&mut back)).await;
        let frames = server_frames(&back);
        // A close frame, if any (a client gone without one may get none),
        // is the last thing the socket sends.
        let close = frames.iter().position(|f| f.0 == 0x8);
        assert!(
            close.is_none_or(|at| at + 1 == frames.len()),
            "{frames:?} for {bytes:?}"
        );
        closes += usize::from(close.is_some());
        for (opcode, payload) in frames {
            match opcode {
                0x1 => assert_error_event(&serde_json::from_slice(&payload).expect("JSON")),
                0x8 => {
                    if payload.len() >= 2 {
                        let code = u16::from_be_bytes([payload[0], payload[1]]);
                        assert!(
                            [1000, 1001, 1002, 1007, 1009].contains(&code),
                            "close code {code} for {bytes:?}"
                        );
                    }
                }
                // The answer to a ping.
                0xa => {}
                other => panic!("frame {other} for {bytes:?}"),
            }
        }
    }
    assert!(closes > 0, "garbled frames must get close frames");

    // Still serving, sockets and all.
    let mut ws = connect().await;
    let create = serde_json::json!({"type": "response.create", "model": "m", "input": "hi"});
    support::within(ws.send(Message::Text(create.to_string().into())))
        .await
        .unwrap();
    loop {
        let Some(Ok(Message::Text(t))) = support::within(ws.next()).await else {
            panic!("an event")
        };
        let e: Value = serde_json::from_str(&t).unwrap();
        if e["type"] == "response.completed" {
            break;
        }
        assert_ne!(e["type"], "error", "{e}");
    }
    assert_healthy(&h).await;
}
