"""The decode saving in vLLM: a Llama-shaped MHA model (random weights, 32 heads) and its GQA-8 conversion, both
served at one KV-cache memory, 64 requests of 2,048 tokens of context at once: output tokens/s, time per output token,
and the maximum concurrency the engine reports, side by side (mha2gqa serve-bench, one run).

    flock -x /work/locks/cpu python bench/serve_gqa8.py --vllm-python VENV/bin/python --tokenizer SMOLLM2_DIR \\
        --work /tmp/serve-gqa8 --out bench/results/serve/gqa8-64x2048.json

Random weights are enough: the time of a step does not depend on the values, and the greedy check still
compares the engine with transformers. Run it alone: it times. `--smoke` builds a toy model and runs it at toy
sizes (against the fake server in tests/test_serving.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SHAPES = {  # (hidden, layers, heads, intermediate): about 0.7B parameters with a 49,152-token vocabulary
    "full": (2048, 12, 32, 5632),
    "smoke": (64, 2, 8, 128),
}
# issue 68: a cache-bound decode wants the cache to outweigh the weights; fewer layers keep the ratio of the two
# per layer and make the long prefills that fill the cache cheaper (6 layers: 0.41B, bench/decode_llamacpp.py's)


def build_parent(folder: Path, tokenizer: Path, shape: tuple, dtype: str, positions: int = 4096) -> Path:
    """A Llama-shaped MHA checkpoint with random weights (seed 0), the given tokenizer's vocabulary, and room for
    `positions` tokens of context."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    hidden, layers, heads, intermediate = shape
    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=intermediate, vocab_size=len(tok), max_position_embeddings=positions, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def convert(parent: Path, child: Path, groups: int) -> Path:
    if not (child / "config.json").is_file():
        command = [sys.executable, "-m", "mha2gqa", "convert", str(parent), str(child), "--groups", str(groups), "-q"]
        subprocess.run(command, check=True)
    return child


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="a Python with vLLM (default: as serve-bench finds it)")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder (its vocabulary sizes the model)")
    parser.add_argument("--work", required=True, help="folder for the two checkpoints and the servers' logs")
    parser.add_argument("--out", help="write serve-bench's JSON here")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument(
        "--kv-cache-memory", default="3GiB", help="each server's KV-cache memory (3GiB holds 64 x 2,048 of GQA-8)"
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, help="default: --context less --output-tokens")
    parser.add_argument("--layers", type=int, help="default: the full shape's 12")
    parser.add_argument("--waves", type=int, default=1, help="requests per timed point: concurrency x waves")
    parser.add_argument("--decode-concurrency", type=int, default=4, help="serve-bench's (0: no decode-only point)")
    parser.add_argument("--capacity-concurrency", default="auto", help="serve-bench's: auto, a count, 0 (none)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--eager", action="store_true", help="vLLM's --enforce-eager (no torch.compile)")
    parser.add_argument("--smoke", action="store_true", help="a toy model at toy sizes: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.groups, args.kv_cache_memory, args.concurrency, args.context, args.output_tokens = 2, "16MiB", 4, 256, 8

    from mha2gqa.serving.bench import serve_bench
    from mha2gqa.serving.options import ServeOptions

    work = Path(args.work)
    shape = SHAPES["smoke" if args.smoke else "full"]
    if args.layers:
        shape = (shape[0], args.layers, *shape[2:])
    name = "mha" if shape[1] == SHAPES["full"][1] or args.smoke else f"mha-{shape[1]}layers"
    positions = max(4096, args.context)
    parent = build_parent(work / name, Path(args.tokenizer), shape, "bfloat16", positions=positions)
    child = convert(parent, work / name.replace("mha", f"gqa{args.groups}"), args.groups)
    options = ServeOptions(
        vllm_python=args.vllm_python, dtype="bfloat16", context=args.context, kv_cache_memory=args.kv_cache_memory,
        concurrency=(args.concurrency,), prompt_tokens=args.prompt_tokens or args.context - args.output_tokens,
        output_tokens=args.output_tokens, waves=args.waves, repeats=args.repeats, eager=args.eager,
        logs=str(work / "logs"), greedy_tokens=16, prompts_per_domain=1, decode_concurrency=args.decode_concurrency,
        capacity_concurrency=args.capacity_concurrency,
    )  # fmt: skip
    found = serve_bench(str(parent), [str(child)], args.out, options, say=lambda line: print(line, flush=True))
    print(json.dumps(table(found), indent=2))


def table(found: dict) -> list[dict]:
    """Per model: KV tokens, max concurrency, and at the one concurrency: output and total tokens/s, time per
    output token (and once no prompt is prefilled any more: steady), inter-token latency, time to the first token; at the decode-only point its time per output token and inter-token
    latency, at the capacity-bound point its output tokens/s; the child's ratios over the parent beside."""
    rows = []
    for m in found["models"]:
        point = m["throughput"][0]
        rows.append({
            "model": m["label"], "kv_heads": m["kv_heads"], "kv_tokens": m["kv"]["engine"]["tokens"],
            "max_concurrency": m["kv"]["engine"]["max_concurrency"], "concurrency": point["concurrency"],
            "output_tokens_per_s": point["output_tokens_per_s"], "total_tokens_per_s": point.get("total_tokens_per_s"),
            "tpot_ms": point["tpot_ms"], "steady_tpot_ms": point.get("steady_tpot_ms"), "itl_ms": point.get("itl_ms"),
            "ttft_ms": point["ttft_ms"], "greedy_equal": m["greedy"]["equal"],
            "decode_tpot_ms": (m.get("decode") or {}).get("tpot_ms"),
            "decode_steady_tpot_ms": (m.get("decode") or {}).get("steady_tpot_ms"),
            "decode_itl_ms": (m.get("decode") or {}).get("itl_ms"),
            "capacity_output_tokens_per_s": (m.get("capacity") or {}).get("output_tokens_per_s"),
            "capacity_running_mean": (m.get("capacity") or {}).get("running_mean"),
        })  # fmt: skip
    keys = ("kv_tokens", "output_tokens_per_s", "tpot_ms", "steady_tpot_ms", "itl_ms", "decode_tpot_ms",
            "decode_steady_tpot_ms", "decode_itl_ms",
            "capacity_output_tokens_per_s")  # fmt: skip
    for row in rows[1:]:
        row["ratios"] = {k: row[k] / rows[0][k] for k in keys if rows[0][k] and row[k]}
    return rows


if __name__ == "__main__":
    main()
