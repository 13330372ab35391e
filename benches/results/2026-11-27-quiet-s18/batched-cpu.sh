#!/bin/sh
M=$HOME/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf
LL=/tmp/llbench-build/bin/llama-batched-bench
C=${C:-/tmp/fresh/target/release/cairn}
for r in 1 2; do
echo "== round $r cairn"; uptime; $C bench --model "$M" --backend cpu --cpu-threads 2 --prompt-tokens 128 --gen-tokens 128 --runs 1 --concurrency 1,4,16 2>&1 | grep -v INFO; uptime
echo "== round $r llama"; uptime; $LL -m "$M" -c 4608 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,4,8 -t 2 -kvu 2>&1 | grep -E '^\|'; uptime
done
