#!/usr/bin/env bash
# The browser's CPU fallback beside the native cpu backend, on this machine, in one run:
# the wasm packages that `cairn` carries (built by native/build.rs) in headless Chromium
# (scripts/bench-wasm.html and bench-wasm-worker.js, served cross-origin isolated as the
# join page is), decoding and prefilling the default model: the single-thread package
# (simd128) on one thread, as in the fallback's Web Worker, and the threaded one
# (`pkg/threads`, simd128 + relaxed SIMD, where the binary carries it: built with
# CAIRN_WEB_THREADS) on 1 and 2 threads, as the fallback's team of Web Workers runs it; then
# `cairn bench --backend cpu` with 1 and with 2 threads.
#
#   scripts/bench-wasm.sh [MODEL]
#
# Each wasm run reports decode (the difference of two generations) and prefill (a long
# prompt's first token against the short prompt's: PREFILL more tokens, 128 by default, as
# scripts/bench-cpu.sh prefills); the native runs prefill PREFILL tokens too, so the two
# sides' prefill figures are over prompts of one length (before session 20: 81 wasm against
# 48 native).
#
# Environment: TOKENS (16 generated per round), ROUNDS (3), PREFILL (128 prompt tokens), PASSES (1: the whole set again,
# so the variants alternate), CAIRN_BIN (a cairn; default target/release/cairn, built if
# missing), PKG (the package folder; default the newest target/release/build/cairn-*/out/pkg),
# BASELINE_PKG (another package folder, e.g. main's, run first in every pass: its single-thread
# package on 1 thread and its threaded one on 2), WASM_SPINS (spin budgets in us, e.g. "0
# 500": the threaded package on 2 threads once more with each; 0 is the waits before
# session 19), WASM_PROBE (1: each threaded run on 2 threads first times the team's
# hand-offs with spin budgets of 0, 20, 100 and 500 us), WASM_SINGLE (0: leave the
# single-thread package out), NATIVE (0: leave the native runs out), WASM_THREADS
# (the threaded package's runs: default "1 2"), WASM_ENGINE (chromium, the default where it
# is installed, or node: scripts/bench-wasm.mjs, single-thread package only), CHROMIUM (the
# browser binary). Needs python3 (it serves the files over HTTP).
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${XDG_CACHE_HOME:-$HOME/.cache}"
model="${1:-${CAIRN_MODEL:-$cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf}}"
tokens="${TOKENS:-16}"
rounds="${ROUNDS:-3}"
prefill="${PREFILL:-128}"
cairn="${CAIRN_BIN:-target/release/cairn}"
if [ ! -x "$cairn" ]; then
    cargo build --release -p cairn -j"${CARGO_BUILD_JOBS:-2}" 2>&1 | tail -1
fi
pkg="${PKG:-$(ls -td target/release/build/cairn-*/out/pkg 2>/dev/null | head -1)}"
if [ ! -f "$pkg/cairn_web_bg.wasm" ]; then
    echo "no wasm package at '$pkg' (build cairn without CAIRN_SKIP_WEB, or set PKG)" >&2
    exit 1
fi

serve="$(mktemp -d)"
ln -s "$(realpath "$model")" "$serve/model.gguf"
ln -s "$(realpath "$pkg")" "$serve/pkg"
# BASELINE_PKG: another package folder (say main's) run first in every pass, on one thread.
if [ -n "${BASELINE_PKG:-}" ]; then
    ln -s "$(realpath "$BASELINE_PKG")" "$serve/base"
fi
ln -s "$PWD/scripts/bench-wasm.html" "$PWD/scripts/bench-wasm-worker.js" "$serve/"
port=$((20000 + RANDOM % 20000))
# Cross-origin isolated, as the coordinator serves the join page: the threaded package's
# shared memory needs it in a browser.
python3 - "$port" "$serve" <<'PY' >/dev/null 2>&1 &
import functools, http.server, sys
class Isolated(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".js": "text/javascript", ".wasm": "application/wasm"}
    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        super().end_headers()
    def log_message(self, *args):
        pass
handler = functools.partial(Isolated, directory=sys.argv[2])
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), handler).serve_forever()
PY
server=$!
trap 'kill "$server" 2>/dev/null; rm -rf "$serve"' EXIT
sleep 1

# WASM_ENGINE: chromium (default where it is installed: headless, the page's workers) or
# node (V8 alone, scripts/bench-wasm.mjs; Node 20's V8 computes relaxed SIMD's dot product
# wrongly, so there the threaded package is not run).
browser="${CHROMIUM:-$(command -v chromium || true)}"
engine="${WASM_ENGINE:-$([ -n "$browser" ] && echo chromium || echo node)}"
# wasm GLUE THREADS [SPIN]: one run of the package whose glue is /pkg/GLUE on THREADS
# threads (SPIN: how long the team's waiting threads spin before sleeping between checks, in
# us; the package's default where not given).
wasm() {
    if [ "$engine" = node ]; then
        PREFILL="$prefill" node scripts/bench-wasm.mjs "$pkg" "http://127.0.0.1:$port/model.gguf" "$tokens" \
            "$rounds" "$2"
        return
    fi
    local log="$serve/chromium.log"
    "$browser" --headless=new --no-sandbox --no-first-run --disable-background-networking \
        --disable-component-update --disable-sync --user-data-dir="$serve/profile" \
        --enable-logging=stderr --v=0 \
        "http://127.0.0.1:$port/bench-wasm.html?pkg=/pkg/$1&threads=$2&tokens=$tokens&rounds=$rounds&spin=${3:--1}&probe=${WASM_PROBE:-0}&prefill=$prefill" \
        >/dev/null 2>"$log" &
    local chromium=$!
    for _ in $(seq 900); do
        grep -q '"BENCH DONE"' "$log" 2>/dev/null && break
        sleep 1
    done
    kill "$chromium" 2>/dev/null
    wait "$chromium" 2>/dev/null || true
    grep -o '"BENCH [^"]*"' "$log" | sed 's/^"BENCH //; s/"$//' 
    rm -rf "$serve/profile" "$log"
}

echo "== $(date -u +'%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg), $(basename "$model")"
echo "== wasm in $engine ($([ "$engine" = node ] && node --version || "$browser" --version)), package $pkg"
# PASSES: the whole set again, so variants alternate on a machine whose load changes.
for pass in $(seq "${PASSES:-1}"); do
    if [ -n "${BASELINE_PKG:-}" ] && [ "$engine" = chromium ]; then
        echo "== pass $pass: wasm, baseline package $BASELINE_PKG, 1 thread"
        wasm ../base/cairn_web.js 1
        if [ -f "$BASELINE_PKG/threads/cairn_web_bg.wasm" ]; then
            echo "== pass $pass: wasm, baseline threaded package, 2 threads"
            wasm ../base/threads/cairn_web.js 2
        fi
    fi
    if [ "${WASM_SINGLE:-1}" != 0 ]; then
        echo "== pass $pass: wasm, single-thread package (simd128), 1 thread"
        wasm cairn_web.js 1
    fi
    if [ -f "$pkg/threads/cairn_web_bg.wasm" ] && [ "$engine" = chromium ]; then
        for threads in ${WASM_THREADS:-1 2}; do
            echo "== pass $pass: wasm, threaded package (simd128+relaxed), $threads thread(s)"
            wasm threads/cairn_web.js "$threads"
        done
        # WASM_SPINS: the threaded package on 2 threads again with each of these spin
        # budgets (us; 0: sleep after 1,024 checks, as before session 19).
        for spin in ${WASM_SPINS:-}; do
            echo "== pass $pass: wasm, threaded package, 2 threads, team spin ${spin} us"
            wasm threads/cairn_web.js 2 "$spin"
        done
    else
        echo "== no threaded package run (none in $pkg, or not in Chromium)"
    fi
    for threads in $([ "${NATIVE:-1}" != 0 ] && echo 1 2); do
        echo "== pass $pass: native cpu backend, $threads thread(s)"
        "$cairn" bench --model "$model" --backend cpu --cpu-threads "$threads" --prompt-tokens "$prefill" \
            --gen-tokens "$tokens" --runs "$rounds" 2>/dev/null | grep -E '^  (prefill|decode) '
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
