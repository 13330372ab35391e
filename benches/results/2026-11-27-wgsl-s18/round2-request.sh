#!/bin/bash
# wgsl18, round 2: `auto` (now the wide walk on GPUs, rows:8,wg:256,unroll:4,dot:1) against
# `subgroup` (the old auto), alternating, 8B (vulkan, wgpu) and 135M (vulkan, where auto keeps
# the streaming kernels: rows of 576/1536 are shorter than a chunk per invocation); three more
# shapes (workgroups of 512 and 1024 among them); the matvec kernel benches (GB/s of one product); the GPU tests. Budget ~3 min.
# $C: cairn binary; $OUT: results folder (only a summary is written there).
set -u
mkdir -p "$OUT" /tmp/wgsl18
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
# Binaries from /work/wt/wgsl18 (override with KT/MT/KB if carried elsewhere):
KT=${KT:-target/debug/deps/kernels-755cdec4e2290c76}   # kernels test
MT=${MT:-target/debug/deps/model-725163032068d5db}     # model test (synthetic models only)
KB=${KB:-target/debug/kernels-bench-wgsl18}            # stripped kernels bench
b() {  # backend size label matvec [shape]
    local be=$1 sz=$2 label=$3 mv=$4 sh=${5:-}
    local f="/tmp/wgsl18/$sz-$be-$label.txt"
    CAIRN_WGPU_MATVEC_SHAPE="$sh" timeout 60 "$C" bench --backend "$be" --synthetic "$sz" \
        --prompt-tokens 128 --gen-tokens 64 --runs 2 --wgpu-matvec "$mv" > "$f" 2>&1
    local rc=$?
    printf '%-5s %-6s %-22s rc=%s %s | %s\n' "$sz" "$be" "$label" "$rc" \
        "$(grep -E '^  decode  ' "$f" | sed 's/  */ /g')" \
        "$(grep -E '^  decode bandwidth' "$f" | sed 's/  */ /g;s/(the faster.*//')"
    [ $rc -ne 0 ] && tail -3 "$f"
}
{
echo "== 8B vulkan"
b vulkan 8b auto auto
b vulkan 8b subgroup subgroup
b vulkan 8b auto-2 auto
b vulkan 8b subgroup-2 subgroup
b vulkan 8b r4w256u1d1 wide rows:4,wg:256,unroll:1,dot:1
b vulkan 8b r8w512u1d1 wide rows:8,wg:512,unroll:1,dot:1
b vulkan 8b r8w1024u1d1 wide rows:8,wg:1024,unroll:1,dot:1
b vulkan 8b auto-3 auto
echo "== 8B wgpu"
b wgpu 8b auto auto
b wgpu 8b subgroup subgroup
b wgpu 8b auto-2 auto
echo "== 135M vulkan"
b vulkan 135m auto auto
b vulkan 135m subgroup subgroup
b vulkan 135m auto-2 auto
b vulkan 135m subgroup-2 subgroup
echo "== matvec kernel benches, vulkan (built from ce90746: same kernels; GB/s of weights read)"
for m in subgroup wide; do
    echo "-- $m"
    CAIRN_BENCH_BACKEND=vulkan CAIRN_WGPU_MATVEC=$m timeout 40 "$KB" --bench \
        'matvec_(q4_1|q8_0)/(4096x4096|14336x4096)/batch' > /tmp/wgsl18/kb-$m.txt 2>&1
    grep -E 'matvec_(q4_1|q8_0)/' /tmp/wgsl18/kb-$m.txt | grep -E 'GB/s|GiB/s|thrpt' | head -8
done
echo "== GPU tests"
CAIRN_TEST_REQUIRE_GPU=1 CAIRN_WGPU_MATVEC_SHAPES="rows:8,wg:256,unroll:4,dot:1;rows:8,wg:512,unroll:1,dot:1;rows:8,wg:1024,unroll:1,dot:1;rows:4,wg:256,unroll:1,dot:1" \
    timeout 40 "$KT" wide_matvec 2>&1 | grep -E "^test |panicked|result"
CAIRN_TEST_REQUIRE_GPU=1 timeout 90 "$MT" synthetic_model_logits_match 2>&1 | grep -E "^test |panicked|result|element|logit" | head -12
} 2>&1 | tee "$OUT/summary.txt"
