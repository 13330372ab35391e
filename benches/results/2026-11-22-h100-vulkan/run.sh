#!/usr/bin/env bash
# Vulkan-backend check on the GPU machine: devices, kernel tests, cairn bench vulkan vs wgpu.
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json XDG_RUNTIME_DIR=/tmp/xdg WGPU_BACKEND=vulkan
mkdir -p /tmp/xdg; chmod 700 /tmp/xdg
D=.device/vulkan
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/all.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== devices"; $D/cairn devices; $D/cairn devices --json > "$OUT/devices.json"
echo "== kernel tests"; timeout 120 $D/kernels --test-threads 4 2>&1 | tail -15
echo "== kernel tests, push constants"; CAIRN_VULKAN_PUSH_CONSTANTS=1 timeout 60 $D/kernels --test-threads 4 2>&1 | grep -E "test result|panicked" | head -5
: > "$OUT/bench.jsonl"
for s in ${SHAPES:-135m 8b}; do
  for b in vulkan wgpu; do
    echo "-- $s $b"
    r=$(timeout 150 $D/cairn bench --synthetic $s --backend $b --prompt-tokens 512 --gen-tokens 128 --runs 3 --json) && \
      printf '{"backend":"%s","pc":0,"result":%s}\n' "$b" "$r" >> "$OUT/bench.jsonl"
  done
done
echo "-- 135m vulkan push constants"
r=$(CAIRN_VULKAN_PUSH_CONSTANTS=1 timeout 60 $D/cairn bench --synthetic 135m --backend vulkan --prompt-tokens 512 --gen-tokens 128 --runs 3 --json) && \
  printf '{"backend":"vulkan","pc":1,"result":%s}\n' "$r" >> "$OUT/bench.jsonl"
python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l); r = j["result"]
    print(f"{j['backend']:<7} pc={j['pc']} {r['model']:<14} prefill {r['prefill_tokens_per_s']:9.1f} decode {r['decode_tokens_per_s']:7.1f} "
          f"ms/tok {r['decode_ms_per_token_median']:6.2f} disp {r['dispatches_per_decode_step']} us/disp {r['per_dispatch_us']:.2f} "
          f"ovh_ms {r['dispatch_overhead_ms_per_step']:.2f} stream {r.get('stream_gb_per_s')}")
PY
echo "== done"
