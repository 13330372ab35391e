#!/usr/bin/env bash
# Cairn's figures on a GPU machine that can install nothing: device listing, the kernel
# benches, `cairn bench` on synthetic 135M/1B/8B shapes (and a real model when one is given) on
# each backend side by side (wgpu, vulkan, cuda), and PyTorch's copy and matmul ceilings, all
# in one run.
#
# Prepare on a development machine (x86-64), from the repository root:
#   scripts/bench-gpu.sh --prepare      builds release binaries into .device/ (ignored by git)
# and bring a Vulkan loader in .gl/ (see the device notes: libvulkan1 and friends as .debs).
# On the GPU machine, from the repository root:
#   scripts/bench-gpu.sh                results under $OUT (default /tmp/cairn-bench)
#
# Environment: OUT; BACKENDS ("wgpu vulkan cuda"); KERNEL_FILTER (a criterion filter for the
# kernel benches, default "^(copy/d2d|matvec)": the copy gives the "% copy" column; "" runs them
# all); SHAPES ("135m 1b 8b"); MODEL (a GGUF to bench too);
# PROMPT_TOKENS (512) and GEN_TOKENS (128), as llama-bench's pp512/tg128; RUNS (3); TORCH (1; 0
# skips PyTorch); KERNELS and CAIRN_BINS, the executables to run (default every .device/kernels*
# and .device/cairn*). To compare builds in one run, put the others in .device/ as kernels-NAME
# (copy and matvec benches only, or VARIANT_FILTER) and cairn-before (SHAPES_BEFORE, "135m 8b").
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
    set -e
    mkdir -p .device
    cargo build --release -p cairn --features vulkan,cuda -j"${CARGO_BUILD_JOBS:-2}"
    exe=$(cargo bench --no-run -p cairn-benches --features vulkan,cuda --bench kernels -j"${CARGO_BUILD_JOBS:-2}" \
        --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "kernels":
        print(m["executable"])' | tail -1)
    strip -o .device/kernels "$exe"
    strip -o .device/cairn "${CARGO_TARGET_DIR:-target}/release/cairn"
    ls -la .device
    exit 0
fi

OUT="${OUT:-/tmp/cairn-bench}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/all.log") 2>&1

shapes="${SHAPES:-135m 1b 8b}"
prompt_tokens="${PROMPT_TOKENS:-512}"
gen_tokens="${GEN_TOKENS:-128}"
runs="${RUNS:-3}"

if ! ldconfig -p | grep -q libvulkan; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
export VK_DRIVER_FILES="${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}"
export WGPU_BACKEND="${WGPU_BACKEND:-vulkan}"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/xdg}"
# The cuda backend opens libnvrtc at run time: the loader's, else the toolkit's, else the one
# PyTorch's wheels bring.
if ! ldconfig -p | grep -q 'libnvrtc\.so'; then
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
        if [ -e "$d/libnvrtc.so.13" ] || [ -e "$d/libnvrtc.so" ]; then
            export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
            break
        fi
    done
fi
backends="${BACKENDS:-wgpu vulkan cuda}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"

echo "== machine"
date -u +"%Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit \
    --format=csv 2>/dev/null
grep -m1 'model name' /proc/cpuinfo | sed 's/.*: /cpu: /'
echo "cores: $(nproc)"

echo "== cairn devices"
.device/cairn devices --json > "$OUT/devices.json"
.device/cairn devices

for exe in ${KERNELS:-.device/kernels*}; do
    [ -x "$exe" ] || continue
    name=$(basename "$exe")
    filter=("${KERNEL_FILTER-^(copy/d2d|matvec)}")
    [ "$name" != kernels ] && filter=("${VARIANT_FILTER:-^(copy/d2d|matvec)}")
    for be in $backends; do
        echo "== $name on $be ${filter[*]}"
        CAIRN_BENCH_BACKEND="$be" CAIRN_BENCH_JSON="$OUT/$name-$be.json" "$exe" --bench "${filter[@]}" > "$OUT/$name-$be.log" 2>&1
        echo "exit $?"
        sed -n '/== cairn kernel summary/,$p' "$OUT/$name-$be.log"
    done
done

echo "== cairn bench"
: > "$OUT/bench.jsonl"
for bin in ${CAIRN_BINS:-.device/cairn*}; do
    [ -x "$bin" ] || continue
    name=$(basename "$bin")
    bin_shapes="$shapes"
    [ "$name" = cairn-before ] && bin_shapes="${SHAPES_BEFORE:-135m 8b}"
    targets=()
    for s in $bin_shapes; do targets+=("--synthetic $s"); done
    [ -n "${MODEL:-}" ] && targets+=("--model $MODEL")
    for t in "${targets[@]}"; do
        for be in $backends; do
            echo "-- $name bench $t on $be"
            # shellcheck disable=SC2086
            if r=$("$bin" bench $t --backend "$be" --prompt-tokens "$prompt_tokens" --gen-tokens "$gen_tokens" \
                --runs "$runs" --json); then
                printf '{"bin": "%s", "result": %s}\n' "$name" "$r" >> "$OUT/bench.jsonl"
            else
                printf '{"bin": "%s", "target": "%s on %s", "error": true}\n' "$name" "$t" "$be" >> "$OUT/bench.jsonl"
            fi
        done
    done
done
python3 - "$OUT/bench.jsonl" <<'EOF2'
import json, sys
print(f"{'binary':<13} {'backend':<8} {'model':<15} {'prefill':>8} {'decode':>7} {'ms/tok':>7} {'MB/tok':>7} {'GB/s':>7} "
      f"{'copy':>7} {'stream':>7} {'%ceil':>6} {'disp':>5} {'us/disp':>7} {'ovh ms':>6}")
for line in open(sys.argv[1]):
    j = json.loads(line)
    if j.get("error"):
        print(f"{j['bin']:<13} {j['target']}: failed (see all.log)")
        continue
    r = j["result"]
    stream = r.get("stream_gb_per_s") or float("nan")
    pct = r.get("decode_pct_of_ceiling", r.get("decode_pct_of_copy"))
    print(f"{j['bin']:<13} {r['backend']:<8} {r['model']:<15} {r['prefill_tokens_per_s']:>8.1f} {r['decode_tokens_per_s']:>7.1f} "
          f"{r['decode_ms_per_token_median']:>7.2f} {(r['weight_bytes_per_token'] + r['kv_bytes_per_token_avg']) / 1e6:>7.1f} "
          f"{r['decode_gb_per_s']:>7.1f} {r['copy_gb_per_s']:>7.1f} {stream:>7.1f} {pct:>6.1f} "
          f"{r['dispatches_per_decode_step']:>5} {r['per_dispatch_us']:>7.2f} {r['dispatch_overhead_ms_per_step']:>6.2f}")
EOF2

[ "${TORCH:-1}" = 0 ] && { echo "== done"; exit 0; }
echo "== PyTorch ceilings"
python3 - "$OUT/torch.json" <<'EOF'
import json, sys
import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}


def timed(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


n = 1 << 28  # 1 GiB of f32
src = torch.rand(n, device=dev)
dst = torch.empty_like(src)
s = timed(lambda: dst.copy_(src), 20)
out["copy_gb_per_s"] = 2 * n * 4 / s / 1e9
del src, dst
for dtype, name in [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]:
    for size in (4096, 8192):
        a = torch.randn(size, size, device=dev, dtype=dtype)
        b = torch.randn(size, size, device=dev, dtype=dtype)
        s = timed(lambda: a @ b, 10)
        out[f"matmul_{name}_{size}_tflop_per_s"] = 2 * size**3 / s / 1e12
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"))
EOF
echo "== done"
