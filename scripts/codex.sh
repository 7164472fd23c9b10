#!/usr/bin/env bash
# Install the real Codex CLI (npm @openai/codex) for tests/codex_cli.rs.
#
# Usage:
#   scripts/codex.sh install    # install/refresh (idempotent); print the codex binary path last
#   scripts/codex.sh path       # print the binary path if installed, else fail
#
# Env: COMPACTOR_CACHE_DIR (default $HOME/.cache/compactor)
set -euo pipefail

# Pinned: the version tests/codex_cli.rs is checked against.
CODEX_VERSION="0.171.0"

CACHE="${COMPACTOR_CACHE_DIR:-$HOME/.cache/compactor}"
PREFIX="$CACHE/codex"
STAMP="$PREFIX/.compactor-installed"
BIN="$PREFIX/node_modules/.bin/codex"

die() { echo "codex.sh: $*" >&2; exit 1; }

usage() {
  sed -n '4,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# The npm package's launcher (bin/codex.js) runs a native binary shipped as an
# optional dependency per platform (@openai/codex-linux-x64 → the tagged
# `0.171.0-linux-x64` release). Name the one this machine needs, so a run with
# optional dependencies disabled still fails loudly.
platform_pkg() {
  local os arch
  case "$(uname -s)" in
    Linux) os=linux ;;
    Darwin) os=darwin ;;
    *) die "unsupported OS $(uname -s)" ;;
  esac
  case "$(uname -m)" in
    x86_64|amd64) arch=x64 ;;
    aarch64|arm64) arch=arm64 ;;
    *) die "unsupported CPU $(uname -m)" ;;
  esac
  echo "$os-$arch"
}

works() {
  [[ -x "$BIN" ]] && "$BIN" --version 2>/dev/null | grep -q "$CODEX_VERSION"
}

npm_install() {
  # --include=optional: the platform binary lives in an optional dependency;
  # an npm config with optional=false (or omit=optional) would skip it.
  npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error \
    --include=optional "$@" >&2
}

install() {
  local plat
  plat=$(platform_pkg)
  # Fast path: the stamp records exactly what was installed, and it still runs.
  if [[ -f "$STAMP" && "$(cat "$STAMP")" == "@openai/codex@$CODEX_VERSION $plat" ]] && works; then
    echo "$BIN"
    return 0
  fi
  command -v npm >/dev/null || die "npm not found (Node.js >= 16 is needed)"
  mkdir -p "$PREFIX"
  # A package.json of our own keeps npm from walking up to some parent project.
  [[ -f "$PREFIX/package.json" ]] \
    || echo '{"name":"compactor-codex","private":true}' > "$PREFIX/package.json"
  echo "installing @openai/codex@$CODEX_VERSION ($plat) into $PREFIX ..." >&2
  npm_install "@openai/codex@$CODEX_VERSION" \
    || { echo "npm failed, retrying once..." >&2; sleep 2;
         npm_install "@openai/codex@$CODEX_VERSION"; }
  if ! works; then
    # The optional dependency was skipped (npm bug #4828 with lockfiles from
    # another platform, or optional=false): install the platform package explicitly.
    echo "platform binary missing; installing @openai/codex-$plat explicitly ..." >&2
    npm_install "@openai/codex-$plat@npm:@openai/codex@$CODEX_VERSION-$plat"
  fi
  works || die "$BIN does not run: $("$BIN" --version 2>&1 | tail -n 3)"
  echo "@openai/codex@$CODEX_VERSION $plat" > "$STAMP"
  echo "installed: $("$BIN" --version)" >&2
  echo "$BIN"
}

path() {
  works || die "Codex $CODEX_VERSION is not installed; run: scripts/codex.sh install"
  echo "$BIN"
}

case "${1:-}" in
  install) [[ $# -eq 1 ]] || usage; install ;;
  path)    [[ $# -eq 1 ]] || usage; path ;;
  *)       usage ;;
esac
