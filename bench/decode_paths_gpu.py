"""Decode tokens/s of MHA, GQA-8 and MQA by every attention path a user can pick, on one GPU (issue 56, item 5).

gpu_check part 1 measured GQA-8 at 1.04x MHA's tokens/s with CUDA graphs and 1.47x eager (batch 64 x 2,048,
an H200), where the cache it no longer reads should give about 4x. Which kernel reads the grouped cache, and
how often, decides it; so one decode step of each model is timed on each path:

  dynamic             transformers' default: DynamicCache, SDPA with enable_gqa (the step has no mask)
  grouped             eval's (mha2gqa/eval/decode_path.py): StaticCache, query heads folded onto kv heads
  static              StaticCache and transformers' SDPA: a mask, so pack_gqa folding (or repeat_kv before it)
  static+force_gqa    the same with TRANSFORMERS_SDPA_FORCE_GQA=1 (enable_gqa beside the mask), where the
                      installed transformers reads that variable
  dynamic/B grouped/B the first two with one SDPA backend B forced (flash, efficient, math, cudnn) by
                      torch.nn.attention.sdpa_kernel: a backend that cannot take the step is recorded with why
  static-compiled     StaticCache under torch.compile (transformers copies K/V to every query head: repeat_kv)
  flex                StaticCache and transformers' flex_attention (compiled FlexAttention, enable_gqa)

bench/decode_gqa.py's machinery (random K/V in the cache, no prefill; the models' steps in turn, round by round)
runs each; a torch.profiler trace of one step of each model on the dynamic and grouped paths keeps the top
kernels and their times, and the record keeps the SDPA backends' priority order torch reports. Paths that need
CUDA are recorded as skipped on a CPU; paths that would run past --deadline-s are recorded as not reached.

    python3 bench/decode_paths_gpu.py --out decode_paths.json     # one GPU; ~3 min (gpu_check part 7)
    python bench/decode_paths_gpu.py --smoke                       # toy sizes on CPU (tests/test_gpu_check.py)

Goal (issue 56): GQA-8 >= 2x MHA's tokens/s on the best path.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_gqa  # noqa: E402
from decode_gqa import KV_HEADS, build, filled_cache, one_step  # noqa: E402

# eval_gpu.py's h200 model at 8 layers, not 16: the two compiled paths compile each model (three of them), and
# the ratios do not depend on the depth (weights and cache both scale with it). MHA's cache: 8.6 GB, 6.5x the
# weights a step reads.
SIZES = {
    "gpu": dict(hidden=2048, intermediate=8192, layers=8, heads=32, vocab=32000, batch=64, context=2048, rounds=3),
    "smoke": dict(decode_gqa.SMOKE),
}
STEPS = 2  # timed steps of each model per round
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH", "cudnn": "CUDNN_ATTENTION"}
CUDA_ONLY = {"efficient", "cudnn"}  # torch's CPU SDPA has a flash-style kernel and math only
FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@dataclass(frozen=True)
class Path_:
    name: str
    static: bool  # StaticCache, else DynamicCache
    attention: str  # "grouped" (eval's GROUPED), or the transformers attention set for the decode
    backend: str | None = None  # the one SDPA backend allowed
    force_gqa: bool = False
    compiled: bool = False
    estimate_s: float = 5.0  # on one H200: what --deadline-s checks before starting it

    def describe(self) -> str:
        cache = "StaticCache" if self.static else "DynamicCache"
        extra = [f"SDPA backend {self.backend} only"] * bool(self.backend) + [f"{FORCE_GQA}=1"] * self.force_gqa
        return ", ".join([cache, self.attention, *extra] + ["torch.compile"] * self.compiled)


PATHS = (
    Path_("dynamic", False, "sdpa"),
    Path_("grouped", True, "grouped"),
    Path_("static", True, "sdpa"),
    Path_("static+force_gqa", True, "sdpa", force_gqa=True),
    *(
        Path_(f"{base}/{b}", base == "grouped", "grouped" if base == "grouped" else "sdpa", backend=b)
        for base in ("dynamic", "grouped")
        for b in BACKENDS
    ),  # fmt: skip
    Path_("static-compiled", True, "sdpa", compiled=True, estimate_s=90.0),  # the whole model, per model
    Path_("flex", True, "flex_attention", estimate_s=45.0),  # FlexAttention compiles a kernel per model
)
ALWAYS = ("dynamic", "grouped")  # the default and eval's, the profiled two: run whatever the deadline says
PROFILE_S = 15.0  # the profiled steps at the end (two paths, three models), kept out of --deadline-s


def sdpa_priority() -> list[str]:
    """The SDPA backends in the order torch tries them (torch's own list; [] where it has none)."""
    from torch.nn.attention import SDPBackend

    names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper()}
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    return [names.get(int(i), str(i)) for i in order()] if order else []


def force_gqa_available() -> bool:
    """Whether the installed transformers reads TRANSFORMERS_SDPA_FORCE_GQA (from its own source)."""
    import transformers.integrations.sdpa_attention as sdpa

    return FORCE_GQA in inspect.getsource(sdpa)


def unavailable(path: Path_, device: torch.device, has_force_gqa: bool) -> str | None:
    """Why `path` cannot run here, or None."""
    if path.backend in CUDA_ONLY and device.type != "cuda":
        return f"the {path.backend} SDPA backend needs CUDA"
    if path.force_gqa and not has_force_gqa:
        import transformers

        return f"transformers {transformers.__version__} does not read {FORCE_GQA}"
    return None


@contextlib.contextmanager
def set_up(models: list, path: Path_):
    """The models' attention, the forced backend and the variable set for `path`; everything restored after."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mha2gqa.eval.decode_path import decode_attention

    with contextlib.ExitStack() as stack:
        if path.attention == "grouped":
            stack.enter_context(decode_attention(models, "grouped"))
        else:
            before = [m.config._attn_implementation for m in models]
            for m in models:
                m.set_attn_implementation(path.attention)
            stack.callback(lambda: [m.set_attn_implementation(b) for m, b in zip(models, before)])
        if path.backend:
            stack.enter_context(sdpa_kernel([getattr(SDPBackend, BACKENDS[path.backend])]))
        if path.force_gqa:
            old = os.environ.get(FORCE_GQA)
            os.environ[FORCE_GQA] = "1"  # read at each call (sdpa_attention.use_gqa_in_sdpa)
            stack.callback(lambda: os.environ.pop(FORCE_GQA) if old is None else os.environ.update({FORCE_GQA: old}))
        yield


def _fresh_states(models: dict, path: Path_, size: dict, room: int) -> dict:
    device = next(iter(models.values())).device
    token = torch.zeros(size["batch"], 1, dtype=torch.long, device=device)
    return {name: {"cache": filled_cache(m, path.static, size, room), "token": token} for name, m in models.items()}


@torch.no_grad()
def time_path(models: dict, path: Path_, size: dict) -> dict:
    """Each model's step seconds on `path` (round 0 warms up and compiles), tokens/s and the ratio to MHA's."""
    room = (size["rounds"] + 1) * STEPS + 1
    states = _fresh_states(models, path, size, room)
    run = {name: torch.compile(m, dynamic=False) if path.compiled else m for name, m in models.items()}
    seconds = {name: [] for name in models}
    with set_up(list(models.values()), path):
        for round_ in range(size["rounds"] + 1):
            for name in models:
                taken = [one_step(run[name], states[name]) for _ in range(STEPS)]
                if round_:
                    seconds[name] += taken
    del states
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "path": path.describe(),
        "rows": {
            name: {"step_ms_median": 1e3 * medians[name], "step_ms_range": [1e3 * min(s), 1e3 * max(s)],
                   "tokens_per_s": size["batch"] / medians[name], "vs_mha": medians["MHA"] / medians[name]}
            for name, s in seconds.items()
        },
    }  # fmt: skip


@torch.no_grad()
def profile_step(models: dict, path: Path_, size: dict, rows: int = 10) -> dict:
    """{model: the top `rows` ops of one step by self time on the device (kernels on a GPU, CPU ops here)}."""
    from torch.profiler import ProfilerActivity, profile

    device = next(iter(models.values())).device
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    found = {}
    for name, model in models.items():
        state = _fresh_states({name: model}, path, size, 4)[name]
        with set_up([model], path):
            one_step(model, state)  # warm-up
            with profile(activities=activities) as prof:
                one_step(model, state)
        events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
        events.sort(key=lambda e: getattr(e, key), reverse=True)
        total = sum(getattr(e, key) for e in events)
        found[name] = {
            "total_us": total,
            "top": [{"name": e.key[:120], "self_us": getattr(e, key), "calls": e.count} for e in events[:rows]],
        }
        del state
    return found


def best_paths(paths: dict) -> dict:
    """Per model, the path of the most tokens/s; and GQA-8's best over MHA's best (the goal: >= 2x)."""
    timed = {name: p["rows"] for name, p in paths.items() if "rows" in p}
    best = {}
    for model in KV_HEADS:
        name = max(timed, key=lambda n: timed[n][model]["tokens_per_s"])
        best[model] = {"path": name, "tokens_per_s": timed[name][model]["tokens_per_s"]}
    ratio = best["GQA-8"]["tokens_per_s"] / best["MHA"]["tokens_per_s"]
    return {"per_model": best, "gqa8_over_mha": ratio, "goal_2x_met": ratio >= 2}


def run(size: dict, dtype: torch.dtype, device: torch.device, deadline_s: float | None, say=print) -> dict:
    start = time.perf_counter()
    has_force_gqa = force_gqa_available()
    with torch.device(device):  # initialised there: no host copy of three 1.3 GB models
        models = {name: build(size, kv, dtype) for name, kv in KV_HEADS.items()}
    record = {"size": size, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
              "sdpa_priority": sdpa_priority(), "force_gqa_in_transformers": has_force_gqa,
              "paths": {}, "skipped": []}  # fmt: skip
    for path in PATHS:
        why = unavailable(path, device, has_force_gqa)
        used = time.perf_counter() - start
        late = deadline_s is not None and used + path.estimate_s + PROFILE_S > deadline_s
        if why is None and late and path.name not in ALWAYS:
            why = (
                f"not reached: {used:.0f} s used, its estimate {path.estimate_s:.0f} s (and the profile's "
                f"{PROFILE_S:.0f} s) would pass --deadline-s {deadline_s:.0f}"
            )
        if why:
            record["skipped"].append({"what": path.name, "reason": why})
            say(f"{path.name}: skipped ({why})")
            continue
        began = time.perf_counter()
        try:
            found = time_path(models, path, size)
        except (RuntimeError, torch.OutOfMemoryError) as err:  # a backend that cannot take the step: a row, not a stop
            found = {
                "path": path.describe(),
                "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}",
            }
        found["seconds"] = round(time.perf_counter() - began, 1)
        record["paths"][path.name] = found
        rows = found.get("rows")
        say(f"{path.name:22s} " + ("  ".join(f"{m} {r['tokens_per_s']:10,.0f} tok/s ({r['vs_mha']:.2f}x)"
                                              for m, r in rows.items()) if rows else found["error"]))  # fmt: skip
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    by_name = {p.name: p for p in PATHS}
    record["profile"] = {name: profile_step(models, by_name[name], size) for name in ("dynamic", "grouped")}
    record["best"] = best_paths(record["paths"])
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on CPU, float32 (run by a test)")
    parser.add_argument("--deadline-s", type=float, default=None, help="leave out the paths that would run past it")
    parser.add_argument("--out", type=Path, default=None, help="write the record as JSON here")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/decode_paths_gpu.py needs a CUDA GPU; --smoke runs its toy sizes on CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    record = run(SIZES["smoke" if args.smoke else "gpu"], dtype, device, args.deadline_s)
    best = record["best"]
    print(
        "best: "
        + ", ".join(f"{m} {b['path']} {b['tokens_per_s']:,.0f} tok/s" for m, b in best["per_model"].items())
        + f"; GQA-8 / MHA {best['gqa8_over_mha']:.2f}x (goal >= 2x: {'met' if best['goal_2x_met'] else 'missed'})"
    )
    print(f"SDPA priority: {', '.join(record['sdpa_priority'])}; total {record['seconds']} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
