#!/usr/bin/env python3
"""Produce tests/data/<family>-reference.json: llama.cpp's teacher-forced logits on the tiny
random-weight model of each family that Cairn's tests write (engine/src/model/tiny.rs).

The model files come from Cairn's own deterministic writer:

    cargo run -p cairn-engine --example tiny_model -- qwen2 /tmp/tiny-qwen2.gguf 1

then, with the reference virtual environment (llama-cpp-python, CPU build):

    /root/.cache/cairn/refenv/bin/python tools/reference/family_logits.py \
        --family qwen2 --model /tmp/tiny-qwen2.gguf --out tests/data/qwen2-reference.json

The JSON records the file's model id (Cairn's `gguf::partial::model_id`: a SHA-256 of the
bytes and length), so the test notices when the writer's output changes and this must be
rerun. For every position of a fixed token sequence it records llama.cpp's top-1, top-2 and
their margin, and full logit rows at a few positions. CPU, 2 threads: reproducible for a given
llama.cpp build.
"""

import argparse
import hashlib
import json

import numpy as np

import llama_cpp
from llama_cpp import Llama

N_TOKENS = 16
# Positions whose full logit rows are kept (the rest keep top-1/top-2 only: files stay small).
FULL_ROWS = [3, 8, 15]


def model_id(data: bytes) -> str:
    assert len(data) <= 8 << 20, "model_id hashes only the first 8 MiB"
    return hashlib.sha256(data + len(data).to_bytes(8, "little")).hexdigest()[:32]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    data = open(args.model, "rb").read()
    tokens = [(37 * i + 11) % 318 + 2 for i in range(N_TOKENS)]
    llm = Llama(
        model_path=args.model,
        n_ctx=64,
        n_batch=64,
        n_threads=2,
        logits_all=True,
        verbose=False,
    )
    llm.eval(tokens)
    scores = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    positions = []
    for row in scores:
        order = np.argsort(-row, kind="stable")
        positions.append(
            {
                "top1": int(order[0]),
                "top2": int(order[1]),
                "margin": round(float(row[order[0]] - row[order[1]]), 5),
            }
        )
    out = {
        "family": args.family,
        "model_id": model_id(data),
        "llama_cpp_python": llama_cpp.__version__,
        "tokens": tokens,
        "positions": positions,
        "full_rows": {str(p): [round(float(v), 4) for v in scores[p]] for p in FULL_ROWS},
    }
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
