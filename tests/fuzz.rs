//! Fuzz targets, run for a bounded number of cases in every test run
//! (`COMPACTOR_FUZZ_CASES=N` runs each for N instead): the request-body
//! split of both endpoints, the proxy's answer to any body, and the SSE
//! tee on any chunking of any event stream. (The journal reader's target
//! is with the reader, in `store::journal`.) Seeds: `tests/corpus/`.

mod support;

use std::ops::Range;
use std::path::PathBuf;

use bytes::Bytes;
use compactor::wire::items::{split_body, ItemCaches, ItemList};
use compactor::wire::sse::SseTee;
use compactor::wire::{item_hash, Api};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use serde_json::Value;

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
        let url = format!("{}{}", h.url(), api.endpoint());
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
        assert!(e["message"].is_string() && e["type"].is_string(), "{v}");
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

/// An event of either API's stream, or something that is not one.
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
        Just(": keep-alive\n\n".to_string()),
        Just("data: {\"half\": \n".to_string()),
        // Any bytes as text, lines and all.
        proptest::collection::vec(any::<u8>(), 0..24)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
}

/// Runs `body` through a tee cut at `cuts` (offsets, taken modulo the
/// length): the client's bytes and what was collected.
fn tee(api: Api, strip: bool, body: &[u8], cuts: &[usize]) -> (Vec<u8>, String) {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut tee = SseTee::new(api, strip);
    let mut out = Vec::new();
    let mut at = 0;
    for cut in cuts.into_iter().chain([body.len()]) {
        out.extend_from_slice(&tee.push(Bytes::copy_from_slice(&body[at..cut])));
        at = cut;
    }
    out.extend_from_slice(&tee.finish());
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

    /// The SSE tee on any chunking of any event stream of either API: never
    /// panics; passes every byte through unless it hides usage; and what
    /// the client gets and what is collected do not depend on how the
    /// upstream cut the stream.
    #[test]
    fn the_sse_tee_does_not_depend_on_chunking(
        events in proptest::collection::vec(any_event(), 0..10),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
        responses in any::<bool>(),
        strip in any::<bool>(),
    ) {
        let api = if responses { Api::Responses } else { Api::Chat };
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
