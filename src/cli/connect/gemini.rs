//! `connect gemini-cli`: Gemini CLI's user `settings.json` with API-key
//! auth (the only kind that honours `GOOGLE_GEMINI_BASE_URL`), the model,
//! and the compression threshold that places its own compression by the
//! window the proxy uses.
//!
//! Gemini CLI reads its base URL from the environment only (no setting
//! names it), so the file cannot point it at the proxy: the variable is
//! set by `compactor run -- gemini`, or by the user.
//!
//! Its window is not a setting either: it assumes 1,048,576 tokens for
//! every model (256,000 for Gemma 4) and compresses its history once the
//! last prompt's reported tokens reach `model.compressionThreshold` (a
//! share, 0.5 by default) of that. The share written is chosen so that
//! point falls where the proxy's window says it should: half the real
//! window when the proxy only observes (Gemini CLI's own default share, of
//! the real window); a quarter above the real window when the proxy
//! compacts, which keeps every prompt below the window, so Gemini CLI's
//! compression is never reached and the proxy's is the only one.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::{json, Value};

use super::agents::{json_object, object_at, pretty};
use super::target::{anthropic_base_url, env_dir, Target};

/// The variable Gemini CLI reads its Gemini API base URL from (the origin:
/// it appends `/v1beta/models/…` itself).
pub const BASE_URL_VAR: &str = "GOOGLE_GEMINI_BASE_URL";

/// The auth type under which Gemini CLI sends `GEMINI_API_KEY` to
/// [`BASE_URL_VAR`].
pub const AUTH_TYPE: &str = "gemini-api-key";

/// The preset Gemini CLI's own compression uses for a model it has no
/// preset of its own for (in `modelConfigs.customAliases`).
const COMPRESSION_ALIAS: &str = "chat-compression-default";

/// Gemini CLI's own compression share, used when the proxy only observes.
const OWN_SHARE: f64 = 0.5;

/// Where the compression point goes, as a share of the real window, when
/// the proxy compacts: past the window, which no prompt reaches.
const PAST_THE_WINDOW: f64 = 1.25;

/// Gemini CLI's user settings: `$GEMINI_CLI_HOME/.gemini/settings.json`,
/// else `~/.gemini/settings.json`.
pub fn settings_file() -> Option<PathBuf> {
    env_dir("GEMINI_CLI_HOME")
        .or_else(dirs::home_dir)
        .map(|h| h.join(".gemini/settings.json"))
}

/// The window Gemini CLI assumes for `model` whatever the server says
/// (its `tokenLimit`, 0.61): 256,000 for the Gemma 4 models, 1,048,576 for
/// every other name.
pub fn assumed_window(model: &str) -> u64 {
    match model {
        "gemma-4-31b-it" | "gemma-4-26b-a4b-it" => 256_000,
        _ => 1_048_576,
    }
}

/// The `model.compressionThreshold` that puts Gemini CLI's compression at
/// the point the proxy's `window` calls for (see the module's header):
/// half of it when `proxy_compacts` is false, a quarter past it when true.
/// Not rounded: Gemini CLI multiplies it back by the window it assumes,
/// which gives the point meant (exactly, for 1,048,576, a power of two).
pub fn compression_threshold(model: &str, window: u64, proxy_compacts: bool) -> f64 {
    let share = if proxy_compacts {
        PAST_THE_WINDOW
    } else {
        OWN_SHARE
    };
    share * window as f64 / assumed_window(model) as f64
}

/// The tokens of the last prompt at which Gemini CLI compresses, given
/// `threshold` for `model`.
fn compression_point(model: &str, threshold: f64) -> u64 {
    (threshold * assumed_window(model) as f64).round() as u64
}

/// Gemini CLI's `settings.json`: `security.auth.selectedType` API-key
/// auth, `model.name`, `model.compressionThreshold` from the window and
/// whether the proxy compacts, and the model its own compression calls;
/// every other key kept in its place.
pub fn settings(existing: Option<&str>, t: &Target) -> anyhow::Result<String> {
    let mut doc = json_object(existing)?;
    let map = doc.as_object_mut().context("not a JSON object")?;
    let security = object_at(map, "security")?;
    object_at(security, "auth")?.insert("selectedType".into(), AUTH_TYPE.into());
    let model = object_at(map, "model")?;
    model.insert("name".into(), t.model.as_str().into());
    let threshold = compression_threshold(&t.model, t.window, t.proxy_compacts);
    model.insert(
        "compressionThreshold".into(),
        serde_json::Number::from_f64(threshold).map_or(Value::Null, Value::Number),
    );
    // Its compression of a model it has no preset for calls
    // gemini-3-pro-preview: this one calls the model written, which the
    // proxy serves.
    let aliases = object_at(object_at(map, "modelConfigs")?, "customAliases")?;
    aliases.insert(
        COMPRESSION_ALIAS.into(),
        json!({"modelConfig": {"model": t.model}}),
    );
    pretty(&doc)
}

/// What to tell the user after the file: how to start Gemini CLI through
/// the proxy, and where its own compression now sits.
pub fn how_to_use(path: &std::path::Path, t: &Target) -> String {
    let origin = anthropic_base_url(&t.base_url);
    let threshold = compression_threshold(&t.model, t.window, t.proxy_compacts);
    let point = compression_point(&t.model, threshold);
    let assumed = assumed_window(&t.model);
    let when = if t.proxy_compacts {
        format!(
            "past the {} tokens compactor uses for {}: compactor compacts and keeps every \
             prompt below that, so Gemini CLI never compresses by itself",
            t.window, t.model
        )
    } else {
        format!(
            "half the {} tokens compactor uses for {}: compactor only observes {}, so Gemini \
             CLI compresses by itself, at its own share of the real window",
            t.window, t.model, t.model
        )
    };
    format!(
        "for {}; then run `{BASE_URL_VAR}={origin} gemini`, or `compactor run -- gemini` \
         (Gemini CLI reads its base URL from the environment only; the key stays its \
         GEMINI_API_KEY)\n# Gemini CLI assumes a {assumed}-token window for every model and \
         compresses at compressionThreshold of it: {threshold} puts that at {point} tokens, {when}",
        path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(proxy_compacts: bool) -> Target {
        Target {
            base_url: "http://127.0.0.1:8787/v1".into(),
            model: "gemini-2.5-flash".into(),
            window: 131_072,
            max_output: 8_192,
            proxy_compacts,
        }
    }

    #[test]
    fn the_threshold_puts_compression_by_the_proxys_window() {
        // Half the window when the proxy observes; past it when it compacts.
        let observe = compression_threshold("gemini-2.5-flash", 131_072, false);
        assert_eq!(observe, 0.0625);
        assert_eq!(compression_point("gemini-2.5-flash", observe), 65_536);
        let compacts = compression_threshold("gemini-2.5-flash", 131_072, true);
        assert_eq!(compression_point("gemini-2.5-flash", compacts), 163_840);
        // Gemma 4 is assumed smaller, so its share is larger.
        let gemma = compression_threshold("gemma-4-31b-it", 128_000, false);
        assert_eq!(compression_point("gemma-4-31b-it", gemma), 64_000);
        // A window as large as the assumed one: the share is past 1, which
        // Gemini CLI's own check never reaches.
        assert_eq!(
            compression_threshold("gemini-2.5-pro", 1_048_576, true),
            1.25
        );
    }

    #[test]
    fn settings_keep_the_users_other_keys() {
        let old = r#"{"ui": {"theme": "Dracula"}, "model": {"maxSessionTurns": 10, "name": "gemini-2.5-pro"}, "security": {"auth": {"selectedType": "oauth-personal"}, "folderTrust": {"enabled": true}}}"#;
        let new = settings(Some(old), &target(true)).unwrap();
        let v: Value = serde_json::from_str(&new).unwrap();
        assert_eq!(v["ui"]["theme"], "Dracula");
        assert_eq!(v["model"]["maxSessionTurns"], 10);
        assert_eq!(v["model"]["name"], "gemini-2.5-flash");
        assert_eq!(v["model"]["compressionThreshold"], 0.15625);
        assert_eq!(v["security"]["auth"]["selectedType"], "gemini-api-key");
        assert_eq!(v["security"]["folderTrust"]["enabled"], true);
        assert_eq!(
            v["modelConfigs"]["customAliases"]["chat-compression-default"]["modelConfig"]["model"],
            "gemini-2.5-flash"
        );
        assert_eq!(
            settings(Some(&new), &target(true)).unwrap(),
            new,
            "idempotent"
        );
        let observed: Value =
            serde_json::from_str(&settings(Some(&new), &target(false)).unwrap()).unwrap();
        assert_eq!(observed["model"]["compressionThreshold"], 0.0625);
        assert!(settings(Some("[1]"), &target(true)).is_err());
        assert!(settings(Some(r#"{"model": 1}"#), &target(true)).is_err());
    }

    #[test]
    fn the_user_is_told_the_base_url_and_where_compression_sits() {
        let path = std::path::Path::new("settings.json");
        let said = how_to_use(path, &target(false));
        assert!(
            said.contains("GOOGLE_GEMINI_BASE_URL=http://127.0.0.1:8787 gemini"),
            "{said}"
        );
        assert!(said.contains("at 65536 tokens"), "{said}");
        assert!(said.contains("compresses by itself"), "{said}");
        let said = how_to_use(path, &target(true));
        assert!(said.contains("never compresses by itself"), "{said}");
    }
}
