#!/usr/bin/env python3
"""Produce tests/data/reference.json: llama.cpp's tokenization and greedy decoding of the
default model, which Cairn's correctness tests compare against.

Run with the reference virtual environment (llama-cpp-python, CPU build):

    /root/.cache/cairn/refenv/bin/python tools/reference/make_reference.py \
        [--model PATH] [--out tests/data/reference.json]

Everything runs on the CPU with 2 threads and greedy (argmax) decoding, so the output is
reproducible for a given llama.cpp build. See docs/tokenizer.md.
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np

import llama_cpp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_model import (  # noqa: E402
    batched_logits,
    chat_formatter,
    greedy,
    open_model,
    prompt_text,
    tokenize,
)

DEFAULT_MODEL = os.path.expanduser("~/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf")
N_CONTINUATION = 32

LONG_TEXT = (
    "Cairns are piles of stones that walkers build along mountain paths. In fog or snow, when "
    "the trail disappears beneath their boots, a line of cairns is often the only thing that "
    "separates a safe descent from a dangerous one. Nobody owns them and nobody is paid to "
    "maintain them; each traveller who passes adds a stone or straightens one that the wind has "
    "knocked over. Over decades the piles grow taller, and some of the oldest ones on the high "
    "passes of Scotland, Norway and the Alps are older than the villages below them.\n\n"
    "There is an etiquette to cairns. You should never take stones from one to build another, "
    "because a cairn that shrinks can mislead the next person who trusts it. In national parks, "
    "rangers sometimes remove cairns that were built in the wrong places, since a pile of rocks "
    "at a scenic viewpoint can draw hikers away from the marked route and onto fragile ground. "
    "In the desert of the American southwest, where the rock is bare and footprints vanish, "
    "the small cairns called ducks are the official trail markers, and park staff ask visitors "
    "to leave them exactly as they are.\n\n"
    "Building a good cairn is harder than it looks. The base must be wide and the stones must "
    "lock together, so that the weight of the upper layers presses the lower ones into place "
    "rather than pushing them apart. A well made cairn can stand for a century of storms, while "
    "a careless one will fall in the first winter. Experienced builders choose flat stones for "
    "the bottom, wedge small pebbles into the gaps, and finish with a single pointed stone on top "
    "so that the marker can be seen against the sky from a long way off. When you reach the "
    "summit, look back along the ridge: the line of small towers you followed is the work of "
    "thousands of strangers, and the stone you add today will guide someone you will never meet."
)

# (name, prompt, chat): chat cases go through the model's chat template as one user message.
PROMPTS = [
    ("short", "The capital of France is", False),
    ("long", LONG_TEXT + "\n\nIn one sentence, the main idea of this text is that", False),
    (
        "code",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
        "        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n"
        "    return b\n\n\ndef is_prime(n):\n",
        False,
    ),
    ("french", "La cuisine française est célèbre dans le monde entier. Les plats les plus connus sont", False),
    ("chinese", "北京是中国的首都，也是一座历史悠久的城市。", False),
    ("russian", "Москва — столица России. Самая длинная река в Европе называется", False),
    (
        "whitespace",
        "Name:\tAlice\nAge:\t\t30\n\n  Hobbies:   hiking,  chess!!  🎉🚀\r\n\tNotes —  \"quoted\"… (x) [y] {z}\n   ",
        False,
    ),
    ("counting", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", False),
    (
        "special_in_text",
        "<|im_start|>user\nWhat is the largest planet in the solar system?<|im_end|>\n<|im_start|>assistant\n",
        False,
    ),
    ("chat_capital", "What is the capital of France?", True),
    ("chat_counting", "Count from 1 to 20, separated by commas.", True),
    ("chat_french", "Écris une phrase sur la mer, s'il te plaît.", True),
]

# Pure tokenizer cases: (text, parse_special). Ids come from tokenize(add_bos=False).
TOKENIZER_CASES = [
    ("", True),
    (" ", True),
    ("   ", True),
    ("\n", True),
    ("\n\n\n", True),
    ("\t\tindented", True),
    ("a\tb  c   d    e", True),
    ("trailing spaces   ", True),
    ("line one\r\nline two\r", True),
    ("0123456789", True),
    ("3.14159 and 2,718 and 1e-10", True),
    ("Order #12345 costs $1,299.99 (20% off)", True),
    ("Ⅻ ½ ² ٣٤٥ ０１２", True),
    ("Hello world", True),
    (" Hello", True),
    ("don't you're I'll we've she'd it's", True),
    ("DON'T YOU'RE", True),
    ("émigré naïve café Zürich", True),
    ("日本語のテキストと中文文本", True),
    ("Привет, мир! Ελληνικά", True),
    ("👩‍👩‍👧 family 🏳️‍🌈 flag", True),
    ("non\u00a0breaking\u3000space", True),
    ("<<>>{}[]()!?...---___***", True),
    ("<|im_start|>user\nhi<|im_end|>\n", True),
    ("<|im_start|>user\nhi<|im_end|>\n", False),
    ("<|endoftext|>", True),
    ("<|endoftext|>", False),
    ("<|im_start|><|im_end|><|im_start|>", True),
    ("text<|im_end|>more", True),
    ("<|im_start", True),
    ("<repo_name>x<reponame>y<file_sep>", True),
    ("<repo_name>x<reponame>y<file_sep>", False),
    ("<jupyter_code>print(1)<jupyter_output>1<empty_output>", True),
]


def md5sum(path):
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "..", "tests", "data", "reference.json"))
    args = ap.parse_args()

    if not os.path.exists(args.model):
        sys.exit(f"model not found: {args.model} (fetch it with scripts/fetch-model.sh)")

    llm = open_model(args.model)
    vocab = llm._model.vocab
    n_vocab = llm.n_vocab()
    bos_id, eos_id = llm.token_bos(), llm.token_eos()
    formatter = chat_formatter(llm)

    cases = []
    for name, prompt, chat in PROMPTS:
        text = prompt_text(formatter, prompt, chat)
        prompt_tokens = tokenize(llm, text)
        continuation, top1, top2s, margin = greedy(llm, prompt_tokens, N_CONTINUATION)
        incremental = np.array(llm.scores[len(prompt_tokens) - 1 : len(prompt_tokens) + N_CONTINUATION - 1])
        batched = batched_logits(llm, prompt_tokens, continuation)
        batched_top1 = [int(i) for i in np.argmax(batched, axis=1)]
        batched_diff = float(np.max(np.abs(batched - incremental)))
        cont_text = llm.detokenize(continuation, special=True).decode("utf-8", errors="replace")
        cases.append(
            {
                "name": name,
                "prompt": prompt,
                "raw": not chat,
                "text": text,
                "prompt_tokens": prompt_tokens,
                "continuation": continuation,
                "continuation_text": cont_text,
                "top1": top1,
                "top2_logits": top2s,
                "margin": margin,
                "min_margin": min(margin),
                # llama.cpp's own kernel noise: the same positions evaluated in one batch.
                "batched_max_abs_logit_diff": round(batched_diff, 4),
                "batched_argmax_disagreements": sum(a != b for a, b in zip(batched_top1, top1)),
            }
        )
        print(
            f"{name:16} prompt={len(prompt_tokens):4} min_margin={min(margin):.4f} "
            f"batched_diff={batched_diff:.4f} {cont_text[:50]!r}",
            flush=True,
        )

    tokenizer_cases = []
    for text, special in TOKENIZER_CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        tokenizer_cases.append({"text": text, "parse_special": special, "ids": ids})

    eog_ids = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    out = {
        "generator": "tools/reference/make_reference.py",
        "model_file": os.path.basename(args.model),
        "model_md5": md5sum(args.model),
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "settings": {
            "n_ctx": 2048,
            "n_threads": 2,
            "n_gpu_layers": 0,
            "flash_attn": False,
            "kv_cache_type": "f32",
            "sampling": "greedy argmax",
            "n_continuation": N_CONTINUATION,
            "chat_template": "GGUF tokenizer.chat_template rendered by llama-cpp-python's Jinja2ChatFormatter "
            "(trim_blocks, lstrip_blocks), one user message, add_generation_prompt; then tokenized "
            "with special=True and BOS only if the model asks",
            "logits": "continuation, top1, top2_logits and margin all come from one greedy loop "
            "with logits kept for all positions (prompt in one batch, then one token at a time), "
            "so top1 == continuation; batched_* compare with one batched evaluation of "
            "prompt + continuation[:-1]",
        },
        "vocab": {"n_vocab": n_vocab, "bos_id": bos_id, "eos_id": eos_id, "eog_ids": eog_ids},
        "cases": cases,
        "tokenizer_cases": tokenizer_cases,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
