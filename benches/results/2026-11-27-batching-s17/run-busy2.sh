#!/bin/sh
# Session 17, after the head's calibration change and workers calibrating one at a time:
# split by layer count against by calibrated time, interleaved. Usage: run-busy2.sh CAIRN OUTDIR
set -u
CAIRN=$1; OUT=$2
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/xdg}
load() { cut -d' ' -f1-3 /proc/loadavg; }
for r in 3 4; do
  for c in 4 8; do
    for b in time layers; do
      f=$OUT/cluster-135m-c$c-$b-r$r.json
      echo "$(date -u +%T) start $f load $(load)" >> $OUT/run-busy.log
      timeout 900 $CAIRN bench cluster --synthetic 135m --backend cpu --workers 2 --concurrent $c \
        --prompt-tokens 32 --gen-tokens 64 --runs 2 --no-recovery --json --balance $b > $f 2> $f.err
      echo "$(date -u +%T) end rc=$? load $(load)" >> $OUT/run-busy.log
    done
  done
done
