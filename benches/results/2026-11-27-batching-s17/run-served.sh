#!/bin/sh
# Session 17: the cut by served stage times against the same count of layers each,
# interleaved; then spot checks on the 135M shape. Usage: run-served.sh CAIRN OUTDIR
set -u
CAIRN=$1; OUT=$2
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/xdg}
load() { cut -d' ' -f1-3 /proc/loadavg; }
for r in 5 6; do
  for c in 4 8; do
    for b in served layers; do
      f=$OUT/cluster-135m-c$c-$b-r$r.json
      echo "$(date -u +%T) start $f load $(load)" >> $OUT/run-busy.log
      timeout 900 $CAIRN bench cluster --synthetic 135m --backend cpu --workers 2 --concurrent $c \
        --prompt-tokens 32 --gen-tokens 64 --runs 2 --no-recovery --json --balance $b > $f 2> $f.err
      echo "$(date -u +%T) end rc=$? load $(load)" >> $OUT/run-busy.log
    done
  done
done
for rate in 0.05; do
  f=$OUT/cluster-135m-c4-spot$rate.json
  mkdir -p $OUT/logs-135m-spot$rate
  echo "$(date -u +%T) start $f load $(load)" >> $OUT/run-spot.log
  RUST_LOG=info,cairn_native::coord::verify=debug timeout 900 $CAIRN bench cluster --synthetic 135m \
    --backend cpu --workers 2 --concurrent 4 --prompt-tokens 32 --gen-tokens 128 --runs 3 \
    --no-recovery --json --spot-check-rate $rate --logs $OUT/logs-135m-spot$rate > $f 2> $f.err
  echo "$(date -u +%T) end rc=$? load $(load)" >> $OUT/run-spot.log
done
