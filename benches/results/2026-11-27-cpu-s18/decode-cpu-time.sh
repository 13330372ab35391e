#!/usr/bin/env bash
# CPU time per decode token (task-clock difference between 264 and 8 generated tokens), one
# thread. Each argument is a setting: space-separated VAR=VALUE words for env, where BIN=path
# picks the cairn binary (default target/debug/cairn).
m=$1; shift
for r in 1 2 3; do
  for cfg in "$@"; do
    t=()
    for g in 8 264; do
      c=$(env $cfg sh -c 'perf stat -x, -e task-clock ${BIN:-target/debug/cairn} bench --model "$0" --backend cpu --cpu-threads 1 --prompt-tokens 8 --gen-tokens $1 --runs 1 --json' "$m" $g 2>&1 >/dev/null | grep task-clock | cut -d, -f1)
      t+=("$c")
    done
    python3 -c "print('round $r $(basename $m .gguf | cut -d. -f2) ${cfg:-default}: %.3f ms CPU per decode token (load $(cut -d' ' -f1 /proc/loadavg))' % ((${t[1]} - ${t[0]}) / 256))"
  done
done
