"""A per-layer (Nemotron-NAS) checkpoint exported to GGUF as llama.cpp's `deci` architecture, by the converter
llama.cpp ships, and the GGUF read back: each layer's head_count_kv must equal the checkpoint's.

    python bench/gguf_deci.py MODEL --converter LLAMA_CPP/convert_hf_to_gguf.py --out model.gguf

The converter is llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python source distribution
(`pip download --no-deps --no-binary llama-cpp-python llama-cpp-python`, vendor/llama.cpp; it needs `gguf`,
torch and transformers), as for bench/serve_llamacpp.py. Its `deci` class (conversion/deci.py, 0.3.36) writes
the per-layer kv heads, MLP widths and weights, but takes a vocabulary only from Llama-3's tokenizer (exactly
128,256 tokens) or a Llama-2 style BPE with byte fallback, and refuses any other ("Cannot find Llama BPE
tokenizer"): SmolLM2's and the embedded model's byte-level BPE. For those this script gives the deci class the
converter's own byte-level BPE reader (`_set_vocab_gpt2`, which its `llama` class uses for the same tokenizers);
it changes nothing else. Nothing here runs llama.cpp itself (that needs it compiled); no test runs this script.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

LLAMA3_VOCAB = 128256  # the one size the deci class reads as a byte-level BPE


def byte_level_bpe(model: Path) -> bool:
    """Whether MODEL's tokenizer.json is a BPE without byte fallback (GPT-2 style), other than Llama-3's."""
    path = model / "tokenizer.json"
    if not path.is_file():
        return False
    found = json.loads(path.read_text())["model"]
    return found.get("type") == "BPE" and not found.get("byte_fallback", False)


def export(model: Path, converter: Path, out: Path, outtype: str) -> None:
    """Run llama.cpp's converter in this process, its deci class reading a byte-level BPE as its llama class does."""
    sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
    from conversion.deci import DeciModel

    stock = DeciModel.set_vocab

    def set_vocab(self):
        if self.hparams.get("vocab_size") != LLAMA3_VOCAB and byte_level_bpe(Path(self.dir_model)):
            self._set_vocab_gpt2()
        else:
            stock(self)

    DeciModel.set_vocab = set_vocab
    sys.argv = [str(converter), str(model), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(converter), run_name="__main__")


def read_back(gguf_path: Path) -> dict:
    """The GGUF's architecture and per-layer attention and MLP sizes."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    arch = fields["general.architecture"].contents()
    return {
        "architecture": arch,
        "head_count_kv": list(fields[f"{arch}.attention.head_count_kv"].contents()),
        "head_count": list(fields[f"{arch}.attention.head_count"].contents()),
        "feed_forward_length": list(fields[f"{arch}.feed_forward_length"].contents()),
        "key_length": fields[f"{arch}.attention.key_length"].contents(),
        "tokenizer": fields["tokenizer.ggml.model"].contents(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a Nemotron-NAS checkpoint (mha2gqa convert --kv-heads-per-layer)")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    parser.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16"])
    args = parser.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    from mha2gqa.nemotron_nas.blocks import layer_kv_heads

    export(args.model, args.converter, args.out, args.outtype)
    found = read_back(args.out)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    checks = {
        "architecture deci": found["architecture"] == "deci",
        "head_count_kv per layer": found["head_count_kv"] == layer_kv_heads(config),
        "key_length = head_dim": found["key_length"] == head_dim,  # the deci class writes hidden / heads
    }
    print(json.dumps({"gguf": str(args.out), **found, "config_kv_heads": layer_kv_heads(config), "checks": checks}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
