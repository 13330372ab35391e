#!/bin/bash
# lead19: wgpu kernels without wgpu's runtime checks (new default) against with them
# (CAIRN_WGPU_SHADER_CHECKS=1), alternating; vulkan beside. GPU time per kernel
# (CAIRN_WGPU_PROFILE=1). Then the synthetic model tests on every GPU device.
set -u
for s in 8b 135m; do
  for chk in 0 1; do
    echo "== $s wgpu checks=$chk"
    CAIRN_WGPU_SHADER_CHECKS=$chk timeout 60 $C bench --backend wgpu --synthetic $s --prompt-tokens 512 --gen-tokens 64 --runs 2 2>&1 | grep -E "^  (decode|prefill) "
  done
  echo "== $s vulkan"
  timeout 60 $C bench --backend vulkan --synthetic $s --prompt-tokens 512 --gen-tokens 64 --runs 2 2>&1 | grep -E "^  (decode|prefill) "
done
for sb in "8b vulkan" "8b wgpu" "135m vulkan"; do
  set -- $sb
  echo "== profile $1 $2"
  CAIRN_WGPU_PROFILE=1 timeout 60 $C bench --backend $2 --synthetic $1 --prompt-tokens 512 --gen-tokens 16 --runs 1 2>&1 | sed 's/\x1b\[[0-9;]*m//g' | grep -E "^  (decode|prefill) |wgpu profile|a run" | awk '/wgpu profile/ {n=0; skip=($0 ~ / add$/ || $0 ~ /of (1|2|256) dispatches/)} {n++; if (!skip && n<=16) print}'
done
echo "== model tests (synthetic) on every device"
CAIRN_TEST_REQUIRE_GPU=1 timeout 100 $W/model synthetic 2>&1 | grep -E "test result|FAILED|panicked|failed" | head -10
echo "== cuda 8B decode per kernel (nsys, if present)"
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [ -n "$NSYS" ]; then
  timeout 120 $NSYS profile -o $OUT/cuda8b --force-overwrite true --stats=false $C bench --backend cuda --synthetic 8b --prompt-tokens 512 --gen-tokens 128 --runs 1 > $OUT/nsys.txt 2>&1
  timeout 60 $NSYS stats --report cuda_gpu_kern_sum --format csv $OUT/cuda8b.nsys-rep 2>/dev/null | head -30 | cut -c1-220
  rm -f $OUT/cuda8b.nsys-rep $OUT/cuda8b.sqlite
else echo "no nsys"; ls /usr/local/cuda/bin | head -40 | tr '\n' ' '; fi
