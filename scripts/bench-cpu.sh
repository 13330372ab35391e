#!/usr/bin/env bash
# Decode and prefill speed of the default model on this machine, in one run: `cairn bench` on
# the cpu backend and on wgpu (lavapipe where there is no GPU), then llama.cpp's own CPU
# figures for the same model, prompt length and generation length through llama-cpp-python.
#
#   scripts/bench-cpu.sh [MODEL]          (default: $CAIRN_MODEL, then the default location)
#
# Environment: PROMPT_TOKENS (128), GEN_TOKENS (64), RUNS (3); WGPU_GEN_TOKENS (16) and
# WGPU_RUNS (1) for the wgpu backend, since lavapipe decodes at about a token a second;
# THREADS (llama.cpp threads, default nproc); CAIRN_REFENV (the llama-cpp-python virtual
# environment, default ~/.cache/cairn/refenv); BACKENDS ("cpu wgpu"); CAIRN_BIN (a cairn
# binary to use instead of building target/release/cairn). Benchmarks on a shared machine are
# only as quiet as the machine: the load average is printed before and after.
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${XDG_CACHE_HOME:-$HOME/.cache}"
model="${1:-${CAIRN_MODEL:-$cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf}}"
prompt_tokens="${PROMPT_TOKENS:-128}"
gen_tokens="${GEN_TOKENS:-64}"
runs="${RUNS:-3}"
threads="${THREADS:-$(nproc)}"
refenv="${CAIRN_REFENV:-$HOME/.cache/cairn/refenv}"
backends="${BACKENDS:-cpu wgpu}"
wgpu_gen_tokens="${WGPU_GEN_TOKENS:-16}"
wgpu_runs="${WGPU_RUNS:-1}"

if [ ! -f "$model" ]; then
    echo "no model at $model; fetch the default one with scripts/fetch-model.sh" >&2
    exit 1
fi

export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/xdg-$(id -u)}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"

if [ -n "${CAIRN_BIN:-}" ]; then
    cairn="$CAIRN_BIN"
else
    echo "== build"
    cargo build --release -p cairn -j"${CARGO_BUILD_JOBS:-2}" 2>&1 | tail -1
    cairn="${CARGO_TARGET_DIR:-target}/release/cairn"
fi

echo "== machine"
date -u +"%Y-%m-%d %H:%M UTC"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
grep -m1 'model name' /proc/cpuinfo | sed 's/.*: /cpu: /'
echo "cores: $(nproc), memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: $model ($(stat -c %s "$model") bytes)"
echo "prompt $prompt_tokens tokens, generate $gen_tokens, $runs runs (medians)"
"$cairn" devices

for b in $backends; do
    g="$gen_tokens" r="$runs"
    [ "$b" = wgpu ] && g="$wgpu_gen_tokens" r="$wgpu_runs"
    echo
    echo "== cairn bench --backend $b --prompt-tokens $prompt_tokens --gen-tokens $g --runs $r"
    "$cairn" bench --model "$model" --backend "$b" --prompt-tokens "$prompt_tokens" \
        --gen-tokens "$g" --runs "$r"
done

echo
echo "== llama.cpp (llama-cpp-python), CPU, $threads threads"
if [ ! -x "$refenv/bin/python" ]; then
    cat >&2 <<EOF
no llama-cpp-python environment at $refenv (set CAIRN_REFENV to another). Create it with:
    python3 -m venv $refenv
    $refenv/bin/python -m pip install llama-cpp-python numpy
(pip builds llama.cpp from source: a few minutes, needs cmake and a C++ compiler).
EOF
    exit 1
fi
"$refenv/bin/python" - "$model" "$prompt_tokens" "$gen_tokens" "$runs" "$threads" <<'EOF'
import statistics, sys, time

import llama_cpp
import numpy as np
from llama_cpp import Llama

model, P, G, runs, threads = sys.argv[1], *map(int, sys.argv[2:])
llm = Llama(model_path=model, n_ctx=P + G + 8, n_batch=512, n_threads=threads,
            n_threads_batch=threads, verbose=False)
vocab = llm.n_vocab()
# The same prompt `cairn bench` feeds: ids (1000 + 7919 i) mod vocab.
prompt = [(1000 + 7919 * i) % vocab for i in range(P)]


def greedy():
    logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,))))


rows = []
for r in range(runs + 1):  # the first run warms up
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm.ctx)
    t0 = time.perf_counter()
    llm.eval(prompt)
    tok = greedy()
    t1 = time.perf_counter()
    for _ in range(G - 1):
        llm.eval([tok])
        tok = greedy()
    t2 = time.perf_counter()
    d = llama_cpp.llama_perf_context(llm.ctx)
    row = {
        "prefill_wall": P / (t1 - t0),
        "decode_wall": (G - 1) / (t2 - t1),
        "prefill_llama": d.n_p_eval / d.t_p_eval_ms * 1e3 if d.t_p_eval_ms > 0 else 0.0,
        "decode_llama": d.n_eval / d.t_eval_ms * 1e3 if d.t_eval_ms > 0 else 0.0,
    }
    if r > 0:
        rows.append(row)
        print(f"run {r}: prefill {row['prefill_llama']:.1f} tok/s, decode {row['decode_llama']:.1f} tok/s "
              f"(llama.cpp timers; wall clock {row['prefill_wall']:.1f} / {row['decode_wall']:.1f})")
med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
print(f"llama.cpp {llama_cpp.__version__} (llama-cpp-python), {threads} threads: "
      f"prefill {med['prefill_llama']:.1f} tok/s ({P} tokens), decode {med['decode_llama']:.1f} tok/s "
      f"(medians of {runs}; wall clock {med['prefill_wall']:.1f} / {med['decode_wall']:.1f})")
EOF
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
