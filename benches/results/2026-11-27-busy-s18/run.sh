# Lead, round 1: stages' busy shares in a two-GPU cluster (issue 19), from the cumulative counters
# (protocol 7) and the per-pass trace, at 4 and 16 at once, cut by layers and by served times.
for spec in "4 layers 384" "4 served 384" "16 layers 256" "16 served 256"; do
  set -- $spec; c=$1; bal=$2; g=$3; tag=c$c-$bal
  mkdir -p $OUT/logs-$tag
  echo "== cluster 8b, a stage per GPU, $c at once, --balance $bal, $g generated"
  RUST_LOG=warn,cairn_native=info,cairn_native::worker::stage_thread=debug timeout 100 $C bench cluster --synthetic 8b --backend cuda --devices cuda:0,cuda:1 --workers 2 --concurrent $c --gen-tokens $g --no-recovery --json --balance $bal --logs $OUT/logs-$tag > $OUT/$tag.json 2> $OUT/$tag.err
  tail -2 $OUT/$tag.err | cut -c1-300
  python3 - $OUT/$tag.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
for c in d.get("clusters",[]):
    cc=c.get("concurrent") or {}
    print(c.get("workers"), "cut", [(s["start"],s["end"]) for s in (c.get("preview") or {}).get("stages",[])], "single", round(c.get("decode_tokens_per_s",0),1), "agg", round(cc.get("aggregate_tokens_per_s") or 0,1), "identical", cc.get("outputs_identical"))
    for s in cc.get("stages",[]): print("   busy", s.get("busy"), "batch", s.get("mean_batch"), "windows", s.get("busy_windows"), s.get("mean_batch_windows"))
PY
  python3 $W/passes.py $OUT/logs-$tag | grep -v "   seqs"
  rm -f $OUT/logs-$tag/baseline.log
done
