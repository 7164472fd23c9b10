//! `compactor connect CLIENT` and `compactor run -- CMD…`: a client's
//! configuration for this proxy, so nobody has to work out which file, key
//! and window a client wants.
//!
//! `connect` prints the file's content on stdout (and where it goes on
//! stderr). With `--write` it changes the file the client reads, keeping
//! what else it holds, after showing the diff; a file that exists and would
//! change is left alone unless `--yes` says so.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::ValueEnum;
use serde_json::{json, Value};

use super::layered::layered_config;
use super::out::{print_out, said, EXIT_USAGE};
use super::reach::{admin_target, command_runtime};
use crate::config::Config;

mod agents;
mod gemini;
mod target;

pub use target::{anthropic_base_url, Target};
use target::{env_dir, PROVIDER};

/// The environment variables the OpenAI SDKs (Python, Node) read for their
/// base URL, and the older one LiteLLM and aider read.
pub const BASE_URL_VARS: [&str; 2] = ["OPENAI_BASE_URL", "OPENAI_API_BASE"];

/// A client `connect` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Client {
    /// Codex CLI: `$CODEX_HOME/config.toml` (default `~/.codex/config.toml`).
    Codex,
    /// aider: `~/.aider.model.metadata.json`, plus `OPENAI_API_BASE`.
    Aider,
    /// Simon Willison's llm: `extra-openai-models.yaml` in its user directory.
    Llm,
    /// The OpenAI SDKs and anything else that reads `OPENAI_BASE_URL`:
    /// `export` lines for a shell (`eval "$(compactor connect openai-env)"`).
    OpenaiEnv,
    /// Claude Code: `env.ANTHROPIC_BASE_URL` in its `settings.json`
    /// (`$CLAUDE_CONFIG_DIR`, default `~/.claude`).
    ClaudeCode,
    /// opencode: a `compactor` provider in `~/.config/opencode/opencode.json`
    /// (or `$OPENCODE_CONFIG`).
    Opencode,
    /// Qwen Code: a `modelProviders.openai` entry in `~/.qwen/settings.json`.
    Qwen,
    /// goose: its `openai` provider at the proxy in `~/.config/goose/config.yaml`.
    Goose,
    /// Gemini CLI: API-key auth, the model and its compression threshold in
    /// `~/.gemini/settings.json` (`$GEMINI_CLI_HOME/.gemini`); the base URL
    /// is `GOOGLE_GEMINI_BASE_URL`, which `compactor run` sets.
    GeminiCli,
}

/// Where the proxy is: the same layering as `serve`.
#[derive(Debug, clap::Args)]
pub struct ProxyArgs {
    /// Config file (TOML; see proxy.toml).
    #[arg(long, env = "COMPACTOR_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address the proxy listens on, e.g. 127.0.0.1:8787.
    #[arg(long, env = "COMPACTOR_LISTEN")]
    pub listen: Option<String>,
}

/// `compactor connect` options.
#[derive(Debug, clap::Args)]
pub struct ConnectArgs {
    /// The client to configure.
    pub client: Client,
    /// The model the client asks for (default: the upstream's only model).
    #[arg(long)]
    pub model: Option<String>,
    /// Write the configuration where the client reads it (shows the diff).
    #[arg(long)]
    pub write: bool,
    /// With --write: change a file that exists and differs.
    #[arg(long, requires = "write")]
    pub yes: bool,
    /// Do not ask the upstream for the model's window; use the models table.
    #[arg(long)]
    pub offline: bool,
    /// Upstream base URL including /v1 (to ask for models and windows).
    #[arg(long, env = "COMPACTOR_UPSTREAM")]
    pub upstream: Option<String>,
    /// Where the proxy is.
    #[command(flatten)]
    pub proxy: ProxyArgs,
}

/// `compactor run` options.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Where the proxy is.
    #[command(flatten)]
    pub proxy: ProxyArgs,
    /// The client and its arguments, after `--`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    pub command: Vec<OsString>,
}

/// The proxy's base URL as clients reach it.
pub fn proxy_base_url(config: &Config) -> anyhow::Result<String> {
    let addr = config.listen_addr().context("server.listen")?;
    Ok(format!("http://{}/v1", admin_target(addr)))
}

/// Runs `compactor connect`.
pub fn main(args: ConnectArgs) -> ExitCode {
    let config = match layered_config(
        args.proxy.config.as_deref(),
        args.proxy.listen.as_deref(),
        args.upstream.as_deref(),
        None,
    ) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("compactor: configuration error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let base_url = match proxy_base_url(&config) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("compactor: configuration error: {}", said(&e));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if args.client == Client::OpenaiEnv {
        if args.write {
            eprintln!("compactor: openai-env has no file to write; use: eval \"$(compactor connect openai-env)\"");
            return ExitCode::from(EXIT_USAGE);
        }
        return print_out(&env_lines(&base_url));
    }
    if args.client == Client::ClaudeCode {
        // Its window is written only for a model named: Claude Code picks
        // its own model otherwise, and sizes it itself.
        let model = match args.model.as_deref() {
            None => None,
            Some(m) => match target(&config, base_url.clone(), Some(m), args.offline) {
                Ok(t) => Some((t.model, t.window)),
                Err(e) => {
                    eprintln!("compactor: {}", said(&e));
                    return ExitCode::FAILURE;
                }
            },
        };
        return connect_claude_code(&base_url, model, args.write, args.yes);
    }
    let target = match target(&config, base_url, args.model.as_deref(), args.offline) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("compactor: {}", said(&e));
            return ExitCode::FAILURE;
        }
    };
    let Some(path) = client_file(args.client) else {
        eprintln!(
            "compactor: cannot tell where {:?} keeps its configuration (no home directory)",
            args.client
        );
        return ExitCode::FAILURE;
    };
    let existing = match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            eprintln!("compactor: cannot read {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    if !args.write {
        eprintln!("# {}", how_to_use(args.client, &target, &path));
        return print_out(&render(args.client, None, &target).unwrap_or_default());
    }
    let new = match render(args.client, existing.as_deref(), &target) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("compactor: {}: {}", path.display(), said(&e));
            return ExitCode::FAILURE;
        }
    };
    match write_reviewed(&path, existing.as_deref(), &new, args.yes) {
        Ok(said) => {
            let code = print_out(&said);
            eprintln!("# {}", how_to_use(args.client, &target, &path));
            code
        }
        Err(e) => {
            eprintln!("compactor: {}", said(&e));
            ExitCode::FAILURE
        }
    }
}

/// The model and its window: the table's (or `[[models]]`), or what the
/// upstream states when it can be asked.
fn target(
    config: &Config,
    base_url: String,
    model: Option<&str>,
    offline: bool,
) -> anyhow::Result<Target> {
    let runtime = command_runtime()?;
    let (model, window, max_output) =
        runtime.block_on(super::doctor::effective_window(config, model, offline))?;
    // A client's own settings are not a tenant's: the model's mode, else
    // the proxy's.
    let proxy_compacts = config.mode_for("", &model).rewrites();
    Ok(Target {
        base_url,
        model,
        window,
        max_output,
        proxy_compacts,
    })
}

/// `export` lines for a POSIX shell.
pub fn env_lines(base_url: &str) -> String {
    BASE_URL_VARS
        .iter()
        .map(|var| format!("export {var}={}\n", shell_quote(base_url)))
        .collect()
}

fn shell_quote(s: &str) -> String {
    if s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"/:._-@%+=,".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The file `client` reads its configuration from.
pub fn client_file(client: Client) -> Option<PathBuf> {
    match client {
        Client::Codex => env_dir("CODEX_HOME")
            .or_else(|| dirs::home_dir().map(|h| h.join(".codex")))
            .map(|d| d.join("config.toml")),
        Client::Aider => dirs::home_dir().map(|h| h.join(".aider.model.metadata.json")),
        Client::Llm => env_dir("LLM_USER_PATH")
            .or_else(|| dirs::config_dir().map(|d| d.join("io.datasette.llm")))
            .map(|d| d.join("extra-openai-models.yaml")),
        Client::OpenaiEnv => None,
        Client::ClaudeCode => claude_settings_file(),
        Client::Opencode => agents::opencode_file(),
        Client::Qwen => agents::qwen_file(),
        Client::Goose => agents::goose_file(),
        Client::GeminiCli => gemini::settings_file(),
    }
}

fn how_to_use(client: Client, t: &Target, path: &std::path::Path) -> String {
    let file = path.display();
    match client {
        Client::Codex => {
            format!("for {file}; then run `codex` (the provider reads OPENAI_API_KEY)")
        }
        Client::Aider => format!(
            "for {file}; then run `OPENAI_API_BASE={} aider --model openai/{}`",
            t.base_url, t.model
        ),
        Client::Llm => format!(
            "for {file}; then run `llm -m {PROVIDER}-{} 'hello'` (the key is llm's openai key)",
            t.model
        ),
        Client::OpenaiEnv => String::new(),
        Client::ClaudeCode => claude_how_to_use(path, Some(t.window)),
        Client::Opencode => format!(
            "for {file}; then run `opencode` (the provider reads OPENAI_API_KEY; model {PROVIDER}/{})",
            t.model
        ),
        Client::Qwen => {
            format!("for {file}; then run `qwen` (the entry reads OPENAI_API_KEY)")
        }
        Client::Goose => format!(
            "for {file}; then run `goose session` (its openai provider reads OPENAI_API_KEY)"
        ),
        Client::GeminiCli => gemini::how_to_use(path, t),
    }
}

/// The client's file with this proxy's entry in it: `existing` with the
/// entry added or updated, or the entry alone.
pub fn render(client: Client, existing: Option<&str>, t: &Target) -> anyhow::Result<String> {
    match client {
        Client::Codex => codex_config(existing, t),
        Client::Aider => aider_metadata(existing, t),
        Client::Llm => llm_models(existing, t),
        Client::OpenaiEnv => Ok(env_lines(&t.base_url)),
        Client::ClaudeCode => claude_settings(
            existing,
            &anthropic_base_url(&t.base_url),
            Some((t.model.as_str(), t.window)),
        ),
        Client::Opencode => agents::opencode_config(existing, t),
        Client::Qwen => agents::qwen_settings(existing, t),
        Client::Goose => agents::goose_config(existing, t),
        Client::GeminiCli => gemini::settings(existing, t),
    }
}

/// Codex's `config.toml`: the model, a provider at the proxy, and the
/// window the proxy uses (Codex's own compaction keys off it).
fn codex_config(existing: Option<&str>, t: &Target) -> anyhow::Result<String> {
    use toml_edit::{value, DocumentMut, Item, Table};
    let mut doc: DocumentMut = existing
        .unwrap_or_default()
        .parse()
        .context("not valid TOML")?;
    doc["model"] = value(t.model.as_str());
    doc["model_provider"] = value(PROVIDER);
    let window = codex_context_window(t.window);
    doc["model_context_window"] = value(i64::try_from(window).unwrap_or(i64::MAX));
    if let Some(mut key) = doc.key_mut("model_context_window") {
        key.leaf_decor_mut().set_prefix(format!(
            "# A quarter above the {} tokens compactor uses for this model: Codex compacts by\n\
             # itself at 90% of this, whatever model_auto_compact_token_limit says, and\n\
             # compactor keeps every request below the real window, so that never happens.\n",
            t.window
        ));
    }
    if !doc.contains_table("model_providers") {
        let mut providers = Table::new();
        providers.set_implicit(true);
        doc["model_providers"] = Item::Table(providers);
    }
    let mut provider = Table::new();
    provider["name"] = value(PROVIDER);
    provider["base_url"] = value(t.base_url.as_str());
    provider["env_key"] = value("OPENAI_API_KEY");
    provider["wire_api"] = value("responses");
    // Codex's default transport with OpenAI: one WebSocket per session,
    // which compactor serves on /v1/responses as it does the HTTP requests.
    provider["supports_websockets"] = value(true);
    let providers = doc["model_providers"]
        .as_table_mut()
        .context("model_providers is not a table")?;
    match providers.get_mut(PROVIDER).and_then(Item::as_table_mut) {
        // Keep the user's other keys of the entry (retries, headers).
        Some(old) => {
            for (k, v) in provider.iter() {
                old[k] = v.clone();
            }
        }
        None => {
            providers.insert(PROVIDER, Item::Table(provider));
        }
    }
    Ok(doc.to_string())
}

/// The `model_context_window` written for Codex when the proxy's window is
/// `window`. Codex 0.171 sends its own compaction request (its turn
/// metadata says `request_kind: compaction`) once a turn's reported tokens
/// reach 90% of `model_context_window`, and no value of
/// `model_auto_compact_token_limit` (above the window, 0, -1) stops it; a
/// window a quarter larger puts that point past the real window, which no
/// request through the proxy reaches.
pub fn codex_context_window(window: u64) -> u64 {
    window.saturating_add(window / 4)
}

/// aider's model metadata (LiteLLM's format): the window of
/// `openai/MODEL`, which aider uses to warn before a request is too big.
fn aider_metadata(existing: Option<&str>, t: &Target) -> anyhow::Result<String> {
    let mut doc: Value = match existing {
        Some(text) if !text.trim().is_empty() => {
            serde_json::from_str(text).context("not valid JSON")?
        }
        _ => json!({}),
    };
    let map = doc.as_object_mut().context("not a JSON object")?;
    map.insert(
        format!("openai/{}", t.model),
        json!({
            "max_input_tokens": t.window,
            "max_output_tokens": t.max_output,
            "max_tokens": t.max_output,
            "litellm_provider": "openai",
            "mode": "chat",
        }),
    );
    let mut text = serde_json::to_string_pretty(&doc)?;
    text.push('\n');
    Ok(text)
}

/// llm's `extra-openai-models.yaml` entry. Strings are written as JSON
/// strings, which YAML reads as its double-quoted scalars. An existing file
/// gets the entry appended; one that already names the model id is left
/// for a person to edit, since rewriting YAML would drop its comments.
fn llm_models(existing: Option<&str>, t: &Target) -> anyhow::Result<String> {
    let id = format!("{PROVIDER}-{}", t.model);
    let q = |s: &str| Value::from(s).to_string();
    // Without `supports_tools`, llm refuses `-T` for the model.
    let entry = format!(
        "- model_id: {}\n  model_name: {}\n  api_base: {}\n  supports_tools: true\n",
        q(&id),
        q(&t.model),
        q(&t.base_url)
    );
    let Some(text) = existing.filter(|t| !t.trim().is_empty()) else {
        return Ok(entry);
    };
    if text.contains(&entry) {
        return Ok(text.to_string());
    }
    let names_it = text.lines().any(|l| {
        l.trim_start_matches(['-', ' '])
            .strip_prefix("model_id:")
            .is_some_and(|v| v.trim().trim_matches(['"', '\'']) == id)
    });
    if names_it {
        anyhow::bail!("already has an entry for {id}; edit it to read:\n{entry}");
    }
    let mut out = text.to_string();
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(&entry);
    Ok(out)
}

/// Writes `new` to `path` after showing what changes: a new file is shown
/// whole, a changed one as a diff, which is applied only with `yes`.
/// Returns what to print.
pub fn write_reviewed(
    path: &std::path::Path,
    existing: Option<&str>,
    new: &str,
    yes: bool,
) -> anyhow::Result<String> {
    let shown = path.display().to_string();
    let said = match existing {
        Some(old) if old == new => {
            return Ok(format!("{shown} already says this; nothing to write\n"))
        }
        Some(old) => {
            let diff = similar::TextDiff::from_lines(old, new)
                .unified_diff()
                .context_radius(3)
                .header(&shown, &shown)
                .to_string();
            if !yes {
                anyhow::bail!(
                    "{shown} exists and would change:\n{diff}not written: run again with --yes to apply this"
                );
            }
            format!("{diff}wrote {shown}\n")
        }
        None => format!("{new}wrote {shown} (new file)\n"),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    // Whole or not at all: a client starting meanwhile never reads half a file.
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".compactor-new");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, new)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            anyhow::Error::new(e).context(format!("cannot write {shown}"))
        })?;
    Ok(said)
}

/// Runs `compactor run -- CMD…`: the command with the base-URL variables
/// set to this proxy, its exit status passed on.
pub fn run(args: RunArgs) -> ExitCode {
    let base_url = layered_config(
        args.proxy.config.as_deref(),
        args.proxy.listen.as_deref(),
        None,
        None,
    )
    .map_err(anyhow::Error::from)
    .and_then(|c| proxy_base_url(&c));
    let base_url = match base_url {
        Ok(u) => u,
        Err(e) => {
            eprintln!("compactor: configuration error: {}", said(&e));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let Some((program, rest)) = args.command.split_first() else {
        eprintln!("compactor run: name a command after --");
        return ExitCode::from(EXIT_USAGE);
    };
    let mut cmd = std::process::Command::new(program);
    cmd.args(rest);
    for var in BASE_URL_VARS {
        cmd.env(var, &base_url);
    }
    cmd.env(ANTHROPIC_BASE_URL_VAR, anthropic_base_url(&base_url));
    cmd.env(gemini::BASE_URL_VAR, anthropic_base_url(&base_url));
    let shown = program.to_string_lossy();
    // The client takes over this process: signals (Ctrl-C) and the exit
    // status are its own.
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let e = cmd.exec();
        eprintln!("compactor run: cannot run {shown}: {e}");
        ExitCode::from(127)
    }
    #[cfg(not(unix))]
    match cmd.status() {
        Ok(s) => ExitCode::from(s.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(1)),
        Err(e) => {
            eprintln!("compactor run: cannot run {shown}: {e}");
            ExitCode::from(127)
        }
    }
}

/// The variable Claude Code and the Anthropic SDKs read for their base URL.
pub const ANTHROPIC_BASE_URL_VAR: &str = "ANTHROPIC_BASE_URL";

/// Claude Code's user `settings.json`: in `$CLAUDE_CONFIG_DIR`, which it
/// reads instead of `~/.claude` when set.
fn claude_settings_file() -> Option<PathBuf> {
    env_dir("CLAUDE_CONFIG_DIR")
        .or_else(|| dirs::home_dir().map(|h| h.join(".claude")))
        .map(|d| d.join("settings.json"))
}

/// The variable Claude Code reads for the window its own compaction keys
/// off (it compacts about 13k tokens before it). It takes no value below
/// [`CLAUDE_WINDOW_FLOOR`].
pub const CLAUDE_WINDOW_VAR: &str = "CLAUDE_CODE_AUTO_COMPACT_WINDOW";

/// The smallest window Claude Code takes from [`CLAUDE_WINDOW_VAR`].
pub const CLAUDE_WINDOW_FLOOR: u64 = 100_000;

fn claude_how_to_use(path: &std::path::Path, window: Option<u64>) -> String {
    let mut said = format!(
        "for {}; then run `claude` (it sets its `env` entries itself; the key stays its own)",
        path.display()
    );
    if let Some(w) = window.filter(|w| *w < CLAUDE_WINDOW_FLOOR) {
        said.push_str(&format!(
            "\n# Claude Code takes no {CLAUDE_WINDOW_VAR} below {CLAUDE_WINDOW_FLOOR}: with a \
             {w}-token window its own compaction comes too late, and the proxy's compaction \
             (and its retry of a refused request) keeps every request inside the window"
        ));
    }
    said
}

/// Claude Code's `settings.json` with `env.ANTHROPIC_BASE_URL` at the
/// proxy (and, when a model is named, `model` and the window the proxy
/// uses for it as `env.CLAUDE_CODE_AUTO_COMPACT_WINDOW`), every other key
/// kept in its place.
fn claude_settings(
    existing: Option<&str>,
    origin: &str,
    model: Option<(&str, u64)>,
) -> anyhow::Result<String> {
    let mut doc: Value = match existing {
        Some(text) if !text.trim().is_empty() => {
            serde_json::from_str(text).context("not valid JSON")?
        }
        _ => json!({}),
    };
    let map = doc.as_object_mut().context("not a JSON object")?;
    let env = map.entry("env").or_insert_with(|| json!({}));
    let env = env.as_object_mut().context("`env` is not a JSON object")?;
    env.insert(ANTHROPIC_BASE_URL_VAR.into(), Value::from(origin));
    if let Some((_, window)) = model {
        // Claude Code reads its `env` values as strings.
        env.insert(CLAUDE_WINDOW_VAR.into(), Value::from(window.to_string()));
    }
    if let Some((model, _)) = model {
        map.insert("model".into(), Value::from(model));
    }
    let mut text = serde_json::to_string_pretty(&doc)?;
    text.push('\n');
    Ok(text)
}

/// `compactor connect claude-code`: the base URL, and for a named model
/// (`model`: its name and the window the proxy uses for it) the model and
/// the window Claude Code's own compaction keys off.
fn connect_claude_code(
    base_url: &str,
    model: Option<(String, u64)>,
    write: bool,
    yes: bool,
) -> ExitCode {
    let window = model.as_ref().map(|(_, w)| *w);
    let model = model.as_ref().map(|(m, w)| (m.as_str(), *w));
    let Some(path) = claude_settings_file() else {
        eprintln!(
            "compactor: cannot tell where Claude Code keeps its settings (no home directory)"
        );
        return ExitCode::FAILURE;
    };
    let origin = anthropic_base_url(base_url);
    if !write {
        eprintln!("# {}", claude_how_to_use(&path, window));
        return print_out(&claude_settings(None, &origin, model).unwrap_or_default());
    }
    let existing = match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            eprintln!("compactor: cannot read {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    let new = match claude_settings(existing.as_deref(), &origin, model) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("compactor: {}: {}", path.display(), said(&e));
            return ExitCode::FAILURE;
        }
    };
    match write_reviewed(&path, existing.as_deref(), &new, yes) {
        Ok(said) => {
            let code = print_out(&said);
            eprintln!("# {}", claude_how_to_use(&path, window));
            code
        }
        Err(e) => {
            eprintln!("compactor: {}", said(&e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target {
            base_url: "http://127.0.0.1:8787/v1".into(),
            model: "gpt-4o".into(),
            window: 128_000,
            max_output: 16_384,
            proxy_compacts: true,
        }
    }

    #[test]
    fn codex_keeps_the_users_other_settings_and_comments() {
        let old = "# mine\napproval_policy = \"never\"\nmodel = \"o3\"\n\n[model_providers.other]\nname = \"x\"\n\n[model_providers.compactor]\nstream_max_retries = 0\n";
        let new = codex_config(Some(old), &target()).unwrap();
        let doc: toml::Table = toml::from_str(&new).unwrap();
        assert!(new.starts_with("# mine\n"), "{new}");
        assert_eq!(doc["approval_policy"].as_str(), Some("never"));
        assert_eq!(doc["model"].as_str(), Some("gpt-4o"));
        assert_eq!(doc["model_context_window"].as_integer(), Some(160_000));
        let providers = doc["model_providers"].as_table().unwrap();
        assert_eq!(providers["other"]["name"].as_str(), Some("x"));
        let ours = providers["compactor"].as_table().unwrap();
        assert_eq!(ours["base_url"].as_str(), Some("http://127.0.0.1:8787/v1"));
        assert_eq!(ours["stream_max_retries"].as_integer(), Some(0));
        assert_eq!(ours["supports_websockets"].as_bool(), Some(true));
        assert_eq!(
            codex_config(Some(&new), &target()).unwrap(),
            new,
            "idempotent"
        );
    }

    #[test]
    fn aider_keeps_other_models() {
        let old = r#"{"openai/other": {"max_input_tokens": 5}}"#;
        let new: Value =
            serde_json::from_str(&aider_metadata(Some(old), &target()).unwrap()).unwrap();
        assert_eq!(new["openai/other"]["max_input_tokens"], 5);
        assert_eq!(new["openai/gpt-4o"]["max_input_tokens"], 128_000);
        assert!(aider_metadata(Some("[1]"), &target()).is_err());
    }

    #[test]
    fn llm_appends_and_refuses_to_rewrite_an_entry_of_its_own_id() {
        let first = llm_models(None, &target()).unwrap();
        assert_eq!(llm_models(Some(&first), &target()).unwrap(), first);
        let other = "# mine\n- model_id: local\n  model_name: x\n";
        let both = llm_models(Some(other), &target()).unwrap();
        assert!(both.starts_with(other) && both.ends_with(&first), "{both}");
        let stale =
            "- model_id: compactor-gpt-4o\n  model_name: gpt-4o\n  api_base: http://old/v1\n";
        let err = llm_models(Some(stale), &target()).unwrap_err().to_string();
        assert!(err.contains("already has an entry"), "{err}");
    }

    #[test]
    fn env_lines_quote_what_a_shell_would_split() {
        assert_eq!(
            env_lines("http://127.0.0.1:8787/v1"),
            "export OPENAI_BASE_URL=http://127.0.0.1:8787/v1\nexport OPENAI_API_BASE=http://127.0.0.1:8787/v1\n"
        );
        assert_eq!(shell_quote("a b'c"), r"'a b'\''c'");
    }

    #[test]
    fn claude_settings_keep_the_users_other_keys_and_env() {
        let old = r#"{"permissions": {"allow": ["Bash"]}, "env": {"DISABLE_TELEMETRY": "1", "ANTHROPIC_BASE_URL": "http://old"}, "theme": "dark"}"#;
        let new = claude_settings(Some(old), "http://127.0.0.1:8787", None).unwrap();
        let v: Value = serde_json::from_str(&new).unwrap();
        assert_eq!(v["env"]["ANTHROPIC_BASE_URL"], "http://127.0.0.1:8787");
        assert_eq!(v["env"]["DISABLE_TELEMETRY"], "1");
        assert_eq!(v["permissions"]["allow"][0], "Bash");
        assert_eq!(keys_of(&v), ["permissions", "env", "theme"], "in place");
        assert!(v.get("model").is_none(), "no model unless named");
        assert_eq!(
            claude_settings(Some(&new), "http://127.0.0.1:8787", None).unwrap(),
            new,
            "idempotent"
        );
        assert!(claude_settings(Some("[1]"), "x", None).is_err());
        assert!(claude_settings(Some(r#"{"env": 1}"#), "x", None).is_err());
        assert_eq!(
            anthropic_base_url("http://127.0.0.1:8787/v1"),
            "http://127.0.0.1:8787"
        );
    }

    fn keys_of(v: &Value) -> Vec<&str> {
        v.as_object().unwrap().keys().map(String::as_str).collect()
    }

    #[test]
    fn a_changed_file_is_written_only_with_yes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/c.toml");
        let said = write_reviewed(&path, None, "a = 1\n", false).unwrap();
        assert!(said.contains("new file"), "{said}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a = 1\n");
        let err = write_reviewed(&path, Some("a = 1\n"), "a = 2\n", false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("-a = 1") && err.contains("+a = 2") && err.contains("--yes"),
            "{err}"
        );
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "a = 1\n",
            "untouched"
        );
        write_reviewed(&path, Some("a = 1\n"), "a = 2\n", true).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a = 2\n");
        let said = write_reviewed(&path, Some("a = 2\n"), "a = 2\n", false).unwrap();
        assert!(said.contains("nothing to write"), "{said}");
    }
}
