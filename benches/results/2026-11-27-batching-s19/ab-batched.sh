#!/bin/sh
# usage: ab-batched.sh BASE_CAIRN NEW_CAIRN [ROUNDS] [LLAMA]  (LLAMA=1: llama-batched-bench in each round)
# Rounds alternate the baseline's binary and this branch's (order swapped every round), each
# `cairn bench --concurrency 1,4,16` on the cpu backend, 2 threads, the default model; with
# LLAMA=1, llama.cpp's llama-batched-bench on the same shape between them. uptime before each.
B=$1; N=$2; R=${3:-2}; LL=${4:-0}
M=${MODEL:-$HOME/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLB=/tmp/llbench-build/bin/llama-batched-bench
export XDG_RUNTIME_DIR=/tmp/xdg
run() {
  echo "== round $1 $2"; uptime
  $3 bench --model "$M" --backend cpu --cpu-threads 2 --prompt-tokens 128 --gen-tokens 128 --runs 1 --concurrency 1,4,16 2>&1 | grep -v INFO
}
for r in $(seq 1 "$R"); do
  if [ $((r % 2)) = 1 ]; then run $r base "$B"; run $r new "$N"; else run $r new "$N"; run $r base "$B"; fi
  if [ "$LL" = 1 ]; then
    echo "== round $r llama"; uptime
    $LLB -m "$M" -c 4608 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,4,8 -t 2 -kvu 2>&1 | grep -E '^\|'
  fi
done
uptime
