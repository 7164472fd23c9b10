#!/usr/bin/env bash
# Install the real Claude Code CLI (npm @anthropic-ai/claude-code) for
# tests/claude_code.rs and the Claude Code checks of tests/connect_claude.rs.
#
# Usage:
#   scripts/claude.sh install    # install/refresh (idempotent); print the claude binary path last
#   scripts/claude.sh path       # print the binary path if installed, else fail
#
# Env: COMPACTOR_CACHE_DIR (default $HOME/.cache/compactor)
set -euo pipefail

# Pinned: the version tests/claude_code.rs is checked against. It runs in
# print mode with a placeholder ANTHROPIC_API_KEY and no network but loopback.
CLAUDE_VERSION="2.1.197"

CACHE="${COMPACTOR_CACHE_DIR:-$HOME/.cache/compactor}"
PREFIX="$CACHE/claude"
STAMP="$PREFIX/.compactor-installed"
BIN="$PREFIX/node_modules/.bin/claude"

die() { echo "claude.sh: $*" >&2; exit 1; }

usage() {
  sed -n '5,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# The npm package's `claude` runs a native binary shipped as an optional
# dependency per platform (@anthropic-ai/claude-code-linux-x64, ...), put in
# place by its postinstall script. Name the one this machine needs, so a run
# with optional dependencies disabled still fails loudly.
platform_pkg() {
  local os arch libc=""
  case "$(uname -s)" in
    Linux) os=linux
           # Alpine and other musl systems get the -musl build.
           if ldd --version 2>&1 | grep -qi musl; then libc="-musl"; fi ;;
    Darwin) os=darwin ;;
    *) die "unsupported OS $(uname -s)" ;;
  esac
  case "$(uname -m)" in
    x86_64|amd64) arch=x64 ;;
    aarch64|arm64) arch=arm64 ;;
    *) die "unsupported CPU $(uname -m)" ;;
  esac
  echo "$os-$arch$libc"
}

# Run with a throwaway HOME so a check of the version writes no config of
# the user's, and with every kind of background traffic off.
works() {
  [[ -x "$BIN" ]] || return 1
  local home
  home=$(mktemp -d)
  local out
  out=$(HOME="$home" CLAUDE_CONFIG_DIR="$home/.claude" DISABLE_AUTOUPDATER=1 \
    DISABLE_TELEMETRY=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
    timeout 60 "$BIN" --version 2>/dev/null || true)
  rm -rf "$home"
  grep -q "$CLAUDE_VERSION" <<<"$out"
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
  if [[ -f "$STAMP" && "$(cat "$STAMP")" == "@anthropic-ai/claude-code@$CLAUDE_VERSION $plat" ]] && works; then
    echo "$BIN"
    return 0
  fi
  command -v npm >/dev/null || die "npm not found (Node.js >= 18 is needed)"
  mkdir -p "$PREFIX"
  # A package.json of our own keeps npm from walking up to some parent project.
  [[ -f "$PREFIX/package.json" ]] \
    || echo '{"name":"compactor-claude","private":true}' > "$PREFIX/package.json"
  echo "installing @anthropic-ai/claude-code@$CLAUDE_VERSION ($plat) into $PREFIX ..." >&2
  npm_install "@anthropic-ai/claude-code@$CLAUDE_VERSION" \
    || { echo "npm failed, retrying once..." >&2; sleep 2;
         npm_install "@anthropic-ai/claude-code@$CLAUDE_VERSION"; }
  if ! works; then
    # The optional dependency was skipped (optional=false, or a lockfile from
    # another platform): install the platform package explicitly, then let
    # the main package's postinstall link it again.
    echo "platform binary missing; installing @anthropic-ai/claude-code-$plat explicitly ..." >&2
    npm_install "@anthropic-ai/claude-code-$plat@$CLAUDE_VERSION"
    npm rebuild --prefix "$PREFIX" --loglevel=error @anthropic-ai/claude-code >&2 || true
  fi
  works || die "$BIN does not run: $(HOME="$(mktemp -d)" timeout 60 "$BIN" --version 2>&1 | tail -n 3)"
  echo "@anthropic-ai/claude-code@$CLAUDE_VERSION $plat" > "$STAMP"
  echo "installed: Claude Code $CLAUDE_VERSION" >&2
  echo "$BIN"
}

path() {
  works || die "Claude Code $CLAUDE_VERSION is not installed; run: scripts/claude.sh install"
  echo "$BIN"
}

case "${1:-}" in
  install) [[ $# -eq 1 ]] || usage; install ;;
  path)    [[ $# -eq 1 ]] || usage; path ;;
  *)       usage ;;
esac
