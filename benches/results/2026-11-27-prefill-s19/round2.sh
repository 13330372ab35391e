#!/bin/bash
# tile19 round 2 (about 3.5 min): the new defaults (auto: linear_gemm_coop on vulkan where the
# driver has f16 cooperative matrices, linear_gemm_* on wgpu) against registers (linear_matmat),
# a sweep of cooperative tiles on the 8B shape, a 1,024-token prompt; then the GPU tests of
# the prompt kernels and of the synthetic models (auto now runs coop on vulkan there).
# cairn bench, prompt 512, 32 generated, 3 runs (run 1 is cold: pipelines compile on first use).
set -u
mkdir -p "$OUT"
b() { # backend shape variant tag [prompt]
  local f="$OUT/bench-$2-$1-$3-$4.txt"
  CAIRN_WGPU_PREFILL=$3 timeout 50 "$C" bench --backend "$1" --synthetic "$2" --prompt-tokens "${5:-512}" \
    --gen-tokens 32 --runs 3 > "$f" 2>&1
  local rc=$?
  printf "%-6s %-4s %-10s p%-4s rc=%s %s\n" "$1" "$2" "$3" "${5:-512}" "$rc" \
    "$(sed 's/\x1b\[[0-9;]*m//g' "$f" | grep -E '^run [0-9]: prefill|^  (prefill|decode) |rror|panicked' | sed 's/ tok\/s (\([0-9.]*\) ms\/token median)//' | tr -s ' ' | tr '\n' ' ' | cut -c1-400)"
}
echo "start $(date -u +%T) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "== kernels test linear_prefill_kernels_match_the_reference"
CAIRN_TEST_REQUIRE_GPU=1 timeout 70 target/debug/deps/kernels-755cdec4e2290c76 --exact linear_prefill_kernels_match_the_reference 2>&1 | grep -E "^test |panicked|element|result" | tail -8
echo "== model test, synthetic models ($(date -u +%T))"
CAIRN_TEST_REQUIRE_GPU=1 timeout 60 target/debug/deps/model-725163032068d5db synthetic 2>&1 | grep -E "^test |panicked|element|result" | tail -10
echo "== benches ($(date -u +%T))"
b vulkan 8b registers 1
b vulkan 8b auto 1
b vulkan 8b coop64x128 1
b vulkan 8b coop64k64 1
b vulkan 8b coop128 1
b vulkan 8b registers 2
b vulkan 8b auto 2
b vulkan 8b auto 3 1024
b wgpu 8b registers 1
b wgpu 8b auto 1
b wgpu 8b auto 2
b vulkan 135m registers 1
b vulkan 135m auto 1
b vulkan 135m coop64k64 1
b vulkan 135m coop64x128 1
b vulkan 135m auto 2
b wgpu 135m registers 1
b wgpu 135m auto 1
echo "done $(date -u +%T)"
cd "$OUT" && tar czf benches.tgz bench-*.txt && rm -f bench-*.txt
