#!/bin/sh
# Rounds 3 and 4 (as ab-batched.sh; llama.cpp at 1 and 4 sequences only, to keep it short).
M=$HOME/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf
LL=/tmp/llbench-build/bin/llama-batched-bench
cairn() { uptime; "$1" bench --model "$M" --backend cpu --cpu-threads 2 --prompt-tokens 128 --gen-tokens 128 --runs 1 --concurrency 1,4,16; uptime; }
llama() { uptime; "$LL" -m "$M" -c 4608 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,4 -t 2 -kvu "$@"; uptime; }
cairn "$1" > "$3/r3-cairn-base.txt" 2>&1
cairn "$2" > "$3/r3-cairn-new.txt" 2>&1
llama > "$3/r3-llama.txt" 2>&1
cairn "$2" > "$3/r4-cairn-new.txt" 2>&1
cairn "$1" > "$3/r4-cairn-base.txt" 2>&1
