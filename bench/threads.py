"""Torch's CPU thread count on the embedded model: an eval forward and a training step per thread count.

    python bench/threads.py                 # 1 and every core count up to the machine's, 7 rounds, medians
    python bench/threads.py --threads 1 2 --repeats 11
    python bench/threads.py --smoke         # one tiny round (run by a test)

The work is the demo's: forward passes of 8 x 512 tokens through the embedded 6-layer model (eval), and
forward + backward + AdamW step on 8 x 512 tokens (uptrain). Thread counts are interleaved within each
round so a busy machine slows them alike; the table gives medians, the spread (min-max) and the ratio to
one thread, with the machine's load average before and after (a loaded machine is the case this is for:
torch's default of one thread per core spins against the other processes). mha2gqa's --threads default
(mha2gqa/runtime/threads.py) is chosen from these numbers (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from mha2gqa.files import embedded


def time_eval(model, batch: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(batch)
    return time.perf_counter() - start


def time_train_step(model, optimizer, batch: torch.Tensor) -> float:
    start = time.perf_counter()
    loss = model(batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.batch, args.seq_len = 1, 1, 32
    counts = args.threads or sorted({1, *range(2, (os.cpu_count() or 1) + 1)})
    load_before = os.getloadavg()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(embedded.model_dir(), dtype=torch.float32)
    batch = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = {(n, job): [] for n in counts for job in ("eval", "train step")}
    for n in counts:  # warm-up: first calls allocate and pick kernels
        torch.set_num_threads(n)
        time_eval(model.eval(), batch)
        time_train_step(model.train(), optimizer, batch)
    for _ in range(args.repeats):
        for n in counts:
            torch.set_num_threads(n)
            times[(n, "eval")].append(time_eval(model.eval(), batch))
            times[(n, "train step")].append(time_train_step(model.train(), optimizer, batch))
    load_after = os.getloadavg()

    print(
        f"embedded model, batch {args.batch} x {args.seq_len} tokens, {args.repeats} rounds, "
        f"{os.cpu_count()} cores, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print("| threads | job | median s | min-max s | median / 1 thread |")
    print("|---|---|---|---|---|")
    for job in ("eval", "train step"):
        base = statistics.median(times[(counts[0], job)])
        for n in counts:
            runs = times[(n, job)]
            median = statistics.median(runs)
            print(f"| {n} | {job} | {median:.3f} | {min(runs):.3f}-{max(runs):.3f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
