//! What the fake upstream answers when no reply is scripted: a short text
//! like a small model's, or, asked for a summary, one that names what the
//! request holds.

use serde_json::{json, Value};

use super::anthropic;
use super::reply::{Received, Reply, AUTO_TEXT};

/// What the fake answers when nothing is scripted.
pub fn auto_reply(rec: &Received) -> Reply {
    let body = rec.json();
    if super::gemini::is_gemini(&rec.path) {
        let chat = super::gemini::as_chat(&body);
        return super::gemini::auto_reply(rec, summarizer_narrative(&chat));
    }
    let prompt = (rec.body.len() as u64 / 4).max(1);
    let completion = 7;
    let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
    if rec.path.ends_with("/chat/completions") {
        if let Some(narrative) = summarizer_narrative(&body) {
            return Reply::chat(&narrative, prompt, 60);
        }
        if stream {
            let include = body
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                == Some(true);
            return Reply::chat_stream(
                &["Hello", " from the", " fake upstream."],
                include.then_some((prompt, completion)),
            );
        }
        return Reply::chat(AUTO_TEXT, prompt, completion);
    }
    if rec.path.ends_with("/messages/count_tokens") {
        return Reply::json(
            200,
            json!({"input_tokens": anthropic::prompt_tokens(&body)}),
        );
    }
    if rec.path.ends_with("/messages") {
        use anthropic::{as_chat, is_summarizer_request, Answer};
        if is_summarizer_request(&body) {
            let narrative = summarizer_narrative(&as_chat(&body)).unwrap_or_default();
            return Reply::Messages(Answer::text(&narrative));
        }
        let thinking = crate::wire::messages::thinking_on(&body);
        let answer = Answer::text(AUTO_TEXT);
        return Reply::Messages(if thinking {
            answer.thinking("The fake upstream thinks briefly.")
        } else {
            answer
        });
    }
    if rec.path.ends_with("/responses") {
        if stream {
            return Reply::responses_stream(
                &["Hello", " from the", " fake upstream."],
                prompt,
                completion,
            );
        }
        return Reply::responses(AUTO_TEXT, prompt, completion);
    }
    Reply::json(
        200,
        json!({"object": "list", "data": [], "path": rec.path, "method": rec.method.as_str()}),
    )
}

/// For a summarizer request (a system message carrying
/// [`SUMMARIZER_MARKER`](crate::compaction::summary::SUMMARIZER_MARKER)),
/// a narrative with every section, each one short line derived from the
/// transcript: DECISIONS and OPEN ITEMS name the last `[user]` line seen.
fn summarizer_narrative(body: &Value) -> Option<String> {
    use crate::compaction::summary::NARRATIVE_SECTIONS;
    if !is_summarizer_request(body) {
        return None;
    }
    let messages = body.get("messages")?.as_array()?;
    let text =
        |m: &Value| crate::compaction::items::value_text(m.get("content").unwrap_or(&Value::Null));
    let is = |m: &&Value, r: &str| m.get("role").and_then(Value::as_str) == Some(r);
    let user = messages
        .iter()
        .rev()
        .find(|m| is(m, "user"))
        .map(text)
        .unwrap_or_default();
    let last_user = user
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("[user] "))
        .map(|l| l.chars().take(120).collect::<String>())
        .unwrap_or_else(|| "(none)".into());
    let calls = user
        .lines()
        .filter(|l| l.starts_with("[tool call "))
        .count();
    let error = user
        .lines()
        .filter(|l| l.starts_with("[tool output "))
        .find(|l| l.to_ascii_lowercase().contains("error"))
        .map(|l| l.chars().take(120).collect::<String>())
        .unwrap_or_else(|| "none".into());
    let lines = [
        format!("- fake plan: continue the work ({calls} tool calls seen)"),
        format!("- fake decision: last user line seen: {last_user}"),
        "- fake workspace: see the files recorded by the proxy".to_string(),
        "- fake constraints: none stated".to_string(),
        format!("- fake errors: {error}"),
        format!("- fake next step: answer \"{last_user}\""),
    ];
    let narrative = NARRATIVE_SECTIONS
        .iter()
        .zip(lines)
        .map(|(h, l)| format!("## {h}\n{l}"))
        .collect::<Vec<_>>()
        .join("\n\n");
    Some(narrative)
}

/// A chat request whose system message carries the summarizer marker, or
/// whose last message does (a summary call repeating the conversation's
/// request with the instruction appended); an Anthropic or a Gemini
/// request that is the proxy's summary call.
pub fn is_summarizer_request(body: &Value) -> bool {
    if anthropic::is_summarizer_request(body) {
        return true;
    }
    if body.get("contents").is_some() {
        return is_summarizer_request(&super::gemini::as_chat(body));
    }
    let text =
        |m: &Value| crate::compaction::items::value_text(m.get("content").unwrap_or(&Value::Null));
    body.get("messages")
        .and_then(Value::as_array)
        .is_some_and(|messages| {
            messages
                .iter()
                .filter(|m| m.get("role").and_then(Value::as_str) == Some("system"))
                .chain(messages.last())
                .any(|m| text(m).contains(crate::compaction::summary::SUMMARIZER_MARKER))
        })
}
