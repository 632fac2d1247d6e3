"""Benchmark: `mha2gqa convert --groups 8` vs `cp -r` vs the naive transformers path, side by side.

    python bench/convert.py                 # 2 GB and 4 GB synthetic Llama-shaped bf16 checkpoints
    python bench/convert.py --sizes 4 --repeats 5
    python bench/convert.py --cold           # drop the page cache before every job (root only)
    python bench/convert.py --jobs convert cp import-torch   # leave out the naive job; time a bare torch import
    python bench/convert.py --jobs convert convert-torch cp  # the torch-free executor vs the torch one (before it)
    python bench/convert.py --smoke          # every job once on a ~3 MB toy checkpoint (run by a test)

Each size: a sharded bf16 checkpoint (hidden 4096, 32 heads, 32 kv heads, LAYERS layers) is written
under --workdir; each job runs as its own process (median of --repeats, after one warm-up that puts
the source in the page cache for all three alike). Prints a table with wall time, peak RSS, peak
anonymous memory and the ratios to convert.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import measure  # noqa: E402

HIDDEN, HEADS, INTERMEDIATE, VOCAB = 4096, 32, 11008, 32000
LAYERS_FOR_GB = {2: 4, 4: 8}  # ~0.4 GB per layer + 0.5 GB embeddings, in bf16
SMOKE = 0  # --smoke: the size key of a ~3 MB toy (hidden 256, 32 heads of 8, 2 layers), every job once

NAIVE = """
import sys, torch
from transformers import AutoModelForCausalLM
from mha2gqa.convert.methods import group_heads, group_mean, ungroup
src, dst, groups = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
config = model.config
for layer in model.model.layers:
    for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
        pooled = ungroup(group_mean(group_heads(proj.weight.data, config.num_key_value_heads, groups)))
        proj.weight = torch.nn.Parameter(pooled.to(torch.bfloat16))
config.num_key_value_heads = groups
model.save_pretrained(dst)
"""


def build_checkpoint(path: Path, layers: int, hidden=HIDDEN, intermediate=INTERMEDIATE, vocab=VOCAB) -> None:
    """A Llama config and one ~0.4 GB shard per layer; values are cheap to make but touched on read.
    Runs in its own process (see main): the measuring parent must stay small, because a child's peak
    RSS as the kernel reports it starts from its parent's at fork time."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=hidden,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        dtype="bfloat16",
        tie_word_embeddings=False,
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    block = torch.randn(1 << 20).to(torch.bfloat16)

    def tensor(*shape):
        numel = 1
        for dim in shape:
            numel *= dim
        return block.repeat(numel // block.numel() + 1)[:numel].reshape(shape).clone()

    shards = [
        {
            "model.embed_tokens.weight": tensor(vocab, hidden),
            "lm_head.weight": tensor(vocab, hidden),
            "model.norm.weight": tensor(hidden),
        }
    ]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append(
            {
                **{
                    f"{p}self_attn.{n}.weight": tensor(hidden, hidden) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                },
                f"{p}mlp.gate_proj.weight": tensor(intermediate, hidden),
                f"{p}mlp.up_proj.weight": tensor(intermediate, hidden),
                f"{p}mlp.down_proj.weight": tensor(hidden, intermediate),
                f"{p}input_layernorm.weight": tensor(hidden),
                f"{p}post_attention_layernorm.weight": tensor(hidden),
            }
        )
    weight_map, total = {}, 0
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        for key, value in shard.items():
            weight_map[key] = name
            total += value.numel() * 2
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


JOBS = ("convert", "cp", "naive", "import-torch", "convert-torch")


def jobs(src: Path, out: Path, chosen=JOBS[:3]) -> dict[str, tuple[list[str], dict | None]]:
    """label -> (command, environment or None)."""
    convert = [sys.executable, "-m", "mha2gqa", "convert", str(src), str(out), "--groups", "8", "-q", "--no-check"]
    every = {
        "convert": ("mha2gqa convert", convert, None),
        # the torch executor on the same plan (what convert ran before convert/fast.py)
        "convert-torch": (
            "mha2gqa convert (torch executor)",
            convert,
            {**os.environ, "MHA2GQA_CONVERT_WITH_TORCH": "1"},
        ),
        "cp": ("cp -r", ["cp", "-r", str(src), str(out)], None),
        "naive": (
            "naive (from_pretrained+save_pretrained)",
            [sys.executable, "-c", NAIVE, str(src), str(out), "8"],
            None,
        ),
        # the fixed cost of any torch process: one that only imports torch
        "import-torch": ("python -c 'import torch'", [sys.executable, "-c", "import torch"], None),
    }
    return {every[job][0]: every[job][1:] for job in chosen}


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_size(workdir: Path, gigabytes: int, repeats: int, cold: bool, chosen=JOBS[:3]) -> dict[str, dict]:
    src, out = workdir / f"llama-{gigabytes}gb", workdir / "out"
    if not src.exists():
        build = [str(src), "2", "smoke"] if gigabytes == SMOKE else [str(src), str(LAYERS_FOR_GB[gigabytes])]
        subprocess.run([sys.executable, __file__, "--build", *build], check=True)
    results: dict[str, list[dict]] = {}
    for attempt in range(repeats + 1):  # interleaved, so background load hits all jobs alike
        for name, (command, env) in jobs(src, out, chosen).items():
            shutil.rmtree(out, ignore_errors=True)
            if cold:
                drop_page_cache()
            measured = measure(command, env)
            if attempt:  # the first round is a warm-up
                results.setdefault(name, []).append(measured)
    shutil.rmtree(out, ignore_errors=True)
    size = sum(p.stat().st_size for p in src.iterdir())
    return {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {"bytes": size}
        for name, runs in results.items()
    }


def main() -> None:
    if sys.argv[1:2] == ["--build"]:
        toy = dict(hidden=256, intermediate=512, vocab=1024) if sys.argv[4:5] == ["smoke"] else {}
        build_checkpoint(Path(sys.argv[2]), int(sys.argv[3]), **toy)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4], choices=sorted(LAYERS_FOR_GB))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every job (needs root)")
    parser.add_argument(
        "--jobs",
        nargs="+",
        choices=JOBS,
        default=list(JOBS[:3]),
        help="which jobs to run (convert is always run: the ratios are to it)",
    )
    parser.add_argument("--smoke", action="store_true", help="every job once on a ~3 MB toy checkpoint")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.repeats, args.jobs = [SMOKE], 1, list(JOBS)
    print(
        f"page cache: {'dropped before every job' if args.cold else 'warm'}; median of {args.repeats}; "
        f"load average {os.getloadavg()[0]:.1f} at the start"
    )
    print("| checkpoint | job | wall s | x convert | peak RSS MiB | peak anon MiB | anon x convert |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for gigabytes in args.sizes:
        chosen = ["convert"] + [job for job in args.jobs if job != "convert"]
        results = run_size(args.workdir, gigabytes, args.repeats, args.cold, chosen)
        base = results["mha2gqa convert"]
        for name, r in results.items():
            print(
                f"| {r['bytes'] / 1e9:.2f} GB | {name} | {r['wall_s']:.2f} | {r['wall_s'] / base['wall_s']:.2f} "
                f"| {r['peak_rss_mib']:.0f} | {r['peak_anon_mib']:.0f} | {r['peak_anon_mib'] / base['peak_anon_mib']:.1f} |",
                flush=True,
            )
        print(f"(load average {os.getloadavg()[0]:.1f} after {gigabytes} GB)", flush=True)
        if not args.keep:
            shutil.rmtree(args.workdir / f"llama-{gigabytes}gb")


if __name__ == "__main__":
    main()
