#!/usr/bin/env bash
# Passes in flight across steps (CAIRN_STAGE_OVERLAP=on; off is the default) against one pass at a time
# (=off), through the cluster path: one worker over two cpu devices of one thread each, split
# by layers; 1 (the single-request rows), 4 and 16 requests at once; alternated on, off, on,
# off. Baseline: one worker on one cpu device of two threads. Run from the repo root after
# building target/debug/cairn.
set -u
C=${C:-./target/debug/cairn}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/xdg}
common=(--prompt-tokens 32 --gen-tokens 32 --runs 2 --no-recovery)
uptime
for round in 1 2; do
  for mode in on off; do
    for n in 4 16; do
      echo "== round $round, CAIRN_STAGE_OVERLAP=$mode, two cpu devices of one thread, $n at once"
      CAIRN_STAGE_OVERLAP=$mode CAIRN_CPU_THREADS=1 "$C" bench cluster --devices cpu,cpu \
        --workers 2 --one-worker --split layers --concurrent "$n" "${common[@]}" 2>&1 |
        grep -E "at once|^  2 |one device"
    done
  done
  for n in 4 16; do
    echo "== round $round, baseline: one worker, one cpu device of two threads, $n at once"
    CAIRN_CPU_THREADS=2 "$C" bench cluster --workers 1 --concurrent "$n" "${common[@]}" 2>&1 |
      grep -E "at once|^  1 |one device"
  done
done
uptime
