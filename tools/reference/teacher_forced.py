"""Teacher-forced top-1 and top-2 margin of another model file on a reference's sequences.

Used to decide which side is wrong where Cairn and llama.cpp disagree on a quantized model:
dequantize the quantized file to F32 with llama.cpp (`llama-quantize --allow-requantize
IN OUT F32`, which keeps each weight's exact dequantized value) and score the same token
sequences with it. On the F32 file llama.cpp multiplies f32 by f32, with no rounding of the
activations to 8 bits (its CPU K-quant and Q8_0 kernels round them to Q8_K/Q8_0), so its
picks are what the quantized weights give with exact arithmetic.

    /root/.cache/cairn/refenv/bin/python tools/reference/teacher_forced.py \
        --model /tmp/q4_k_m-as-f32.gguf --reference tests/data/reference-q4_k_m.json \
        [--positions code:5,long:17] [--annotate]

Prints, per listed position (or every position where the reference's margin is at least
0.3 and this model's top-1 differs), the reference's top-1 and margin beside this model's.
With --annotate it also writes this model's picks into the reference file, as each case's
`exact_top1` and `exact_margin` (and `exact_model`, how they were made), which the Q4_K_M
test uses where llama.cpp's two arithmetics pick differently (tests/tests/model.rs).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_model import batched_logits, open_model, top2  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--positions", default="", help="case:position,... to print")
    ap.add_argument("--annotate", action="store_true", help="write exact_top1/exact_margin into the reference")
    args = ap.parse_args()
    ref = json.load(open(args.reference))
    wanted = {}
    for item in filter(None, args.positions.split(",")):
        name, pos = item.split(":")
        wanted.setdefault(name, set()).add(int(pos))

    llm = open_model(args.model)
    agree = total = 0
    for case in ref["cases"]:
        rows = batched_logits(llm, case["prompt_tokens"], case["continuation"])
        case["exact_top1"], case["exact_margin"] = [], []
        for i, row in enumerate(rows):
            top1, _, margin = top2(row)
            case["exact_top1"].append(top1)
            case["exact_margin"].append(margin)
            want, want_margin = case["top1"][i], case["margin"][i]
            total += 1
            agree += top1 == want
            firm_miss = want_margin >= 0.3 and top1 != want
            if i in wanted.get(case["name"], ()) or firm_miss:
                print(
                    f"{case['name']}:{i} reference top-1 {want} (margin {want_margin:.3f}); "
                    f"this model top-1 {top1} (margin {margin:.3f}), "
                    f"logit of the reference's pick {row[want]:.3f}"
                )
    print(f"top-1 agreement with the reference: {agree}/{total}")
    if args.annotate:
        ref["exact_model"] = (
            "exact_top1/exact_margin: llama.cpp on the same file dequantized to F32 "
            "(llama-quantize --allow-requantize IN OUT F32), one batched teacher-forced pass "
            "(tools/reference/teacher_forced.py)"
        )
        with open(args.reference, "w", encoding="utf-8") as f:
            json.dump(ref, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"annotated {args.reference}")


if __name__ == "__main__":
    main()
