# Lead, final call on merged main (session 18): cairn bench on every GPU backend with the defaults
# (auto kernels, pipelined decode), prompt 512 and 128 generated as llama-bench's pp512/tg128;
# then the GPU tests of the kernels and the synthetic models.
for s in 135m 8b; do for b in cuda vulkan wgpu; do
  printf "%-5s %-6s " $s $b
  timeout 80 $C bench --backend $b --synthetic $s --prompt-tokens 512 --gen-tokens 128 --runs 2 > $OUT/bench-$s-$b.txt 2>&1
  echo "rc=$? $(grep -E '^  (prefill|decode) ' $OUT/bench-$s-$b.txt | tr -s ' ' | tr '\n' ' ')"
done; done
echo "== kernels test ($(date -u +%T))"
CAIRN_TEST_REQUIRE_GPU=1 timeout 200 $W/kernels 2>&1 | grep -E "^test |panicked|element|result" | tail -40
echo "== model test, synthetic models ($(date -u +%T))"
CAIRN_TEST_REQUIRE_GPU=1 timeout 150 $W/model synthetic 2>&1 | grep -E "^test |panicked|element|result" | tail -20
echo "done $(date -u +%T)"
cd $OUT && tar czf benches.tgz bench-*.txt && rm -f bench-*.txt
