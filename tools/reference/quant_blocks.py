#!/usr/bin/env python3
"""Produce tests/data/quant_blocks.bin: random GGML blocks of every block format Cairn reads,
with their values as the `gguf` Python package (llama.cpp's gguf-py) dequantizes them. Cairn's
CPU reference (engine/src/quant) must decode the same bytes to the same values; the test is
`quant::tests::matches_gguf_py_on_random_blocks`.

gguf-py comes with llama.cpp's source (../shared/README.md says how to download the
`llama-cpp-python` source package without building it):

    pip install numpy
    PYTHONPATH=LLAMA_CPP/gguf-py python3 tools/reference/quant_blocks.py [--out PATH]

The file is a sequence of records, all little-endian:
    u32 GGML type id, u32 element count n, u32 byte count b, b bytes of blocks, n f32 values.

Blocks are random bytes except their f16 fields (scales, minimums), which are random finite
values of moderate size, so every quant bit pattern (including the extremes of 6-bit scales
and the sign of Q6_K's int8 scales) is exercised without overflow or NaN.
"""

import argparse
import os
import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

SEED = 18

# Byte offsets of the f16 fields inside one block of each format.
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}

# Blocks per format: 40 legacy blocks (1280 values) or 6 super-blocks (1536 values).
COUNTS = {t: (40 if GGML_QUANT_SIZES[t][0] == 32 else 6) for t in F16_FIELDS}


def random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    # Magnitudes from 2^-14 to 2^2 with random signs, and a few exact zeros.
    v = rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(-14.0, 2.0, n))
    v[rng.random(n) < 0.05] = 0.0
    return v.astype(np.float16)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.join(here, "..", "..", "tests", "data", "quant_blocks.bin")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=default_out)
    args = ap.parse_args()

    rng = np.random.default_rng(SEED)
    out = bytearray()
    for t, fields in F16_FIELDS.items():
        block_len, block_bytes = GGML_QUANT_SIZES[t]
        n_blocks = COUNTS[t]
        blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
        for off in fields:
            blocks[:, off : off + 2] = random_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        raw = blocks.reshape(-1)
        values = dequantize(raw, t).astype("<f4").reshape(-1)
        assert values.size == n_blocks * block_len
        assert np.all(np.isfinite(values))
        out += struct.pack("<III", int(t), values.size, raw.size)
        out += raw.tobytes()
        out += values.tobytes()
        print(f"{t.name}: {n_blocks} blocks, {values.size} values")
    with open(args.out, "wb") as f:
        f.write(out)
    print(f"wrote {len(out)} bytes to {args.out}")


if __name__ == "__main__":
    main()
