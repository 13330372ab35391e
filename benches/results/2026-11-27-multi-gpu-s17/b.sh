#!/bin/bash
# Call B (4 GPUs): where a tensor-split step goes, the chain across processes on 1, 2 and 4 GPUs, 135M one worker, the cuda tests.
. .gpu17/env.sh
echo "== plain bench 8b and 135m (dispatches per step)"
for s in 8b 135m; do timeout 60 $C bench --backend cuda --synthetic $s --prompt-tokens 128 --gen-tokens 128 --runs 2 2>&1 | grep -E "decode|dispatch|prefill" | head -8; done
for d in cuda:0 cuda:0,cuda:1,cuda:2,cuda:3; do
  echo "== gpu time per run, 8b tensor over $d"
  CAIRN_CUDA_GPU_TIME=1 NO_COLOR=1 timeout 60 $C bench --backend cuda --device $d --split tensor --synthetic 8b --prompt-tokens 16 --gen-tokens 48 --runs 1 > /tmp/g.log 2>&1
  grep "cuda run timed" /tmp/g.log | tail -8 | sed "s/\x1b\[[0-9;]*m//g" | cut -c30-250
  grep -E "tok/s|decode" /tmp/g.log | tail -3
done
CB="--backend cuda --devices cuda:0,cuda:1,cuda:2,cuda:3 --workers 1,2,4 --concurrent 16 --gen-tokens 128 --no-recovery --json"
for s in 8b; do
  echo "== cluster $s chain"; timeout ${T:-170} $C bench cluster --synthetic $s $CB > $OUT/cluster-$s-chain.json 2> $OUT/cluster-$s-chain.err; tail -2 $OUT/cluster-$s-chain.err
done
python3 - <<'PY'
import json,os
for s in ["8b"]:
    f=os.environ["OUT"]+f"/cluster-{s}-chain.json"
    try: d=json.load(open(f))
    except Exception as e: print(f, e); continue
    print(s, "one device", d.get("one_device"))
    for c in d["clusters"]:
        print(" ", c["workers"], round(c["decode_tokens_per_s"],1), round(c["vs_one_device"],3), (c.get("concurrent") or {}).get("aggregate_tokens_per_s"))
PY
s=135m; mkdir -p $OUT/logs-$s
echo "== cluster $s one worker, placement chooses"; timeout 120 $C bench cluster --synthetic $s $CB --one-worker --logs $OUT/logs-$s > $OUT/cluster-$s-one-auto.json 2> $OUT/cluster-$s-one-auto.err; tail -2 $OUT/cluster-$s-one-auto.err
grep -h "worker calibrated\|placement ready" $OUT/logs-$s/*serve.log | sed "s/\x1b\[[0-9;]*m//g" | cut -c1-300 | tail -6
python3 -c "
import json; d=json.load(open('$OUT/cluster-135m-one-auto.json')); print('one device', d.get('one_device'))
[print(' ', c['workers'], c.get('placement_split'), round(c['decode_tokens_per_s'],1), round(c['vs_one_device'],3), (c.get('concurrent') or {}).get('aggregate_tokens_per_s')) for c in d['clusters']]"
cd $W
echo "== kernels (cuda, cpu)"; CUDA_VISIBLE_DEVICES=0 timeout 200 ./kernels 2>&1 | grep -E "^test |test result|panicked" | tail -30
