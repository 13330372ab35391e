#!/bin/bash
# Call A (4 GPUs): the split bench over 4 and 2, and the one-worker cluster with placement choosing the split.
. .gpu17/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -6
B="--backend cuda --prompt-tokens 128 --gen-tokens 128 --runs 2 --concurrency 16"
echo "== split all 8b over 4"; timeout 200 $C bench $B --device cuda:0,cuda:1,cuda:2,cuda:3 --split all --synthetic 8b --json > $OUT/split-8b-x4.json 2> $OUT/split-8b-x4.err; grep -vE "INFO|^\s*$" $OUT/split-8b-x4.err | tail -12
echo "== split tensor 8b over 2"; timeout 120 $C bench $B --device cuda:0,cuda:1 --split tensor --synthetic 8b --json > $OUT/split-8b-x2.json 2> $OUT/split-8b-x2.err; grep -vE "INFO|^\s*$" $OUT/split-8b-x2.err | tail -8
if command -v nsys >/dev/null; then for d in cuda:0 cuda:0,cuda:1; do
  echo "== nsys 8b tensor over $d"
  timeout 100 nsys profile -t cuda --cuda-graph-trace=node -o /tmp/tp --force-overwrite true $C bench --backend cuda --device $d --split tensor --synthetic 8b --prompt-tokens 16 --gen-tokens 64 --runs 1 > /dev/null 2>&1
  nsys stats -q -r cuda_gpu_kern_sum -f csv -o $OUT/kern-$(echo $d | tr -d ':,') /tmp/tp.nsys-rep > /dev/null 2>&1; head -14 $OUT/kern-*$(echo $d | tr -d ':,')*.csv | cut -c1-200
done; else echo "no nsys"; fi
CB="--backend cuda --devices cuda:0,cuda:1,cuda:2,cuda:3 --workers 1,2,4 --concurrent 16 --gen-tokens 128 --no-recovery --json --one-worker"
for s in 8b; do
  mkdir -p $OUT/logs-$s
  echo "== cluster $s one worker, placement chooses"; timeout ${T:-220} $C bench cluster --synthetic $s $CB --logs $OUT/logs-$s > $OUT/cluster-$s-one-auto.json 2> $OUT/cluster-$s-one-auto.err; tail -3 $OUT/cluster-$s-one-auto.err
  grep -h "worker calibrated\|placement ready" $OUT/logs-$s/*serve.log | sed "s/\x1b\[[0-9;]*m//g" | cut -c1-260 | tail -6
done
python3 - <<'PY'
import json,os
for s in ["8b"]:
    f=os.environ["OUT"]+f"/cluster-{s}-one-auto.json"
    try: d=json.load(open(f))
    except Exception as e: print(f, e); continue
    print(s, "one device", d.get("one_device"))
    for c in d["clusters"]:
        print(" ", c["workers"], c.get("placement_split"), round(c["decode_tokens_per_s"],1), round(c["vs_one_device"],3), (c.get("concurrent") or {}).get("aggregate_tokens_per_s"), "pred", c.get("predicted_tokens_per_s"))
PY
