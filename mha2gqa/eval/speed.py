"""Greedy decode speed over a grid of batch sizes x context lengths.

Each grid point: prefill `context` random tokens at `batch`, then time `new_tokens` greedy steps
with the KV cache (the prefill is timed apart). A warm-up run, then at least `repeats` timed runs,
more while the point has taken less than `seconds` (at most `max_repeats`): a busy machine's noise
shows as spread, which the point records (interquartile range and min-max of tokens/s) beside the
median, and the report marks a speed-up whose spread is larger than its effect.
tokens/s counts every sequence in the batch: batch * new_tokens / decode seconds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from mha2gqa.errors import InputError
from mha2gqa.eval.memory import PeakMemory
from mha2gqa.eval.metrics import quartiles


@dataclass(frozen=True)
class SpeedGrid:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    new_tokens: int
    repeats: int = 3  # at least this many timed runs (3 give quartiles) ...
    warmup: int = 1
    seconds: float = 1.0  # ... and more while the point's timed runs took less than this (a fast point
    max_repeats: int = 30  # gets many cheap repeats; on a busy machine, where one run takes seconds, 3)


# CPU: seconds on a tiny model. GPU: the sizes where GQA's smaller cache shows in throughput.
PRESETS = {
    "cpu": SpeedGrid(batches=(1, 4), contexts=(32,), new_tokens=16, seconds=1.0),
    "gpu": SpeedGrid(batches=(1, 8, 32, 64), contexts=(512, 2048), new_tokens=64, seconds=2.0),
}


def make_grid(preset: str, batches=None, contexts=None, new_tokens=None, repeats=None) -> SpeedGrid:
    if preset not in PRESETS:
        raise InputError(f"--speed {preset!r} is not a preset (use {', '.join(PRESETS)} or off)")
    base = PRESETS[preset]
    grid = SpeedGrid(
        batches=tuple(batches or base.batches),
        contexts=tuple(contexts or base.contexts),
        new_tokens=new_tokens or base.new_tokens,
        repeats=repeats or base.repeats,
        warmup=base.warmup,
        seconds=base.seconds,
        max_repeats=max(base.max_repeats, repeats or 0),
    )
    for flag, values in (
        ("--speed-batches", grid.batches),
        ("--speed-contexts", grid.contexts),
        ("--new-tokens", (grid.new_tokens,)),
        ("--repeats", (grid.repeats,)),
    ):
        if not values or min(values) < 1:
            raise InputError(f"{flag} {','.join(map(str, values))}: every value must be a positive integer")
    return grid


def check_grid_fits(grid: SpeedGrid, max_positions: int | None) -> None:
    longest = max(grid.contexts) + grid.new_tokens
    if max_positions and longest > max_positions:
        raise InputError(
            f"--speed-contexts {max(grid.contexts)} + --new-tokens {grid.new_tokens} = {longest} exceeds the "
            f"model's max_position_embeddings={max_positions}: use shorter contexts"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_decode(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for `new_tokens` greedy steps after prefilling ids (B, T)."""
    device = ids.device
    _sync(device)
    t0 = time.perf_counter()
    # Only the last position's logits: a (B, T, vocab) tensor would dominate peak memory at large B*T.
    out = model(ids, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
    _sync(device)
    t1 = time.perf_counter()
    cache = out.cache
    for _ in range(new_tokens):
        out = model(nxt, cache=cache, use_cache=True)
        cache = out.cache
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def measure_point(model, batch: int, context: int, grid: SpeedGrid, seed: int = 0) -> dict:
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen).to(device)  # (B, T)
    for _ in range(grid.warmup):
        greedy_decode(model, ids, grid.new_tokens)
    prefill, decode = [], []
    started = time.perf_counter()
    with PeakMemory(device) as mem:
        while len(decode) < grid.repeats or (
            len(decode) < grid.max_repeats and time.perf_counter() - started < grid.seconds
        ):
            p, d = greedy_decode(model, ids, grid.new_tokens)
            prefill.append(p)
            decode.append(d)
    tokens = batch * grid.new_tokens
    fast, median, slow = quartiles(decode)  # seconds: the slow quartile is the low tokens/s
    return {
        "batch": batch,
        "context": context,
        "new_tokens": grid.new_tokens,
        "tokens_per_s": tokens / median,
        "tokens_per_s_iqr": [tokens / slow, tokens / fast],
        "tokens_per_s_range": [tokens / max(decode), tokens / min(decode)],
        "repeats": len(decode),
        "decode_s_median": median,
        "prefill_s_median": statistics.median(prefill),
        "decode_s": decode,
        "peak_memory_bytes": mem.peak_bytes,
        "peak_memory_kind": mem.kind,
    }


def decode_speed(model, grid: SpeedGrid, seed: int = 0, progress: bool = False) -> dict:
    points = [(b, c) for c in grid.contexts for b in grid.batches]
    results = []
    for batch, context in tqdm(points, desc="decode speed", disable=not progress, leave=False):
        results.append(measure_point(model, batch, context, grid, seed))
    return {"grid": asdict(grid), "points": results}
