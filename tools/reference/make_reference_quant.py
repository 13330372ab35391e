"""Produce tests/data/reference-q4_k_m.json (or another format's): llama.cpp's greedy
continuation, top-1 and top-2 margins on the default model requantized by `cairn quantize`,
for the prompts of make_reference.py. The test quantizes the model again with the library
function and checks the file's sha256 against the one recorded here before comparing.

    target/debug/cairn quantize --allow-requantize \
        ~/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-q4_k_m.gguf Q4_K_M
    /root/.cache/cairn/refenv/bin/python tools/reference/make_reference_quant.py \
        --model /tmp/smollm2-q4_k_m.gguf --out tests/data/reference-q4_k_m.json

Same settings as make_reference.py: CPU, 2 threads, greedy argmax, f32 KV cache.
"""

import argparse
import hashlib
import json
import os
import sys

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_reference import N_CONTINUATION, PROMPTS, greedy, token_text  # noqa: E402


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

    llm = Llama(
        model_path=args.model,
        n_ctx=2048,
        n_batch=2048,
        n_ubatch=512,
        n_threads=2,
        n_threads_batch=2,
        n_gpu_layers=0,
        logits_all=True,
        seed=0,
        flash_attn=False,
        type_k=0,
        type_v=0,
        verbose=False,
    )
    template = llm.metadata.get("tokenizer.chat_template")
    bos_id, eos_id = llm.token_bos(), llm.token_eos()
    bos_text = token_text(llm, bos_id) if bos_id >= 0 else ""
    eos_text = token_text(llm, eos_id) if eos_id >= 0 else ""
    formatter = Jinja2ChatFormatter(template, eos_token=eos_text, bos_token=bos_text, add_generation_prompt=True)

    cases = []
    wanted = [c for c in args.cases.split(",") if c]
    for name, prompt, chat in PROMPTS:
        if wanted and name not in wanted:
            continue
        text = formatter(messages=[{"role": "user", "content": prompt}]).prompt if chat else prompt
        prompt_tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
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
