"""Greedy decode speed over a grid of batch sizes x context lengths.

Each grid point: prefill `context` random tokens at `batch`, then time `new_tokens` greedy steps
with the KV cache (the prefill is timed apart). A warm-up run, then at least `repeats` timed runs,
more while the point has taken less than `seconds` (at most `max_repeats`): a busy machine's noise
shows as spread, which the point records (interquartile range and min-max of tokens/s) beside the
median, and the report marks a speed-up whose spread is larger than its effect.
tokens/s counts every sequence in the batch: batch * new_tokens / decode seconds.
The steps run on a decode path (eval/decode_path.py: by default a static cache and the query heads folded onto
the kv heads, so each cached kv head is read once for its group); the result names it (`decode_path`).
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

import torch

from mha2gqa.architecture.hfcache import cache_kwargs, cache_of
from mha2gqa.eval.decode_path import DecodePath, decode_attention, new_cache
from mha2gqa.eval.memory import PeakMemory
from mha2gqa.eval.metrics import quartiles
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.progress import progress_bar


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
    """The preset's grid with the values given in place of its own; None keeps the preset's. A value given
    is never replaced by the preset's (0 repeats or an empty batch list is refused, not read as unset)."""
    if preset not in PRESETS:
        raise InputError(f"--speed {preset!r} is not a preset (use {', '.join(PRESETS)} or off)")
    for flag, value in (("--new-tokens", new_tokens), ("--repeats", repeats)):
        if value is not None and value < 1:  # eval's early checks (cli/early.py) say the same before torch
            raise InputError(f"{flag} {value} must be at least 1")
    base = PRESETS[preset]
    grid = SpeedGrid(
        batches=tuple(base.batches if batches is None else batches),
        contexts=tuple(base.contexts if contexts is None else contexts),
        new_tokens=base.new_tokens if new_tokens is None else new_tokens,
        repeats=base.repeats if repeats is None else repeats,
        warmup=base.warmup,
        seconds=base.seconds,
        max_repeats=max(base.max_repeats, repeats or 0),
    )
    for flag, values in (("--speed-batches", grid.batches), ("--speed-contexts", grid.contexts)):
        if not values or min(values) < 1:
            shown = ",".join(map(str, values)) or "''"
            raise InputError(f"{flag} {shown}: every value must be a positive integer")
    return grid


def validate_grid_fits(grid: SpeedGrid, max_positions: int | None) -> None:
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
def greedy_decode(
    model, ids: torch.Tensor, new_tokens: int, path: DecodePath | str = DecodePath.GROUPED, tokens: list | None = None
) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for `new_tokens` greedy steps after prefilling ids (B, T), with the
    cache of `path` (its attention is set by decode_attention); `tokens` gets the (B, 1) ids each step is fed."""
    device = ids.device
    cache = new_cache(model, path, ids.shape[1] + new_tokens)
    _sync(device)
    t0 = time.perf_counter()
    # Only the last position's logits: a (B, T, vocab) tensor would dominate peak memory at large B*T.
    out = model(ids, use_cache=True, logits_to_keep=1, **({} if cache is None else cache_kwargs(model, cache)))
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
    _sync(device)
    t1 = time.perf_counter()
    cache = cache_of(out)
    for _ in range(new_tokens):
        if tokens is not None:
            tokens.append(nxt)
        out = model(nxt, use_cache=True, **cache_kwargs(model, cache))
        cache = cache_of(out)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def machine_load() -> dict:
    """The load average (1, 5, 15 min) and CPU count, recorded beside every speed: a speed measured on a busy
    machine is slower, and two speeds timed at different loads do not make a speed-up."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"load_average": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count(), "cpus_usable": usable}


def _prompt(model, batch: int, context: int, seed: int, vocab: int | None = None) -> torch.Tensor:
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab or model.config.vocab_size, (batch, context), generator=gen).to(device)  # (B, T)


def _point(batch: int, context: int, grid: SpeedGrid, prefill: list, decode: list, mem, load: dict) -> dict:
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
        **load,
    }


def _more(done: int, grid: SpeedGrid, started: float) -> bool:
    return done < grid.repeats or (done < grid.max_repeats and time.perf_counter() - started < grid.seconds)


def measure_point(model, batch: int, context: int, grid: SpeedGrid, seed: int = 0, path=DecodePath.GROUPED) -> dict:
    ids = _prompt(model, batch, context, seed)
    load = machine_load()
    for _ in range(grid.warmup):
        greedy_decode(model, ids, grid.new_tokens, path)
    prefill, decode = [], []
    started = time.perf_counter()
    with PeakMemory(ids.device) as mem:
        while _more(len(decode), grid, started):
            p, d = greedy_decode(model, ids, grid.new_tokens, path)
            prefill.append(p)
            decode.append(d)
    return _point(batch, context, grid, prefill, decode, mem, load)


def measure_side_by_side(
    models: list, batch: int, context: int, grid: SpeedGrid, seed: int = 0, path=DecodePath.GROUPED
) -> list[dict]:
    """One grid point of every model, timed side by side: repeat by repeat in turn (A, B, A, B, ...), in one
    process, on the same prompt, so that whatever load the machine has falls on each alike. The peak memory
    is the process's with all the models loaded (its kind says so)."""
    vocab = min(m.config.vocab_size for m in models)
    prompts = [_prompt(m, batch, context, seed, vocab) for m in models]
    load = machine_load()
    for model, ids in zip(models, prompts):
        for _ in range(grid.warmup):
            greedy_decode(model, ids, grid.new_tokens, path)
    prefill, decode = [[] for _ in models], [[] for _ in models]
    started = time.perf_counter()
    with PeakMemory(prompts[0].device) as mem:
        while _more(len(decode[0]), grid, started):
            for k, (model, ids) in enumerate(zip(models, prompts)):
                p, d = greedy_decode(model, ids, grid.new_tokens, path)
                prefill[k].append(p)
                decode[k].append(d)
    mem.kind += f", {len(models)} models side by side"
    return [_point(batch, context, grid, prefill[k], decode[k], mem, load) for k in range(len(models))]


def decode_speed(
    model, grid: SpeedGrid, seed: int = 0, progress: bool | str = False, beside=None, path=DecodePath.GROUPED
) -> dict:
    """The grid's points on the decode `path` (its description in `decode_path`); with `beside` (the reference
    model) each point is timed side by side with it, and its points go in `side_by_side` under a fresh id: the
    only speeds a report turns into a speed-up."""
    points = [(b, c) for c in grid.contexts for b in grid.batches]
    results, theirs = [], []
    label = progress if isinstance(progress, str) else "decode speed"  # the bar's label: model and stage
    with decode_attention([model] if beside is None else [model, beside], path) as used:
        for batch, context in progress_bar(len(points), label, bool(progress), points, leave=False):
            if beside is None:
                results.append(measure_point(model, batch, context, grid, seed, path))
            else:
                mine, other = measure_side_by_side([model, beside], batch, context, grid, seed, path)
                results.append(mine)
                theirs.append(other)
    found = {"grid": asdict(grid), "decode_path": used, "points": results, **machine_load()}
    if beside is not None:
        found["side_by_side"] = {"id": uuid.uuid4().hex, "points": theirs}
    return found
