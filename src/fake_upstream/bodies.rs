//! The bodies and events the fake upstream answers with: Chat Completions
//! and Responses, whole and streamed, with their usage.

use serde_json::{json, Value};

/// A fresh `resp_…` id: every Responses answer has its own, as upstreams do.
pub fn next_response_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    format!(
        "resp_fake{}",
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// Usage object of Chat Completions.
pub fn usage_chat(prompt: u64, completion: u64) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": 0}})
}

/// A complete chat completion body.
pub fn chat_body(text: &str, prompt: u64, completion: u64) -> Value {
    json!({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": "fake",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text, "refusal": null}}],
        "usage": usage_chat(prompt, completion),
    })
}

/// The events of a streamed chat completion.
pub fn chat_stream_events(pieces: &[&str], usage: Option<(u64, u64)>) -> Vec<String> {
    let head =
        r#""id":"chatcmpl-fake","object":"chat.completion.chunk","created":1,"model":"fake""#;
    let null_usage = if usage.is_some() {
        r#","usage":null"#
    } else {
        ""
    };
    let mut ev = vec![format!(
        "data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"finish_reason\":null}}]{null_usage}}}\n\n"
    )];
    for p in pieces {
        let text = serde_json::to_string(p).unwrap_or_default();
        ev.push(format!(
            "data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{text}}},\"finish_reason\":null}}]{null_usage}}}\n\n"
        ));
    }
    ev.push(format!(
        "data: {{{head},\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}]{null_usage}}}\n\n"
    ));
    if let Some((p, c)) = usage {
        ev.push(format!(
            "data: {{{head},\"choices\":[],\"usage\":{}}}\n\n",
            usage_chat(p, c)
        ));
    }
    ev.push("data: [DONE]\n\n".into());
    ev
}

/// A complete Responses body.
pub fn responses_body(id: &str, text: &str, input: u64, output: u64) -> Value {
    json!({
        "id": id, "object": "response", "created_at": 1, "status": "completed", "model": "fake",
        "output": [{"type": "message", "id": format!("msg_{id}"), "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": {"input_tokens": input, "output_tokens": output, "total_tokens": input + output},
    })
}

/// The events of a streamed Responses answer.
pub fn responses_stream_events(id: &str, pieces: &[&str], input: u64, output: u64) -> Vec<String> {
    let text: String = pieces.concat();
    let mut seq = 0;
    let mut ev = Vec::new();
    let mut push = |kind: &str, mut data: Value| {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(seq);
        seq += 1;
        ev.push(format!("event: {kind}\ndata: {data}\n\n"));
    };
    let created = json!({"id": id, "object": "response", "status": "in_progress", "output": []});
    push("response.created", json!({"response": created}));
    push("response.in_progress", json!({"response": created}));
    let item_id = format!("msg_{id}");
    push(
        "response.output_item.added",
        json!({"output_index": 0,
        "item": {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}}),
    );
    for p in pieces {
        push(
            "response.output_text.delta",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": p}),
        );
    }
    let done = responses_body(id, &text, input, output);
    push(
        "response.output_item.done",
        json!({"output_index": 0, "item": done["output"][0]}),
    );
    push("response.completed", json!({"response": done}));
    ev
}
