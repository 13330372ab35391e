#!/bin/bash
# Session 19 final: merged main's defaults on one GPU (135M and the 8B shape, cuda / vulkan /
# wgpu; prompt 512, 128 generated; medians of 3, whose first run compiles the prompt kernels),
# the multi-GPU engine bench (8B over both GPUs), and the synthetic model tests.
set -u
for s in 135m 8b; do for b in cuda vulkan wgpu; do
  printf "== %-4s %-6s " $s $b
  timeout 70 $C bench --backend $b --synthetic $s --prompt-tokens 512 --gen-tokens 128 --runs 3 > $OUT/bench-$s-$b.txt 2>&1
  grep -E "^  (prefill|decode) " $OUT/bench-$s-$b.txt | tr -s ' ' | tr '\n' ' '; echo
done; done
echo "== 8b over two GPUs (--split all), 1 and 16 at once"
timeout 80 $C bench --backend cuda --device cuda:0,cuda:1 --synthetic 8b --split all --prompt-tokens 128 --gen-tokens 96 --runs 2 --concurrency 16 2>&1 | grep -E "tok/s" | cut -c1-200
echo "== model tests (synthetic) on every device"
CAIRN_TEST_REQUIRE_GPU=1 timeout 60 $W/model synthetic 2>&1 | grep -E "^test |test result|FAILED|panicked" | head -8
