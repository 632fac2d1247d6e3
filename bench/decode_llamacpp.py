"""Decode tokens/s in llama.cpp, measured by its own benchmark tool, of a parent and its GQA-8 child at long
contexts (issue 68): the engine most CPU users decode with, on our documented path (GGUF by llama.cpp's converter).

A Llama-shaped MHA model with random weights (32 heads of 64, hidden 2,048, intermediate 5,632, 6 layers,
SmolLM2's 49,152-token vocabulary, tied embeddings: 409M parameters; the speed does not depend on the values),
its `mha2gqa convert --groups 8` child, both exported to GGUF in float16 by llama.cpp's convert_hf_to_gguf.py
and, by default, quantized to Q4_0 with llama-quantize (what users run on a CPU: 4-bit weights, a float16 KV
cache). One `llama-bench` run per depth then decodes `--gen` tokens after a context of that depth (its `-d`: the
depth is filled by a prefill that is not timed), both models in the run, `--reps` times each; the median
of the repetitions is each one's tokens/s. Beside each: the bytes a token must read (the GGUF's tensors, and the
float16 KV cache at that depth) at this machine's bandwidth, measured in the same run as bench/decode_gqa.py does.

    python bench/decode_llamacpp.py --tokenizer SMOLLM2_DIR --work /tmp/gguf-bench \\
        --converter LLAMA_CPP/convert_hf_to_gguf.py --converter-python VENV/bin/python \\
        --llama-bench LLAMA_CPP/build/bin/llama-bench --llama-quantize LLAMA_CPP/build/bin/llama-quantize \\
        --depths 4096,8192,16384 --out bench/results/llamacpp/decode-q4_0.json

llama.cpp's tools are built from the llama-cpp-python source distribution, which vendors llama.cpp
(docs/benchmarks.md says how); the converter needs `gguf`, `sentencepiece`, torch and transformers (vLLM's venv
has them). `--smoke` builds a toy pair; tests/test_bench_smoke.py runs it against a stand-in converter and
llama-bench (the test environment has no llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mha2gqa, for serve_gqa8's convert
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_gqa import bandwidth
from serve_gqa8 import build_parent, convert

SHAPES = {"full": (2048, 6, 32, 5632), "smoke": (64, 2, 8, 128)}  # hidden, layers, heads, intermediate
KV_BYTES = 2  # llama-bench's default KV cache type, f16


def export(model: Path, args, weights: str) -> Path:
    """MODEL -> GGUF by llama.cpp's converter (float16), then llama-quantize to `weights` unless f16; once each."""
    f16 = Path(args.work) / f"{model.name}-f16.gguf"
    if not f16.is_file():
        command = [args.converter_python, args.converter, str(model), "--outfile", str(f16), "--outtype", "f16"]
        env = dict(os.environ, PYTHONPATH=str(Path(args.converter).parent / "gguf-py"))
        subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    if weights == "f16":
        return f16
    out = f16.with_name(f"{model.name}-{weights}.gguf")
    if not out.is_file():
        subprocess.run([args.llama_quantize, str(f16), str(out), weights.upper()], check=True, capture_output=True)
    return out


def cache_bytes_per_token(model: Path) -> int:
    """The float16 KV cache of one token over all layers, from the checkpoint's config."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * KV_BYTES


def run_llama_bench(args, ggufs: list[Path]) -> tuple[list[dict], list[list[str]]]:
    """llama-bench's JSON records (one per model and depth), and the commands that made them: one llama-bench per
    depth with both models, so the two models of a depth run minutes apart, not one model's depths before the
    other's (a drifting load then falls on a depth's pair alike)."""
    records, commands = [], []
    for depth in args.depths.split(","):
        command = [args.llama_bench, "-p", "0", "-n", str(args.gen), "-d", depth, "-r", str(args.reps)]
        command += ["-t", str(args.threads), "-o", "json"] + [arg for g in ggufs for arg in ("-m", str(g))]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        records += json.loads(done.stdout)
        commands.append(command)
    return records, commands


def summarise(records: list[dict], models: dict, limit_gb_s: float) -> list[dict]:
    """A row per model and depth: median tokens/s over the repetitions, the bytes a token reads, the fraction of
    the bandwidth limit, and (past the first model) tokens/s over the first model's at that depth."""
    rows = []
    for record in records:
        name, info = next((n, i) for n, i in models.items() if Path(record["model_filename"]).name == i["gguf"].name)
        per_s = statistics.median(record["samples_ts"])
        need = info["gguf"].stat().st_size + info["cache_per_token"] * record["n_depth"]
        rows.append({
            "model": name, "kv_heads": info["kv_heads"], "depth": record["n_depth"], "gen": record["n_gen"],
            "tokens_per_s_median": per_s, "tokens_per_s_samples": record["samples_ts"],
            "gguf_bytes": info["gguf"].stat().st_size, "cache_bytes": info["cache_per_token"] * record["n_depth"],
            "fraction_of_bandwidth_limit": need / (limit_gb_s * 1e9) * per_s,
        })  # fmt: skip
    first = rows[0]["model"]
    for row in rows:
        base = next(r for r in rows if r["model"] == first and r["depth"] == row["depth"])
        row["vs_first"] = row["tokens_per_s_median"] / base["tokens_per_s_median"]
    return rows


def print_table(rows: list[dict]) -> None:
    print("| depth | model | kv heads | GGUF GB | cache GB | tok/s (median) | vs MHA | of the limit |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["depth"], -r["kv_heads"])):
        print(
            f"| {r['depth']} | {r['model']} | {r['kv_heads']} | {r['gguf_bytes'] / 1e9:.3f} | "
            f"{r['cache_bytes'] / 1e9:.3f} | {r['tokens_per_s_median']:.2f} | {r['vs_first']:.2f}x | "
            f"{100 * r['fraction_of_bandwidth_limit']:.0f}% |"
        )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder (its vocabulary sizes the model)")
    parser.add_argument("--work", required=True, help="folder for the checkpoints and GGUF files (kept, reused)")
    parser.add_argument("--converter", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--converter-python", default=sys.executable, help="a Python with gguf and sentencepiece")
    parser.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench")
    parser.add_argument("--llama-quantize", help="llama.cpp's llama-quantize (for --weights other than f16)")
    parser.add_argument("--weights", default="q4_0", help="f16, or a llama-quantize type (q4_0, q8_0, ...)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--depths", default="4096,8192,16384", help="llama-bench -d: comma-separated")
    parser.add_argument("--gen", type=int, default=32, help="tokens decoded per repetition (llama-bench -n)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--smoke", action="store_true", help="a toy pair: checks the script runs")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    if args.weights != "f16" and not args.llama_quantize:
        parser.error(f"--weights {args.weights} needs --llama-quantize (or --weights f16)")
    return args


def main() -> None:
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    depths = [int(d) for d in args.depths.split(",")]
    shape = SHAPES["smoke" if args.smoke else "full"]
    parent = build_parent(work / "mha", Path(args.tokenizer), shape, "bfloat16", positions=max(depths) + 1024)
    child = convert(parent, work / f"gqa{args.groups}", args.groups)
    models = {}
    for name, folder in (("MHA", parent), (f"GQA-{args.groups}", child)):
        config = json.loads((folder / "config.json").read_text())
        models[name] = {"gguf": export(folder, args, args.weights), "kv_heads": config["num_key_value_heads"],
                        "cache_per_token": cache_bytes_per_token(folder)}  # fmt: skip
    load_before = os.getloadavg()
    limit = bandwidth(args.threads, 0.0625 if args.smoke else 1.0)
    records, commands = run_llama_bench(args, [m["gguf"] for m in models.values()])
    rows = summarise(records, models, limit["limit_gb_s"])
    load_after = os.getloadavg()
    print(f"bandwidth {limit['limit_gb_s']:.1f} GB/s, {args.threads} threads; load {load_before} -> {load_after}")
    print_table(rows)
    engine = {k: records[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "flash_attn")}
    result = {
        "commands": commands, "weights": args.weights, "kv_type": "f16", "engine": engine, "bandwidth": limit,
        "load_average": {"before": load_before, "after": load_after}, "rows": rows, "llama_bench": records,
        "models": {n: {**m, "gguf": str(m["gguf"])} for n, m in models.items()},
    }  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
