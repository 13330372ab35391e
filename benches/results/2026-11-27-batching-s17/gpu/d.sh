#!/bin/bash
# Call D (issue 19): busy share with a stage per GPU, cut by count and by served times; spot checks on kept caches.
. .gpu17/env.sh
CB="--synthetic 8b --backend cuda --workers 2 --gen-tokens 128 --no-recovery --json"
run() { name=$1; shift
  echo "== $name"; timeout ${T:-110} $C bench cluster $CB "$@" > $OUT/$name.json 2> $OUT/$name.err; tail -2 $OUT/$name.err | cut -c1-200
  python3 -c "
import json; d=json.load(open('$OUT/$name.json')); print('one device', round(d['one_device']['decode_tokens_per_s'],1))
for c in d['clusters']:
    cc=c.get('concurrent') or {}
    print(' ', c['workers'], [ (s['start'],s['end']) for s in c['stages']], 'single', round(c['decode_tokens_per_s'],1), 'at once', cc.get('requests'), round(cc.get('aggregate_tokens_per_s',0),1), 'busy', cc.get('busy') or cc.get('utilization') or [ (s.get('busy'), s.get('mean_batch')) for s in cc.get('stages',[])], 'checks', c.get('spot_checks'), 'gap', c.get('longest_gap_ms'), 'identical', cc.get('outputs_identical'))
" 2>&1 | tail -4
}
run gpu2-c4-layers --devices cuda:0,cuda:1 --concurrent 4 --balance layers
run gpu2-c4-served --devices cuda:0,cuda:1 --concurrent 4 --balance served
run gpu2-c16-served --devices cuda:0,cuda:1 --concurrent 16 --balance served
run gpu1-c4-spot --devices cuda:0 --concurrent 4 --spot-check-rate 0.01
