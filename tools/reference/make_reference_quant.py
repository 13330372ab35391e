"""Produce tests/data/reference-q4_k_m.json (or another format's): llama.cpp's greedy
continuation, top-1 and top-2 margins on the default model requantized by `cairn quantize`,
for the prompts of make_reference.py. The test quantizes the model again with the library
function and checks the file's sha256 against the one recorded here before comparing.

    target/debug/cairn quantize --allow-requantize \
        ~/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-q4_k_m.gguf Q4_K_M
    /root/.cache/cairn/refenv/bin/python tools/reference/make_reference_quant.py \
        --model /tmp/smollm2-q4_k_m.gguf --out tests/data/reference-q4_k_m.json

The Q5_K_M and Q6_K references hold a few cases (CI runs them on the cpu backend only):

    ... make_reference_quant.py --model /tmp/smollm2-q5_k_m.gguf --type Q5_K_M \
        --cases short,code,chinese,chat_capital --out tests/data/reference-q5_k_m.json
    ... make_reference_quant.py --model /tmp/smollm2-q6_k.gguf --type Q6_K \
        --cases short,chinese,chat_capital --out tests/data/reference-q6_k.json

and each then gets teacher_forced.py --annotate on its file dequantized to F32.

Same settings as make_reference.py (tools/reference/reference_model.py): CPU, 2 threads,
greedy argmax, f32 KV cache.
"""

import argparse
import hashlib
import json
import os
import sys

import llama_cpp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_reference import N_CONTINUATION, PROMPTS  # noqa: E402
from reference_model import chat_formatter, greedy, open_model, prompt_text, tokenize  # noqa: E402


def sha256sum(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the file cairn quantize wrote")
    ap.add_argument("--out", required=True)
    ap.add_argument("--source", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    if not os.path.exists(args.model):
        sys.exit(f"model not found: {args.model}")

    llm = open_model(args.model)
    formatter = chat_formatter(llm)

    cases = []
    wanted = [c for c in args.cases.split(",") if c]
    for name, prompt, chat in PROMPTS:
        if wanted and name not in wanted:
            continue
        prompt_tokens = tokenize(llm, prompt_text(formatter, prompt, chat))
        continuation, top1, top2s, margin = greedy(llm, prompt_tokens, N_CONTINUATION)
        cases.append(
            {
                "name": name,
                "prompt_tokens": prompt_tokens,
                "continuation": continuation,
                "top1": top1,
                "top2_logits": top2s,
                "margin": margin,
            }
        )
        print(f"{name:16} prompt={len(prompt_tokens):4} min_margin={min(margin):.4f}", flush=True)

    out = {
        "generator": "tools/reference/make_reference_quant.py",
        "made_by": f"cairn quantize --allow-requantize {args.source} OUT {args.type}",
        "model_sha256": sha256sum(args.model),
        "type": args.type,
        "llama_cpp_python_version": llama_cpp.__version__,
        "settings": "as make_reference.py: CPU, 2 threads, greedy argmax, f32 KV cache; top1 == continuation",
        "cases": cases,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
