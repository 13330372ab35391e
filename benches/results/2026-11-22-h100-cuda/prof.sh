#!/usr/bin/env bash
# One GPU call: cuda tests (built-in kernels and each variant), bench per variant, and ncu
# per-kernel times of decode.  Usage: bash .device/cuda/prof.sh  (VARIANTS="ksplit ..."; NCU=0/1)
set -u
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json XDG_RUNTIME_DIR=/tmp/xdg WGPU_BACKEND=vulkan
mkdir -p /tmp/xdg; chmod 700 /tmp/xdg
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/all.log") 2>&1
B=/tmp/cuda-bin; mkdir -p $B; tar -xJf .device/cuda/bin.tar.xz -C $B
if ! ldconfig -p | grep -q 'libnvrtc\.so'; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 \
           $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] || [ -e "$d/libnvrtc.so" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" && break
  done
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu 2>/dev/null)
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; echo "ncu=$NCU"
for v in builtin ${VARIANTS:-}; do
  env=""; [ $v != builtin ] && env="CAIRN_CUDA_KERNELS=$PWD/.device/cuda/variants/$v"
  echo "===== $v"
  [ "${TESTS:-1}" = 1 ] && [ "$v" != builtin -o "${TEST_BUILTIN:-1}" = 1 ] && {
    env $env CAIRN_TEST_REQUIRE_CUDA=1 timeout 150 $B/kernels --test-threads 4 > $OUT/kernels-$v.log 2>&1; echo "kernels exit $?"; grep -E "test result|panicked|FAILED|^test " $OUT/kernels-$v.log | head -14
    env $env timeout 150 $B/model synthetic_model 2>&1 | grep -E "test result|panicked|FAILED|assert" | head -5
  }
  [ "${BENCH:-1}" = 1 ] && for s in ${SHAPES:-135m 8b}; do
    r=$(env $env timeout 200 $B/cairn bench --synthetic $s --backend cuda --prompt-tokens 512 --gen-tokens 128 --runs 3 --json 2>>"$OUT/bench-stderr.log") && \
      printf '{"variant":"%s","result":%s}\n' "$v" "$r" >> "$OUT/bench.jsonl" && \
      echo "$r" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["model"], "prefill %.0f decode %.1f ms/tok %.2f GB/s %.0f stream %.0f" % (r["prefill_tokens_per_s"], r["decode_tokens_per_s"], r["decode_ms_per_token_median"], r["decode_gb_per_s"], r["stream_gb_per_s"]))'
  done
  if [ "${NCU_RUN:-1}" = 1 ] && [ -n "$NCU" ]; then
    for s in ${NCU_SHAPES:-8b 135m}; do
      env $env CAIRN_CUDA_GRAPHS=0 timeout 240 $NCU --clock-control none --csv --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
        --kernel-name regex:"linear|attention|rmsnorm|rope|silu|softmax|argmax|sample|embed" --launch-skip ${SKIP:-0} --launch-count ${COUNT:-2500} $B/cairn bench --synthetic $s --backend cuda --prompt-tokens 512 --gen-tokens 4 --runs 1 --json > "$OUT/ncu-$v-$s.csv" 2>"$OUT/ncu-$v-$s.err"
      echo "ncu $v $s exit $?"
      python3 - "$OUT/ncu-$v-$s.csv" <<'PY'
import csv, sys, collections, io
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
if not rows: print("no ncu rows"); sys.exit()
r = csv.DictReader(io.StringIO("".join(rows)))
k = collections.defaultdict(lambda: {})
for row in r:
    key = (row["ID"], row["Kernel Name"])
    k[key][row["Metric Name"]] = row["Metric Value"].replace(",", "")
agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
for (i, name), m in k.items():
    g = m.get("launch__grid_size", "?")
    t = float(m.get("gpu__time_duration.sum", 0))
    dr = float(m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", 0))
    a = agg[(name, g)]; a[0] += 1; a[1] += t; a[2] += dr * t
tot = sum(a[1] for a in agg.values())
print(f"{len(k)} launches, {tot/1e6:.2f} ms total (unit as ncu reports: usually ns)")
for (name, g), a in sorted(agg.items(), key=lambda x: -x[1][1])[:25]:
    print(f"{name[:28]:<28} grid {g:>8} n {a[0]:>5} mean {a[1]/a[0]:>9.1f} total {a[1]/1e3:>9.1f}us dram% {a[2]/max(a[1],1e-9):5.1f}")
PY
    done
  fi
done
echo "== done"
