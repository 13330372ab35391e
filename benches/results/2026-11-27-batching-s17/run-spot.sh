#!/bin/sh
# Session 17: spot checks on kept caches. 8b-thin over 2 cpu workers, 4 at once, at
# --spot-check-rate 0.05 (the coordinator's debug log names each check's rows and ms) and 0.
# Usage: run-spot.sh CAIRN OUTDIR
set -u
CAIRN=$1; OUT=$2
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/xdg}
load() { cut -d' ' -f1-3 /proc/loadavg; }
for rate in 0.05 0; do
  f=$OUT/cluster-8b-thin-c4-spot$rate.json
  mkdir -p $OUT/logs-spot$rate
  echo "$(date -u +%T) start $f load $(load)" >> $OUT/run-spot.log
  RUST_LOG=info,cairn_native::coord::verify=debug timeout 1200 $CAIRN bench cluster --synthetic 8b-thin \
    --backend cpu --workers 2 --concurrent 4 --prompt-tokens 32 --gen-tokens 64 --runs 3 \
    --no-recovery --json --spot-check-rate $rate --logs $OUT/logs-spot$rate > $f 2> $f.err
  echo "$(date -u +%T) end rc=$? load $(load)" >> $OUT/run-spot.log
done
