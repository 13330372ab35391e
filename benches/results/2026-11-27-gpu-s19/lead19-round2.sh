#!/bin/bash
# lead19 round 2: decode attention split by keys, 32 invocations a key (39ce11e, $C) against
# the kernel before it (cc7745c, $W/cairn-old), alternating; 8B and 135M, vulkan and wgpu,
# prompt 512 and 2048. Then per-kernel profile of the new 8B vulkan decode; GPU tests.
set -u
for sbp in "8b vulkan 512" "8b vulkan 2048" "8b wgpu 512" "135m vulkan 512" "135m wgpu 2048"; do for v in new old; do
  set -- $sbp; s=$1; b=$2; pt=$3
  bin=$C; [ $v = old ] && bin=$W/cairn-old
  printf "%-5s %-6s prompt %-4s %-3s " $s $b $pt $v
  timeout 50 $bin bench --backend $b --synthetic $s --prompt-tokens $pt --gen-tokens 64 --runs 2 2>&1 | grep -E "^  decode " | tr -s ' '
done; done
echo "== profile 8b vulkan, new"
CAIRN_WGPU_PROFILE=1 timeout 60 $C bench --backend vulkan --synthetic 8b --prompt-tokens 512 --gen-tokens 16 --runs 1 2>&1 | sed 's/\x1b\[[0-9;]*m//g' | grep -E "wgpu profile|a run" | awk '/wgpu profile/ {n=0; keep=($0 ~ /of 291 dispatches/)} {n++; if (keep && n<=8) print}'
echo "== kernels tests (attention) on every device"
CAIRN_TEST_REQUIRE_GPU=1 timeout 150 $W/kernels attention 2>&1 | grep -E "^test |test result|panicked" | head -12
echo "== model tests (synthetic)"
CAIRN_TEST_REQUIRE_GPU=1 timeout 100 $W/model synthetic 2>&1 | grep -E "test result|FAILED|panicked" | head -6
