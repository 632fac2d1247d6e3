"""convert's check only ever adds to a conversion (convert/check_run.py's run_check_or_skip, check_cache.py):
whatever fails inside it, the model is written whole, one line says the check was skipped and why, and
mha2gqa.json records it; a cache entry that parses but holds the wrong content is scored again, never trusted
and never blamed on the model; the cache key sees a weight file replaced with the same size and time."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mha2gqa.cli import main

SKIPPED = "check: skipped (it could not run: "


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_tokenizer, save_tiny_model

    src = tmp_path_factory.mktemp("parent") / "src"
    save_tiny_model(src, "llama", max_position_embeddings=64)
    make_tiny_tokenizer(src)
    return src


def _convert(src: Path, dst: Path, cache: str, *args):
    result = CliRunner().invoke(
        main, ["convert", str(src), str(dst), "-g", "2", "-q", *args], env={"MHA2GQA_CACHE": cache}
    )
    assert result.exit_code == 0, result.output
    record = json.loads((dst / "mha2gqa.json").read_text())["lineage"][-1]["check"]
    return result.output.splitlines(), record


# ---- a fault inside the check: the model written whole, the skip said and recorded ----


def _tokenizer_json_not_json(src: Path, env: dict) -> None:
    (src / "tokenizer.json").write_text("{not json")


def _tokenizer_json_not_a_tokenizer(src: Path, env: dict) -> None:
    (src / "tokenizer.json").write_text('{"version": "1.0"}')


def _tokenizer_config_without_tokenizer_json(src: Path, env: dict) -> None:
    (src / "tokenizer.json").unlink()


def _ids_beyond_the_vocabulary(src: Path, env: dict) -> None:
    """Common characters' ids moved past the model's vocab_size (128): a tokenizer of another model."""
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for token in ("e", "t", "▁"):
        vocab[token] += 1000
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))


def _unknown_hidden_act(src: Path, env: dict) -> None:
    config = json.loads((src / "config.json").read_text())
    config["hidden_act"] = "no_such_act"
    (src / "config.json").write_text(json.dumps(config))


def _unusable_cache(src: Path, env: dict) -> None:
    env["MHA2GQA_CACHE"] = "~nosuchuser-mha2gqa/c"


def _parent_not_finite(src: Path, env: dict) -> None:
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"][0, 0] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


FAULTS = {  # what breaks -> the words the skip names
    "tokenizer.json not JSON": (_tokenizer_json_not_json, "SRC's tokenizer"),
    "tokenizer.json not a tokenizer": (_tokenizer_json_not_a_tokenizer, "SRC's tokenizer"),
    "tokenizer_config.json without tokenizer.json": (_tokenizer_config_without_tokenizer_json, "SRC's tokenizer"),
    "ids beyond the vocabulary": (_ids_beyond_the_vocabulary, "outside its vocabulary of 128 tokens"),
    "an unknown hidden_act": (_unknown_hidden_act, "no_such_act"),
    "MHA2GQA_CACHE ~nosuchuser": (_unusable_cache, "MHA2GQA_CACHE=~nosuchuser-mha2gqa/c is not a usable folder"),
    "the parent's own scores not finite": (_parent_not_finite, "SRC's own numbers"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_inside_the_check_leaves_the_model_whole_and_records_the_skip(fault, parent, tmp_path):
    from transformers import AutoModelForCausalLM

    break_it, words = FAULTS[fault]
    src = tmp_path / "src"
    shutil.copytree(parent, src)
    env = {"MHA2GQA_CACHE": str(tmp_path / "cache")}
    break_it(src, env)
    lines, record = _convert(src, tmp_path / "out" / "checked", env["MHA2GQA_CACHE"])
    assert lines[-1].startswith(SKIPPED) and words in lines[-1], lines
    assert record["skipped"].startswith("it could not run: ") and words in record["skipped"]
    assert words in (tmp_path / "out" / "checked" / "README.md").read_text()  # the card says it too
    # the same model as --no-check writes: every file, the same weights, nothing left beside it
    _convert(src, tmp_path / "out" / "unchecked", env["MHA2GQA_CACHE"], "--no-check")
    checked, unchecked = tmp_path / "out" / "checked", tmp_path / "out" / "unchecked"
    assert sorted(p.name for p in checked.iterdir()) == sorted(p.name for p in unchecked.iterdir())
    assert (checked / "model.safetensors").read_bytes() == (unchecked / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checked", "unchecked"]
    if fault == "an unknown hidden_act":  # transformers cannot build either model: the weights load once it can
        config = json.loads((checked / "config.json").read_text())
        (checked / "config.json").write_text(json.dumps({**config, "hidden_act": "silu"}))
    model = AutoModelForCausalLM.from_pretrained(checked)
    assert model.config.num_key_value_heads == 2


# ---- a cache entry that parses but holds the wrong content: scored again, the same numbers ----


def _first(meta: dict) -> str:
    return next(iter(meta))


def _drop_domain(tensors, meta):
    name = _first(meta)
    del meta[name]
    return {k: v for k, v in tensors.items() if not k.startswith(f"{name}.")}, meta


def _set_id(value):
    def change(tensors, meta):
        key = f"{_first(meta)}.ids"
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = value
        return tensors, meta

    return change


def _too_few_rows(tensors, meta):
    return {k: v[:-3].clone() for k, v in tensors.items()}, meta


def _set_field(field, value):
    def change(tensors, meta):
        meta[_first(meta)][field] = value
        return tensors, meta

    return change


def _scaled_loss(tensors, meta):
    meta[_first(meta)]["nll"] *= 1.5
    return tensors, meta


def _ids_of_another_type(tensors, meta):
    key = f"{_first(meta)}.ids"
    tensors[key] = tensors[key].to(torch.int32)
    return tensors, meta


def _least_likely_first(tensors, meta):
    """Each row's top tokens and their log-probabilities reversed: still a distribution, no longer in order."""
    return {k: v.flip(-1) if v.dim() == 2 else v for k, v in tensors.items()}, meta


def _not_finite_log_probs(tensors, meta):
    for key, value in tensors.items():
        if value.is_floating_point():
            tensors[key] = value.clone()
            tensors[key][0, 0] = float("nan")
    return tensors, meta


CACHE_FAULTS = {
    "a domain missing": _drop_domain,
    "an id beyond the vocabulary": _set_id(10**6),
    "a negative id": _set_id(-5),
    "too few rows": _too_few_rows,
    "a loss that is text": _set_field("nll", "12.5"),
    "a loss that is NaN": _set_field("nll", float("nan")),
    "a loss that is infinite": _set_field("nll", float("inf")),
    "a loss that is zero": _set_field("nll", 0.0),
    "a loss that is another number": _scaled_loss,
    "ids of another integer type": _ids_of_another_type,
    "top tokens least likely first": _least_likely_first,
    "a token count that is a boolean": _set_field("tokens", True),
    "a domain's numbers that are a string": lambda tensors, meta: (tensors, {**meta, _first(meta): "x"}),
    "metadata that is a list": lambda tensors, meta: (tensors, list(meta)),
    "log-probabilities that are NaN": _not_finite_log_probs,
}


@pytest.fixture(scope="module")
def checked_once(parent, tmp_path_factory):
    """A conversion of the parent with its check, and the valid cache entry it left."""
    root = tmp_path_factory.mktemp("first")
    _, record = _convert(parent, root / "dst", str(root / "cache"))
    (entry,) = (root / "cache" / "check").iterdir()
    return record, entry


def _rewrite(path: Path, change) -> None:
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["domains"])
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    tensors, meta = change(tensors, meta)
    save_file(tensors, path, metadata={"domains": json.dumps(meta)})


@pytest.mark.parametrize("fault", list(CACHE_FAULTS))
def test_a_cache_entry_with_the_wrong_content_is_scored_again_never_blamed_on_the_model(
    fault, parent, checked_once, tmp_path
):
    first, entry = checked_once
    cache = tmp_path / "cache"
    (cache / "check").mkdir(parents=True)
    shutil.copy(entry, cache / "check" / entry.name)
    _rewrite(cache / "check" / entry.name, CACHE_FAULTS[fault])
    lines, record = _convert(parent, tmp_path / "dst", str(cache))
    assert "skipped" not in record and record["verdict"] == first["verdict"]
    assert record["domains"] == first["domains"]  # the numbers of a fresh scoring, not the cache's
    assert not any("not finite" in line for line in lines)
    assert (cache / "check" / entry.name).read_bytes() == entry.read_bytes()  # the entry made again, valid


def test_the_cache_key_sees_a_weight_file_replaced_with_the_same_size_and_time(parent, tmp_path):
    from tiny_models import save_tiny_model

    src = tmp_path / "src"
    shutil.copytree(parent, src)
    cache = str(tmp_path / "cache")
    _, first = _convert(src, tmp_path / "a", cache)
    weights = src / "model.safetensors"
    stat = weights.stat()
    other = tmp_path / "other"
    save_tiny_model(other, "llama", seed=1, max_position_embeddings=64)
    assert (other / "model.safetensors").stat().st_size == stat.st_size
    shutil.copyfile(other / "model.safetensors", weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    _, second = _convert(src, tmp_path / "b", cache)
    _, fresh = _convert(src, tmp_path / "c", str(tmp_path / "fresh-cache"))
    assert second["domains"] == fresh["domains"] != first["domains"]
    parent_ppl = {name: row["parent_perplexity"] for name, row in second["domains"].items()}
    assert all(math.isfinite(v) for v in parent_ppl.values())
    assert parent_ppl != {name: row["parent_perplexity"] for name, row in first["domains"].items()}


def test_a_valid_cache_entry_is_read_as_it_is(parent, checked_once, tmp_path):
    """The valid entry is read as it is: the parent is not scored again (the rules above reject no good entry)."""
    first, entry = checked_once
    (tmp_path / "cache" / "check").mkdir(parents=True)
    shutil.copy(entry, tmp_path / "cache" / "check" / entry.name)
    result = CliRunner().invoke(
        main,
        ["convert", str(parent), str(tmp_path / "dst"), "-g", "2"],
        env={"MHA2GQA_CACHE": str(tmp_path / "cache")},
    )
    assert result.exit_code == 0 and "SRC's numbers from the cache" in result.output, result.output
    record = json.loads((tmp_path / "dst" / "mha2gqa.json").read_text())["lineage"][-1]["check"]
    assert record["domains"] == first["domains"]
