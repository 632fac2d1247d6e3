"""Where a sampled token's time goes on a GPU (corpus/sampling.py): milliseconds a step of sample_batch for a
SmolLM2-shaped Llama (random weights, bf16) at one batch, three ways side by side, alternating, medians:

  forward   the likeliest token only (argmax on the GPU): the model's forward through its KV cache, the floor
  cpu_draw  the (B, V) logits moved to the CPU and drawn there (the code of gpu_check part 6's first run)
  shipped   nucleus_draw on the GPU's logits (ranked there; narrow rows drawn on the CPU, wide rows there)

at two temperatures: 1.0 (random weights give flat rows: every nucleus is wider than the top-k candidates)
and 0.05 (peaked rows: every nucleus inside the candidates), the two paths of nucleus_draw.

    python3 bench/sampling_gpu.py --out $OUT/sampling_gpu.json          # on the GPU machine, ~1 min
    python bench/sampling_gpu.py --smoke                                 # CPU, toy sizes (tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOLLM2 = dict(  # ../shared/real-models' SmolLM2-135M-Instruct config, without its weights
    hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip
TOY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
           vocab_size=4096, max_position_embeddings=256)  # fmt: skip


class _Bar:
    def update(self, n):
        pass


def step_ms(model, batch: int, steps: int, temperature: float, way: str, device) -> float:
    from mha2gqa.corpus import sampling

    recipe = sampling.SamplingRecipe(temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    opening = torch.randint(model.config.vocab_size, (batch, 1), generator=generator)
    shipped = sampling.nucleus_draw
    if way == "cpu_draw":
        sampling.nucleus_draw = lambda logits, r, g: shipped(logits.float().cpu(), r, g)
    try:
        greedy = steps + 1 if way == "forward" else 0
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        sampling.sample_batch(model, opening, steps + 1, greedy, recipe, generator, device, _Bar())
        return (time.perf_counter() - started) / steps * 1000
    finally:
        sampling.nucleus_draw = shipped


def wide_share(model, batch: int, temperature: float, device) -> float:
    """The share of rows whose nucleus is wider than the candidates, on the first step."""
    from mha2gqa.corpus import sampling

    ids = torch.randint(model.config.vocab_size, (batch, 1)).to(device)
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits[:, -1].float() / temperature, -1)
    top = probs.topk(min(sampling.NUCLEUS_CANDIDATES, probs.shape[-1]), -1).values.sum(-1)
    return float((top < sampling.DEFAULT_RECIPE.top_p).float().mean())


def main(argv=None) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64, help="tokens drawn per sequence and timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a toy model on the CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.batch, args.steps, args.repeats = 8, 4, 1
    torch.manual_seed(0)
    config = LlamaConfig(**(TOY if args.smoke else SMOLLM2))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "batch": args.batch}
    result |= {"steps": args.steps, "torch": torch.__version__}
    result["rows"] = [temperature_row(model, args, temperature, device) for temperature in (1.0, 0.05)]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def temperature_row(model, args, temperature: float, device) -> dict:
    """The three ways at one temperature, alternating, --repeats times: medians and every run."""
    step_ms(model, args.batch, 4, temperature, "shipped", device)  # warm-up: kernels, allocator
    times = {way: [] for way in ("forward", "cpu_draw", "shipped")}
    for _ in range(args.repeats):
        for way in times:
            times[way].append(step_ms(model, args.batch, args.steps, temperature, way, device))
    row = {"temperature": temperature, "wide_rows": wide_share(model, args.batch, temperature, device)}
    row |= {"ms_per_step": {way: round(statistics.median(t), 2) for way, t in times.items()}, "runs": times}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
