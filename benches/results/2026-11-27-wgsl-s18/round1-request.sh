#!/bin/bash
# wgsl18, round 1: the wide matrix-vector walk (`--wgpu-matvec wide`, shape in
# CAIRN_WGPU_MATVEC_SHAPE) against today's `subgroup`, alternating, on the 8B shape (vulkan,
# then wgpu) and 135M (vulkan); then the wide kernels test on the GPU with the swept shapes.
# $C: cairn binary; $OUT: results folder. Budget ~4 min.
set -u
mkdir -p "$OUT"
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; git log --oneline -1 2>/dev/null
KT=target/debug/deps/kernels-755cdec4e2290c76
b() {  # backend shape label [matvec shape]
    local be=$1 sz=$2 label=$3 mv=$4 sh=${5:-}
    local f="$OUT/$sz-$be-$label.txt"
    CAIRN_WGPU_MATVEC_SHAPE="$sh" timeout 60 "$C" bench --backend "$be" --synthetic "$sz" \
        --prompt-tokens 128 --gen-tokens 64 --runs 2 --wgpu-matvec "$mv" > "$f" 2>&1
    local rc=$?
    printf '%-5s %-6s %-34s rc=%s %s | %s\n' "$sz" "$be" "$label" "$rc" \
        "$(grep -E '^  decode  ' "$f" | sed 's/  */ /g')" \
        "$(grep -E '^  decode bandwidth' "$f" | sed 's/  */ /g')"
    [ $rc -ne 0 ] && tail -3 "$f"
}
W=wide
echo "== 8B vulkan (A/B alternating)"
b vulkan 8b subgroup subgroup
b vulkan 8b r8w256u4d1 $W rows:8,wg:256,unroll:4,dot:1
b vulkan 8b r8w256u4d0 $W rows:8,wg:256,unroll:4,dot:0
b vulkan 8b r4w128u4d1 $W rows:4,wg:128,unroll:4,dot:1
b vulkan 8b subgroup-2 subgroup
b vulkan 8b r8w128u2d1 $W rows:8,wg:128,unroll:2,dot:1
b vulkan 8b r16w256u2d1 $W rows:16,wg:256,unroll:2,dot:1
b vulkan 8b r8w64u4d1 $W rows:8,wg:64,unroll:4,dot:1
b vulkan 8b r4w256u8d1 $W rows:4,wg:256,unroll:8,dot:1
b vulkan 8b r8w256u1d1 $W rows:8,wg:256,unroll:1,dot:1
b vulkan 8b r4w64u2d1 $W rows:4,wg:64,unroll:2,dot:1
b vulkan 8b subgroup-3 subgroup
b vulkan 8b r8w256u4d1-2 $W rows:8,wg:256,unroll:4,dot:1
echo "== 8B wgpu"
b wgpu 8b subgroup subgroup
b wgpu 8b r8w256u4d1 $W rows:8,wg:256,unroll:4,dot:1
b wgpu 8b r4w128u4d1 $W rows:4,wg:128,unroll:4,dot:1
b wgpu 8b r8w256u4d0 $W rows:8,wg:256,unroll:4,dot:0
echo "== 135M vulkan"
b vulkan 135m subgroup subgroup
b vulkan 135m r8w256u4d1 $W rows:8,wg:256,unroll:4,dot:1
b vulkan 135m r4w64u2d1 $W rows:4,wg:64,unroll:2,dot:1
b vulkan 135m r4w32u1d1 $W rows:4,wg:32,unroll:1,dot:1
b vulkan 135m subgroup-2 subgroup
echo "== wide kernels test on the GPU ($KT)"
CAIRN_TEST_REQUIRE_GPU=1 \
CAIRN_WGPU_MATVEC_SHAPES="rows:8,wg:256,unroll:4,dot:1;rows:8,wg:256,unroll:4,dot:0;rows:4,wg:128,unroll:4,dot:1;rows:16,wg:256,unroll:2,dot:1;rows:4,wg:256,unroll:8,dot:1" \
    timeout 60 "$KT" --nocapture wide_matvec 2>&1 | grep -E "rows|test |panicked|result" | tail -30
