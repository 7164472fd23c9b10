//! Configuration values that parse but make no sense, refused by key.

use super::error::ConfigError;
use super::schema::{Config, MAX_RECALL_ROUNDS, MIN_TENANT_PREFIX, SYNCHRONOUS_COMMIT};

impl Config {
    /// Checks values that parse but make no sense.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &str, why: &str| Err(ConfigError::Invalid(key.to_string(), why.to_string()));
        if self.listen_addr().is_err() {
            return invalid("server.listen", "not a socket address like 127.0.0.1:8787");
        }
        if self.store.retain_days == Some(0) {
            return invalid(
                "store.retain_days",
                "must be at least 1 (leave it out to keep conversations)",
            );
        }
        if self.upstream_is_listener() {
            return invalid(
                "upstream.base_url",
                "points at the proxy's own listen address (server.listen): every request would come back to it",
            );
        }
        if self.server.max_body_bytes == 0 {
            return invalid("server.max_body_bytes", "must be greater than 0");
        }
        if self.server.max_connections == 0 {
            return invalid("server.max_connections", "must be greater than 0");
        }
        match reqwest::Url::parse(&self.upstream.base_url) {
            Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
            _ => return invalid("upstream.base_url", "not an http(s) URL"),
        }
        // Unlike the server's, the upstream's timeouts have no "no limit":
        // 0 would fail every request.
        let u = &self.upstream;
        for (key, secs) in [
            ("upstream.connect_timeout_secs", u.connect_timeout_secs),
            ("upstream.response_timeout_secs", u.response_timeout_secs),
            ("upstream.idle_timeout_secs", u.idle_timeout_secs),
        ] {
            if secs == 0 {
                return invalid(key, "must be greater than 0");
            }
        }
        let c = &self.compaction;
        if !(c.trigger_ratio > 0.0 && c.trigger_ratio <= 1.0) {
            return invalid("compaction.trigger_ratio", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&c.holdout_ratio) {
            return invalid("compaction.holdout_ratio", "must be in [0, 1]");
        }
        if !(c.warn_ratio > 0.0 && c.warn_ratio <= 1.0) {
            return invalid("compaction.warn_ratio", "must be in (0, 1]");
        }
        if !(c.target_ratio > 0.0 && c.target_ratio < c.trigger_ratio) {
            return invalid("compaction.target_ratio", "must be in (0, trigger_ratio)");
        }
        if !(c.cache_ttl_secs.is_finite() && c.cache_ttl_secs >= 0.0) {
            return invalid("compaction.cache_ttl_secs", "must be 0 or more");
        }
        if !(c.cold_ratio > 0.0 && c.cold_ratio <= c.trigger_ratio) {
            return invalid("compaction.cold_ratio", "must be in (0, trigger_ratio]");
        }
        if c.recall_max_rounds > MAX_RECALL_ROUNDS {
            return invalid(
                "compaction.recall_max_rounds",
                &format!("must be at most {MAX_RECALL_ROUNDS}"),
            );
        }
        if c.provider_timeout_secs == 0 {
            return invalid("compaction.provider_timeout_secs", "must be at least 1");
        }
        if c.tool_output_keep_bytes >= c.tool_output_max_bytes {
            return invalid(
                "compaction.tool_output_keep_bytes",
                "must be less than tool_output_max_bytes",
            );
        }
        let st = &self.store;
        if st.is_postgres() {
            match reqwest::Url::parse(&st.url) {
                Ok(u) if u.scheme() == "postgres" || u.scheme() == "postgresql" => {}
                _ => return invalid("store.url", "not a postgres:// URL"),
            }
            if st.pool_size == 0 {
                return invalid("store.pool_size", "must be greater than 0");
            }
            if st.statement_timeout_ms == 0 {
                return invalid("store.statement_timeout_ms", "must be greater than 0");
            }
            if st.stall_after_ms == 0 {
                return invalid("store.stall_after_ms", "must be greater than 0");
            }
            if st.commit_delay_ms > 10_000 {
                return invalid("store.commit_delay_ms", "must be at most 10000 (10 s)");
            }
            if st.claim_lapse_secs == 0 {
                return invalid("store.claim_lapse_secs", "must be greater than 0");
            }
            if !SYNCHRONOUS_COMMIT.contains(&st.synchronous_commit.as_str()) {
                return invalid(
                    "store.synchronous_commit",
                    "one of on, off, local, remote_write, remote_apply",
                );
            }
        }
        let token_env = &self.admin.token_env;
        if token_env.contains(['=', '\0']) || token_env.trim() != token_env {
            return invalid("admin.token_env", "not an environment variable name");
        }
        for t in &self.tenants {
            if t.id.len() < MIN_TENANT_PREFIX || !t.id.bytes().all(|b| b.is_ascii_hexdigit()) {
                return invalid(
                    "tenants.id",
                    "must be a tenant id (or its first 12 or more hex characters)",
                );
            }
        }
        for m in &self.models {
            for (key, price) in [
                ("models.input_price_per_mtok", m.input_price_per_mtok),
                (
                    "models.cached_input_price_per_mtok",
                    m.cached_input_price_per_mtok,
                ),
                (
                    "models.cache_write_price_per_mtok",
                    m.cache_write_price_per_mtok,
                ),
                (
                    "models.cache_write_1h_price_per_mtok",
                    m.cache_write_1h_price_per_mtok,
                ),
                ("models.output_price_per_mtok", m.output_price_per_mtok),
            ] {
                if price.is_some_and(|p| !(p.is_finite() && p >= 0.0)) {
                    return invalid(key, "must be a price of 0 or more");
                }
            }
            if m.context_window == 0 {
                return invalid("models.context_window", "must be greater than 0");
            }
            if let Some(r) = m.trigger_ratio {
                if !(r > 0.0 && r <= 1.0) {
                    return invalid("models.trigger_ratio", "must be in (0, 1]");
                }
            }
        }
        Ok(())
    }

    /// Whether `upstream.base_url` names the address the proxy listens on,
    /// in any spelling of it: `localhost`, a loopback address when the
    /// proxy listens on one, any local address when it listens on all
    /// (`0.0.0.0`, `[::]`). Others (the host's own LAN address, a name that
    /// resolves to it) are caught per request by the hop header.
    fn upstream_is_listener(&self) -> bool {
        use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
        let (Ok(listen), Ok(url)) = (
            self.listen_addr(),
            reqwest::Url::parse(&self.upstream.base_url),
        ) else {
            return false;
        };
        if listen.port() == 0 || url.port_or_known_default() != Some(listen.port()) {
            return false;
        }
        let Some(host) = url.host_str() else {
            return false;
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let named: Vec<IpAddr> = if host.eq_ignore_ascii_case("localhost")
            || host.to_ascii_lowercase().ends_with(".localhost")
        {
            vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()]
        } else {
            match host.parse::<IpAddr>() {
                Ok(ip) => vec![ip],
                Err(_) => return false,
            }
        };
        let listen = listen.ip().to_canonical();
        named.into_iter().map(|ip| ip.to_canonical()).any(|ip| {
            ip == listen
                || (listen.is_unspecified() && (ip.is_loopback() || ip.is_unspecified()))
                || (ip.is_unspecified() && listen.is_loopback())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_settings_out_of_range_are_named() {
        let base = "[store]\nurl = \"postgres://u@127.0.0.1:5432/db\"\n";
        for (line, key) in [
            ("stall_after_ms = 0", "store.stall_after_ms"),
            ("claim_lapse_secs = 0", "store.claim_lapse_secs"),
            ("commit_delay_ms = 60000", "store.commit_delay_ms"),
            (
                "synchronous_commit = \"off; DROP\"",
                "store.synchronous_commit",
            ),
        ] {
            let c = Config::from_toml(&format!("{base}{line}\n"));
            let err = c
                .and_then(|c| c.validate().map(|()| c))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains(key), "{line}: {err}");
        }
        let c =
            Config::from_toml(&format!("{base}synchronous_commit = \"off\"\n")).expect("parses");
        assert!(c.validate().is_ok());
        assert_eq!(c.store.synchronous_commit, "off");
    }

    #[test]
    fn an_upstream_at_the_listen_address_is_refused() {
        let check = |listen: &str, upstream: &str| {
            let mut c = Config::default();
            c.server.listen = listen.into();
            c.upstream.base_url = upstream.into();
            c.validate().map_err(|e| e.to_string())
        };
        for (listen, upstream) in [
            ("127.0.0.1:8787", "http://127.0.0.1:8787/v1"),
            ("127.0.0.1:8787", "http://localhost:8787/v1"),
            ("127.0.0.1:8787", "http://LocalHost:8787"),
            ("127.0.0.1:8787", "http://0.0.0.0:8787/v1"),
            ("0.0.0.0:8787", "http://127.0.0.1:8787/v1"),
            ("0.0.0.0:8787", "http://127.0.0.2:8787/v1"),
            ("0.0.0.0:80", "http://localhost/v1"),
            ("[::]:8787", "http://127.0.0.1:8787/v1"),
            ("[::1]:8787", "http://[::1]:8787/v1"),
            ("[::1]:8787", "http://localhost:8787/v1"),
            ("192.168.1.5:8787", "http://192.168.1.5:8787/v1"),
        ] {
            let err = check(listen, upstream).expect_err(upstream);
            assert!(err.contains("upstream.base_url"), "{err}");
        }
        for (listen, upstream) in [
            ("127.0.0.1:8787", "http://127.0.0.1:8788/v1"),
            ("127.0.0.1:8787", "https://127.0.0.1/v1"),
            ("127.0.0.1:8787", "http://127.0.0.2:8787/v1"),
            ("127.0.0.1:8787", "http://api.example.com:8787/v1"),
            ("127.0.0.1:0", "http://127.0.0.1:0/v1"),
            ("192.168.1.5:8787", "http://127.0.0.1:8787/v1"),
        ] {
            assert!(check(listen, upstream).is_ok(), "{listen} {upstream}");
        }
    }

    #[test]
    fn bad_values_rejected() {
        assert!(Config::from_toml("[compaction]\ntrigger_ratio = 1.5\n").is_err());
        assert!(Config::from_toml("[server]\nlisten = \"nope\"\n").is_err());
        assert!(Config::from_toml("[upstream]\nbase_url = \"ftp://x\"\n").is_err());
        for key in [
            "connect_timeout_secs",
            "response_timeout_secs",
            "idle_timeout_secs",
        ] {
            let err = Config::from_toml(&format!("[upstream]\n{key} = 0\n")).unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
        let err = Config::from_toml("[upstream]\nwebsocket = \"on\"\n").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("line 2, column 13: unknown variant `on`")
                && err.to_string().contains("`auto` or `off`"),
            "{err}"
        );
        let off = Config::from_toml("[upstream]\nwebsocket = \"off\"\n").unwrap();
        assert_eq!(
            off.upstream.websocket,
            crate::config::UpstreamWebSocket::Off
        );
    }
}
