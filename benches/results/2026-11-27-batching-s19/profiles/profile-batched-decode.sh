#!/bin/bash
# usage: prof.sh BIN OUT.data CONC [delay]  — profiles only the batched decode phase
BIN=$1; OUT=$2; C=$3; D=${4:-8}
M=~/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf
export XDG_RUNTIME_DIR=/tmp/xdg
LOG=/tmp/batch15-prof-$$.log
$BIN bench --backend cpu --cpu-threads 2 --model $M --prompt-tokens 128 --gen-tokens 256 --runs 1 --concurrency $C > /dev/null 2> $LOG &
PID=$!
while ! grep -q "run 1:" $LOG 2>/dev/null; do sleep 0.2; done
sleep $D
perf record -F 499 --call-graph dwarf,16384 -o $OUT -p $PID -- sleep 12 2>/dev/null >/dev/null
wait $PID
cat $LOG | tail -3
