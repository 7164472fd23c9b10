//! The upstream's real context windows: learned from what its overflow
//! answers state, or discovered by asking it (vLLM's `/v1/models`
//! `max_model_len`, llama.cpp's `/props` `n_ctx`), and remembered per
//! upstream and model in the store.
//!
//! The built-in table only guesses from a model's name, and a local server
//! runs with whatever window its operator gave it; the upstream's word wins
//! over the table. A `[[models]]` entry the user wrote stays the override,
//! except that a smaller window the upstream states wins: a request must
//! fit what the upstream enforces.

use std::sync::Mutex;
use std::time::Duration;

use foldhash::{HashMap, HashSet};
use serde::Serialize;
use serde_json::Value;

use crate::config::ModelLimits;

/// Where a model's effective window came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The built-in table (a guess from the model's name).
    Table,
    /// A `[[models]]` entry.
    Config,
    /// Stated by the upstream in an overflow answer.
    Learned,
    /// Reported by the upstream when asked.
    Discovered,
}

impl Source {
    /// Name used in records, the admin API and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Table => "table",
            Source::Config => "config",
            Source::Learned => "learned",
            Source::Discovered => "discovered",
        }
    }

    /// Parses [`Source::as_str`] (the stored forms).
    pub fn parse(s: &str) -> Option<Source> {
        [
            Source::Table,
            Source::Config,
            Source::Learned,
            Source::Discovered,
        ]
        .into_iter()
        .find(|x| x.as_str() == s)
    }
}

/// A window the upstream told, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Told {
    /// The upstream's base URL.
    pub upstream: String,
    /// The model, as clients name it.
    pub model: String,
    /// Context window, tokens.
    pub window: u64,
    /// [`Source::Learned`] or [`Source::Discovered`].
    pub source: Source,
    /// Unix ms.
    pub updated_ms: i64,
}

/// Most models whose told window is kept (names come from clients).
const MAX_MODELS: usize = 1024;

/// Longest a discovery may take; the request it precedes goes on after.
pub const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(2);

/// The windows the upstream told, for this process's upstream.
#[derive(Default)]
pub struct Windows {
    told: Mutex<HashMap<String, Told>>,
    /// Models already asked about (or being asked), so each is asked once.
    asked: Mutex<HashSet<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Windows {
    /// The registry with what the store remembers of `upstream`.
    pub fn from_stored(upstream: &str, stored: Vec<Told>) -> Self {
        let me = Self::default();
        {
            let mut told = lock(&me.told);
            for t in stored.into_iter().filter(|t| t.upstream == upstream) {
                if told.len() < MAX_MODELS {
                    told.insert(t.model.clone(), t);
                }
            }
        }
        me
    }

    /// Remembers a window the upstream told; returns the record to store
    /// when it is new or changed.
    pub fn tell(
        &self,
        upstream: &str,
        model: &str,
        window: u64,
        source: Source,
        now_ms: i64,
    ) -> Option<Told> {
        let mut told = lock(&self.told);
        if told.get(model).is_some_and(|t| t.window == window) {
            return None;
        }
        if told.len() >= MAX_MODELS && !told.contains_key(model) {
            return None;
        }
        let t = Told {
            upstream: upstream.to_string(),
            model: model.to_string(),
            window,
            source,
            updated_ms: now_ms,
        };
        told.insert(model.to_string(), t.clone());
        Some(t)
    }

    /// What the upstream told of `model`, if anything.
    pub fn told(&self, model: &str) -> Option<Told> {
        lock(&self.told).get(model).cloned()
    }

    /// Every told window, by model name.
    pub fn all(&self) -> Vec<Told> {
        let mut v: Vec<Told> = lock(&self.told).values().cloned().collect();
        v.sort_by(|a, b| a.model.cmp(&b.model));
        v
    }

    /// True the first time it is called for `model`: the caller then asks
    /// the upstream.
    pub fn first_ask(&self, model: &str) -> bool {
        let mut asked = lock(&self.asked);
        if asked.len() >= MAX_MODELS {
            return false;
        }
        asked.insert(model.to_string())
    }
}

/// The effective limits of a model: the configured ones (`source`: table
/// or config) with what the upstream told applied. A told window replaces
/// the table's guess; it replaces a `[[models]]` entry only when smaller.
/// The answer's room shrinks with the window (a quarter of it at most).
pub fn effective(
    configured: ModelLimits,
    source: Source,
    told: Option<&Told>,
) -> (ModelLimits, Source) {
    let Some(t) = told else {
        return (configured, source);
    };
    if source == Source::Config && t.window >= configured.context_window {
        return (configured, source);
    }
    let limits = ModelLimits {
        context_window: t.window,
        max_output_tokens: configured.max_output_tokens.min(t.window / 4),
        trigger_ratio: configured.trigger_ratio,
        trigger_max_tokens: configured.trigger_max_tokens,
    };
    (limits, t.source)
}

/// The window a `/v1/models` answer gives `model`: vLLM's `max_model_len`,
/// llama.cpp's `meta.n_ctx`, of the entry that names it. llama.cpp serves
/// its one model under any name: its one entry (with `meta`) stands for
/// every name. Any other server's window is its named model's alone: a
/// gateway that lists one small model of its own may route other names to
/// models of any size. Gemini's listing (`models`, each entry named
/// `models/{model}`) gives the entry's `inputTokenLimit`.
pub fn window_in_models(body: &Value, model: &str) -> Option<u64> {
    let window = |w: Option<&Value>| w.and_then(Value::as_u64).filter(|&w| w > 0);
    if let Some(models) = body.get("models").and_then(Value::as_array) {
        let name = format!("models/{model}");
        let entry = models
            .iter()
            .find(|m| m.get("name").and_then(Value::as_str) == Some(name.as_str()))?;
        return window(entry.get("inputTokenLimit"));
    }
    let data = body.get("data")?.as_array()?;
    match data
        .iter()
        .find(|m| m.get("id").and_then(Value::as_str) == Some(model))
    {
        Some(entry) => window(
            entry
                .get("max_model_len")
                .or_else(|| entry.pointer("/meta/n_ctx")),
        ),
        None if data.len() == 1 => window(data[0].pointer("/meta/n_ctx")),
        None => None,
    }
}

/// The window a llama.cpp `/props` answer gives (per slot).
pub fn window_in_props(body: &Value) -> Option<u64> {
    body.pointer("/default_generation_settings/n_ctx")
        .or_else(|| body.get("n_ctx"))
        .and_then(Value::as_u64)
        .filter(|&w| w > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn table() -> ModelLimits {
        ModelLimits {
            context_window: 8192,
            max_output_tokens: 2048,
            trigger_ratio: 0.75,
            trigger_max_tokens: 0,
        }
    }

    #[test]
    fn told_windows_replace_the_table_and_only_shrink_the_config() {
        let w = Windows::default();
        assert!(w.tell("u", "smollm2", 2048, Source::Learned, 1).is_some());
        assert!(
            w.tell("u", "smollm2", 2048, Source::Learned, 2).is_none(),
            "unchanged: nothing to store"
        );
        let told = w.told("smollm2");
        let (l, s) = effective(table(), Source::Table, told.as_ref());
        assert_eq!(
            (l.context_window, l.max_output_tokens, s),
            (2048, 512, Source::Learned)
        );
        let (l, s) = effective(table(), Source::Config, told.as_ref());
        assert_eq!(
            (l.context_window, s),
            (2048, Source::Learned),
            "smaller wins"
        );
        let big = Told {
            window: 100_000,
            ..told.unwrap()
        };
        let (l, s) = effective(table(), Source::Config, Some(&big));
        assert_eq!((l, s), (table(), Source::Config), "the override stays");
        assert_eq!(
            effective(table(), Source::Table, None),
            (table(), Source::Table)
        );
    }

    #[test]
    fn stored_windows_of_another_upstream_are_ignored() {
        let t = |upstream: &str, model: &str| Told {
            upstream: upstream.into(),
            model: model.into(),
            window: 4096,
            source: Source::Discovered,
            updated_ms: 0,
        };
        let w = Windows::from_stored("a", vec![t("a", "m1"), t("b", "m2")]);
        assert!(w.told("m1").is_some());
        assert!(w.told("m2").is_none());
        assert!(w.first_ask("m1") && !w.first_ask("m1"));
    }

    #[test]
    fn discovery_answers_of_vllm_and_llama_cpp() {
        let vllm = json!({"object": "list", "data": [
            {"id": "Qwen/Qwen3-8B", "object": "model", "max_model_len": 32768},
            {"id": "other", "object": "model", "max_model_len": 4096}]});
        assert_eq!(window_in_models(&vllm, "Qwen/Qwen3-8B"), Some(32768));
        assert_eq!(window_in_models(&vllm, "missing"), None);
        let llama = json!({"object": "list", "data": [
            {"id": "smollm2", "object": "model", "meta": {"n_ctx": 2048, "n_ctx_train": 8192}}]});
        assert_eq!(window_in_models(&llama, "anything"), Some(2048));
        let gateway = json!({"object": "list", "data": [
            {"id": "small-local", "object": "model", "max_model_len": 2048}]});
        assert_eq!(window_in_models(&gateway, "small-local"), Some(2048));
        assert_eq!(window_in_models(&gateway, "gpt-4o"), None, "not its model");
        let openai = json!({"object": "list", "data": [{"id": "gpt-4o", "object": "model"}]});
        assert_eq!(window_in_models(&openai, "gpt-4o"), None);
        let gemini = json!({"models": [
            {"name": "models/gemini-2.5-flash", "inputTokenLimit": 1_048_576, "outputTokenLimit": 65_536},
            {"name": "models/gemma-3-4b-it", "inputTokenLimit": 32_768}], "nextPageToken": "x"});
        assert_eq!(window_in_models(&gemini, "gemma-3-4b-it"), Some(32_768));
        assert_eq!(
            window_in_models(&gemini, "gemini-2.5-pro"),
            None,
            "not listed"
        );
        let props = json!({"default_generation_settings": {"n_ctx": 2048}, "total_slots": 1});
        assert_eq!(window_in_props(&props), Some(2048));
        assert_eq!(window_in_props(&json!({})), None);
    }
}
