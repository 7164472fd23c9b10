//! Images are not text: a conversation at ~1% of its window whose next
//! turn carries a ~1 MB screenshot goes upstream as it came, on each of
//! the four APIs — no compaction, no summarizer call, the image's bytes
//! unchanged. Tokenized as words, its base64 counted a million tokens and
//! the turn was compacted on the spot.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use compactor::config::{Config, ModelConfig};
use compactor::fake_upstream::{Received, Reply};
use serde_json::{json, Value};
use support::*;

const KEY: &str = "sk-images-test-0001";
/// The model's window; the conversation reports about 1% of it.
const WINDOW: u64 = 200_000;

/// Models matching `pattern` get a window of `window` tokens and an
/// answer budget of `output`.
fn model(pattern: &'static str, window: u64, output: u64) -> impl FnOnce(&mut Config) {
    move |c| {
        c.models.push(ModelConfig {
            pattern: pattern.into(),
            context_window: window,
            max_output_tokens: Some(output),
            trigger_ratio: None,
            ..Default::default()
        })
    }
}

use compactor::tokens::media::encode_base64 as b64;

fn chunk(kind: &[u8], data: &[u8]) -> Vec<u8> {
    let mut c = (data.len() as u32).to_be_bytes().to_vec();
    c.extend(kind);
    c.extend(data);
    let mut crc = crc32fast::Hasher::new();
    crc.update(kind);
    crc.update(data);
    c.extend(crc.finalize().to_be_bytes());
    c
}

/// A valid PNG of a 2880 × 1800 screenshot: its header, then ~1 MB of
/// incompressible image data (what a busy screenshot's deflate stream
/// looks like to anything but a PNG decoder).
fn screenshot() -> Vec<u8> {
    let mut ihdr = 2880u32.to_be_bytes().to_vec();
    ihdr.extend(1800u32.to_be_bytes());
    ihdr.extend([8, 6, 0, 0, 0]);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..1_100_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(chunk(b"IHDR", &ihdr));
    png.extend(chunk(b"IDAT", &data));
    png.extend(chunk(b"IEND", &[]));
    png
}

/// ~2,000 tokens of conversation before the screenshot (1% of the window).
fn history() -> Vec<(&'static str, String)> {
    (0..8)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let text = format!(
                "Turn {i}: the settings page renders its sidebar twice when the window is narrow; \
                 {} ",
                "the layout code in src/ui/sidebar.rs decides the breakpoints. ".repeat(14)
            );
            (role, text)
        })
        .collect()
}

/// The four APIs: where a request goes, how it is sent, the image block,
/// and a scripted answer reporting `prompt` input tokens.
#[derive(Clone, Copy, Debug)]
enum Api {
    Chat,
    Responses,
    Messages,
    Gemini,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/chat/completions",
            Api::Responses => "/responses",
            Api::Messages => "/messages",
            Api::Gemini => "/models/shot-gemini:generateContent",
        }
    }

    fn image(self, png: &str) -> Value {
        match self {
            Api::Chat => {
                json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}})
            }
            Api::Responses => {
                json!({"type": "input_image", "image_url": format!("data:image/png;base64,{png}"), "detail": "auto"})
            }
            Api::Messages => {
                json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}})
            }
            Api::Gemini => json!({"inlineData": {"mimeType": "image/png", "data": png}}),
        }
    }

    fn text(self, text: &str) -> Value {
        match self {
            Api::Responses => json!({"type": "input_text", "text": text}),
            Api::Gemini => json!({ "text": text }),
            _ => json!({"type": "text", "text": text}),
        }
    }

    fn body(self, items: &[Value]) -> Value {
        match self {
            Api::Chat => json!({"model": "shot-chat", "messages": items}),
            Api::Responses => json!({"model": "shot-responses", "input": items}),
            Api::Messages => {
                json!({"model": "shot-messages", "max_tokens": 1024, "messages": items})
            }
            Api::Gemini => json!({"contents": items.iter().map(as_content).collect::<Vec<_>>()}),
        }
    }

    /// Where the history is in a request body.
    fn items(self, body: &Value) -> &Value {
        match self {
            Api::Responses => &body["input"],
            Api::Gemini => &body["contents"],
            _ => &body["messages"],
        }
    }

    /// Where the parts are in an item the client sent.
    fn parts(self) -> &'static str {
        match self {
            Api::Gemini => "parts",
            _ => "content",
        }
    }

    fn answer(self, text: &str, prompt: u64) -> Reply {
        match self {
            Api::Chat => Reply::chat(text, prompt, 40),
            Api::Responses => Reply::responses(text, prompt, 40),
            Api::Messages => Reply::json(
                200,
                json!({
                    "id": "msg_shot", "type": "message", "role": "assistant", "model": "shot-messages",
                    "content": [{"type": "text", "text": text}],
                    "stop_reason": "end_turn", "stop_sequence": null,
                    "usage": {"input_tokens": prompt, "output_tokens": 40},
                }),
            ),
            Api::Gemini => compactor::fake_upstream::gemini::text(text, prompt, 40),
        }
    }

    async fn send(self, h: &Harness, body: &Value) -> (u16, Vec<u8>) {
        let mut req = client()
            .post(format!("{}{}", h.url(), self.path()))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(body).unwrap());
        req = match self {
            Api::Messages => req
                .header("x-api-key", KEY)
                .header("anthropic-version", "2023-06-01"),
            Api::Gemini => req.header("x-goog-api-key", KEY),
            _ => req.header("authorization", format!("Bearer {KEY}")),
        };
        let resp = within(req.send()).await.expect("request");
        let status = resp.status().as_u16();
        (status, within(resp.bytes()).await.expect("body").to_vec())
    }
}

fn message(role: &str, content: Value) -> Value {
    json!({"role": role, "content": content})
}

/// A message as a Gemini content: `assistant` is `model`, the content its
/// parts.
fn as_content(m: &Value) -> Value {
    let role = if m["role"] == "assistant" {
        "model"
    } else {
        "user"
    };
    let parts = match &m["content"] {
        Value::String(t) => json!([{ "text": t }]),
        parts => parts.clone(),
    };
    json!({"role": role, "parts": parts})
}

async fn a_screenshot_at_one_percent_goes_as_it_came(api: Api) {
    let h = Harness::start_with(model("shot-*", WINDOW, 8_000)).await;
    let mut items: Vec<Value> = history()
        .into_iter()
        .map(|(role, text)| message(role, json!(text)))
        .collect();
    items.push(message(
        "user",
        json!("Here is where it breaks; look next."),
    ));
    // The upstream counts the conversation at ~1% of the window.
    h.fake.push(api.answer("Send me a screenshot.", 2_000));
    let (status, body) = api.send(&h, &api.body(&items)).await;
    assert_eq!(status, 200, "{api:?}: {}", String::from_utf8_lossy(&body));
    items.push(message("assistant", json!("Send me a screenshot.")));

    let png = b64(&screenshot());
    assert!(png.len() > 1_400_000, "{}", png.len());
    let image = api.image(&png);
    items.push(message(
        "user",
        json!([api.text("The sidebar, twice:"), image.clone()]),
    ));
    // A 2880 × 1800 image: ~1,600 tokens on Anthropic, 1,105 on OpenAI.
    h.fake.push(api.answer("I see two sidebars.", 3_700));
    let (status, body) = api.send(&h, &api.body(&items)).await;
    assert_eq!(status, 200, "{api:?}: {}", String::from_utf8_lossy(&body));
    let at = items.len() - 1;
    h.wait_exchanges(2).await;
    // The turn after it: the screenshot is history now.
    items.push(message("assistant", json!("I see two sidebars.")));
    items.push(message("user", json!("Fix it, then show me the diff.")));
    h.fake.push(api.answer("Done.", 3_800));
    let (status, body) = api.send(&h, &api.body(&items)).await;
    assert_eq!(status, 200, "{api:?}: {}", String::from_utf8_lossy(&body));
    h.wait_exchanges(3).await;
    // What follows the exchange (the trigger's check) has run.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;

    let received: Vec<Received> = h.fake.received();
    let summaries = received.iter().filter(|r| is_summary_call(r)).count();
    assert_eq!(summaries, 0, "{api:?}: no summarizer call");
    assert_eq!(received.len(), 3, "{api:?}: the three turns, nothing else");
    assert_eq!(compactions(&h), 0, "{api:?}: nothing compacted");
    // The screenshot reached the upstream byte for byte, in its place,
    // with the turn that sent it and with the next.
    for (turn, n) in [(1, at + 1), (2, items.len())] {
        let r = &received[turn];
        assert!(
            memchr::memmem::find(&r.body, png.as_bytes()).is_some(),
            "{api:?}: the base64 went as it came"
        );
        let sent = r.json();
        let list = api.items(&sent);
        assert_eq!(list.as_array().map(Vec::len), Some(n), "{api:?}");
        assert_eq!(list[at][api.parts()][1], image, "{api:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_screenshot_at_one_percent_is_not_compacted() {
    a_screenshot_at_one_percent_goes_as_it_came(Api::Chat).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_screenshot_at_one_percent_is_not_compacted() {
    a_screenshot_at_one_percent_goes_as_it_came(Api::Responses).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_screenshot_at_one_percent_is_not_compacted() {
    a_screenshot_at_one_percent_goes_as_it_came(Api::Messages).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gemini_screenshot_at_one_percent_is_not_compacted() {
    a_screenshot_at_one_percent_goes_as_it_came(Api::Gemini).await;
}

/// The estimate may be far above what the upstream counts (three PDFs by
/// file id, whose pages the proxy cannot see, are taken at ten pages
/// each); the upstream reported the conversation at 900 tokens, and the
/// next turn adds a few hundred. Its last report plus what was added fits:
/// no hard-limit compaction, though the estimate of the whole is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reported_usage_plus_what_was_added_decides_the_hard_limit() {
    // A 3,000-token window, whose hard limit (2,700) a small body's bytes pass.
    let h = Harness::start_with(model("docs-*", 3_000, 300)).await;
    let file = |id: &str| json!({"type": "file", "file": {"file_id": id}});
    let mut items = vec![
        message("system", json!("You review contracts.")),
        message(
            "user",
            json!([
                {"type": "text", "text": "Compare the termination clauses of these three."},
                file("file-a"), file("file-b"), file("file-c"),
            ]),
        ),
    ];
    let body = |items: &[Value]| json!({"model": "docs-chat", "messages": items});
    h.fake.push(Reply::chat("Which clause first?", 900, 20));
    let (status, _, _) = post(&format!("{}/chat/completions", h.url()), KEY, &body(&items)).await;
    assert_eq!(status, 200);
    h.wait_exchanges(1).await;
    // The report is kept by the accounting step, after the answer: an agent's
    // next turn comes after its tool run; this test's comes at once.
    assert!(
        h.state
            .background
            .drained(std::time::Duration::from_secs(10))
            .await
    );
    items.push(message("assistant", json!("Which clause first?")));
    // About 400 tokens of new text: a pasted excerpt.
    items.push(message(
        "user",
        json!(format!(
            "Clause 14 first. Here is the excerpt I mean: {}",
            "either party may terminate on ninety days written notice; ".repeat(40)
        )),
    ));
    let sent = body(&items);
    assert!(
        serde_json::to_vec(&sent).unwrap().len() > 2_700,
        "past the bytes shortcut"
    );
    h.fake
        .push(Reply::chat("Clause 14 of A allows ninety days.", 1_350, 20));
    let (status, _, _) = post(&format!("{}/chat/completions", h.url()), KEY, &sent).await;
    assert_eq!(status, 200);
    h.wait_exchanges(2).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;

    let received = h.fake.received();
    assert_eq!(received.iter().filter(|r| is_summary_call(r)).count(), 0);
    assert_eq!(compactions(&h), 0, "nothing compacted");
    assert_eq!(received.len(), 2);
    assert_eq!(
        received[1].json()["messages"],
        sent["messages"],
        "sent as it came"
    );
}

/// An image in a message the summary replaces is not dropped silently: the
/// summary says what it was (its size and cost) and where, so the model
/// knows it was shown something it no longer has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_the_summary_replaces_leaves_a_marker() {
    let h = Harness::start_with(model("media-*", 20_000, 2_000)).await;
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = 800u32.to_be_bytes().to_vec();
    ihdr.extend(600u32.to_be_bytes());
    ihdr.extend([8, 6, 0, 0, 0]);
    png.extend(chunk(b"IHDR", &ihdr));
    png.extend(chunk(b"IEND", &[]));
    let png = b64(&png);
    let mut items = vec![message(
        "user",
        json!([
            {"type": "text", "text": "This dialog renders its buttons off screen. Fix the layout."},
            Api::Messages.image(&png),
        ]),
    )];
    // Later turns long enough that the recent user messages kept verbatim
    // are these, not the first.
    for i in 0..6 {
        items.push(message(
            "assistant",
            json!(format!("Step {i}: looked at the dialog code.")),
        ));
        items.push(message(
            "user",
            json!(format!(
                "Turn {i}: {}",
                "the dialog's buttons sit in a flex row whose width comes from the parent. "
                    .repeat(30)
            )),
        ));
    }
    let mut req = client()
        .post(format!("{}/messages", h.url()))
        .header("content-type", "application/json")
        .header("x-api-key", KEY)
        .header("anthropic-version", "2023-06-01")
        .header("x-compactor-compact", "now");
    let body = json!({"model": "media-messages", "max_tokens": 1024, "messages": items});
    req = req.body(serde_json::to_vec(&body).unwrap());
    let resp = within(req.send()).await.expect("request");
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers().get("x-compactor-compacted").is_some(),
        "compacted at once"
    );
    let sent = h
        .fake
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/messages" && !is_summary_call(r))
        .last()
        .expect("the compacted request");
    let text = String::from_utf8_lossy(&sent.body).into_owned();
    assert!(!text.contains(&png), "the image went as it came");
    assert!(text.contains("## MEDIA NOT KEPT"), "{text}");
    assert!(
        text.contains("[image omitted by compactor: 800×600 PNG, ~640 tokens] (in a user message)"),
        "{text}"
    );
}
