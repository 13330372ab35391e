#!/bin/sh
# Issue 22, lever 1, for the GPU machine: decode and prefill with the streaming kernels over
# GGUF's layout (`subgroup`, today's `auto`) against weights repacked at upload (`repacked`),
# same binary, same call, alternating; then the host's time of a fused 135M step on each
# backend (benches/wgpu-host-time.sh). Prints the bench lines that matter and the host medians.
#
#   CAIRN=target/debug/cairn SHAPES="8b 135m" BACKENDS="vulkan wgpu" RUNS=2 benches/gpu-repacked.sh
set -eu
CAIRN=${CAIRN:-target/debug/cairn}
SHAPES=${SHAPES:-8b 135m}
BACKENDS=${BACKENDS:-vulkan wgpu}
RUNS=${RUNS:-2}
OUT=${OUT:-/tmp/cairn-repacked}
mkdir -p "$OUT"
here=$(dirname "$0")
for s in $SHAPES; do
    for b in $BACKENDS; do
        for m in subgroup repacked; do
            f="$OUT/$s-$b-$m"
            RUST_LOG=cairn_engine::backend::wgpu=trace "$CAIRN" bench --backend "$b" --synthetic "$s" \
                --prompt-tokens 512 --gen-tokens 128 --runs "$RUNS" --wgpu-matvec "$m" \
                > "$f.txt" 2> "$f.trace" || { echo "$s $b $m: failed (see $f.txt, $f.trace)"; continue; }
            echo "== $s $b $m"
            grep -E '^  (load|prefill|decode|decode bandwidth|dispatches per decode step) ' "$f.txt" || true
            n=$(awk '/dispatches per decode step/ {print $5}' "$f.txt")
            [ -n "$n" ] && "$here/wgpu-host-time.sh" "$f.trace" "$n" || true
        done
    done
done
