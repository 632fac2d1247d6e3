"""A parent and its conversions in llama.cpp: exported to GGUF with the converter llama.cpp ships, run with
llama-cpp-python, and the two checks serve-bench makes in vLLM: greedy continuations equal to transformers' on
prompts from every probe domain, and the KV-cache size llama.cpp reports beside our formula.

    python bench/serve_llamacpp.py PARENT CHILD... --converter LLAMA_CPP/convert_hf_to_gguf.py \\
        --work /tmp/gguf --out bench/results/serve/llamacpp-smollm2.json

The converter is not in the `gguf` package: it is llama.cpp's convert_hf_to_gguf.py, which the llama-cpp-python
source distribution carries in vendor/llama.cpp (`pip download --no-deps --no-binary llama-cpp-python
llama-cpp-python`); it needs `gguf`, `sentencepiece`, torch and transformers. llama-cpp-python itself compiles
llama.cpp on install (cmake and a C++ compiler). Each model is run in a child process of its own, so that
llama.cpp's log (written by C code to the process's stderr) can be read. No test runs this script: the test
environment has no llama-cpp-python.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

# llama.cpp's load log: "llama_kv_cache: size =   45.00 MiB (  2048 cells,  30 layers,  1/1 seqs), K (f32): ..."
_KV = re.compile(r"llama_kv_cache: +size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*?K \((\w+)\): +([\d.]+) MiB")
_TYPES = {"f32": (0, 4), "f16": (1, 2)}  # llama.cpp's ggml type id and bytes per element


def export(model: Path, converter: Path, out: Path) -> Path:
    """MODEL -> OUT.gguf in float32, by llama.cpp's own converter, once."""
    if not out.is_file():
        command = [sys.executable, str(converter), str(model), "--outfile", str(out), "--outtype", "f32"]
        subprocess.run(command, check=True, capture_output=True, text=True)
    return out


def child_main(gguf: str, prompts_file: str, tokens: int, context: int, kv_type: str) -> None:
    """In the child: load GGUF with llama-cpp-python, greedy-decode every prompt by argmax over the logits (no
    sampler: no repeat penalty, no top-k), print the ids as JSON; llama.cpp logs the KV cache to stderr."""
    import numpy as np
    from llama_cpp import Llama

    type_id = _TYPES[kv_type][0]
    llm = Llama(model_path=gguf, n_ctx=context, n_threads=1, verbose=True, type_k=type_id, type_v=type_id)
    vocab = llm.n_vocab()
    found = []
    for prompt in json.loads(Path(prompts_file).read_text()):
        llm.reset()
        llm.eval(prompt)
        ids = []
        for _ in range(tokens):
            # the last position's logits (Llama.scores keeps them only with logits_all, 0.3.36)
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
            ids.append(int(np.argmax(logits)))
            llm.eval([ids[-1]])
        found.append(ids)
    print(json.dumps(found))


def run_llamacpp(gguf: Path, prompts_file: Path, tokens: int, context: int, kv_type: str) -> tuple[list, dict]:
    """(greedy ids per prompt, the KV cache as llama.cpp reports it) from a child process."""
    command = [sys.executable, __file__, "--child", str(gguf), str(prompts_file), str(tokens), str(context), kv_type]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    found = _KV.search(done.stderr)
    kv = None
    if found:
        kv = {"mib": float(found[1]), "cells": int(found[2]), "layers": int(found[3]), "type": found[4]}
    return json.loads(done.stdout.strip().splitlines()[-1]), kv


def check(models: list[Path], converter: Path, work: Path, tokens: int, context: int, kv_type: str) -> dict:
    from mha2gqa.architecture.layouts import attention_shape, read_config
    from mha2gqa.eval.model import load_tokenizer
    from mha2gqa.serving import prompts
    from mha2gqa.serving.options import GREEDY_PROMPT_TOKENS
    from mha2gqa.serving.reference import reference_texts

    ids = prompts.probe_ids(load_tokenizer(models[0]))
    greedy_set = prompts.greedy_prompts(ids, 2, GREEDY_PROMPT_TOKENS)
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps([p for _, p in greedy_set]))
    rows = []
    for model in models:
        gguf = export(model, converter, work / f"{model.name}.gguf")
        engine, kv = run_llamacpp(gguf, prompts_file, tokens, context, kv_type)
        reference = reference_texts(model, "float32", [p for _, p in greedy_set], tokens)
        shape = attention_shape(read_config(model))
        cells = kv["cells"] if kv else context  # llama.cpp may pad n_ctx: the formula at the cells it allocated
        formula_mib = shape.kv_bytes_per_token(dtype_bytes=_TYPES[kv_type][1]) * cells / 2**20
        rows.append({
            "model": str(model), "kv_heads": shape.kv_heads, "gguf": str(gguf),
            "greedy_equal": sum(a == b for a, b in zip(engine, reference)), "prompts": len(greedy_set),
            "first_difference": [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                 for a, b in zip(engine, reference)],
            "kv_reported": kv, "kv_formula_mib": formula_mib,
        })  # fmt: skip
    for row in rows[1:]:
        if row["kv_reported"] and rows[0]["kv_reported"]:
            row["kv_ratio"] = rows[0]["kv_reported"]["mib"] / row["kv_reported"]["mib"]
            row["formula_ratio"] = rows[0]["kv_formula_mib"] / row["kv_formula_mib"]
    return {"context": context, "kv_type": kv_type, "greedy_tokens": tokens, "models": rows}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        gguf, prompts_file, tokens, context, kv_type = sys.argv[2:7]
        return child_main(gguf, prompts_file, int(tokens), int(context), kv_type)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="the parent, then its conversions (local folders)")
    parser.add_argument("--converter", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--work", required=True, help="folder for the GGUF files")
    parser.add_argument("--out", help="write the result JSON here")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048, help="llama.cpp's n_ctx: the KV cache's cells")
    parser.add_argument("--kv-type", choices=sorted(_TYPES), default="f32", help="the KV cache's element type")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    found = check([Path(m) for m in args.models], Path(args.converter), work, args.greedy_tokens, args.context,
                  args.kv_type)  # fmt: skip
    text = json.dumps(found, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
