"""Mean-pooling without torch: numpy has no bfloat16, but bf16 -> fp32 is a 16-bit shift and fp32 -> bf16
is round-to-nearest-even on the bit pattern (mha2gqa/convert/fast.py, the torch-free executor). This
pools a bf16 K projection of (32 kv heads x 128, 4096) into 8 groups with fast.pool + fast.cast and with
torch's `group_mean`, checks the results are bit-identical, and times both (medians).

    python bench/bf16_numpy_pool.py
    python bench/bf16_numpy_pool.py --smoke      # a small tensor, one repeat (run by a test)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from mha2gqa.convert.fast import cast, pool
from mha2gqa.convert.methods import group_heads, group_mean, ungroup
from mha2gqa.convert.options import Method


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    kv, groups, hd, d = (32, 8, 128, 4096) if not args.smoke else (8, 2, 8, 64)
    repeats = 1 if args.smoke else args.repeats
    weight = torch.randn(kv * hd, d, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    bits = weight.view(torch.int16).numpy().view(np.uint16)
    torch_s, numpy_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        expected = ungroup(group_mean(group_heads(weight, kv, groups))).to(torch.bfloat16)
        torch_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        pooled = cast(pool(bits, kv, groups, Method.MEAN), "BF16")
        numpy_s.append(time.perf_counter() - start)
    identical = np.array_equal(expected.view(torch.int16).numpy().view(np.uint16), pooled)
    print(
        f"({kv * hd}, {d}) bf16, {kv} -> {groups} kv heads, median of {repeats}, load average "
        f"{os.getloadavg()[0]:.1f}: torch group_mean {statistics.median(torch_s):.3f} s, numpy "
        f"{statistics.median(numpy_s):.3f} s, bit-identical: {identical}"
    )
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
