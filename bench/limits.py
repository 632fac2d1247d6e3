"""How long `mha2gqa inspect` of a bare config.json takes at each documented ceiling (layouts.CEILINGS:
layers, heads, width, experts), each as its own process, against a small config (docs/guarantees.md:
at the documented limits every command answers in seconds).

    python bench/limits.py --repeats 3

`--smoke` runs each case once at a hundredth of its ceiling (tests/test_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mha2gqa.architecture.layouts import CEILINGS

BASE = {  # a small llama: 2 layers, 4 heads of 16
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def cases(scale: float) -> dict[str, dict]:
    """One config per ceiling, at `scale` of it, the rest small."""
    layers, heads, width, experts = (max(2, int(CEILINGS[k] * scale)) for k in ("layers", "heads", "width", "experts"))
    return {
        "small": dict(BASE),
        "layers": {**BASE, "num_hidden_layers": layers},
        "heads": {**BASE, "num_attention_heads": heads, "num_key_value_heads": heads, "hidden_size": heads * 16},
        "width": {**BASE, "intermediate_size": width},
        "experts": {
            **BASE,
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": experts,
            "num_experts_per_tok": 2,
        },
    }


def time_inspect(config: dict, work: Path) -> float:
    (work / "config.json").write_text(json.dumps(config))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mha2gqa", "inspect", str(work), "--json"], capture_output=True)
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 2):  # 2: refused in one line, which is an answer too
        raise SystemExit(f"inspect failed: {done.stderr.decode()[-2000:]}")
    return seconds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    scale, repeats = (0.01, 1) if args.smoke else (1.0, args.repeats)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="limits-") as work:
        for name, config in cases(scale).items():
            rows[name] = round(statistics.median(time_inspect(config, Path(work)) for _ in range(repeats)), 2)
            print(f"{name:8s} {rows[name]:7.2f} s", flush=True)
    return rows


if __name__ == "__main__":
    main()
