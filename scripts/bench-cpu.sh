#!/usr/bin/env bash
# Cairn's cpu backend against llama.cpp's CPU backend on this machine, side by side: the same
# model files, prompt and generation lengths and thread count, in rounds that interleave the
# two (cairn, llama.cpp, cairn, llama.cpp, ...) so a change in the machine's load hits both.
# Prints each round and the medians with Cairn's ratio to llama.cpp (decode and prefill).
#
#   scripts/bench-cpu.sh [MODEL.gguf ...]
#
# Models: the arguments; by default the default model (Q4_1) and a Q4_K_M made from it with
# llama.cpp's llama-quantize (kept next to it), when llama-quantize is at hand.
#
# llama.cpp: `llama-bench` from $LLAMA_BENCH, else built once into $LLAMA_BUILD
# (/tmp/llbench-build) from llama.cpp's source in $LLAMA_SRC (the `llama-cpp-python==0.3.36`
# source package's vendor/llama.cpp; ../shared/README.md says how to download it). The build
# is CPU only, Release, and not `GGML_NATIVE`: these virtual machines advertise instructions
# (AMX) the VM does not enable, so `-march=native` binaries die with "Illegal instruction".
# It turns on AVX-512 (and its VNNI, VBMI and BF16 parts) only where /proc/cpuinfo lists
# each: some AMD EPYC machines have AVX2 and FMA only, and an AVX-512 build crashes there.
#
# Environment: PROMPT_TOKENS (128), GEN_TOKENS (64), ROUNDS (3), THREADS (2), CAIRN_BIN
# (a cairn binary instead of building target/release/cairn), LLAMA_BENCH, LLAMA_BUILD,
# LLAMA_SRC, LLAMA_QUANTIZE; CAIRN_CPU_TILES (off, all), CAIRN_CPU_ROWS (off) and CAIRN_CPU_ISA
# (avx2, scalar) reach Cairn's binary and are printed. CONFIGS runs Cairn in several settings alternating in
# every round, each against the same llama.cpp runs: settings separated by `;`, each a
# space-separated list of VAR=VALUE (an empty one is the default), e.g.
# CONFIGS=';CAIRN_CPU_ROWS=off' for before/after in one binary. A shared machine's load bends
# both engines (llama.cpp's spinning threads the most): the load average is printed with every
# round.
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${XDG_CACHE_HOME:-$HOME/.cache}"
prompt_tokens="${PROMPT_TOKENS:-128}"
gen_tokens="${GEN_TOKENS:-64}"
rounds="${ROUNDS:-3}"
threads="${THREADS:-2}"
llama_build="${LLAMA_BUILD:-/tmp/llbench-build}"
llama_src="${LLAMA_SRC:-$cache/cairn/llama-cpp-python-0.3.36/vendor/llama.cpp}"
default_model="${CAIRN_MODEL:-$cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf}"

export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/xdg-$(id -u)}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"

# llama-bench: given, already built, or built now.
llama_bench="${LLAMA_BENCH:-$llama_build/bin/llama-bench}"
if [ ! -x "$llama_bench" ]; then
    if [ ! -f "$llama_src/CMakeLists.txt" ]; then
        echo "no llama.cpp source at $llama_src (set LLAMA_SRC, or LLAMA_BENCH to a built llama-bench)" >&2
        exit 1
    fi
    simd=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
    if grep -qw avx512f /proc/cpuinfo; then
        simd+=(-DGGML_AVX512=ON)
        grep -qw avx512_vnni /proc/cpuinfo && simd+=(-DGGML_AVX512_VNNI=ON)
        grep -qw avx512vbmi /proc/cpuinfo && simd+=(-DGGML_AVX512_VBMI=ON)
        grep -qw avx512_bf16 /proc/cpuinfo && simd+=(-DGGML_AVX512_BF16=ON)
    else
        simd+=(-DGGML_AVX512=OFF)
    fi
    echo "== building llama-bench into $llama_build (${simd[*]})"
    cmake -S "$llama_src" -B "$llama_build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        "${simd[@]}" -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF >/dev/null
    cmake --build "$llama_build" --target llama-bench llama-quantize -j"$(nproc)" >/dev/null
fi
llama_quantize="${LLAMA_QUANTIZE:-$(dirname "$llama_bench")/llama-quantize}"

models=("$@")
if [ ${#models[@]} -eq 0 ]; then
    if [ ! -f "$default_model" ]; then
        echo "no model at $default_model; fetch the default one with scripts/fetch-model.sh" >&2
        exit 1
    fi
    models=("$default_model")
    kq="${default_model%.Q4_1.gguf}.Q4_K_M.gguf"
    if [ ! -f "$kq" ] && [ -x "$llama_quantize" ]; then
        echo "== making $kq with llama-quantize"
        LD_LIBRARY_PATH="$(dirname "$llama_quantize")" \
            "$llama_quantize" --allow-requantize "$default_model" "$kq" Q4_K_M >/dev/null 2>&1
    fi
    [ -f "$kq" ] && models+=("$kq")
fi

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
echo "prompt $prompt_tokens tokens, generate $gen_tokens, $threads threads, $rounds rounds"
"$cairn" devices 2>/dev/null | grep -E '^cpu ' || true
env | grep -E '^CAIRN_CPU_(TILES|ROWS|ISA)=' || true

results="$(mktemp)"
summary="$(mktemp)"
trap 'rm -f "$results" "$summary"' EXIT
# Reads result lines (one JSON object each: round, model, engine, load, the engine's own
# JSON) from stdin; `rows` prints each, `medians` the medians and Cairn's ratio to llama.cpp.
cat >"$summary" <<'EOF'
import json, statistics, sys


def speeds(r):
    o = r["out"]
    if r["engine"].startswith("cairn"):
        return o["prefill_tokens_per_s"], o["decode_tokens_per_s"]
    prefill = next(x["avg_ts"] for x in o if x["n_prompt"] > 0)
    decode = next(x["avg_ts"] for x in o if x["n_gen"] > 0)
    return prefill, decode


lines = [json.loads(line) for line in sys.stdin if line.strip()]
if sys.argv[1] == "rows":
    for r in lines:
        p, d = speeds(r)
        print(f"round {r['round']} {r['model']:<36} {r['engine']:<24} prefill {p:7.1f} tok/s"
              f"  decode {d:6.1f} tok/s  (load {r['load']})")
    sys.exit()
rows = {}
for r in lines:
    rows.setdefault(r["model"], {}).setdefault(r["engine"], []).append(speeds(r))
print(f"{'model':<36} {'engine':<24} {'prefill':>8} {'decode':>8}")
for model, engines in rows.items():
    med = {e: tuple(statistics.median(v[i] for v in vals) for i in range(2))
           for e, vals in engines.items()}
    for e, (p, d) in med.items():
        print(f"{model:<36} {e:<24} {p:8.1f} {d:8.1f}")
    for e in med:
        if e.startswith("cairn") and "llama.cpp" in med:
            (cp, cd), (lp, ld) = med[e], med["llama.cpp"]
            print(f"{model:<36} {'ratio ' + e[5:]:<24} {cp / lp:7.2f}x {cd / ld:7.2f}x")
EOF
for r in $(seq 1 "$rounds"); do
    for m in "${models[@]}"; do
        name="$(basename "$m" .gguf)"
        IFS=';' read -r -a configs <<<"${CONFIGS:-}"
        [ ${#configs[@]} -eq 0 ] && configs=("")
        for cfg in "${configs[@]}"; do
            load="$(cut -d' ' -f1 /proc/loadavg)"
            # shellcheck disable=SC2086 # the setting's assignments are words for env
            c="$(env $cfg "$cairn" bench --model "$m" --backend cpu --cpu-threads "$threads" \
                --prompt-tokens "$prompt_tokens" --gen-tokens "$gen_tokens" --runs 1 --json 2>/dev/null)"
            engine="cairn${cfg:+ $cfg}"
            echo "{\"round\": $r, \"model\": \"$name\", \"engine\": \"$engine\", \"load\": $load, \"out\": $c}" >>"$results"
            tail -1 "$results" | python3 "$summary" rows
        done
        load="$(cut -d' ' -f1 /proc/loadavg)"
        l="$(LD_LIBRARY_PATH="$(dirname "$llama_bench")" "$llama_bench" -m "$m" -t "$threads" \
            -p "$prompt_tokens" -n "$gen_tokens" -r 1 -o json 2>/dev/null)"
        echo "{\"round\": $r, \"model\": \"$name\", \"engine\": \"llama.cpp\", \"load\": $load, \"out\": $(echo "$l" | tr -d '\n')}" >>"$results"
        tail -1 "$results" | python3 "$summary" rows
    done
done

echo
echo "== medians over $rounds rounds (Cairn / llama.cpp)"
python3 "$summary" medians <"$results"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
