#!/usr/bin/env bash
# Install the real Gemini CLI (npm @google/gemini-cli) for tests/gemini_cli.rs.
#
# Usage:
#   scripts/gemini.sh install    # install/refresh (idempotent); print the gemini binary path last
#   scripts/gemini.sh path       # print the binary path if installed, else fail
#
# Env: COMPACTOR_CACHE_DIR (default $HOME/.cache/compactor)
set -euo pipefail

# Pinned: the version tests/gemini_cli.rs and tests/fixtures/gemini-cli-request.json
# are checked against. It needs Node.js >= 20.
GEMINI_VERSION="0.61.0"

CACHE="${COMPACTOR_CACHE_DIR:-$HOME/.cache/compactor}"
PREFIX="$CACHE/gemini"
STAMP="$PREFIX/.compactor-installed"
BIN="$PREFIX/node_modules/.bin/gemini"

die() { echo "gemini.sh: $*" >&2; exit 1; }

usage() {
  sed -n '4,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Run with a throwaway HOME so a check of the version writes no settings of
# the user's, and with update checks and telemetry off.
works() {
  [[ -x "$BIN" ]] || return 1
  local home out
  home=$(mktemp -d)
  out=$(HOME="$home" GEMINI_CLI_NO_RELAUNCH=true GEMINI_TELEMETRY_ENABLED=false \
    timeout 60 "$BIN" --version 2>/dev/null || true)
  rm -rf "$home"
  grep -q "$GEMINI_VERSION" <<<"$out"
}

npm_install() {
  # The package is one bundled script. Its optional dependencies (a pseudo
  # terminal for its shell tool, a keychain binding) are native builds the
  # tests never use: leaving them out keeps the install to seconds and needs
  # no compiler.
  npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error \
    --omit=optional "$@" >&2
}

install() {
  # Fast path: the stamp records exactly what was installed, and it still runs.
  if [[ -f "$STAMP" && "$(cat "$STAMP")" == "@google/gemini-cli@$GEMINI_VERSION" ]] && works; then
    echo "$BIN"
    return 0
  fi
  command -v npm >/dev/null || die "npm not found (Node.js >= 20 is needed)"
  node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' \
    || die "Gemini CLI $GEMINI_VERSION needs Node.js >= 20; this is $(node --version)"
  mkdir -p "$PREFIX"
  # A package.json of our own keeps npm from walking up to some parent project.
  [[ -f "$PREFIX/package.json" ]] \
    || echo '{"name":"compactor-gemini","private":true}' > "$PREFIX/package.json"
  echo "installing @google/gemini-cli@$GEMINI_VERSION into $PREFIX ..." >&2
  npm_install "@google/gemini-cli@$GEMINI_VERSION" \
    || { echo "npm failed, retrying once..." >&2; sleep 2;
         npm_install "@google/gemini-cli@$GEMINI_VERSION"; }
  works || die "$BIN does not run: $(HOME="$(mktemp -d)" timeout 60 "$BIN" --version 2>&1 | tail -n 3)"
  echo "@google/gemini-cli@$GEMINI_VERSION" > "$STAMP"
  echo "installed: Gemini CLI $GEMINI_VERSION" >&2
  echo "$BIN"
}

path() {
  works || die "Gemini CLI $GEMINI_VERSION is not installed; run: scripts/gemini.sh install"
  echo "$BIN"
}

case "${1:-}" in
  install) [[ $# -eq 1 ]] || usage; install ;;
  path)    [[ $# -eq 1 ]] || usage; path ;;
  *)       usage ;;
esac
