#!/bin/sh
# The Q4_K_M file, baseline's binary against this branch's, alternating: cpu, 2 threads, 1 and 4 at once.
B=$1; N=$2
M=$HOME/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_K_M.gguf
export XDG_RUNTIME_DIR=/tmp/xdg
for r in 1 2; do
  for which in base new; do
    [ $which = base ] && C=$B || C=$N
    echo "== round $r $which"; uptime
    $C bench --model "$M" --backend cpu --cpu-threads 2 --prompt-tokens 128 --gen-tokens 128 --runs 1 --concurrency 1,4 2>&1 | grep "at once"
  done
done
uptime
