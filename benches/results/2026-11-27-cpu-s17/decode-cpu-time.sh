#!/usr/bin/env bash
# CPU time per decode token (task-clock difference between 264 and 8 generated tokens), one thread.
m=$1; shift
for r in 1 2 3; do
  for cfg in "$@"; do
    t=()
    for g in 8 264; do
      c=$(env $cfg perf stat -x, -e task-clock target/release/cairn bench --model "$m" --backend cpu --cpu-threads 1 --prompt-tokens 8 --gen-tokens $g --runs 1 --json 2>&1 >/dev/null | grep task-clock | cut -d, -f1)
      t+=("$c")
    done
    python3 -c "print('round $r $(basename $m .gguf | cut -d. -f2) ${cfg:-default}: %.3f ms CPU per decode token (load $(cut -d' ' -f1 /proc/loadavg))' % ((${t[1]} - ${t[0]}) / 256))"
  done
done
