"""GPU check of the eval harness: decode throughput, KV bytes and peak memory, MHA vs GQA, side by side.

A ~1.2B Llama-shaped model with random weights (speed does not need trained ones): 16 layers,
hidden 2048, 32 query heads of 64 dims, vocab 32000; with 32 kv heads (MHA), 8 (GQA-8) and 1 (MQA),
bf16, context 2048, batch 1..64. Target: GQA-8 decodes >= 3x the MHA tokens/s at the largest batch.

Two decode paths are timed for each point:
- eager: what `mha2gqa eval` measured until 2026-12 (`--decode-path dynamic`: transformers DynamicCache, one Python forward a token);
- graph: a StaticCache and one CUDA-graph-captured decode step, replayed: Python launch overhead
  removed, so what remains is the GPU's work (weights + KV reads). If capture fails on this
  transformers version the row says why and the eager numbers still stand.

Run (GPU, about 2-3 minutes on one H200):   python bench/eval_gpu.py
Smoke run of the same code on CPU (seconds): python bench/eval_gpu.py --smoke   (= --preset cpu-tiny)
Writes a JSON with every number to --out (default: $OUT/eval_gpu.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

from mha2gqa.architecture.hfcache import cache_kwargs
from mha2gqa.eval.environment import device_name, versions
from mha2gqa.eval.kvcache import measure_kv_cache
from mha2gqa.eval.memory import PeakMemory
from mha2gqa.eval.model import shape_of
from mha2gqa.eval.speed import SpeedGrid, measure_point

PRESETS = {
    # name: (model dims, kv-head variants, batches, context, new tokens, repeats, device, dtype)
    "h200": (
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            head_dim=64,
            vocab_size=32000,
        ),
        (32, 8, 1),
        (1, 4, 16, 64),
        2048,
        32,
        3,
        "cuda",
        torch.bfloat16,
    ),
    "cpu-small": (
        dict(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            head_dim=32,
            vocab_size=4096,
        ),
        (8, 2, 1),
        (1, 8, 32),
        256,
        16,
        5,
        "cpu",
        torch.float32,
    ),
    "cpu-tiny": (
        dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, head_dim=8, vocab_size=128
        ),
        (8, 2, 1),
        (1, 2),
        32,
        4,
        2,
        "cpu",
        torch.float32,
    ),
}


def build(dims: dict, kv_heads: int, context: int, new_tokens: int, device: str, dtype):
    config = LlamaConfig(
        **dims,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context + new_tokens + 64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: no 5 GB host copy
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def graph_point(model, batch: int, context: int, new_tokens: int, repeats: int) -> dict:
    """Greedy decode with a StaticCache; on CUDA each step is one captured graph replay."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)  # (B, T)
    cache = StaticCache(config=model.config, max_cache_len=context + new_tokens + 1)
    step_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (B, 1): the graph's fixed input
    position = torch.zeros(1, dtype=torch.long, device=device)

    def prefill():
        cache.reset()  # in place: the graph keeps pointing at the same cache tensors and length counter
        out = model(
            ids, cache_position=torch.arange(context, device=device), logits_to_keep=1, **cache_kwargs(model, cache)
        )
        step_ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        position.fill_(context)

    def step():
        return model(step_ids, cache_position=position, **cache_kwargs(model, cache)).logits  # (B, 1, V)

    prefill()
    graph, logits = None, None
    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as CUDA graphs require
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
    times = []
    with PeakMemory(device) as mem:
        for _ in range(repeats + 1):  # the first is a warm-up
            prefill()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                if graph is not None:
                    graph.replay()
                else:
                    logits = step()
                step_ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
                position.add_(1)
            _sync(device)
            times.append(time.perf_counter() - t0)
    median = statistics.median(times[1:])
    return {
        "batch": batch,
        "context": context,
        "tokens_per_s": batch * new_tokens / median,
        "decode_s_median": median,
        "cuda_graph": graph is not None,
        "peak_memory_bytes": mem.peak_bytes,
    }


def run_variant(preset, kv_heads: int) -> dict:
    dims, _, batches, context, new_tokens, repeats, device, dtype = preset
    model = build(dims, kv_heads, context, new_tokens, device, dtype)
    grid = SpeedGrid(batches=batches, contexts=(context,), new_tokens=new_tokens, repeats=repeats, seconds=0.0)
    out = {
        "kv_heads": kv_heads,
        "params": sum(p.numel() for p in model.parameters()),
        "kv_cache": measure_kv_cache(model, shape_of(model.config), batch=2, tokens=64),
        "points": [],
    }
    for batch in batches:
        # eval's path until 2026-12 (DynamicCache), kept so the H200 rows compare; eval now times `grouped`
        point = {"batch": batch, "eager": measure_point(model, batch, context, grid, path="dynamic")}
        try:
            point["graph"] = graph_point(model, batch, context, new_tokens, repeats)
        except Exception as err:  # a benchmark row, not control flow: the eager number still stands
            point["graph"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        out["points"].append(point)
        print(
            f"  kv={kv_heads} B={batch}: eager {point['eager']['tokens_per_s']:,.0f} tok/s, "
            f"graph {point['graph'].get('tokens_per_s', float('nan')):,.0f} tok/s",
            flush=True,
        )
        if device == "cuda":
            torch.cuda.empty_cache()
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def table(variants: list[dict]) -> str:
    """One row per batch: each variant's tokens/s (eager, then CUDA graph; x the MHA variant's) and peak memory."""
    mha = variants[0]
    names = ["MHA" if v is mha else f"kv={v['kv_heads']}" for v in variants]
    header = [f"{n} {mode} tok/s" for mode in ("eager", "graph") for n in names] + [f"{n} peak GiB" for n in names]
    lines = ["| batch | " + " | ".join(header) + " |", "|" + "---|" * (len(header) + 1)]
    for i, base in enumerate(mha["points"]):
        cells = []
        for mode in ("eager", "graph"):
            for v in variants:
                rate, ref = v["points"][i][mode].get("tokens_per_s"), base[mode].get("tokens_per_s")
                if rate is None:
                    cells.append("failed")
                else:
                    cells.append(f"{rate:,.0f}" + ("" if v is mha or not ref else f" ({rate / ref:.2f}x)"))
        cells += [f"{v['points'][i]['eager']['peak_memory_bytes'] / 2**30:.2f}" for v in variants]
        lines.append(f"| {base['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ["OUT"]) / "eval_gpu.json" if os.environ.get("OUT") else None
    )
    parser.add_argument("--smoke", action="store_true", help="the same as --preset cpu-tiny (run by a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset = "cpu-tiny"
    preset = PRESETS[args.preset]
    if preset[6] == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--preset {args.preset} needs a CUDA GPU; use --preset cpu-small or cpu-tiny here")
    start = time.time()
    variants = [run_variant(preset, kv) for kv in preset[1]]
    for v in variants:
        kv = v["kv_cache"]
        print(
            f"kv_heads={v['kv_heads']}: {v['params'] / 1e9:.3f}B params, KV {kv['measured_bytes_per_token']:,.0f} "
            f"B/token measured vs {kv['formula_bytes_per_token']:,} formula ({'match' if kv['match'] else 'MISMATCH'})"
        )
    print(table(variants))
    last = [v["points"][-1] for v in variants[:2]]  # MHA and the GQA variant the target is about
    verdict = {}
    for mode in ("eager", "graph"):
        if all("tokens_per_s" in p[mode] for p in last):
            ratio = last[1][mode]["tokens_per_s"] / last[0][mode]["tokens_per_s"]
            verdict[mode] = ratio
            print(
                f"{mode}: GQA-{variants[1]['kv_heads']}/MHA at batch {last[0]['batch']} = {ratio:.2f}x "
                f"(target >= 3x: {'PASS' if ratio >= 3 else 'FAIL'})"
            )
    device = torch.device(preset[6])
    record = {
        "preset": args.preset,
        "device_name": device_name(device),
        "versions": versions(),
        "seconds": time.time() - start,
        "variants": variants,
        "ratio_at_largest_batch": verdict,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")
    print(f"total {record['seconds']:.0f} s on {record['device_name']}")


if __name__ == "__main__":
    main()
