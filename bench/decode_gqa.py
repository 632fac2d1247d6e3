"""Decode step time of MHA, GQA-8 and MQA on CPU where the KV cache dominates what a step reads (issue 56).

A Llama-shaped model (32 heads, random weights built from a config: no download) in three kv-head counts,
32, 8 and 1, each with a KV cache of `batch` x `context` tokens filled with random K/V (the prefill is not
run: a decode step's time does not depend on the cache's values). One run times single greedy steps of the
three in turn, round by round (MHA, GQA-8, MQA, MHA, ...), so the machine's load falls on each alike; the
median step of each is its time. Beside each: the bytes a step must read (the weights but the embedding
table, of which it reads a row per sequence, and the live cache), and this machine's memory bandwidth,
measured here at the same thread count (a 1 GiB copy and a 1 GiB sum, the faster taken as the limit): each
step's time as a fraction of the time those bytes take at that bandwidth. Each path of eval/decode_path.py
can be timed (--paths): grouped is eval's.

    python bench/decode_gqa.py                       # the full size (docs/benchmarks.md, ~10 GB of RAM)
    python bench/decode_gqa.py --paths grouped,dynamic --profile --out bench/results/decode_gqa.json
    python bench/decode_gqa.py --smoke               # toy sizes, seconds (tests/test_bench_smoke.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mha2gqa.architecture.hfcache import cache_kwargs, cache_of
from mha2gqa.eval import decode_path
from mha2gqa.eval.decode_path import decode_attention

FULL = dict(hidden=2048, intermediate=5632, layers=6, heads=32, vocab=32000, batch=4, context=20480, rounds=6)
SMOKE = dict(hidden=256, intermediate=512, layers=2, heads=32, vocab=256, batch=2, context=64, rounds=2)
KV_HEADS = {"MHA": 32, "GQA-8": 8, "MQA": 1}
# A path of no eval option, what generate() does with a static cache on CUDA: the model's SDPA under
# torch.compile, where transformers copies K/V out to every query head (repeat_kv). Its first step compiles.
COMPILED = "static-compiled"


def build(size: dict, kv_heads: int, dtype: torch.dtype):
    config = LlamaConfig(
        hidden_size=size["hidden"], intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], num_key_value_heads=kv_heads, vocab_size=size["vocab"],
        max_position_embeddings=size["context"] + 1024, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


# eval's grouped path with its CPU kernel forced: the fused kernel (eval/decode_kernel.c), PyTorch's CPU SDPA (what
# eval timed in any dtype before issue 68) or two batched matmuls around a softmax (decode_path.matmul_attention);
# `grouped` picks as eval does
FORCED = {"grouped-fused": "fused", "grouped-sdpa": "sdpa", "grouped-matmul": "matmul"}
STATIC_PATHS = ("grouped", *FORCED, COMPILED)  # the paths whose decode runs on a StaticCache


def filled_cache(model, static: bool, size: dict, room: int):
    """A cache holding `context` tokens of random K/V for each layer, on the model's device: static (room for
    `room` more) or dynamic, as a decode on that path has after its prefill."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    cache = StaticCache(config=c, max_cache_len=size["context"] + room) if static else DynamicCache(config=c)
    device = model.device  # drawn there: on a GPU a host copy of MHA's cache would take longer than the decode
    gen = torch.Generator(device=device).manual_seed(1)
    for layer in range(c.num_hidden_layers):
        shape = (size["batch"], c.num_key_value_heads, size["context"], head_dim)
        keys, values = (torch.randn(shape, generator=gen, device=device, dtype=model.dtype) for _ in range(2))
        cache.update(keys, values, layer)
        del keys, values
    return cache


def step_bytes(model, size: dict) -> dict:
    """What one step must read: every weight but the embedding table (a row per sequence of it), and the cache."""
    c = model.config
    embedding = model.get_input_embeddings().weight
    weights = (
        sum(p.numel() * p.element_size() for p in model.parameters()) - embedding.numel() * embedding.element_size()
    )
    weights += size["batch"] * c.hidden_size * embedding.element_size()
    head_dim = c.hidden_size // c.num_attention_heads
    cache = 2 * c.num_hidden_layers * size["batch"] * c.num_key_value_heads * size["context"] * head_dim
    return {"weights": weights, "cache": cache * embedding.element_size()}


def bandwidth(threads: int, gib: float = 1.0) -> dict:
    """GB/s of a large copy (read + write counted) and a large sum (read), the median of 5 after a warm-up."""
    a = torch.ones(int(gib * 2**30) // 4)
    b = torch.empty_like(a)
    found = {}
    for name, run, moved in (("copy", lambda: b.copy_(a), 2), ("sum", lambda: a.sum(), 1)):
        run()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        found[f"{name}_gb_s"] = moved * a.numel() * 4 / statistics.median(times) / 1e9
    found["limit_gb_s"] = max(found["copy_gb_s"], found["sum_gb_s"])
    found["threads"] = threads
    return found


@contextmanager
def attention_for(models: list, path: str):
    """decode_attention for eval's paths, FORCED's as grouped on the kernel named; for COMPILED the models' own
    SDPA, and a description as eval's."""
    if path != COMPILED:
        own = decode_path.CPU_KERNEL["name"]
        decode_path.CPU_KERNEL["name"] = FORCED.get(path, own)
        try:
            with decode_attention(models, "grouped" if path in FORCED else path) as used:
                used["name"] = path
                yield used
        finally:
            decode_path.CPU_KERNEL["name"] = own
        return
    yield {"name": COMPILED, "cache": "static", "attention": "sdpa under torch.compile", "copied_per_step": "repeat_kv"}


def runnable(model, path: str):
    """The model, or its forward compiled (one graph per shape, no recompiles: the cache is static)."""
    return torch.compile(model, dynamic=False) if path == COMPILED else model


@torch.no_grad()
def one_step(model, state: dict) -> float:
    """Seconds of one greedy step from state's cache and token; the state moves on."""
    start = time.perf_counter()
    out = model(state["token"], use_cache=True, logits_to_keep=1, **cache_kwargs(model, state["cache"]))
    state["token"] = out.logits[:, -1].argmax(-1, keepdim=True)
    state["cache"] = cache_of(out)
    if state["token"].is_cuda:  # the kernels run on after the launch returns
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_path(models: dict, path: str, size: dict, steps: int) -> dict:
    """{model: [seconds of each timed step]}: round by round, `steps` steps of each model in turn; round 0 warms up."""
    room = (size["rounds"] + 1) * steps + 1
    states = {name: {"cache": filled_cache(m, path in STATIC_PATHS, size, room)} for name, m in models.items()}
    for state in states.values():
        state["token"] = torch.zeros(size["batch"], 1, dtype=torch.long)
    seconds = {name: [] for name in models}
    run = {name: runnable(m, path) for name, m in models.items()}
    with attention_for(list(models.values()), path) as used:
        for round_ in range(size["rounds"] + 1):
            for name in models:
                taken = [one_step(run[name], states[name]) for _ in range(steps)]
                if round_:
                    seconds[name] += taken
    del states
    return {"decode_path": used, "seconds": seconds}


def profile_step(models: dict, path: str, size: dict, rows: int) -> dict:
    """torch.profiler's table (self CPU time) of one step of each model on `path`: what the step's time goes to."""
    from torch.profiler import ProfilerActivity, profile

    tables = {}
    for name, model in models.items():
        state = {
            "cache": filled_cache(model, path in STATIC_PATHS, size, 4),
            "token": torch.zeros(size["batch"], 1, dtype=torch.long),
        }
        run = runnable(model, path)
        with attention_for([model], path):
            one_step(run, state)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                one_step(run, state)
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        del state
    return tables


def summarise(timed: dict, bytes_of: dict, limit_gb_s: float, batch: int) -> list[dict]:
    rows, mha = [], statistics.median(timed["seconds"]["MHA"])
    for name, seconds in timed["seconds"].items():
        median, need = statistics.median(seconds), bytes_of[name]
        floor = (need["weights"] + need["cache"]) / (limit_gb_s * 1e9)  # the step at the bandwidth limit
        rows.append({
            "model": name, "kv_heads": KV_HEADS[name], "step_s_median": median, "steps": len(seconds),
            "step_s_range": [min(seconds), max(seconds)], "tokens_per_s": batch / median, "speedup_vs_mha": mha / median,
            "weights_bytes": need["weights"], "cache_bytes": need["cache"], "floor_s": floor,
            "fraction_of_bandwidth_limit": floor / median,
        })  # fmt: skip
    return rows


def print_table(path: dict, rows: list[dict]) -> None:
    """The rows under the path's description: its cache, its attention, what a step copies, the routes taken."""
    print(f"\npath {path['name']}: " + ", ".join(f"{k} {v}" for k, v in path.items() if k != "name"))
    print(
        "| model | kv heads | step ms (median) | tok/s | vs MHA | weights GB | cache GB | at the limit, ms | of the limit |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['kv_heads']} | {1e3 * r['step_s_median']:.1f} | {r['tokens_per_s']:.2f} | "
            f"{r['speedup_vs_mha']:.2f}x | {r['weights_bytes'] / 1e9:.3f} | {r['cache_bytes'] / 1e9:.3f} | "
            f"{1e3 * r['floor_s']:.1f} | {100 * r['fraction_of_bandwidth_limit']:.0f}% |"
        )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, seconds: the script still runs")
    sized = dict(type=int, default=None, help="default: FULL's (SMOKE's with --smoke)")
    parser.add_argument("--hidden", **sized)
    parser.add_argument("--intermediate", **sized)
    parser.add_argument("--layers", **sized)
    parser.add_argument("--heads", **sized)
    parser.add_argument("--vocab", **sized)
    parser.add_argument("--batch", **sized)
    parser.add_argument("--context", **sized)
    parser.add_argument("--rounds", **sized, metavar="N")  # timed rounds after the warm-up round
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each model per round")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--paths", default="grouped", help=f"comma-separated: eval/decode_path.py's, {', '.join(FORCED)} or {COMPILED}"
    )
    parser.add_argument("--models", default=",".join(KV_HEADS), help="comma-separated, MHA among them")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--profile", action="store_true", help="a torch.profiler table of one step of each model")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    size = {key: getattr(args, key) or (SMOKE if args.smoke else FULL)[key] for key in FULL}
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    load_before = os.getloadavg()
    limit = bandwidth(args.threads, 0.0625 if args.smoke else 1.0)
    names = args.models.split(",")
    if "MHA" not in names or not set(names) <= set(KV_HEADS):
        sys.exit(f"--models: MHA and any of {', '.join(KV_HEADS)}, comma-separated (got {args.models!r})")
    models = {name: build(size, KV_HEADS[name], dtype) for name in names}
    bytes_of = {name: step_bytes(m, size) for name, m in models.items()}
    params = sum(p.numel() for p in models["MHA"].parameters())
    mha = bytes_of["MHA"]
    print(
        f"{params / 1e6:.0f}M parameters ({args.dtype}), batch {size['batch']} x context {size['context']}: MHA cache "
        f"{mha['cache'] / 1e9:.2f} GB = {mha['cache'] / (params * dtype.itemsize):.1f}x the weights; bandwidth "
        f"{limit['copy_gb_s']:.1f} GB/s copy, {limit['sum_gb_s']:.1f} GB/s sum, {args.threads} threads; load {load_before}"
    )
    result = {"size": size, "dtype": args.dtype, "params_mha": params, "bandwidth": limit, "paths": {}}
    for path in args.paths.split(","):
        timed = time_path(models, path, size, args.steps)
        rows = summarise(timed, bytes_of, limit["limit_gb_s"], size["batch"])
        result["paths"][path] = {"decode_path": timed["decode_path"], "rows": rows, "seconds": timed["seconds"]}
        print_table(timed["decode_path"], rows)
        if args.profile:
            tables = profile_step(models, path, size, 8)
            result["paths"][path]["profile"] = tables
            for name, table in tables.items():
                print(f"\none {name} step, path {path}:\n{table}")
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    result.update(threads=args.threads, torch=torch.__version__, cpu_count=os.cpu_count())
    print(f"\nload average before {load_before}, after {result['load_average']['after']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
