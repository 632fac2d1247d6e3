"""Text -> token ids -> blocks is done once, in corpus/tokens.py and corpus/blocks.py, for calibration (and
--refine), uptrain, eval and convert's check. Moving it there changed no id: the hashes below are of what each
caller produced before the move (computed with the code at d24cd12 on these fixed inputs and the embedded
Austen tokenizer, a shipped file, made to add a BOS), and every caller must still produce exactly those bytes."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from uptrain_helpers import recipe_file

import mha2gqa
from mha2gqa.files import embedded

WORDS = (
    "the a of and to in is was her it that he she had not be with as for his on but at my all which this by "
    "Elizabeth Darcy Emma Anne were could would been have so no there said very what they them when more "
    "def return import class ( ) [ ] { } : ; = + - * / # 0 1 2 3 4 5 6 7 8 9 \n \n\n"
).split(" ")


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _corpus(root):
    """A folder of every kind of local text: plain (one long enough to be read in several 64 KiB pieces),
    compressed, JSON lines (a document a record), with an empty document among them."""
    folder = root / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(_text(1, 30000))  # ~150,000 characters: three calibration pieces
    with gzip.open(folder / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write(_text(2, 3000) + "\n")
    records = [{"text": _text(10 + i, 50 + 37 * i)} for i in range(40)] + [{"text": ""}]
    (folder / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    docs = root / "docs.jsonl"  # uptrain reads one format at a time
    docs.write_text("".join(json.dumps({"text": _text(100 + i, 30 + 11 * i)}) + "\n" for i in range(120)))
    other = root / "other.jsonl"
    other.write_text("".join(json.dumps({"text": _text(500 + i, 40 + 7 * i)}) + "\n" for i in range(60)))
    return folder, docs, other


def _sha(*tensors) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(f"{tuple(t.shape)} {t.dtype};".encode())
        digest.update(t.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _source(root):
    """The embedded model's config and tokenizer, the tokenizer made to put a BOS first (most do; the Austen one
    adds none), so that the pins tell the ids read with special tokens from those read without."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    src = root / "src"
    src.mkdir()
    shutil.copy(embedded.model_dir() / "config.json", src)
    tok = Tokenizer.from_file(str(embedded.tokenizer_dir() / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(
        src
    )
    return src


def _tokenizer(src):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src)


def _calibration(src, folder) -> dict[str, str]:
    from mha2gqa.convert.inputs import RefineBudget
    from mha2gqa.convert.refine.buffers import calibration_blocks
    from mha2gqa.corpus.calibration import read_calibration, resolve_calibration

    found = {}
    specs = {
        "folder": ([str(folder)], 80037),  # a.txt in two pieces, b.txt.gz, most of c.jsonl; no whole block
        "short": ([f"{folder / 'c.jsonl'}:0.5", "austen:0.5"], 100000),  # c.jsonl holds fewer than its share
        "mix": ([f"{folder}:0.25", "austen:0.75"], 9000),
        "three": ([f"{folder / 'a.txt'}:1", f"{folder / 'c.jsonl'}:1", f"{folder / 'b.txt.gz'}:2"], 5000),
    }
    for name, (spec, tokens) in specs.items():
        ids, record = read_calibration(resolve_calibration(spec, tokens, 64), src, progress=False)
        found[f"calibration {name}"] = _sha(ids)
        found[f"calibration {name} parts"] = json.dumps([part["tokens"] for part in record["parts"]])
        for wanted in (10**9, 1500):
            blocks, split = calibration_blocks(ids, RefineBudget(seq_len=64, wanted_tokens=wanted))
            found[f"refine {name} {wanted}"] = _sha(blocks, split["fit"], split["heldout"])
    return found


def _statistics_batches() -> dict[str, str]:
    """The batches the calibration statistics are gathered in: whole blocks, a shorter last block alone."""
    from mha2gqa.convert.calibration import _batches

    ids = torch.arange(5000, 6000)
    return {f"calibration batches {n}": _sha(*_batches(ids[:n], 64, 4)) for n in (1000, 640, 63)}


def _uptrain(tmp_path, src, folder, docs, other) -> dict[str, str]:
    from mha2gqa.uptrain import load_recipe
    from mha2gqa.uptrain.mixed_data import build

    tokenizer, found = _tokenizer(src), {}
    recipes = {
        "memory": {"train": str(docs)},
        "streaming": {"train": str(docs), "streaming": True, "shuffle_buffer": 16},
        "eval text": {"train": str(docs), "eval": str(other)},
        "mix": {"train": [f"{docs}:0.7", f"{other}:0.3"]},
        "mix eval": {"train": [f"{docs}:0.5", f"{other}:0.5"], "eval": str(folder / "a.txt")},
    }
    for name, data in recipes.items():
        path = recipe_file(tmp_path / f"{name}.yaml", model=str(tmp_path), output_dir="o", data=data, seed=3)
        recipe = load_recipe(path, validate_files=False)
        for rank in range(2):
            built = build(recipe, tokenizer, rank, 2, False)
            batches = built.train.batches(0)
            first = torch.stack([next(batches) for _ in range(3)])
            found[f"uptrain {name} rank {rank}"] = _sha(built.eval, first)
            if name not in ("streaming",):
                found[f"uptrain {name} rank {rank} pool"] = _sha(built.train.blocks)
    return found


def _eval(src, folder) -> dict[str, str]:
    from mha2gqa.eval.data import load_eval_text

    tokenizer, found = _tokenizer(src), {}
    for name, data, limit in (("folder", folder, None), ("file cut", folder / "c.jsonl", 700)):
        text = load_eval_text(str(data), tokenizer, max_tokens=limit)
        found[f"eval {name}"] = _sha(text.ids)
        found[f"eval {name} identity"] = text.identity["text_sha256"][:16] + f" {text.identity['documents']}"
    return found


def _attention_maps(src) -> dict[str, str]:
    """eval --attention-maps's text, as the ids of the tokens it labels the maps with."""
    from mha2gqa.eval.attention_maps import attention_maps
    from mha2gqa.files.loading import load_causal_lm

    tokenizer, model = _tokenizer(src), load_causal_lm(embedded.model_dir(), progress=False)
    found = attention_maps(model, tokenizer, "It is a truth universally acknowledged,\n\nthat a single man", 0)
    return {"eval attention maps": _sha(torch.tensor(tokenizer.convert_tokens_to_ids(found["tokens"])))}


def _check(src) -> dict[str, str]:
    """convert's check: the probe domains as eval reads them for it (check_run.eval_options), SRC's tokenizer."""
    from mha2gqa.convert.check import CheckPlan
    from mha2gqa.convert.check_run import eval_options
    from mha2gqa.corpus.probe import DOMAINS
    from mha2gqa.eval.reference_tops import TopReference
    from mha2gqa.eval.run import read_texts

    found = {}
    for tokens in (300, 4096):
        options = eval_options(CheckPlan(tokens, 128, DOMAINS, 0.0), TopReference(src, 512), False)
        texts = read_texts(options, _tokenizer(src))
        found.update({f"check {name} {tokens}": _sha(t.ids) for name, t in texts.items()})
    return found


def produced(tmp_path) -> dict[str, str]:
    folder, docs, other = _corpus(tmp_path)
    src = _source(tmp_path)
    return {
        **_calibration(src, folder),
        **_statistics_batches(),
        **_uptrain(tmp_path, src, folder, docs, other),
        **_eval(src, folder),
        **_attention_maps(src),
        **_check(src),
    }


BEFORE = {  # python tests/test_corpus_blocks.py with the code at d24cd12
    "calibration batches 1000": "5171ce0bbd9383d2",
    "calibration batches 640": "32d3c1a9033df737",
    "calibration batches 63": "3bb6d2d1e77b088c",
    "calibration folder": "8a2210b57ed8fb25",
    "calibration folder parts": "[80037]",
    "refine folder 1000000000": "21199295613b6a98",
    "refine folder 1500": "30b3b97c9aa820ec",
    "calibration short": "966c2eac96d47f87",
    "calibration short parts": "[41198, 49984]",
    "refine short 1000000000": "6c3d4ed49e2f372f",
    "refine short 1500": "f44d3be5fe8a90e3",
    "calibration mix": "e79b93f56a4e4d36",
    "calibration mix parts": "[2240, 6784]",
    "refine mix 1000000000": "220975d5db0e85f5",
    "refine mix 1500": "085b81c62ecfceff",
    "calibration three": "d099724d2067af54",
    "calibration three parts": "[1280, 1280, 2432]",
    "refine three 1000000000": "416c4fff568aef12",
    "refine three 1500": "ad44e124e68cae2a",
    "uptrain memory rank 0": "f6a202f272b6849e",
    "uptrain memory rank 0 pool": "d670489b295fca0e",
    "uptrain memory rank 1": "d5d09102aa19c128",
    "uptrain memory rank 1 pool": "d670489b295fca0e",
    "uptrain streaming rank 0": "9c472efacbd41fb0",
    "uptrain streaming rank 1": "a76206a1bf41dcfd",
    "uptrain eval text rank 0": "059c569d49563de5",
    "uptrain eval text rank 0 pool": "d645bf9c3dfef529",
    "uptrain eval text rank 1": "4c996f34c1d114cc",
    "uptrain eval text rank 1 pool": "d645bf9c3dfef529",
    "uptrain mix rank 0": "27949da8e9ced454",
    "uptrain mix rank 0 pool": "8a268890110a9dbe",
    "uptrain mix rank 1": "118c7ea153c3a45c",
    "uptrain mix rank 1 pool": "513905f243b7bdf6",
    "uptrain mix eval rank 0": "38c96c5e079adfbd",
    "uptrain mix eval rank 0 pool": "3f61992c4e2f72b9",
    "uptrain mix eval rank 1": "219a3c92353a7512",
    "uptrain mix eval rank 1 pool": "f4a42d35cc3af9d0",
    "eval folder": "87f60d6f16907b1d",
    "eval folder identity": "994903bc7f6ee013 43",
    "eval file cut": "f3c030586223635a",
    "eval file cut identity": "90e10a2c08d2865f 41",
    "eval attention maps": "a73d46812d082b15",
    "check prose 300": "d90a2af7cce2cdb4",
    "check code 300": "072e6a3af6d2641b",
    "check python_docs 300": "1cf3471ac8a4555b",
    "check licences 300": "de7489796bce10a2",
    "check prose 4096": "aeb4e6172f2c7c34",
    "check code 4096": "cf3186096bd39797",
    "check python_docs 4096": "3580b725c554ef57",
    "check licences 4096": "6e01a86c8dcacb63",
}


@pytest.mark.parametrize("caller", ["calibration", "refine", "uptrain", "eval", "check"])
def test_every_caller_produces_the_ids_it_produced_before_corpus_owned_them(tmp_path_factory, caller):
    found = _produced_once(tmp_path_factory)
    mine = {key: value for key, value in found.items() if key.startswith(caller)}
    assert mine and mine == {key: value for key, value in BEFORE.items() if key.startswith(caller)}


# A tokenizer called on text, or ids cut into whole blocks: what corpus/tokens.py and corpus/blocks.py own.
SECOND_WAY = re.compile(r"\btokenizer(\.encode)?\(|// seq_len \* seq_len|\.view\(-1, seq_len\)|\.split\(seq_len\)")
OWNERS = {"corpus/tokens.py", "corpus/blocks.py"}
LEFT = {  # the calls that stay where they are, and why
    "corpus/sampling.py": "the turn header of the parent's chat template, cut at a marker (no text is read)",
    "serving/prompts.py": "serve-bench's prompts: the probe texts' ids without special tokens (document_ids's rule)",
}


def test_no_module_outside_corpus_tokenizes_text_or_cuts_blocks():
    package = Path(mha2gqa.__file__).parent
    found = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if any(SECOND_WAY.search(line) for line in path.read_text().splitlines())
    }
    assert found - OWNERS == set(LEFT), "tokenize text with corpus.tokens and cut blocks with corpus.blocks"
    assert SECOND_WAY.search('    ids = tokenizer(text, return_tensors="pt")["input_ids"]')  # the shapes it finds
    assert SECOND_WAY.search("    blocks = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)")


_CACHE: dict[str, str] = {}


def _produced_once(tmp_path_factory) -> dict[str, str]:
    if not _CACHE:
        _CACHE.update(produced(tmp_path_factory.mktemp("pins")))
    return _CACHE


if __name__ == "__main__":  # print the pins (run with the code before a change to them)
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as tmp:
        for key, value in produced(Path(tmp)).items():
            print(f"    {key!r}: {value!r},")
