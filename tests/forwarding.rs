//! Forwarding through real sockets: what the upstream receives and what the
//! client receives, JSON and SSE, both APIs, plus passthrough paths.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use compactor::fake_upstream::{chat_stream_events, responses_stream_events, Reply};
use serde_json::{json, Value};
use support::{client, post, post_raw, stream_chat, within, Harness};

const KEY: &str = "sk-test-forwarding-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_json_reaches_upstream_byte_for_byte_and_back() {
    let h = Harness::start().await;
    // Unknown fields, odd spacing and key order must survive untouched.
    let raw = br#"{ "model":"gpt-4o-mini", "zz_unknown": {"keep": [1, 2.50, null]},
        "messages": [{"role":"system","content":"be brief"},{"content":"hi","role":"user","x_extra":true}] }"#;
    let upstream_answer = json!({"id": "chatcmpl-1", "object": "chat.completion", "weird_field": [1, {"a": null}],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}});
    h.fake.push(Reply::json(200, upstream_answer.clone()));
    let (status, headers, body) =
        post_raw(&format!("{}/chat/completions", h.url()), KEY, raw.to_vec()).await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        upstream_answer.to_string().as_bytes(),
        "client gets the upstream's bytes"
    );
    assert!(headers
        .get("x-compactor-conversation")
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("conv_"));
    let got = h.fake.last().unwrap();
    assert_eq!(got.path, "/v1/chat/completions");
    assert_eq!(&got.body[..], &raw[..], "upstream gets the client's bytes");
    assert_eq!(
        got.headers.get("authorization").unwrap(),
        &format!("Bearer {KEY}")
    );
    assert!(got.headers.get("x-compactor-conversation").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_with_usage_requested_is_relayed_unchanged() {
    let h = Harness::start().await;
    let events = chat_stream_events(&["Hel", "lo"], Some((20, 2)));
    h.fake.push(Reply::sse(events.clone()));
    let req = json!({"model": "gpt-4o", "stream": true, "stream_options": {"include_usage": true},
                     "messages": [{"role": "user", "content": "hi"}]});
    let (status, headers, body) = post(&format!("{}/chat/completions", h.url()), KEY, &req).await;
    assert_eq!(status, 200);
    assert_eq!(headers.get("content-type").unwrap(), "text/event-stream");
    assert_eq!(String::from_utf8(body.to_vec()).unwrap(), events.concat());
    assert_eq!(h.fake.last().unwrap().json(), req);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_gets_usage_injected_upstream_and_hidden_from_client() {
    let h = Harness::start().await;
    // No script: the fake answers like OpenAI, honouring include_usage.
    let req =
        json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, body) = post(&format!("{}/chat/completions", h.url()), KEY, &req).await;
    assert_eq!(status, 200);
    let received = h.fake.last().unwrap();
    let sent = received.json();
    assert_eq!(
        sent["stream_options"]["include_usage"], true,
        "proxy asks for usage"
    );
    // The member goes before the client's bytes, sent with their length.
    let client = serde_json::to_vec(&req).unwrap();
    assert_eq!(
        &received.body[received.body.len() - (client.len() - 1)..],
        &client[1..]
    );
    assert_eq!(
        received
            .headers
            .get("content-length")
            .unwrap()
            .to_str()
            .unwrap(),
        received.body.len().to_string()
    );
    assert!(received.headers.get("transfer-encoding").is_none());
    // What a client asking directly without include_usage would have seen.
    let direct = chat_stream_events(&["Hello", " from the", " fake upstream."], None).concat();
    assert_eq!(String::from_utf8(body.to_vec()).unwrap(), direct);
    // ...while the usage was read and recorded.
    let (input, output): (Option<i64>, Option<i64>) = h
        .db()
        .query_row(
            "SELECT input_tokens, output_tokens FROM exchanges",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert!(input.unwrap() > 0);
    assert_eq!(output, Some(7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_the_proxy_must_rewrite_keeps_everything_else_in_place() {
    let h = Harness::start().await;
    // stream_options without include_usage: the body is serialised again.
    let tools =
        json!([{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]);
    let req = json!({"model": "gpt-4o", "tools": tools, "stream": true,
                     "stream_options": {"x_vendor": 1}, "parallel_tool_calls": false,
                     "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, _) = post(&format!("{}/chat/completions", h.url()), KEY, &req).await;
    assert_eq!(status, 200);
    let sent = h.fake.last().unwrap().json();
    let mut want = req.clone();
    want["stream_options"]["include_usage"] = json!(true);
    assert_eq!(sent, want);
    assert_eq!(
        support::keys(&sent),
        [
            "model",
            "tools",
            "stream",
            "stream_options",
            "parallel_tool_calls",
            "messages"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_json_and_stream_are_relayed_unchanged() {
    let h = Harness::start().await;
    let answer = compactor::fake_upstream::responses_body("resp_A", "hi there", 12, 3);
    h.fake.push(Reply::json(200, answer.clone()));
    let req = json!({"model": "gpt-5", "instructions": "be brief", "input": "hi", "store": false,
                     "reasoning": {"effort": "low"}, "unknown_knob": 1});
    let (status, _, body) = post(&format!("{}/responses", h.url()), KEY, &req).await;
    assert_eq!(status, 200);
    assert_eq!(body, answer.to_string().as_bytes());
    assert_eq!(h.fake.last().unwrap().json(), req);

    let events = responses_stream_events("resp_B", &["a", "b"], 30, 2);
    h.fake.push(Reply::sse(events.clone()));
    let mut req = req.clone();
    req["stream"] = json!(true);
    let (status, _, body) = post(&format!("{}/responses", h.url()), KEY, &req).await;
    assert_eq!(status, 200);
    assert_eq!(String::from_utf8(body.to_vec()).unwrap(), events.concat());
    assert_eq!(
        h.fake.last().unwrap().json(),
        req,
        "no usage injection for Responses"
    );
    let rows: Vec<(Option<String>, i64, i64, i64)> = h
        .db()
        .prepare(
            "SELECT response_id, input_tokens, output_tokens, streamed FROM exchanges ORDER BY id",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        rows,
        vec![
            (Some("resp_A".into()), 12, 3, 0),
            (Some("resp_B".into()), 30, 2, 1)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_chunks_arrive_as_they_are_sent() {
    let h = Harness::start().await;
    let events = chat_stream_events(&["one", "two", "three"], Some((5, 3)));
    let gap = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let mut resp = stream_chat(&h, events, gap, true).await;
    let first = within(resp.chunk()).await.unwrap().unwrap();
    let first_at = started.elapsed();
    assert!(String::from_utf8_lossy(&first).contains("\"role\":\"assistant\""));
    let mut rest = 0;
    while within(resp.chunk()).await.unwrap().is_some() {
        rest += 1;
    }
    let total = started.elapsed();
    assert!(
        rest >= 5,
        "chunks were forwarded separately, got {rest} more"
    );
    // The first chunk left before the upstream had sent the rest (7 gaps).
    assert!(
        first_at < total - gap * 4,
        "first chunk at {first_at:?} of {total:?}: body was buffered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_events_leaves_in_few_writes_and_unchanged() {
    let h = Harness::start().await;
    let pieces: Vec<String> = (0..12).map(|i| format!(" word{i}")).collect();
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    let events = chat_stream_events(&pieces, Some((5, 3)));
    let sent: String = events.concat();
    let count = events.len();
    // All events in one burst, as an upstream that has them ready sends them.
    let mut resp = stream_chat(&h, events, Duration::ZERO, true).await;
    let mut received = Vec::new();
    let mut chunks = 0;
    while let Some(chunk) = within(resp.chunk()).await.unwrap() {
        received.extend_from_slice(&chunk);
        chunks += 1;
    }
    assert_eq!(String::from_utf8(received).unwrap(), sent);
    // The first event leaves at once; those that arrived with it after it
    // join into few writes rather than one each.
    assert!(
        chunks * 2 <= count,
        "{count} events reached the client in {chunks} chunks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_paths_stream_untouched_both_ways() {
    let h = Harness::start().await;
    let resp = within(
        client()
            .get(format!("{}/models?limit=2", h.url()))
            .header("authorization", format!("Bearer {KEY}"))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("x-compactor-conversation").is_none());
    let body: Value = within(resp.json()).await.unwrap();
    assert_eq!(body["path"], "/v1/models");
    let got = h.fake.last().unwrap();
    assert_eq!(got.query.as_deref(), Some("limit=2"));
    assert_eq!(
        got.headers.get("authorization").unwrap(),
        &format!("Bearer {KEY}")
    );

    // A compressed answer reaches the client exactly as the upstream sent it.
    let gz: Vec<u8> = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6];
    h.fake.push(Reply::Full {
        status: 200,
        headers: vec![
            ("content-encoding".into(), "gzip".into()),
            ("content-type".into(), "application/json".into()),
        ],
        body: gz.clone().into(),
    });
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let resp = within(
        client()
            .post(format!("{}/files", h.url()))
            .header("accept-encoding", "zstd,gzip")
            .body(payload.clone())
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers().get("content-encoding").unwrap(), "gzip");
    assert_eq!(within(resp.bytes()).await.unwrap().to_vec(), gz);
    let got = h.fake.last().unwrap();
    assert_eq!(
        got.body.to_vec(),
        payload,
        "request body streamed through intact"
    );
    assert_eq!(got.headers.get("accept-encoding").unwrap(), "zstd,gzip");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_requests_keep_the_clients_framing() {
    let h = Harness::start().await;
    let framing = |r: &compactor::fake_upstream::Received| {
        let get = |name: &str| r.headers.get(name).map(|v| v.to_str().unwrap().to_string());
        (get("content-length"), get("transfer-encoding"))
    };
    let url = |path: &str| format!("{}{path}", h.url());
    let big: Vec<u8> = (0..2u32 << 20).map(|i| (i % 253) as u8).collect();
    let chunked = || {
        let pieces = vec![Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"abc"))];
        reqwest::Body::wrap_stream(futures_util::stream::iter(pieces))
    };
    // What is sent; the content-length and transfer-encoding the upstream
    // must see; the body it must get.
    type Case<'a> = (
        &'a str,
        reqwest::RequestBuilder,
        Option<&'a str>,
        Option<&'a str>,
        &'a [u8],
    );
    let cases: Vec<Case> = vec![
        ("GET", client().get(url("/models")), None, None, b""),
        ("DELETE", client().delete(url("/files/f1")), None, None, b""),
        (
            "empty POST",
            client().post(url("/files")).header("content-length", "0"),
            Some("0"),
            None,
            b"",
        ),
        (
            "POST with a length",
            client().post(url("/files")).body(vec![7u8; 1000]),
            Some("1000"),
            None,
            &[7u8; 1000],
        ),
        (
            "POST with a length past what is read first",
            client().post(url("/files")).body(big.clone()),
            Some("2097152"),
            None,
            &big,
        ),
        (
            "chunked POST",
            client().post(url("/files")).body(chunked()),
            None,
            Some("chunked"),
            b"abc",
        ),
    ];
    for (what, req, length, encoding, body) in cases {
        let resp = within(req.bearer_auth(KEY).send()).await.unwrap();
        assert_eq!(resp.status(), 200, "{what}");
        let got = h.fake.last().unwrap();
        assert_eq!(
            framing(&got),
            (length.map(String::from), encoding.map(String::from)),
            "{what}"
        );
        assert_eq!(got.body.as_ref(), body, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parsed_endpoints_ask_upstream_for_an_uncompressed_answer() {
    let h = Harness::start().await;
    let resp = within(
        client()
            .post(format!("{}/chat/completions", h.url()))
            .header("accept-encoding", "zstd,gzip")
            .json(&json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    // The proxy must read usage out of the body, so it asks for identity;
    // the client gets a plain body, which every client accepts.
    assert_eq!(
        h.fake
            .last()
            .unwrap()
            .headers
            .get("accept-encoding")
            .unwrap(),
        "identity"
    );
    assert!(resp.headers().get("content-encoding").is_none());
    let body: Value = within(resp.json()).await.unwrap();
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_stay_on_their_hop() {
    let h = Harness::start().await;
    let resp = within(
        client()
            .post(format!("{}/chat/completions", h.url()))
            .header("connection", "x-hop")
            .header("x-hop", "1")
            .header("x-end-to-end", "2")
            .header("session-id", "s-1")
            .json(&json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let got = h.fake.last().unwrap();
    assert!(got.headers.get("x-hop").is_none());
    assert_eq!(got.headers.get("x-end-to-end").unwrap(), "2");
    assert_eq!(got.headers.get("session-id").unwrap(), "s-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_side_key_replaces_the_clients() {
    // The variable name is used by this test alone.
    std::env::set_var("COMPACTOR_TEST_SERVER_KEY", "sk-server-side");
    let h =
        Harness::start_with(|c| c.upstream.api_key_env = "COMPACTOR_TEST_SERVER_KEY".into()).await;
    let (status, _, _) = post(
        &format!("{}/chat/completions", h.url()),
        KEY,
        &json!({"model": "m", "messages": []}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        h.fake.last().unwrap().headers.get("authorization").unwrap(),
        "Bearer sk-server-side"
    );
    // A client known by another credential header does not pass it on
    // beside the server's key either.
    for header in ["api-key", "x-api-key"] {
        let resp = within(
            reqwest::Client::new()
                .post(format!("{}/chat/completions", h.url()))
                .header(header, "client-side-key-0123")
                .json(&json!({"model": "m", "messages": []}))
                .send(),
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 200);
        let got = h.fake.last().unwrap();
        assert!(got.headers.get(header).is_none(), "{header} forwarded");
        assert_eq!(
            got.headers.get("authorization").unwrap(),
            "Bearer sk-server-side"
        );
    }
}

/// `GET /v1/models` answers the upstream's listing with each model carrying
/// the window the proxy uses for it: a `[[models]]` entry's, the built-in
/// table's, or the listing's own where the proxy only guesses; one model's
/// answer likewise; an error goes through as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_models_listing_tells_each_models_window() {
    use compactor::config::ModelConfig;
    let h = Harness::start_with(|c| {
        c.models.insert(
            0,
            ModelConfig {
                pattern: "my-model*".into(),
                context_window: 9000,
                ..Default::default()
            },
        );
    })
    .await;
    h.fake.push(Reply::json(
        200,
        json!({"object": "list", "data": [
            {"id": "gpt-4o", "object": "model", "owned_by": "openai"},
            {"id": "my-model-7b", "object": "model", "max_model_len": 32768},
            {"id": "served.gguf", "object": "model", "max_model_len": 4096},
            {"id": "claude-sonnet-4-6", "type": "model", "display_name": "Claude Sonnet 4.6"},
        ]}),
    ));
    let get = |path: &str| {
        client()
            .get(format!("{}{path}", h.url()))
            .header("authorization", format!("Bearer {KEY}"))
            .send()
    };
    let resp = within(get("/models")).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body: Value = within(resp.json()).await.unwrap();
    let window = |id: &str, field: &str| {
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == id)
            .unwrap_or_else(|| panic!("{id} in {body}"))[field]
            .clone()
    };
    // The built-in table's window.
    assert_eq!(window("gpt-4o", "context_length"), 128_000, "{body}");
    assert_eq!(
        window("gpt-4o", "owned_by"),
        "openai",
        "the rest stays: {body}"
    );
    // The configured window wins over what the server states.
    assert_eq!(window("my-model-7b", "context_length"), 9000, "{body}");
    assert_eq!(window("my-model-7b", "max_model_len"), 9000, "{body}");
    // A name the table only guesses at: the server's word stays.
    assert_eq!(window("served.gguf", "context_length"), 4096, "{body}");
    // Anthropic's listing field too.
    assert_eq!(
        window("claude-sonnet-4-6", "max_input_tokens"),
        200_000,
        "{body}"
    );
    assert_eq!(
        window("claude-sonnet-4-6", "display_name"),
        "Claude Sonnet 4.6",
        "{body}"
    );
    let asked = h.fake.last().unwrap();
    assert_eq!(asked.path, "/v1/models");

    h.fake.push(Reply::json(
        200,
        json!({"id": "my-model-7b", "object": "model"}),
    ));
    let resp = within(get("/models/my-model-7b")).await.unwrap();
    let one: Value = within(resp.json()).await.unwrap();
    assert_eq!(one["context_length"], 9000, "{one}");
    assert_eq!(h.fake.last().unwrap().path, "/v1/models/my-model-7b");

    h.fake.push(Reply::json(
        401,
        json!({"error": {"message": "bad key", "type": "invalid_request_error"}}),
    ));
    let resp = within(get("/models")).await.unwrap();
    assert_eq!(resp.status(), 401);
    let error: Value = within(resp.json()).await.unwrap();
    assert_eq!(error["error"]["message"], "bad key", "{error}");
    assert!(error.get("data").is_none(), "{error}");
}

/// Gemini's `GET /v1beta/models` (and one model) answers the upstream's
/// listing with each model's `inputTokenLimit` and `outputTokenLimit` the
/// proxy's: a `[[models]]` entry's over what the upstream states, the
/// upstream's where the proxy only guesses from the name. The key goes
/// upstream in `x-goog-api-key`, the query (pagination) as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gemini_listing_tells_each_models_window() {
    use compactor::config::ModelConfig;
    let h = Harness::start_with(|c| {
        c.models.insert(
            0,
            ModelConfig {
                pattern: "my-gemini*".into(),
                context_window: 9000,
                max_output_tokens: Some(1000),
                ..Default::default()
            },
        );
    })
    .await;
    let origin = h.url().strip_suffix("/v1").unwrap().to_string();
    let key = "AIza-test-listing-key";
    h.fake.push(Reply::json(
        200,
        json!({"models": [
            {"name": "models/my-gemini-pro", "displayName": "Mine", "inputTokenLimit": 1_048_576,
             "outputTokenLimit": 65_536, "supportedGenerationMethods": ["generateContent"]},
            {"name": "models/served-flash", "inputTokenLimit": 32_768, "outputTokenLimit": 4096},
        ], "nextPageToken": "page-2"}),
    ));
    let get = |path: &str| {
        client()
            .get(format!("{origin}{path}"))
            .header("x-goog-api-key", key)
            .send()
    };
    let resp = within(get("/v1beta/models?pageSize=2")).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body: Value = within(resp.json()).await.unwrap();
    let model = |name: &str| {
        body["models"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == format!("models/{name}"))
            .unwrap_or_else(|| panic!("{name} in {body}"))
            .clone()
    };
    let limits = |m: &Value| (m["inputTokenLimit"].clone(), m["outputTokenLimit"].clone());
    let mine = model("my-gemini-pro");
    assert_eq!(
        limits(&mine),
        (json!(9000), json!(1000)),
        "configured: {body}"
    );
    assert_eq!(mine["displayName"], "Mine", "the rest stays: {body}");
    let served = model("served-flash");
    assert_eq!(
        limits(&served),
        (json!(32_768), json!(4096)),
        "stated: {body}"
    );
    assert_eq!(body["nextPageToken"], "page-2", "{body}");
    let asked = h.fake.last().unwrap();
    assert_eq!(asked.path, "/v1/models", "below the upstream's base");
    assert_eq!(asked.query.as_deref(), Some("pageSize=2"));
    assert_eq!(asked.headers.get("x-goog-api-key").unwrap(), key);

    h.fake.push(Reply::json(
        200,
        json!({"name": "models/my-gemini-pro", "inputTokenLimit": 1_048_576}),
    ));
    let resp = within(get("/v1beta/models/my-gemini-pro")).await.unwrap();
    let one: Value = within(resp.json()).await.unwrap();
    assert_eq!(limits(&one), (json!(9000), json!(1000)), "{one}");
    assert_eq!(h.fake.last().unwrap().path, "/v1/models/my-gemini-pro");

    // A key in the query goes upstream in the header, and nowhere in the
    // query.
    h.fake.push(Reply::json(200, json!({"models": []})));
    let resp = within(
        client()
            .get(format!("{origin}/v1beta/models?key={key}&pageSize=5"))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let asked = h.fake.last().unwrap();
    assert_eq!(asked.query.as_deref(), Some("pageSize=5"));
    assert_eq!(asked.headers.get("x-goog-api-key").unwrap(), key);

    // An error goes through as it came; a path that would leave the base
    // is refused, in Google's shape.
    h.fake.push(Reply::json(
        400,
        json!({"error": {"code": 400, "message": "API key not valid.", "status": "INVALID_ARGUMENT"}}),
    ));
    let resp = within(get("/v1beta/models")).await.unwrap();
    assert_eq!(resp.status(), 400);
    let error: Value = within(resp.json()).await.unwrap();
    assert_eq!(error["error"]["status"], "INVALID_ARGUMENT", "{error}");
    let asked = h.fake.count();
    let resp = within(get("/v1beta/models/a%2fb")).await.unwrap();
    assert_eq!(resp.status(), 400);
    let error: Value = within(resp.json()).await.unwrap();
    assert_eq!(error["error"]["status"], "INVALID_ARGUMENT", "{error}");
    assert_eq!(h.fake.count(), asked, "nothing sent upstream");
}
