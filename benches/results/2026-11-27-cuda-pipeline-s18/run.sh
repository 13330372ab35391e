# Lead: pipelined decode on cuda (step n+1 queued before step n's token is read through pinned
# memory and an event), off against on, alternating; then the pipelined-decode model test on
# every GPU device (cuda, vulkan, wgpu).
for s in 135m 8b; do for r in a b; do for p in 0 1; do
  printf "%-5s cuda pipeline=%s [%s]: " $s $p $r
  CAIRN_CUDA_PIPELINE=$p timeout 70 $C bench --backend cuda --synthetic $s --prompt-tokens 128 --gen-tokens 128 --runs 2 2>&1 | grep -E "^  decode |^  prefill " | tr -s ' ' | tr '\n' ' '; echo
done; done; done
echo "== model test: pipelined decode against serial on every GPU device"
CAIRN_TEST_REQUIRE_GPU=1 timeout 200 $W/model --test-threads 1 synthetic_model_pipelined 2>&1 | grep -E "^test |panicked|result|assert" | head -20
