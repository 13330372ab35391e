#!/bin/bash
# multi19, round 2 (2 GPUs), issue 24; one binary, variants by env. About 4 minutes.
# 1. engine bench, split by layers, 16 at once: micro-batches of 8 (new default) / 4 / off.
# 2. cluster path, one worker over both GPUs, by layers then by tensors: new / old, 3 single runs each.
# 3. where a tensor-split step goes now (CAIRN_CUDA_GPU_TIME=1), head split and embedding copies on.
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
B="--backend cuda --device cuda:0,cuda:1 --synthetic 8b --prompt-tokens 128 --gen-tokens 96 --runs 2 --concurrency 16 --split layers"
for v in 8 4 off; do
  echo "== bench --split layers, CAIRN_LAYER_PIPELINE=$v"
  CAIRN_LAYER_PIPELINE=$v timeout 40 $C bench $B > $OUT/layers-$v.txt 2> $OUT/layers-$v.err; grep -E "tok/s|not run" $OUT/layers-$v.txt | cut -c1-200; grep -iE "error|panic" $OUT/layers-$v.err | tail -2
done
OLD="env CAIRN_LAYER_PIPELINE=off CAIRN_HEAD_SPLIT=off CAIRN_EMBED_COPIES=off"
for s in layers tensor; do for v in new old; do
  e=""; [ $v = old ] && e="$OLD"
  CB="--backend cuda --devices cuda:0,cuda:1 --workers 2 --one-worker --split $s --synthetic 8b --prompt-tokens 32 --gen-tokens 96 --runs 3 --concurrent 16 --no-recovery --json"
  echo "== cluster one worker --split $s, $v"
  timeout 45 $e $C bench cluster $CB > $OUT/cluster-$s-$v.json 2> $OUT/cluster-$s-$v.err; tail -1 $OUT/cluster-$s-$v.err | cut -c1-200
  python3 -c "
import json; d=json.load(open('$OUT/cluster-$s-$v.json')); print('  one device', d.get('one_device'))
[print('  ', c['workers'], c.get('placement_split'), 'single', round(c['decode_tokens_per_s'],1), round(c['vs_one_device'],3), '16 at once', (c.get('concurrent') or {}).get('aggregate_tokens_per_s'), 'same', (c.get('concurrent') or {}).get('outputs_identical')) for c in d['clusters']]" 2>&1 | tail -3
done; done
for v in on; do
  echo "== gpu time per run, 8b tensor over 2, head split $v"
  CAIRN_HEAD_SPLIT=$v CAIRN_EMBED_COPIES=$v CAIRN_CUDA_GPU_TIME=1 NO_COLOR=1 timeout 30 $C bench --backend cuda --device cuda:0,cuda:1 --split tensor --synthetic 8b --prompt-tokens 16 --gen-tokens 48 --runs 1 > $OUT/gputime-$v.log 2>&1
  grep "cuda run timed" $OUT/gputime-$v.log | tail -6 | sed "s/\x1b\[[0-9;]*m//g" | cut -c30-220
done
