#!/usr/bin/env bash
# The browser's CPU fallback beside the native cpu backend, on this machine, in one run:
# the wasm packages that `cairn` carries (simd128, built by native/build.rs) run under Node
# (V8, the engine Chromium runs) decoding the default model: the single-thread one, as in the
# fallback's Web Worker, and the threaded one (`pkg/threads`, where the binary carries it:
# built with CAIRN_WEB_THREADS) with 2 threads, as the fallback's team of Web Workers runs it
# on a cross-origin isolated page; then `cairn bench --backend cpu` with 1 and with 2 threads.
#
#   scripts/bench-wasm.sh [MODEL]
#
# Environment: TOKENS (16 generated per round), ROUNDS (3), CAIRN_BIN (a release cairn;
# default target/release/cairn, built if missing), PKG (the package folder; default the
# newest target/release/build/cairn-*/out/pkg), WASM_THREADS (the threaded package's runs:
# default "2"). Needs node (18 or later) and python3 (it serves the model file over HTTP for
# the package's loader).
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${XDG_CACHE_HOME:-$HOME/.cache}"
model="${1:-${CAIRN_MODEL:-$cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf}}"
tokens="${TOKENS:-16}"
rounds="${ROUNDS:-3}"
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
port=$((20000 + RANDOM % 20000))
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$serve" >/dev/null 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; rm -rf "$serve"' EXIT
sleep 1

echo "== $(date -u +'%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg), $(basename "$model")"
echo "== wasm (Node $(node --version)), package $pkg"
node scripts/bench-wasm.mjs "$pkg" "http://127.0.0.1:$port/model.gguf" "$tokens" "$rounds" 1
if [ -f "$pkg/threads/cairn_web_bg.wasm" ]; then
    for threads in ${WASM_THREADS:-2}; do
        echo "== wasm, threaded package, $threads threads"
        node scripts/bench-wasm.mjs "$pkg" "http://127.0.0.1:$port/model.gguf" "$tokens" "$rounds" "$threads"
    done
else
    echo "== no threaded package in $pkg (build cairn with CAIRN_WEB_THREADS=nightly-...)"
fi
for threads in 1 2; do
    echo "== native cpu backend, $threads thread(s)"
    "$cairn" bench --model "$model" --backend cpu --cpu-threads "$threads" --prompt-tokens 8 \
        --gen-tokens "$tokens" --runs "$rounds" 2>/dev/null | grep -E '^  (prefill|decode) '
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
