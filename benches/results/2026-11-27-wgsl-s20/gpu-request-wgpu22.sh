#!/bin/bash
# wgpu22 (session 20, issue 22), one H200, merged main's $C, from the repo root:
#  Q1 decode attention: the grouped first pass (--wgpu-attention-kernel grouped: a workgroup
#     per key/value head for the 4 query heads sharing it) against the per-head one (heads,
#     the default); 8B at 512 and 2,048 keys, 135M at 512.
#  Q2 vulkan behind wgpu: the vulkan backend's SPIR-V zeroes workgroup memory with naga's
#     polyfill (invocation 0 of every workgroup stores zeros over all its workgroup arrays,
#     then a barrier); wgpu's own pipelines let the driver do it (native). polyfill (default)
#     against native and off.
#  Then GPU time per kernel (CAIRN_WGPU_PROFILE=1) where time is left.
# Every bench: --prompt-tokens P --gen-tokens 64 --runs 2; alternated A B A B. About 10 s an
# 8B run; steps past 140 s are skipped. Lines: label, decode tok/s, ms/token, prefill tok/s.
set -u
T0=$SECONDS
n=0
: > $OUT/summary.tsv
bench() { # bench LABEL SHAPE BACKEND PROMPT [VAR=VALUE ...]
  local label=$1 s=$2 be=$3 pt=$4; shift 4
  n=$((n + 1))
  if [ $((SECONDS - T0)) -gt 140 ]; then echo "skipped (time): $label"; return; fi
  local f=$OUT/$(printf %02d $n)-$label.txt
  printf "%3ss %-26s " $((SECONDS - T0)) "$label"
  env "$@" timeout 40 $C bench --backend $be --synthetic $s --prompt-tokens $pt --gen-tokens 64 --runs 2 > $f 2>&1
  local d=$(sed 's/\x1b\[[0-9;]*m//g' $f | grep -E "^  decode +[0-9]" | awk '{print $2, $4}' | tr -d '(')
  local p=$(sed 's/\x1b\[[0-9;]*m//g' $f | grep -E "^  prefill +[0-9]" | awk '{print $2}')
  echo "decode ${d:-FAILED} ms/token; prefill ${p:-?}"
  [ -n "$d" ] && echo "$label ${d%% *}" >> $OUT/summary.tsv
}
profile() { # profile LABEL BACKEND [VAR=VALUE ...]: the decode step's kernels, largest first
  local label=$1 be=$2; shift 2
  if [ $((SECONDS - T0)) -gt 140 ]; then echo "skipped (time): profile $label"; return; fi
  echo "== $((SECONDS - T0))s profile $label (8b, prompt 512, 16 generated)"
  env CAIRN_WGPU_PROFILE=1 "$@" timeout 30 $C bench --backend $be --synthetic 8b --prompt-tokens 512 --gen-tokens 16 --runs 1 > $OUT/profile-$label.txt 2>&1
  sed 's/\x1b\[[0-9;]*m//g' $OUT/profile-$label.txt | grep -E "wgpu profile|a run" \
    | awk '/wgpu profile/ {n=0; keep=($0 ~ / of 29[0-9] dispatches/)} {n++; if (keep && n<=7) print}'
}
G=CAIRN_WGPU_ATTENTION_KERNEL
Z=CAIRN_VULKAN_ZERO_INIT
echo "== Q1 8b wgpu, prompt 512"
for r in 1 2; do
  bench 8b-wgpu-512-heads 8b wgpu 512 $G=heads
  bench 8b-wgpu-512-grouped 8b wgpu 512 $G=grouped
done
echo "== Q2 8b vulkan, prompt 512"
for r in 1 2; do
  bench 8b-vulkan-512-polyfill 8b vulkan 512 $Z=polyfill
  bench 8b-vulkan-512-native 8b vulkan 512 $Z=native
  bench 8b-vulkan-512-off 8b vulkan 512 $Z=off
done
echo "== Q1 8b wgpu, prompt 2048; 135m wgpu, prompt 512"
bench 8b-wgpu-2048-heads 8b wgpu 2048 $G=heads
bench 8b-wgpu-2048-grouped 8b wgpu 2048 $G=grouped
bench 135m-wgpu-512-heads 135m wgpu 512 $G=heads
bench 135m-wgpu-512-grouped 135m wgpu 512 $G=grouped
profile wgpu-grouped wgpu $G=grouped
bench 8b-wgpu-512-grouped-piece16 8b wgpu 512 $G=grouped CAIRN_WGPU_ATTENTION_PIECE=16
profile vulkan-native vulkan $Z=native
echo "== $((SECONDS - T0))s means (decode tok/s) and ratios"
awk '{s[$1]+=$2; c[$1]++} END {for (k in s) m[k]=s[k]/c[k];
  for (k in m) printf "  %-30s %7.1f (%d runs)\n", k, m[k], c[k];
  r("8b-wgpu-512-grouped", "8b-wgpu-512-heads"); r("8b-wgpu-2048-grouped", "8b-wgpu-2048-heads");
  r("135m-wgpu-512-grouped", "135m-wgpu-512-heads"); r("8b-wgpu-512-grouped-piece16", "8b-wgpu-512-grouped");
  r("8b-vulkan-512-native", "8b-vulkan-512-polyfill"); r("8b-vulkan-512-off", "8b-vulkan-512-native");
  r("8b-vulkan-512-native", "8b-wgpu-512-heads") }
  function r(a, b) { if (a in m && b in m) printf "  %-30s / %-26s %.3f\n", a, b, m[a] / m[b] }' $OUT/summary.tsv | sort
if [ -x "${W:-}/kernels" ] && [ $((SECONDS - T0)) -lt 130 ]; then
  echo "== grouped attention test on the GPU (wgpu and vulkan)"
  CAIRN_TEST_REQUIRE_GPU=1 timeout 20 $W/kernels grouped_decode 2>&1 | grep -E "^test |test result|panicked" | head -4
fi
echo "== done at $((SECONDS - T0))s"
