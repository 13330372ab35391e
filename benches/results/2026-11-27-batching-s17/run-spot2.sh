#!/bin/sh
# Session 17, with prompts computed ahead of a request's first check: the runs of run-spot.sh
# again at rate 0.05. Usage: run-spot2.sh CAIRN OUTDIR
set -u
CAIRN=$1; OUT=$2
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/xdg}
load() { cut -d' ' -f1-3 /proc/loadavg; }
for shape in 135m 8b-thin; do
  f=$OUT/cluster-$shape-c4-spot0.05-prefetch.json
  gen=64; [ $shape = 135m ] && gen=128
  mkdir -p $OUT/logs-$shape-spot0.05-prefetch
  echo "$(date -u +%T) start $f load $(load)" >> $OUT/run-spot.log
  RUST_LOG=info,cairn_native::coord::verify=debug timeout 900 $CAIRN bench cluster --synthetic $shape \
    --backend cpu --workers 2 --concurrent 4 --prompt-tokens 32 --gen-tokens $gen --runs 3 \
    --no-recovery --json --spot-check-rate 0.05 --logs $OUT/logs-$shape-spot0.05-prefetch > $f 2> $f.err
  echo "$(date -u +%T) end rc=$? load $(load)" >> $OUT/run-spot.log
done
