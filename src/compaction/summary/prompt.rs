//! What the summarizer model is sent: the transcript (one line or paragraph
//! per item, bulky payloads cut to head and tail) and the prompt asking for
//! the six narrative sections.

use serde_json::{json, Value};

use super::calls::calls_of;
use super::labels::{NARRATIVE_SECTIONS, SUMMARIZER_MARKER};
use super::text::{head_tail, kind, role};
use crate::compaction::items::{is_summary, is_tool_output, outputs, text_of, SUMMARY_MARKER};

/// One line/paragraph of transcript per item, for the summarizer: user and
/// assistant text, tool calls with their arguments, tool outputs (head and
/// tail kept within `max_item_bytes`), previous summaries labelled as such
/// (allowed 4× the size). Reasoning and opaque compaction items are skipped.
pub fn render_transcript(part: &[Value], max_item_bytes: usize) -> Vec<String> {
    let mut out = Vec::new();
    for item in part {
        let k = kind(item);
        if matches!(k, "reasoning" | "compaction" | "compaction_trigger") {
            continue;
        }
        if is_summary(item) {
            out.push(format!(
                "[previous summary]\n{}",
                head_tail(&text_of(item), max_item_bytes.saturating_mul(4))
            ));
            continue;
        }
        if is_tool_output(item) {
            for (id, text, _) in outputs(item) {
                out.push(format!(
                    "[tool output {id}] {}",
                    head_tail(&text, max_item_bytes)
                ));
            }
            continue;
        }
        let mut lines = Vec::new();
        let r = role(item);
        if !r.is_empty() {
            let text = text_of(item);
            if !text.trim().is_empty() {
                lines.push(format!("[{r}] {}", head_tail(&text, max_item_bytes)));
            }
        }
        let calls = calls_of(item);
        for call in &calls {
            let args = match &call.args {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                v => v.to_string(),
            };
            let id = if call.id.is_empty() {
                String::new()
            } else {
                format!(" {}", call.id)
            };
            let mut line = format!(
                "[tool call {}{id}] {}",
                call.name,
                head_tail(&args, max_item_bytes)
            );
            if let Some(o) = &call.inline {
                line.push_str(if o.failed { " → failed" } else { " → done" });
            }
            lines.push(line);
        }
        if r.is_empty() && calls.is_empty() {
            // Unknown item type: its JSON minus opaque blobs.
            let mut v = item.clone();
            if let Some(o) = v.as_object_mut() {
                o.remove("encrypted_content");
            }
            lines.push(format!(
                "[{}] {}",
                if k.is_empty() { "item" } else { k },
                head_tail(&v.to_string(), max_item_bytes)
            ));
        }
        if !lines.is_empty() {
            out.push(lines.join("\n"));
        }
    }
    out
}

/// What the prompt asks for in each of [`NARRATIVE_SECTIONS`] (also how an
/// answer that only echoes the prompt is recognised).
pub(super) const SECTION_DESCRIPTIONS: [&str; 6] = [
    "the current plan or todo list, each step with its status (done / in progress / pending).",
    "choices made and why, one line each.",
    "every file created, changed or deleted, by exact path, and what it now contains or was changed to (not just \"edited X\"); commands that worked.",
    "rules and preferences the user or the environment stated.",
    "errors hit, quoted exactly, and how each was fixed, or that it is unresolved.",
    "what remains to be done, and the very next action.",
];

fn system_prompt() -> String {
    let list: String = NARRATIVE_SECTIONS
        .iter()
        .zip(SECTION_DESCRIPTIONS)
        .map(|(h, what)| format!("## {h}\n{what}\n"))
        .collect();
    format!(
        "{SUMMARIZER_MARKER}\nYou write the hand-off summary of an earlier part of a conversation between a user and an AI assistant \
(often a coding agent using tools). Another model will continue the work from your summary alone, without the transcript.\n\n\
Write exactly these sections, in this order, each under its level-2 markdown heading written exactly as shown:\n\n{list}\n\
Rules:\n\
- Preserve exact file paths, names, identifiers, commands and error strings: copy them, do not paraphrase.\n\
- Never invent anything that is not in the transcript or the previous summary. If a section has nothing, write \"none\".\n\
- Be concise: short bullet lines. The proxy itself attaches the original task verbatim, file contents, the exact error list \
and the tool-call log, so do not copy long code or logs and do not restate the task.\n\
- Start directly with \"## {}\". No preamble, no closing remarks.\n",
        NARRATIVE_SECTIONS[0]
    )
}

/// The user message a summary call appends to the request the upstream
/// last saw (see `engine::summarizer`), so that everything before it is
/// read from the upstream's prompt cache: the summarizer's instructions
/// (carrying [`SUMMARIZER_MARKER`]), asked of the conversation above; with
/// `continuing`, of what follows its last summary (the new summary is
/// appended after the earlier ones, see [`crate::compaction::append`]).
pub fn cached_instruction(continuing: bool) -> String {
    let what = if continuing {
        format!(
            "The transcript is this conversation after its last message that starts \
\"{SUMMARY_MARKER}\": the summaries above already cover what came before it. Write the \
hand-off summary of what came after that summary only"
        )
    } else {
        "The transcript is this conversation, everything above this message. Write the hand-off \
summary of it"
            .to_string()
    };
    format!(
        "{}
{what} now, as text: call no tool, and do not continue the work.",
        system_prompt()
    )
}

/// The chat `messages` for one summarizer call: the system prompt (carrying
/// [`SUMMARIZER_MARKER`]) and a user message with the previous summary, when
/// chunking or re-compacting, and the transcript chunk.
pub fn summarizer_messages(previous_summary: Option<&str>, transcript: &str) -> Vec<Value> {
    let user = match previous_summary.filter(|s| !s.trim().is_empty()) {
        Some(prev) => format!(
            "Here is the summary so far:\n\n<previous_summary>\n{}\n</previous_summary>\n\n\
Update this summary with the new transcript below: keep what is still true, revise what changed, add what is new. \
Answer with the complete updated summary.\n\n<transcript>\n{}\n</transcript>",
            prev.trim(),
            transcript
        ),
        None => format!("Summarize this transcript.\n\n<transcript>\n{transcript}\n</transcript>"),
    };
    vec![
        json!({"role": "system", "content": system_prompt()}),
        json!({"role": "user", "content": user}),
    ]
}

/// The messages of a retry after an answer that lacked `missing`: the same
/// request, with the user message saying which sections were missing.
pub fn retry_messages(
    previous_summary: Option<&str>,
    transcript: &str,
    missing: &[&str],
) -> Vec<Value> {
    let mut m = summarizer_messages(previous_summary, transcript);
    let list = missing
        .iter()
        .map(|h| format!("## {h}"))
        .collect::<Vec<_>>()
        .join(", ");
    let note = format!(
        "\n\nYour previous answer lacked these sections: {list}. Answer again with all six sections, \
each under its heading written exactly as shown, with what the transcript says (\"none\" if nothing), \
not the description of the section."
    );
    if let Some(Value::String(u)) = m.get_mut(1).and_then(|u| u.get_mut("content")) {
        u.push_str(&note);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::items::{user_message, SUMMARY_MARKER};
    use crate::compaction::summary::testing::*;
    use crate::compaction::summary::*;
    use serde_json::json;

    #[test]
    fn transcript_renders_both_shapes() {
        let big = format!("HEAD{}TAIL", "x".repeat(5000));
        let part = vec![
            json!({"role": "user", "content": "hello"}),
            chat_call("c1", "read_file", json!({"path": "a.py"})),
            chat_out("c1", &big),
            json!({"type": "reasoning", "encrypted_content": "SECRET"}),
            fc("f1", "exec_command", json!({"cmd": "ls"})),
            fco("f1", "README.md"),
            json!({"type": "custom_tool_call", "call_id": "p", "name": "apply_patch", "input": AUTH_PATCH}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}),
            user_message(format!("{SUMMARY_MARKER} of 3 earlier items]\n## TASK\nx")),
            json!({"type": "web_search_call", "id": "ws", "status": "completed", "action": {"type": "search", "query": "rust"}}),
        ];
        let t = render_transcript(&part, 200);
        assert_eq!(t.len(), 9, "{t:#?}");
        assert_eq!(t[0], "[user] hello");
        assert_eq!(t[1], "[tool call read_file c1] {\"path\":\"a.py\"}");
        assert!(
            t[2].starts_with("[tool output c1] HEAD") && t[2].ends_with("TAIL") && t[2].len() < 300,
            "{}",
            t[2]
        );
        assert!(t[2].contains("bytes elided"));
        assert!(!t.iter().any(|l| l.contains("SECRET")));
        assert_eq!(t[3], "[tool call exec_command f1] {\"cmd\":\"ls\"}");
        assert_eq!(t[4], "[tool output f1] README.md");
        assert!(t[5].starts_with("[tool call apply_patch p] *** Begin Patch"));
        assert_eq!(t[6], "[assistant] done");
        assert!(t[7].starts_with("[previous summary]\n[compactor summary of 3"));
        assert!(
            t[8].starts_with("[tool call web_search_call] {") && t[8].ends_with("→ done"),
            "{}",
            t[8]
        );
    }

    #[test]
    fn summarizer_prompt_has_marker_sections_and_previous_summary() {
        let m = summarizer_messages(None, "[user] hi");
        assert_eq!(m.len(), 2);
        assert_eq!(m[0]["role"], "system");
        let sys = m[0]["content"].as_str().unwrap();
        assert!(sys.contains(SUMMARIZER_MARKER));
        for h in NARRATIVE_SECTIONS {
            assert!(sys.contains(&format!("## {h}\n")), "{h}");
        }
        assert!(sys.contains("exact") && sys.contains("Never invent"));
        let u = m[1]["content"].as_str().unwrap();
        assert!(u.contains("[user] hi") && !u.contains("previous_summary"));
        let m2 = summarizer_messages(Some("## PLAN STATE\nold"), "[user] more");
        let u2 = m2[1]["content"].as_str().unwrap();
        assert!(
            u2.contains("## PLAN STATE\nold")
                && u2.contains("Update this summary")
                && u2.contains("[user] more")
        );
    }

    #[test]
    fn fake_upstream_answers_summarizer_requests() {
        use crate::fake_upstream::{auto_reply, Received, Reply};
        let items = [
            json!({"role": "user", "content": "add --verbose"}),
            fc("a", "sh", json!({"cmd": "ls"})),
        ];
        let transcript = render_transcript(&items, 100).join("\n");
        let request = |messages: Vec<Value>| Received {
            method: http::Method::POST,
            path: "/v1/chat/completions".into(),
            query: None,
            headers: Default::default(),
            body: json!({"model": "m", "messages": messages})
                .to_string()
                .into(),
        };
        let answer = |rec: &Received| match auto_reply(rec) {
            Reply::Full { body, .. } => serde_json::from_slice::<Value>(&body).unwrap(),
            other => panic!("{other:?}"),
        };
        let v = answer(&request(summarizer_messages(
            Some("## PLAN STATE\nold"),
            &transcript,
        )));
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(validate(text), Ok(()), "{text}");
        assert!(text.contains("add --verbose"));
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
        // Ordinary chat requests still get the ordinary answer.
        let plain = answer(&request(vec![json!({"role": "user", "content": "hi"})]));
        assert_eq!(
            plain["choices"][0]["message"]["content"],
            crate::fake_upstream::AUTO_TEXT
        );
    }

    #[test]
    fn a_retry_names_the_missing_sections() {
        let m = retry_messages(None, "[user] hi", &["DECISIONS", "ERRORS & FIXES"]);
        assert_eq!(m[0], summarizer_messages(None, "[user] hi")[0]);
        let u = m[1]["content"].as_str().unwrap();
        assert!(u.contains("[user] hi"));
        assert!(
            u.ends_with("not the description of the section.")
                && u.contains("lacked these sections: ## DECISIONS, ## ERRORS & FIXES."),
            "{u}"
        );
    }
}
