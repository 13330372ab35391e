#!/bin/sh
# Interleaved rounds: Cairn before (main's linear.rs) and after (this branch), and llama.cpp's
# llama-batched-bench, 2 threads, default model, prompt 128, 128 generated, 1/4/16 sequences.
# Usage: ab-batched.sh BASE_CAIRN NEW_CAIRN OUTDIR
M=$HOME/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf
LL=/tmp/llbench-build/bin/llama-batched-bench
cairn() { uptime; "$1" bench --model "$M" --backend cpu --cpu-threads 2 --prompt-tokens 128 --gen-tokens 128 --runs 1 --concurrency 1,4,16; uptime; }
llama() { uptime; "$LL" -m "$M" -c 4608 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,4,16 -t 2 -kvu "$@"; uptime; }
cairn "$1" > "$3/r1-cairn-base.txt" 2>&1
cairn "$2" > "$3/r1-cairn-new.txt" 2>&1
llama > "$3/r1-llama.txt" 2>&1
cairn "$2" > "$3/r2-cairn-new.txt" 2>&1
cairn "$1" > "$3/r2-cairn-base.txt" 2>&1
llama --poll 0 > "$3/r2-llama-poll0.txt" 2>&1
