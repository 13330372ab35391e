#!/bin/bash
# Session 19, 4 GPUs: the engine bench over 4 and 2 devices (8B shape), merged main's defaults
# (layer split pipelined in micro-batches, tensor split with the head split and embedding copies).
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
for d in cuda:0,cuda:1,cuda:2,cuda:3; do
  echo "== 8b over $d (--split all), 1 and 16 at once"
  timeout 100 $C bench --backend cuda --device $d --synthetic 8b --split all --prompt-tokens 128 --gen-tokens 96 --runs 2 --concurrency 16 2>&1 | grep -E "tok/s" | cut -c1-200
done
echo "== old behaviour, 8b over 4"
CAIRN_LAYER_PIPELINE=off CAIRN_HEAD_SPLIT=off CAIRN_EMBED_COPIES=off timeout 100 $C bench --backend cuda --device cuda:0,cuda:1,cuda:2,cuda:3 --synthetic 8b --split all --prompt-tokens 128 --gen-tokens 96 --runs 2 --concurrency 16 2>&1 | grep -E "tok/s" | cut -c1-200
