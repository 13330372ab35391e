#!/usr/bin/env bash
# CUDA-backend check on the GPU machine: devices, unit/kernel/synthetic-model tests on every
# backend, cairn bench cuda (graphs on and off) vs vulkan vs wgpu in the same call.
# Usage: bash .device/cuda/run.sh [tests|bench|all] (SHAPES="135m 8b")
set -u
WHAT=${1:-all}
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json XDG_RUNTIME_DIR=/tmp/xdg WGPU_BACKEND=vulkan
mkdir -p /tmp/xdg; chmod 700 /tmp/xdg
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/all.log") 2>&1
B=/tmp/cuda-bin; mkdir -p $B; tar -xJf .device/cuda/bin.tar.xz -C $B
# libnvrtc: the loader's path, else the toolkit's, else the pip wheel PyTorch ships.
if ! ldconfig -p | grep -q 'libnvrtc\.so'; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 \
           $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] || [ -e "$d/libnvrtc.so" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" && break
  done
fi
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; ldconfig -p | grep -E 'libcuda\.so|libnvrtc' | head -4
echo "== devices"; $B/cairn devices; $B/cairn devices --json > "$OUT/devices.json"
if [ "$WHAT" != bench ]; then
  echo "== engine unit tests (cuda)"; RUST_LOG=info timeout 120 $B/engine-lib cuda --test-threads 1 2>&1 | tail -25
  echo "== kernel tests (every device)"; CAIRN_TEST_REQUIRE_CUDA=1 timeout 180 $B/kernels --test-threads 4 2>&1 | tail -25
  echo "== kernel tests, graphs off"; CAIRN_CUDA_GRAPHS=0 CAIRN_TEST_REQUIRE_CUDA=1 timeout 120 $B/kernels --test-threads 4 2>&1 | grep -E "test result|panicked" | head -5
  echo "== synthetic model test"; timeout 180 $B/model synthetic_model 2>&1 | tail -12
fi
if [ "$WHAT" != tests ]; then
  : > "$OUT/bench.jsonl"
  for s in ${SHAPES:-135m 8b}; do
    for b in cuda cuda-nograph vulkan wgpu; do
      echo "-- $s $b"
      be=$b; env=""
      [ $b = cuda-nograph ] && be=cuda && env="CAIRN_CUDA_GRAPHS=0"
      r=$(env $env RUST_LOG=cairn_engine=info timeout 200 $B/cairn bench --synthetic $s --backend $be --prompt-tokens 512 --gen-tokens 128 --runs 3 --json 2>>"$OUT/bench-stderr.log") && \
        printf '{"backend":"%s","result":%s}\n' "$b" "$r" >> "$OUT/bench.jsonl"
    done
  done
  grep -E "cuda device closed|capture failed" "$OUT/bench-stderr.log" | tail -8
  python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l); r = j["result"]
    print(f"{j['backend']:<13} {r['model']:<14} prefill {r['prefill_tokens_per_s']:9.1f} decode {r['decode_tokens_per_s']:7.1f} "
          f"ms/tok {r['decode_ms_per_token_median']:6.2f} disp {r['dispatches_per_decode_step']} us/disp {r['per_dispatch_us']:.2f} "
          f"ovh_ms {r['dispatch_overhead_ms_per_step']:.2f} sync_us {r['submit_sync_us']:.1f} GB/s {r['decode_gb_per_s']:.0f} copy {r.get('copy_gb_per_s')} stream {r.get('stream_gb_per_s')}")
PY
fi
echo "== done"
