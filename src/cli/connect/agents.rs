//! `connect` for the coding agents that read their provider from a file of
//! their own — opencode, Qwen Code, goose: the proxy as an OpenAI-compatible
//! provider, the model, and the window the proxy uses for it.
//!
//! Each of them compacts by itself at a share of the window it is told
//! (opencode near its end, Qwen Code at 70 %, goose at 80 %). Told the real
//! window, each compacts at the right size when the proxy only observes;
//! when the proxy compacts, its trigger (by default 0.75 of the window less
//! the answer's room, at most `compaction.trigger_max_tokens`) comes first,
//! and the client's own compaction is not reached.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::{json, Value};

use super::target::{anthropic_base_url, env_dir, Target, PROVIDER};

/// `$XDG_CONFIG_HOME`, else `~/.config` (on every platform: these agents
/// follow the XDG layout on macOS too).
fn xdg_config() -> Option<PathBuf> {
    env_dir("XDG_CONFIG_HOME").or_else(|| dirs::home_dir().map(|h| h.join(".config")))
}

/// opencode's global config: `$OPENCODE_CONFIG` when it names a file, else
/// `opencode.json` in `~/.config/opencode`.
pub fn opencode_file() -> Option<PathBuf> {
    env_dir("OPENCODE_CONFIG").or_else(|| xdg_config().map(|d| d.join("opencode/opencode.json")))
}

/// Qwen Code's user settings: `~/.qwen/settings.json`.
pub fn qwen_file() -> Option<PathBuf> {
    dirs::home_dir().map(|h| h.join(".qwen/settings.json"))
}

/// goose's config: `~/.config/goose/config.yaml`.
pub fn goose_file() -> Option<PathBuf> {
    xdg_config().map(|d| d.join("goose/config.yaml"))
}

/// A JSON settings file as an object: `{}` when new or empty.
pub(super) fn json_object(existing: Option<&str>) -> anyhow::Result<Value> {
    let doc: Value = match existing {
        Some(text) if !text.trim().is_empty() => serde_json::from_str(text)
            .context("not valid JSON (comments are not kept: edit it by hand, or move it aside)")?,
        _ => json!({}),
    };
    anyhow::ensure!(doc.is_object(), "not a JSON object");
    Ok(doc)
}

/// `doc[key]` as an object, made when missing.
pub(super) fn object_at<'a>(
    doc: &'a mut serde_json::Map<String, Value>,
    key: &str,
) -> anyhow::Result<&'a mut serde_json::Map<String, Value>> {
    doc.entry(key)
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .with_context(|| format!("`{key}` is not a JSON object"))
}

pub(super) fn pretty(doc: &Value) -> anyhow::Result<String> {
    let mut text = serde_json::to_string_pretty(doc)?;
    text.push('\n');
    Ok(text)
}

/// opencode's `opencode.json`: a `compactor` provider
/// (`@ai-sdk/openai-compatible` at the proxy, the key from
/// `OPENAI_API_KEY`) whose model carries `limit.context` and
/// `limit.output`, and `model` set to it. Other providers, other models of
/// this one, and every other key stay.
pub fn opencode_config(existing: Option<&str>, t: &Target) -> anyhow::Result<String> {
    let mut doc = json_object(existing)?;
    let map = doc.as_object_mut().context("not a JSON object")?;
    if existing.is_none_or(|e| e.trim().is_empty()) {
        map.insert("$schema".into(), "https://opencode.ai/config.json".into());
    }
    let providers = object_at(map, "provider")?;
    let ours = object_at(providers, PROVIDER)?;
    ours.insert("npm".into(), "@ai-sdk/openai-compatible".into());
    ours.insert("name".into(), PROVIDER.into());
    let options = object_at(ours, "options")?;
    options.insert("baseURL".into(), t.base_url.as_str().into());
    options
        .entry("apiKey")
        .or_insert_with(|| "{env:OPENAI_API_KEY}".into());
    let models = object_at(ours, "models")?;
    let model = object_at(models, &t.model)?;
    model
        .entry("name")
        .or_insert_with(|| t.model.as_str().into());
    model.insert(
        "limit".into(),
        json!({"context": t.window, "output": t.max_output}),
    );
    map.insert("model".into(), format!("{PROVIDER}/{}", t.model).into());
    pretty(&doc)
}

/// Qwen Code's `settings.json`: an entry in `modelProviders.openai` for
/// the model at the proxy (key from `OPENAI_API_KEY`) with
/// `generationConfig.contextWindowSize`, chosen as the model, OpenAI auth
/// selected. Other providers' entries stay; an entry of this model at this
/// proxy is replaced.
pub fn qwen_settings(existing: Option<&str>, t: &Target) -> anyhow::Result<String> {
    let mut doc = json_object(existing)?;
    let map = doc.as_object_mut().context("not a JSON object")?;
    let entry = json!({
        "id": t.model,
        "name": format!("{} ({PROVIDER})", t.model),
        "baseUrl": t.base_url,
        "envKey": "OPENAI_API_KEY",
        "generationConfig": {"contextWindowSize": t.window},
    });
    let providers = object_at(map, "modelProviders")?;
    let list = providers
        .entry("openai")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .context("`modelProviders.openai` is not a JSON array")?;
    let same = |e: &Value| e["id"] == entry["id"] && e["baseUrl"] == entry["baseUrl"];
    match list.iter_mut().find(|e| same(e)) {
        Some(old) => *old = entry,
        None => list.push(entry),
    }
    object_at(map, "model")?.insert("name".into(), t.model.as_str().into());
    let security = object_at(map, "security")?;
    object_at(security, "auth")?.insert("selectedType".into(), "openai".into());
    pretty(&doc)
}

/// goose's `config.yaml`: its provider `openai` at the proxy
/// (`OPENAI_HOST`, `OPENAI_BASE_PATH`), the model, and
/// `GOOSE_CONTEXT_LIMIT`. These are keys at the file's top level; each is
/// replaced on its own line, or appended, and every other line (comments,
/// extensions) stays as it was.
pub fn goose_config(existing: Option<&str>, t: &Target) -> anyhow::Result<String> {
    let origin = anthropic_base_url(&t.base_url);
    let q = |s: &str| Value::from(s).to_string();
    let keys: [(&str, String); 5] = [
        ("GOOSE_PROVIDER", q("openai")),
        ("GOOSE_MODEL", q(&t.model)),
        ("OPENAI_HOST", q(&origin)),
        ("OPENAI_BASE_PATH", q("v1/chat/completions")),
        ("GOOSE_CONTEXT_LIMIT", t.window.to_string()),
    ];
    let mut lines: Vec<String> = existing
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    for (key, value) in keys {
        let line = format!("{key}: {value}");
        let at = lines.iter().position(|l| {
            l.strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with(':'))
        });
        match at {
            Some(i) => lines[i] = line,
            None => lines.push(line),
        }
    }
    let mut text = lines.join("\n");
    text.push('\n');
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target {
            base_url: "http://127.0.0.1:8787/v1".into(),
            model: "qwen3-coder".into(),
            window: 65_536,
            max_output: 8_192,
            proxy_compacts: true,
        }
    }

    #[test]
    fn opencode_keeps_other_providers_and_models() {
        let old = r#"{"theme": "dark", "provider": {"other": {"npm": "x"}, "compactor": {"options": {"apiKey": "{env:MINE}"}, "models": {"m2": {"name": "m2"}}}}}"#;
        let new = opencode_config(Some(old), &target()).unwrap();
        let v: Value = serde_json::from_str(&new).unwrap();
        assert_eq!(v["theme"], "dark");
        assert_eq!(v["provider"]["other"]["npm"], "x");
        let ours = &v["provider"]["compactor"];
        assert_eq!(ours["options"]["baseURL"], "http://127.0.0.1:8787/v1");
        assert_eq!(
            ours["options"]["apiKey"], "{env:MINE}",
            "the user's key setting"
        );
        assert_eq!(ours["models"]["m2"]["name"], "m2");
        assert_eq!(ours["models"]["qwen3-coder"]["limit"]["context"], 65_536);
        assert_eq!(ours["models"]["qwen3-coder"]["limit"]["output"], 8_192);
        assert_eq!(v["model"], "compactor/qwen3-coder");
        assert!(v.get("$schema").is_none(), "added to new files only");
        assert_eq!(opencode_config(Some(&new), &target()).unwrap(), new);
        assert!(opencode_config(Some("// a comment\n{}"), &target()).is_err());
    }

    #[test]
    fn qwen_replaces_only_its_own_entry() {
        let old = r#"{"modelProviders": {"openai": [{"id": "other", "baseUrl": "https://x/v1"}, {"id": "qwen3-coder", "baseUrl": "http://127.0.0.1:8787/v1", "generationConfig": {"contextWindowSize": 1}}]}, "general": {"vimMode": true}}"#;
        let new = qwen_settings(Some(old), &target()).unwrap();
        let v: Value = serde_json::from_str(&new).unwrap();
        let list = v["modelProviders"]["openai"].as_array().unwrap();
        assert_eq!(list.len(), 2, "{new}");
        assert_eq!(list[0]["id"], "other");
        assert_eq!(list[1]["generationConfig"]["contextWindowSize"], 65_536);
        assert_eq!(v["model"]["name"], "qwen3-coder");
        assert_eq!(v["security"]["auth"]["selectedType"], "openai");
        assert_eq!(v["general"]["vimMode"], true);
        assert_eq!(qwen_settings(Some(&new), &target()).unwrap(), new);
    }

    #[test]
    fn goose_replaces_its_keys_and_keeps_every_other_line() {
        let old = "# mine\nGOOSE_PROVIDER: anthropic\nextensions:\n  developer:\n    enabled: true\nGOOSE_CONTEXT_LIMIT: 4096\n";
        let new = goose_config(Some(old), &target()).unwrap();
        assert!(new.starts_with("# mine\nGOOSE_PROVIDER: \"openai\"\nextensions:\n  developer:\n    enabled: true\nGOOSE_CONTEXT_LIMIT: 65536\n"), "{new}");
        assert!(new.contains("GOOSE_MODEL: \"qwen3-coder\"\n"), "{new}");
        assert!(
            new.contains("OPENAI_HOST: \"http://127.0.0.1:8787\"\n"),
            "{new}"
        );
        assert!(
            new.contains("OPENAI_BASE_PATH: \"v1/chat/completions\"\n"),
            "{new}"
        );
        assert_eq!(goose_config(Some(&new), &target()).unwrap(), new);
    }
}
