//! Plan and todo tools (`update_plan`, `TodoWrite`, …): recognised by name,
//! rendered one step per line with its status verbatim.

use serde_json::Value;

use super::text::{name_words, str_field};

pub(super) fn is_plan_tool(name: &str) -> bool {
    let words = name_words(name);
    let joined: String = words.concat();
    (joined.contains("todo") && !words.iter().any(|w| w == "read"))
        || matches!(
            joined.as_str(),
            "updateplan" | "setplan" | "createplan" | "plan" | "writeplan"
        )
}

/// A plan/todo call's arguments, rendered one step per line with its status
/// kept verbatim: `- [in_progress] Fix the cookie expiry`.
pub(super) fn render_plan(args: &Value) -> String {
    let args = match args {
        Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        v => v.clone(),
    };
    let mut out: Vec<String> = Vec::new();
    if let Some(e) =
        str_field(&args, &["explanation", "summary", "title"]).filter(|e| !e.trim().is_empty())
    {
        out.push(e.trim().to_string());
    }
    let list = ["plan", "todos", "items", "steps", "tasks", "todoList"]
        .iter()
        .find_map(|k| args.get(*k).and_then(Value::as_array))
        .or_else(|| args.as_array());
    match list {
        Some(list) => {
            for entry in list {
                let text = match entry {
                    Value::String(s) => s.clone(),
                    e => str_field(
                        e,
                        &[
                            "step",
                            "content",
                            "description",
                            "title",
                            "task",
                            "text",
                            "name",
                        ],
                    )
                    .map(String::from)
                    .unwrap_or_else(|| e.to_string()),
                };
                let status = str_field(entry, &["status", "state"])
                    .map(String::from)
                    .or_else(|| {
                        entry
                            .get("completed")
                            .or_else(|| entry.get("done"))
                            .and_then(Value::as_bool)
                            .map(|d| {
                                if d {
                                    "completed".into()
                                } else {
                                    "pending".into()
                                }
                            })
                    });
                out.push(match status {
                    Some(s) => format!("- [{s}] {text}"),
                    None => format!("- {text}"),
                });
            }
        }
        None => match &args {
            Value::String(s) => out.push(s.clone()),
            Value::Object(o) => match o.get("plan").and_then(Value::as_str) {
                Some(p) => out.push(p.to_string()),
                None => out.push(args.to_string()),
            },
            Value::Null => {}
            other => out.push(other.to_string()),
        },
    }
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use crate::compaction::summary::testing::*;
    use crate::compaction::summary::*;
    use serde_json::json;

    #[test]
    fn plan_tools_rendered_with_statuses_latest_wins() {
        let plan1 = json!({"explanation": "start", "plan": [{"step": "Reproduce", "status": "in_progress"}, {"step": "Fix cookie", "status": "pending"}]});
        let plan2 = json!({"plan": [{"step": "Reproduce", "status": "completed"}, {"step": "Fix cookie", "status": "in_progress"}]});
        let part = vec![
            fc("1", "update_plan", plan1),
            fco("1", "Plan updated"),
            fc("2", "update_plan", plan2),
            fco("2", "Plan updated"),
        ];
        let f = extract_facts(&part, None);
        assert_eq!(
            f.plan.as_deref(),
            Some("- [completed] Reproduce\n- [in_progress] Fix cookie")
        );
        // Claude Code's TodoWrite, chat shape.
        let todo = json!({"todos": [{"content": "Write tests", "status": "pending", "activeForm": "Writing tests"}]});
        let f2 = extract_facts(
            &[chat_call("t", "TodoWrite", todo), chat_out("t", "ok")],
            Some(&f),
        );
        assert_eq!(f2.plan.as_deref(), Some("- [pending] Write tests"));
        let f3 = extract_facts(&[json!({"role": "user", "content": "more"})], Some(&f2));
        assert_eq!(f3.plan, f2.plan, "no newer plan: kept");
    }
}
