"""Memory of one uptraining step: trainable all vs attention vs kv vs lora.

    python bench/train_memory.py            # embedded model (converted to 2 kv heads), batch 8 x 512, CPU
    python bench/train_memory.py --smoke    # batch 1 x 64, one repeat (a test runs this)

Part 1, measured: each mode runs in a child process of its own (load, select the trainable part the
way `mha2gqa uptrain` does, build AdamW, one forward/backward/optimizer step). Reported: the
process's peak RSS, its rise during the step above the resident size before it, and the exact bytes
of gradients and AdamW state (summed over tensors). Median of --repeats children per mode.

Part 2, computed: the same accounting for a Llama-2-7B-shaped model converted to 8 kv heads, held
the way the uptrain loop holds it (fp32 master weights for all/attention/kv; for lora the frozen
base as stored, bf16, adapters fp32; for QLoRA a 4-bit NF4 base), with gradient checkpointing and
one 4096-token sequence per step, against one 24 GB and one 80 GB GPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

MODES = ("all", "attention", "kv", "lora")
GB = 1e9


def child(model_dir: str, mode: str, batch: int, seq_len: int) -> dict:
    """One step in this process; returns the measurements as a dict."""
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    from mha2gqa.uptrain import lora
    from mha2gqa.uptrain.models import make_optimizer, select_trainable
    from mha2gqa.uptrain.recipe import LoraConfig, OptimConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if mode == "lora":
        model = lora.add_adapters(model, LoraConfig())
    trainable = select_trainable(model, mode)
    optimizer = make_optimizer(model, OptimConfig(), "cpu")
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    before = psutil.Process().memory_info().rss
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "mode": mode,
        "trainable_params": trainable,
        "weights_bytes": weights,
        "grad_bytes": grads,
        "adam_bytes": state,
        "peak_rss_bytes": peak,
        "step_rise_bytes": peak - before,
    }


def measure(model_dir: Path, batch: int, seq_len: int, repeats: int) -> list[dict]:
    rows = []
    for mode in MODES:
        runs = []
        for _ in range(repeats):
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    mode,
                    "--model",
                    str(model_dir),
                    "--batch",
                    str(batch),
                    "--seq-len",
                    str(seq_len),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        row = dict(runs[0])
        for key in ("peak_rss_bytes", "step_rise_bytes"):
            row[key] = statistics.median(r[key] for r in runs)
        rows.append(row)
    return rows


# Llama-2-7B's shape with 8 kv heads (what `mha2gqa convert --groups 8` makes of it).
LLAMA_7B_GQA8 = SimpleNamespace(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=11008, vocab=32000)


def computed_7b(m=LLAMA_7B_GQA8, seq_len: int = 4096, rank: int = 16) -> list[dict]:
    """Bytes of weights, gradients, AdamW state and activations per mode (see the module docstring)."""
    q = o = m.hidden * m.heads * m.head_dim
    k = v = m.hidden * m.kv_heads * m.head_dim
    layer = q + k + v + o + 3 * m.hidden * m.ffn + 2 * m.hidden
    embed = 2 * m.vocab * m.hidden  # untied input and output embeddings
    total = m.layers * layer + embed + m.hidden
    adapters = m.layers * rank * ((m.hidden + m.heads * m.head_dim) * 2 + (m.hidden + m.kv_heads * m.head_dim) * 2)
    # Gradient checkpointing keeps each layer's bf16 input; add one layer's recompute (attention
    # projections and the MLP's three ffn-wide bf16 tensors) and the fp32 logits and their gradient.
    activations = (
        m.layers * seq_len * m.hidden * 2 + seq_len * (4 * m.hidden + 3 * m.ffn) * 2 + 2 * seq_len * m.vocab * 4
    )
    linear = m.layers * (layer - 2 * m.hidden)
    trainable = {
        "all": total,
        "attention": m.layers * (q + k + v + o + m.hidden),
        "kv": m.layers * (k + v),
        "lora": adapters,
        "qlora": adapters,
    }
    base = {
        "all": 4 * total,
        "attention": 4 * total,
        "kv": 4 * total,
        "lora": 2 * total,
        # NF4 with double quantisation: 4 bits + about 0.127 bits of scales per weight; the rest bf16
        "qlora": linear * (4.127 / 8) + (total - linear) * 2,
    }
    rows = []
    for mode, n in trainable.items():
        adapter_weights = 4 * n if mode in ("lora", "qlora") else 0
        need = base[mode] + adapter_weights + 4 * n + 8 * n + activations
        rows.append(
            {
                "mode": mode,
                "params": total,
                "trainable_params": n,
                "weights_bytes": base[mode] + adapter_weights,
                "grad_bytes": 4 * n,
                "adam_bytes": 8 * n,
                "activation_bytes": activations,
                "total_bytes": need,
                "fits_24GB": need < 24 * GB * 0.95,
                "fits_80GB": need < 80 * GB * 0.95,
            }
        )
    return rows


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="batch 1 x 64 tokens, one repeat")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write both tables here")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.child, args.batch, args.seq_len)))
        return 0
    if args.smoke:
        args.batch, args.seq_len, args.repeats = 1, 64, 1

    from mha2gqa.convert.run import convert
    from mha2gqa.files import embedded

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "gqa2"
        convert(embedded.model_dir(), model, groups=2, progress=False, check=False)
        rows = measure(model, args.batch, args.seq_len, args.repeats)
    print(
        f"embedded model converted to 2 kv heads, one step of batch {args.batch} x {args.seq_len} tokens, "
        f"fp32, CPU, median of {args.repeats} (MiB):"
    )
    print("| trainable | params trained | weights | gradients | AdamW state | peak RSS | rise during the step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['trainable_params']:,} | {_mib(r['weights_bytes'])} | {_mib(r['grad_bytes'])} | "
            f"{_mib(r['adam_bytes'])} | {_mib(r['peak_rss_bytes'])} | {_mib(r['step_rise_bytes'])} |"
        )
    big = computed_7b()
    print("\nLlama-2-7B shape, 8 kv heads, computed (GB = 1e9 bytes; one 4096-token sequence, gradient checkpointing):")
    print("| trainable | params trained | weights | gradients + AdamW | activations | total | 24 GB GPU | 80 GB GPU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in big:
        print(
            f"| {r['mode']} | {r['trainable_params'] / 1e6:,.1f} M | {r['weights_bytes'] / GB:.1f} | "
            f"{(r['grad_bytes'] + r['adam_bytes']) / GB:.1f} | {r['activation_bytes'] / GB:.1f} | "
            f"{r['total_bytes'] / GB:.1f} | {'fits' if r['fits_24GB'] else 'no'} | {'fits' if r['fits_80GB'] else 'no'} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"measured": rows, "computed_7b": big}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
