#!/bin/bash
# host18 (issue 22 item 5): pipelined decode on wgpu and vulkan, off (CAIRN_WGPU_PIPELINE=0,
# the old encode -> submit -> wait order) against on (the new default), alternating in one
# call, same binary. Each bench line is one process: prompt 128, 128 generated, 2 runs.
# Then the host's time of a step (`wgpu run` trace: plan/bind/encode/submit) and the host's
# wait for the GPU (`wgpu read` serial, `wgpu collect` pipelined), medians over decode steps.
# Run from the tree's root; $C is the cairn binary, $OUT comes back. About 3 to 4 minutes.
set -u
C=${C:-target/debug/cairn}
OUT=${OUT:-/tmp/host18-out}
mkdir -p "$OUT"
med() { sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "-"}'; }
one() { # shape backend pipeline tag
    local s=$1 b=$2 p=$3 tag=$4 f="$OUT/$1-$2-p$3-$4"
    if [ "$SECONDS" -gt 200 ]; then echo "$s $b pipeline=$p [$tag]: skipped (time)"; return; fi
    RUST_LOG=cairn_engine::backend::wgpu=trace CAIRN_WGPU_PIPELINE=$p timeout ${LIMIT:-80} "$C" bench \
        --backend "$b" --synthetic "$s" --prompt-tokens "${PT:-128}" --gen-tokens "${GT:-128}" --runs "${RUNS:-2}" \
        > "$f.txt" 2> "$f.trace" || { echo "$s $b pipeline=$p: failed rc=$? (tail of trace:)"; tail -5 "$f.trace"; return; }
    local n dec
    n=$(awk '/dispatches per decode step/ {print $5}' "$f.txt")
    dec=$(grep -E '^  decode ' "$f.txt" | head -1 | tr -s ' ')
    local clean
    clean=$(sed 's/\x1b\[[0-9;]*m//g' "$f.trace")
    local runs
    runs=$(printf '%s\n' "$clean" | grep "wgpu run" | grep "dispatches=$n " | tail -n 200)
    local tot wait
    tot=$(printf '%s\n' "$runs" | grep -o 'plan_us=[0-9]* bind_us=[0-9]* encode_us=[0-9]* submit_us=[0-9]*' | tr '=' ' ' | awk '{print $2+$4+$6+$8}' | med)
    wait=$(printf '%s\n' "$clean" | grep -E "wgpu (read|collect)" | grep -o 'wait_us=[0-9]*' | cut -d= -f2 | tail -n 200 | med)
    echo "$s $b pipeline=$p [$tag]:$dec | dispatches $n, host us/step (plan+bind+encode+submit) median $tot, wait us median $wait"
    grep -E '^run [0-9]' "$f.trace" | sed 's/^/    /'
}
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
# Round a over every shape and backend first, then round b, so the time guard (200 s) cuts
# repeats, not configurations.
for tag in ${TAGS:-a b}; do
    for s in ${SHAPES:-135m 8b}; do
        for b in ${BACKENDS:-vulkan wgpu}; do
            one $s $b 0 $tag
            one $s $b 1 $tag
        done
    done
done
echo "total ${SECONDS} s"
for b in ${BACKENDS:-vulkan wgpu}; do
    for p in 0 1; do
        echo "== host parts, 135m $b pipeline=$p (benches/wgpu-host-time.sh)"
        n=$(awk '/dispatches per decode step/ {print $5}' "$OUT/135m-$b-p$p-a.txt" 2>/dev/null)
        [ -n "$n" ] && benches/wgpu-host-time.sh "$OUT/135m-$b-p$p-a.trace" "$n" || true
    done
done
