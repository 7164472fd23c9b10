//! The models table: each model's window, answer budget and trigger from
//! the `[[models]]` entries, then the built-in families.

use super::schema::{Config, ModelConfig};

/// What the proxy knows about one model's limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelLimits {
    /// Context window in tokens.
    pub context_window: u64,
    /// Largest completion, in tokens.
    pub max_output_tokens: u64,
    /// Fraction of the window at which compaction triggers.
    pub trigger_ratio: f64,
    /// Most tokens at which it triggers, whatever the window (0: no cap;
    /// see [`crate::compaction::policy::trigger_tokens`]).
    pub trigger_max_tokens: u64,
}

/// Built-in defaults for common model families: (glob, window, max output).
/// Consulted after the user's `[[models]]`, so any entry there wins.
const BUILTIN_MODELS: &[(&str, u64, u64)] = &[
    ("gpt-4o*", 128_000, 16_384),
    ("chatgpt-4o*", 128_000, 16_384),
    ("gpt-4.1*", 1_047_576, 32_768),
    ("gpt-5*", 400_000, 128_000),
    ("codex-*", 400_000, 128_000),
    ("o1*", 200_000, 100_000),
    ("o3*", 200_000, 100_000),
    ("o4*", 200_000, 100_000),
    ("gpt-4-turbo*", 128_000, 4_096),
    ("gpt-4", 8_192, 4_096),
    ("gpt-3.5-turbo*", 16_385, 4_096),
    ("gpt-oss*", 131_072, 32_768),
    ("claude*", 200_000, 32_000),
    ("gemini-1.5-pro*", 2_097_152, 8_192),
    ("gemini-1.5*", 1_048_576, 8_192),
    ("gemini-2.0*", 1_048_576, 8_192),
    ("gemini*", 1_048_576, 65_536),
    ("*llama-3*", 131_072, 8_192),
    ("*qwen2.5*", 32_768, 8_192),
    ("*qwen3*", 40_960, 8_192),
    ("*mistral*", 32_768, 8_192),
    ("*deepseek*", 128_000, 8_192),
    ("*gemma*", 131_072, 8_192),
    ("*smollm2*", 8_192, 2_048),
    ("*", 128_000, 16_384),
];

impl Config {
    /// Limits of `model`. Order: the user's `[[models]]` entries (first match),
    /// then the built-in families, and only then a user entry of bare `*` —
    /// so a fallback for unknown models does not hide what is known of gpt-5.
    pub fn model_limits(&self, model: &str) -> ModelLimits {
        self.model_limits_sourced(model).0
    }

    /// [`Config::model_limits`], and whether a `[[models]]` entry gave them
    /// (rather than the built-in table).
    pub fn model_limits_sourced(&self, model: &str) -> (ModelLimits, bool) {
        let lower = model.to_ascii_lowercase();
        let builtin = BUILTIN_MODELS
            .iter()
            .find(|(p, _, _)| *p != "*" && glob_match(p, &lower))
            .map(|(_, w, o)| (*w, *o));
        let chosen = self.model_entry(model);
        if let Some(m) = chosen {
            let default_out = builtin.map(|b| b.1).unwrap_or(16_384);
            let limits = ModelLimits {
                context_window: m.context_window,
                max_output_tokens: m
                    .max_output_tokens
                    .unwrap_or_else(|| default_out.min(m.context_window / 4)),
                trigger_ratio: m.trigger_ratio.unwrap_or(self.compaction.trigger_ratio),
                trigger_max_tokens: self.compaction.trigger_max_tokens,
            };
            return (limits, true);
        }
        let (window, out) = builtin.unwrap_or((128_000, 16_384));
        let limits = ModelLimits {
            context_window: window,
            max_output_tokens: out,
            trigger_ratio: self.compaction.trigger_ratio,
            trigger_max_tokens: self.compaction.trigger_max_tokens,
        };
        (limits, false)
    }

    /// The `[[models]]` entry that gives `model`'s limits, if one does
    /// (the same order as [`Config::model_limits`]).
    pub fn model_entry(&self, model: &str) -> Option<&ModelConfig> {
        let lower = model.to_ascii_lowercase();
        let user = |fallback: bool| {
            self.models.iter().find(|m| {
                (m.pattern == "*") == fallback
                    && glob_match(&m.pattern.to_ascii_lowercase(), &lower)
            })
        };
        let builtin = BUILTIN_MODELS
            .iter()
            .any(|(p, _, _)| *p != "*" && glob_match(p, &lower));
        user(false).or(if builtin { None } else { user(true) })
    }

    /// The effective models table in the order it applies (the banner's):
    /// the user's entries, then the built-in families, then the user's bare
    /// `*` if there is one, else the built-in fallback. The first row whose
    /// pattern matches a model gives its window.
    pub fn models_table(&self) -> Vec<(String, u64, String)> {
        let row = |m: &ModelConfig| (m.pattern.clone(), m.context_window, "config".to_string());
        let builtin = |(p, w, _): &(&str, u64, u64)| (p.to_string(), *w, "built-in".to_string());
        let (fallback, named): (Vec<_>, Vec<_>) =
            self.models.iter().partition(|m| m.pattern == "*");
        let mut rows: Vec<_> = named.into_iter().map(row).collect();
        rows.extend(BUILTIN_MODELS.iter().filter(|b| b.0 != "*").map(builtin));
        match fallback.first() {
            Some(m) => rows.push(row(m)),
            None => rows.extend(BUILTIN_MODELS.iter().filter(|b| b.0 == "*").map(builtin)),
        }
        rows
    }
}

/// Glob match with `*` (any run) and `?` (one char); everything else literal.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    // Every request looks its model up in the tables several times: byte
    // by byte when both are ASCII (a byte is then a char), as the built-in
    // patterns and model names are, without collecting either.
    if pattern.is_ascii() && text.is_ascii() {
        return glob(pattern.as_bytes(), text.as_bytes(), b'*', b'?');
    }
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    glob(&p, &t, '*', '?')
}

/// [`glob_match`] over units of one kind (bytes or chars), `any` and
/// `one` its wildcards.
fn glob<T: Copy + PartialEq>(p: &[T], t: &[T], any: T, one: T) -> bool {
    let (mut pi, mut ti) = (0, 0);
    // Position of the last `*` and the text index it was tried at, for backtracking.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == one || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == any {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == any)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("gpt-4o*", "gpt-4o-mini"));
        assert!(glob_match("*", ""));
        assert!(glob_match(
            "*qwen3*",
            "Qwen/qwen3-8b".to_lowercase().as_str()
        ));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("gpt-4o*", "gpt-4.1"));
        assert!(!glob_match("gpt-4", "gpt-4o"));
        assert!(glob_match("*a*b", "xxaxxbxb"));
        // `?` is one char, not one byte, in a name that is not ASCII.
        assert!(glob_match("modèle-?", "modèle-é"));
        assert!(!glob_match("modèle-??", "modèle-é"));
        assert!(glob_match("*-?b", "x-éb"));
    }

    #[test]
    fn user_models_win_over_builtins() {
        let c = Config::from_toml(
            "[[models]]\nmatch = \"gpt-4o*\"\ncontext_window = 1000\ntrigger_ratio = 0.5\n",
        )
        .unwrap();
        let l = c.model_limits("gpt-4o");
        assert_eq!(l.context_window, 1000);
        assert_eq!(l.trigger_ratio, 0.5);
        assert_eq!(c.model_limits("gpt-5-codex").context_window, 400_000);
        assert_eq!(c.model_limits("something-new").context_window, 128_000);
        // Gemini's families, not the fallback's 128k; Gemma is not Gemini.
        assert_eq!(c.model_limits("gemini-2.5-flash").context_window, 1_048_576);
        assert_eq!(c.model_limits("gemini-2.5-pro").max_output_tokens, 65_536);
        assert_eq!(c.model_limits("gemini-2.0-flash").max_output_tokens, 8_192);
        assert_eq!(
            c.model_limits("gemini-1.5-pro-002").context_window,
            2_097_152
        );
        assert_eq!(c.model_limits("gemma-3-27b-it").context_window, 131_072);
        let c = Config::from_toml("[[models]]\nmatch = \"*\"\ncontext_window = 4096\n").unwrap();
        assert_eq!(c.model_limits("gpt-5").context_window, 400_000);
        assert_eq!(c.model_limits("my-local-model").context_window, 4096);
    }
}
