//! `compactor serve` and `compactor demo`: start-up, logging, the banner,
//! `--check-config`, shutdown.

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context as _;

use super::args::{DemoArgs, LogFormat, ServeArgs};
use super::layered::ConfigArgs;
use super::out::{said, EXIT_USAGE};
use super::render::table;
use crate::app::AppState;
use crate::config::Config;
use crate::server;

/// What `--check-config` prints: every effective setting, where it came
/// from, secrets masked.
pub(super) fn check_config(args: &ConfigArgs, config: &Config) -> String {
    use crate::config::Origin;
    // clap takes a flag over its variable: a value equal to the variable's
    // came from it unless the flag said the same.
    let origin = |flag: &'static str, var: &str, value: Option<String>| {
        let value = value?;
        let from_env = std::env::var(var).is_ok_and(|v| v == value)
            && !std::env::args().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
        Some(if from_env {
            Origin::Env(var.to_string())
        } else {
            Origin::Flag(flag)
        })
    };
    let given: Vec<(&str, Origin)> = [
        (
            "server.listen",
            origin("--listen", "COMPACTOR_LISTEN", args.listen.clone()),
        ),
        (
            "upstream.base_url",
            origin("--upstream", "COMPACTOR_UPSTREAM", args.upstream.clone()),
        ),
        (
            "store.path",
            origin(
                "--db",
                "COMPACTOR_DB",
                args.db.as_ref().map(|d| d.display().to_string()),
            ),
        ),
        (
            "store.url",
            origin(
                "--database-url",
                "COMPACTOR_DATABASE_URL",
                args.database_url.clone(),
            ),
        ),
    ]
    .into_iter()
    .filter_map(|(k, o)| Some((k, o?)))
    .collect();
    let path = crate::config::file_in_effect(args.config.as_deref());
    let file = path
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| t.parse::<toml::Table>().ok());
    let mut out = String::from("configuration OK\n");
    if let Some(path) = &path {
        let how = match &args.config {
            Some(named) => origin(
                "--config",
                "COMPACTOR_CONFIG",
                Some(named.display().to_string()),
            )
            .map(|o| o.to_string())
            .unwrap_or_default(),
            None => "found in the working directory".to_string(),
        };
        out.push_str(&format!("  config file: {} ({how})\n", path.display()));
    }
    if config.store.is_postgres() {
        out.push_str(&format!("  database: {}\n", config.store.shown_url()));
    } else {
        out.push_str(&format!(
            "  store file: {}\n",
            config.store_path().display()
        ));
    }
    let settings = config.settings(file.as_ref(), &given);
    let rows: Vec<Vec<String>> = settings
        .into_iter()
        .map(|s| vec![s.key, s.value, s.origin.to_string()])
        .collect();
    let table = table(
        &[("SETTING", false), ("VALUE", false), ("FROM", false)],
        &rows,
    );
    for line in table.lines() {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

pub(super) fn demo(args: DemoArgs) -> ExitCode {
    // Only real warnings: the demo's own lines tell the story.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    let opts = crate::demo::DemoOptions {
        requests: args.requests,
        window: args.window,
        store: args.db,
        pause: std::time::Duration::from_millis(args.pause_ms),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("compactor: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut out = std::io::stdout();
    match runtime.block_on(crate::demo::run_and_print(opts, &mut out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("compactor demo: {}", said(&e));
            ExitCode::FAILURE
        }
    }
}

pub(super) fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for a person watching: a redirected log gets no escape codes.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Pretty => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

pub(super) fn serve(args: ServeArgs) -> ExitCode {
    // The server-side key's variable is checked with the rest, so that
    // `--check-config` does not pass what `serve` then refuses.
    let config = match args
        .load_config()
        .and_then(|c| c.upstream.api_key().map(|_| c))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("compactor: configuration error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if args.check_config {
        print!("{}", check_config(&args.settings, &config));
        if config.store.is_postgres() {
            return check_database(&config);
        }
        return ExitCode::SUCCESS;
    }
    init_logging(args.log_format);
    match (&args.settings.config, crate::config::file_in_effect(None)) {
        (Some(named), _) => tracing::info!(config = %named.display(), "configuration file"),
        (None, Some(found)) => tracing::info!(
            config = %found.display(),
            "configuration file found in the working directory (--config or COMPACTOR_CONFIG names another)"
        ),
        (None, None) => tracing::info!(
            "no configuration file (--config, COMPACTOR_CONFIG or ./{}): built-in defaults, flags and environment",
            crate::config::FOUND_CONFIG
        ),
    }
    let runtime = match crate::server::runtime_builder().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("compactor: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve_async(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("compactor: {}", said(&e));
            ExitCode::FAILURE
        }
    }
}

pub(super) async fn serve_async(config: Config) -> anyhow::Result<()> {
    let addr = config.listen_addr()?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    server::raise_open_file_limit(config.server.max_connections);
    let state = AppState::open(config)?;
    if let Some(days) = state.config.store.retain_days {
        tokio::spawn(crate::admin::retention_loop(state.clone(), days));
    }
    banner(&state, listener.local_addr()?);
    admin_notice(&state.config);
    tokio::spawn(upstream_notice(state.clone()));
    server::run(listener, state, shutdown_signal()).await;
    Ok(())
}

pub(super) fn banner(state: &AppState, addr: std::net::SocketAddr) {
    let c = &state.config;
    let models: Vec<String> = c
        .models_table()
        .into_iter()
        .map(|(pattern, window, source)| format!("{pattern}={window} ({source})"))
        .collect();
    // Windows the upstream told in earlier runs, which replace the table's.
    let told: Vec<String> = state
        .models_seen()
        .into_iter()
        .map(|(model, window, source)| format!("{model}={window} ({source})"))
        .collect();
    tracing::info!(
        listen = %addr,
        upstream = %crate::config::shown_url(state.upstream.base()),
        store = %c.store.shown(&c.store_path()),
        trigger_ratio = c.compaction.trigger_ratio,
        warn_ratio = c.compaction.warn_ratio,
        models = %models.join(", "),
        windows_told = %told.join(", "),
        "compactor listening"
    );
}

/// `--check-config` with a PostgreSQL store: connects, and says whether
/// the schema is current (`serve` brings it up to date at start-up).
pub(super) fn check_database(config: &Config) -> ExitCode {
    match crate::store::schema_status(config) {
        Ok(s) if s.is_current() => {
            println!(
                "  database: reachable, schema current (version {})",
                s.applied
            );
            ExitCode::SUCCESS
        }
        Ok(s) => {
            println!(
                "  database: reachable, schema at version {} of {} (serve migrates it at start-up)",
                s.applied, s.latest
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "compactor: cannot reach the database {}: {e}",
                config.store.shown_url()
            );
            ExitCode::FAILURE
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Says at start-up, as a warning, when the upstream cannot be reached: a
/// TCP connection to its host and port, for at most 5 s, and no request (a
/// request would count against the upstream, and a scripted one would take
/// an answer meant for a client). Left out when an HTTP proxy variable is
/// set, since the connection would then go through it. The proxy serves
/// either way: the upstream may come up later.
async fn upstream_notice(state: std::sync::Arc<AppState>) {
    let proxied = [
        "HTTPS_PROXY",
        "https_proxy",
        "HTTP_PROXY",
        "http_proxy",
        "ALL_PROXY",
        "all_proxy",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()));
    let Ok(base) = reqwest::Url::parse(state.upstream.base()) else {
        return;
    };
    let (Some(host), Some(port)) = (base.host_str(), base.port_or_known_default()) else {
        return;
    };
    if proxied {
        return;
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let connect = tokio::net::TcpStream::connect((host, port));
    let why = match tokio::time::timeout(std::time::Duration::from_secs(5), connect).await {
        Ok(Ok(_)) => return,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer within 5 s".to_string(),
    };
    tracing::warn!(
        upstream = %crate::config::shown_url(state.upstream.base()),
        "cannot reach the upstream: connection to {} failed: {why}; requests answer 502 until it can be reached (--upstream or [upstream] base_url sets it)",
        base.origin().ascii_serialization()
    );
}

/// Says at start-up who may use `/admin/`.
pub(super) fn admin_notice(config: &Config) {
    let loopback = config
        .listen_addr()
        .is_ok_and(|a| a.ip().to_canonical().is_loopback());
    let name = &config.admin.token_env;
    let token_set = !name.is_empty() && std::env::var(name).is_ok_and(|t| !t.is_empty());
    if !name.is_empty() && !token_set {
        tracing::warn!(token_env = %name, "admin.token_env names a variable that is unset or empty: /admin/ answers loopback clients of a loopback listener only");
    } else if !loopback && !token_set {
        tracing::warn!("listening on a non-loopback address without [admin] token_env: /admin/ refuses every request");
    }
}

// ---------------------------------------------------------------------------
// compactor conversations …
