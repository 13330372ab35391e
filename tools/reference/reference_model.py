"""What the reference scripts share: llama.cpp opened on a model file with the reference
settings, chat prompts rendered and tokenized as the tests expect, and the two ways of scoring
a sequence (a greedy generation loop, and one batched teacher-forced pass).

Everything runs on the CPU with 2 threads, an f32 KV cache and no flash attention, so results
are reproducible for a given llama.cpp build.
"""

import numpy as np

from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

N_CTX = 2048
N_THREADS = 2


def open_model(path):
    """llama.cpp on `path`, CPU only, logits kept for every position."""
    return Llama(
        model_path=path,
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_ubatch=512,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        n_gpu_layers=0,
        logits_all=True,
        seed=0,
        # llama.cpp's most precise CPU configuration: an f32 KV cache and no flash attention
        # (whose f16 accumulation alone moves logits by up to ~0.5 on the default model). Cairn
        # keeps f32 keys and values, so this is the like-for-like reference.
        flash_attn=False,
        type_k=0,
        type_v=0,
        verbose=False,
    )


def token_text(llm, tid):
    return llm._model.token_get_text(tid)


def chat_formatter(llm):
    """The file's chat template as llama-cpp-python renders it: one user message, with the
    generation prompt."""
    template = llm.metadata.get("tokenizer.chat_template")
    bos_id, eos_id = llm.token_bos(), llm.token_eos()
    bos_text = token_text(llm, bos_id) if bos_id >= 0 else ""
    eos_text = token_text(llm, eos_id) if eos_id >= 0 else ""
    return Jinja2ChatFormatter(template, eos_token=eos_text, bos_token=bos_text, add_generation_prompt=True)


def prompt_text(formatter, prompt, chat):
    """A case's text: the prompt itself, or through the chat template as one user message."""
    if chat:
        return formatter(messages=[{"role": "user", "content": prompt}]).prompt
    return prompt


def tokenize(llm, text, special=True):
    # add_bos=True maps to llama.cpp's add_special: BOS/EOS only where the model asks.
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=special)


def top2(row):
    """The argmax of a logit row, its two largest logits and their difference."""
    order = np.argsort(-row, kind="stable")[:2]
    a, b = float(row[order[0]]), float(row[order[1]])
    return int(order[0]), [round(a, 4), round(b, 4)], round(a - b, 4)


def greedy(llm, prompt_tokens, n):
    """Greedy continuation as a generation loop computes it: the prompt evaluated in one
    batch, then one token at a time. Returns the continuation and, per position, the
    argmax, the two largest logits and their difference, from that same evaluation."""
    llm.reset()
    llm.eval(prompt_tokens)
    cont, top1, top2s, margins = [], [], [], []
    for _ in range(n):
        tok, t2, m = top2(llm.scores[llm.n_tokens - 1])
        cont.append(tok)
        top1.append(tok)
        top2s.append(t2)
        margins.append(m)
        if len(cont) < n:
            llm.eval([tok])
    return cont, top1, top2s, margins


def batched_logits(llm, prompt_tokens, continuation):
    """Logits at every continuation position from one batched evaluation of
    prompt + continuation[:-1] (teacher-forced), i.e. logits for all positions at once."""
    llm.reset()
    seq = list(prompt_tokens) + list(continuation[:-1])
    llm.eval(seq)
    return np.array(llm.scores[len(prompt_tokens) - 1 : len(seq)])
