#!/bin/bash
# Call C (4 GPUs): one worker over 1, 2 and 4 GPUs: placement choosing (new calibration), and forced tensor; 135M too.
. .gpu17/env.sh
CB="--backend cuda --devices cuda:0,cuda:1,cuda:2,cuda:3 --workers 1,2,4 --concurrent 16 --gen-tokens 128 --no-recovery --json --one-worker"
run() { s=$1; sp=$2; mkdir -p $OUT/logs-$s-$sp
  echo "== cluster $s one worker, split $sp"; timeout ${T:-150} $C bench cluster --synthetic $s $CB --split $sp --logs $OUT/logs-$s-$sp > $OUT/cluster-$s-one-$sp.json 2> $OUT/cluster-$s-one-$sp.err; tail -2 $OUT/cluster-$s-one-$sp.err
  grep -h "worker calibrated\|placement ready" $OUT/logs-$s-$sp/*serve.log | sed "s/\x1b\[[0-9;]*m//g" | cut -c60-330 | tail -6
  python3 -c "
import json; d=json.load(open('$OUT/cluster-$s-one-$sp.json')); print('one device', d.get('one_device'))
[print(' ', c['workers'], c.get('placement_split'), round(c['decode_tokens_per_s'],1), round(c['vs_one_device'],3), (c.get('concurrent') or {}).get('aggregate_tokens_per_s'), 'pred', c.get('predicted_tokens_per_s')) for c in d['clusters']]"
}
run 8b auto
run 135m auto
run 8b tensor
T=120 run 8b layers
