//! How a command reaches a running proxy: the address it is reached at,
//! and the one-thread runtime a command's few requests run on.

use anyhow::Context as _;

/// A one-thread runtime for a command's few requests (`compact`,
/// `doctor`, `connect`).
pub(super) fn command_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")
}

/// Where to reach a proxy listening on `addr`: an unspecified address
/// (`0.0.0.0`, `::`) is reached over loopback.
pub fn admin_target(addr: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unspecified_listen_is_reached_over_loopback() {
        assert_eq!(
            admin_target("0.0.0.0:8787".parse().unwrap()).to_string(),
            "127.0.0.1:8787"
        );
        assert_eq!(
            admin_target("[::]:1".parse().unwrap()).to_string(),
            "[::1]:1"
        );
        assert_eq!(
            admin_target("10.1.2.3:5".parse().unwrap()).to_string(),
            "10.1.2.3:5"
        );
    }
}
