"""Could mean-pooling run without torch? numpy has no bfloat16, but bf16 -> fp32 is a 16-bit shift and
fp32 -> bf16 is round-to-nearest-even on the bit pattern. This pools a bf16 K projection of
(32 kv heads x 128, 4096) into 8 groups both ways, checks the results are bit-identical to the
package's `group_mean`, and times both (medians). A measurement for issue 14 item 8, not a code path.

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

from mha2gqa.convert.methods import group_heads, group_mean, ungroup


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    u = f32.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(f32), np.uint16(0x7FC0), rounded)


def numpy_pool(u16: np.ndarray, kv_heads: int, groups: int) -> np.ndarray:
    """(n_kv*hd, d) bf16 bits -> (groups*hd, d): the same slice-by-slice fp32 sum as group_mean."""
    grouped = u16.reshape(groups, kv_heads // groups, -1, u16.shape[-1])  # (G, r, hd, d)
    total = bf16_to_f32(grouped[:, 0])
    for j in range(1, grouped.shape[1]):
        total += bf16_to_f32(grouped[:, j])
    total /= np.float32(grouped.shape[1])
    return f32_to_bf16(total).reshape(-1, u16.shape[-1])


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
        pooled = numpy_pool(bits, kv, groups)
        numpy_s.append(time.perf_counter() - start)
    identical = np.array_equal(expected.view(torch.int16).numpy().view(np.uint16), pooled)
    print(f"({kv * hd}, {d}) bf16, {kv} -> {groups} kv heads, median of {repeats}, load average "
          f"{os.getloadavg()[0]:.1f}: torch group_mean {statistics.median(torch_s):.3f} s, numpy "
          f"{statistics.median(numpy_s):.3f} s, bit-identical: {identical}")
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
