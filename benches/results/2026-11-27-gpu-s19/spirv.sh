#!/bin/bash
# SPIR-V 1.3 (default) against 1.6 (CAIRN_VULKAN_SPIRV=1.6) on the vulkan backend, alternating; wgpu beside.
set -u
for s in 8b 135m; do
  for v in 1.3 1.6 1.3 1.6; do
    [ $s = 135m ] && [ $v = 1.3 ] && [ "${done135:-}" = 1 ] && continue
    printf "%-4s vulkan spirv %s " $s $v
    CAIRN_VULKAN_SPIRV=$v timeout 50 $C bench --backend vulkan --synthetic $s --prompt-tokens 512 --gen-tokens 64 --runs 2 2>&1 | grep -E "^  (decode|prefill) " | tr -s ' ' | tr '\n' ' '; echo
  done
  printf "%-4s wgpu             " $s
  timeout 50 $C bench --backend wgpu --synthetic $s --prompt-tokens 512 --gen-tokens 64 --runs 2 2>&1 | grep -E "^  (decode|prefill) " | tr -s ' ' | tr '\n' ' '; echo
done
