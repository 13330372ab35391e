#!/bin/bash
# tile19 round 1 (about 3 min): prompt products, linear_matmat (registers) against the new
# workgroup-memory tiles linear_gemm_* (gemm: tile by shape; gemm128/gemm64/gemm32 forced) and
# linear_gemm_coop / _coop_128 (vulkan, f16 cooperative matrices: coop by shape, coop64,
# coop128 forced), switched by CAIRN_WGPU_PREFILL,
# alternated on one machine; cairn bench, prompt 512, 8 generated, 2 runs. Then the GPU
# correctness test of the prompt kernels. Run from the tile19 tree's root.
set -u
mkdir -p "$OUT"
b() { # backend shape variant tag
  local f="$OUT/bench-$2-$1-$3-$4.txt"
  CAIRN_WGPU_PREFILL=$3 timeout 45 "$C" bench --backend "$1" --synthetic "$2" --prompt-tokens 512 \
    --gen-tokens 8 --runs 2 > "$f" 2>&1
  local rc=$?
  printf "%-6s %-4s %-9s rc=%s %s\n" "$1" "$2" "$3" "$rc" \
    "$(sed 's/\x1b\[[0-9;]*m//g' "$f" | grep -E '^run [0-9]: prefill|^  prefill|rror|panicked' | sed 's/, decode.*//' | tr -s ' ' | tr '\n' ' ' | cut -c1-300)"
}
echo "start $(date -u +%T) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
b vulkan 8b registers 1
b vulkan 8b gemm 1
b vulkan 8b gemm128 1
b vulkan 8b gemm64 1
b vulkan 8b coop64 1
b vulkan 8b coop128 1
b vulkan 8b registers 2
b vulkan 8b gemm 2
b vulkan 8b coop 2
b wgpu 8b registers 1
b wgpu 8b gemm 1
b wgpu 8b registers 2
b wgpu 8b gemm 2
b vulkan 135m registers 1
b vulkan 135m gemm 1
b vulkan 135m gemm64 1
b vulkan 135m gemm32 1
b vulkan 135m coop64 1
b vulkan 135m coop 1
b vulkan 135m registers 2
b vulkan 135m gemm 2
b wgpu 135m registers 1
b wgpu 135m gemm 1
grep -h "coop" "$OUT"/bench-8b-vulkan-coop64-1.txt | sed 's/\x1b\[[0-9;]*m//g' | head -3
echo "== kernels test linear_prefill_kernels_match_the_reference ($(date -u +%T))"
CAIRN_TEST_REQUIRE_GPU=1 timeout 60 target/debug/deps/kernels-755cdec4e2290c76 --exact linear_prefill_kernels_match_the_reference 2>&1 | grep -E "^test |panicked|element|result" | tail -8
echo "done $(date -u +%T)"
cd "$OUT" && tar czf benches.tgz bench-*.txt && rm -f bench-*.txt
