#!/bin/bash
# multi19, round 1 (2 GPUs): issue 24. A = this branch's defaults (layer split pipelined in
# micro-batches of 4 sequences; tensor split: the head split by vocabulary rows over the GPUs
# and the embedding copied to every GPU);
# B = the old behaviour (CAIRN_LAYER_PIPELINE=off CAIRN_HEAD_SPLIT=off CAIRN_EMBED_COPIES=off). Same binary, A/B/A/B.
# About 3.5 minutes. Prints the tables; JSON into $OUT.
nvidia-smi --query-gpu=name --format=csv,noheader
B="--backend cuda --device cuda:0,cuda:1 --synthetic 8b --prompt-tokens 128 --gen-tokens 96 --runs 2 --concurrency 16"
OLD="env CAIRN_LAYER_PIPELINE=off CAIRN_HEAD_SPLIT=off CAIRN_EMBED_COPIES=off"
run() { # label, env-prefix, args...
  local l=$1 e=$2; shift 2
  echo "== $l"; timeout ${TO:-60} $e $C bench "$@" > $OUT/$l.txt 2> $OUT/$l.err; grep -E "tok/s|not run" $OUT/$l.txt | cut -c1-200; grep -iE "error|panic" $OUT/$l.err | tail -3
}
run split-all-new-1 "" $B --split all
run split-all-old-1 "$OLD" $B --split all
run split-all-new-2 "" $B --split all
run split-all-old-2 "$OLD" $B --split all
run layers-micro8 "env CAIRN_LAYER_PIPELINE=8" $B --split layers
CB="--backend cuda --devices cuda:0,cuda:1 --workers 2 --one-worker --split layers --synthetic 8b --prompt-tokens 32 --gen-tokens 96 --runs 1 --concurrent 16 --no-recovery --json"
for v in new old; do
  e=""; [ $v = old ] && e="$OLD"
  echo "== cluster one worker --split layers, $v"
  timeout 55 $e $C bench cluster $CB > $OUT/cluster-layers-$v.json 2> $OUT/cluster-layers-$v.err; tail -2 $OUT/cluster-layers-$v.err | cut -c1-200
  python3 -c "
import json; d=json.load(open('$OUT/cluster-layers-$v.json')); print('  one device', d.get('one_device'))
[print('  ', c['workers'], c.get('placement_split'), 'single', round(c['decode_tokens_per_s'],1), round(c['vs_one_device'],3), '16 at once', (c.get('concurrent') or {}).get('aggregate_tokens_per_s'), 'same', (c.get('concurrent') or {}).get('outputs_identical'), 'mean batch', [s.get('mean_batch') for s in (c.get('concurrent') or {}).get('stages',[])]) for c in d['clusters']]" 2>&1 | tail -4
done
# The tensor split (now with the head split) on two CUDA devices against the cpu's logits
# (test binary from this tree: target/debug/deps/model-725163032068d5db).
echo "== test synthetic_model_split_by_tensors_with_every_device_matches_the_cpu"
CAIRN_TEST_REQUIRE_GPU=1 timeout 60 target/debug/deps/model-725163032068d5db synthetic_model_split_by_tensors_with_every_device_matches_the_cpu 2>&1 | grep -E "^test |test result|panicked|assert" | head -8
