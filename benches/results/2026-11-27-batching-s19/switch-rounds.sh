#!/bin/sh
# usage: switch-rounds.sh CAIRN [PAIRS]  One binary, CAIRN_CPU_BATCH=off (the four-token kernel
# per row, main's path) and on (the batch kernel) alternating, `cairn bench --concurrency 1,4`
# on the cpu backend, 2 threads, the default model, prompts 128, 128 generated; uptime each.
C=$1; P=${2:-6}
M=${MODEL:-$HOME/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf}
export XDG_RUNTIME_DIR=/tmp/xdg
for i in $(seq 1 "$P"); do
  for mode in off on; do
    printf '%s %s %s ' "$i" "$mode" "$(cut -d' ' -f1 /proc/loadavg)"
    CAIRN_CPU_BATCH=$mode $C bench --model "$M" --backend cpu --cpu-threads 2 --prompt-tokens 128 --gen-tokens 128 --runs 1 --concurrency 1,4 2>&1 | grep -E '^(1|4) at once' | awk '{printf "%s ", $4}'
    echo
  done
done
