"""eval against a reference known by its top tokens (eval/reference_tops.py): the numbers of a reference run beside
the model when the top tokens are the whole vocabulary, the reference never loaded when its numbers are known,
and the refusals eval's texts and tokenizer get in one line (what convert's check, one evaluate call, relies on)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from tiny_models import make_tiny_tokenizer, save_tiny_model

from mha2gqa.cli import main
from mha2gqa.eval import evaluate
from mha2gqa.eval import model as M
from mha2gqa.eval.reference_tops import TopReference

SETTINGS = dict(max_tokens=96, context=32, stride=32, speed_preset=None, progress=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    for name, seed in (("parent", 0), ("child", 1)):
        save_tiny_model(root / name, "llama", seed=seed, max_position_embeddings=64)
        make_tiny_tokenizer(root / name)
    (root / "text.txt").write_text("It is a truth universally acknowledged, that a single man. " * 40)
    return root


class Keeping(TopReference):
    """A reference that remembers what eval scored and gives it back the next time."""

    def __init__(self, path, top_k, kept=None):
        super().__init__(path, top_k, name="PARENT")
        self.kept, self.calls = kept, []

    def known(self, ids, context, stride, vocab):
        self.calls.append(("known", {n: t.numel() for n, t in ids.items()}, context, stride, vocab))
        return self.kept

    def scored(self, numbers):
        self.calls.append(("scored", sorted(numbers)))
        self.kept = numbers


def test_top_tokens_of_the_whole_vocabulary_give_the_numbers_of_the_reference_run_beside(pair, monkeypatch):
    data = {"text": str(pair / "text.txt")}
    beside = evaluate(pair / "child", data, reference=str(pair / "parent"), **SETTINGS)
    ref = Keeping(pair / "parent", 128)  # the tiny vocabulary: the coarsened KL is the full one
    tops = evaluate(pair / "child", data, reference=ref, **SETTINGS, kv_cache=False)
    assert ref.calls == [("known", {"text": 96}, 32, 32, 128), ("scored", ["text"])]
    assert tops["kv_cache"] is None and beside["kv_cache"] is not None
    assert tops["reference"]["top_k"] == 128 and tops["reference"]["label"] == "parent"
    mine, theirs = tops["domains"]["text"], beside["domains"]["text"]
    assert mine["perplexity"]["perplexity"] == pytest.approx(theirs["perplexity"]["perplexity"], rel=1e-6)
    for key in ("top1_agreement", "tokens"):
        assert mine["agreement"][key] == theirs["agreement"][key]
    assert mine["agreement"]["kl_mean"] == pytest.approx(theirs["agreement"]["kl_mean"], rel=1e-4)
    assert mine["agreement"]["kl_mean"] > 1e-4
    expected = theirs["agreement"]["reference_perplexity"]
    assert mine["agreement"]["reference_perplexity"] == pytest.approx(expected, rel=1e-6)

    # known numbers: the reference is never loaded, and the model's numbers are the same
    loads = []
    real = M.load_model
    monkeypatch.setattr(M, "load_model", lambda path, *a, **k: loads.append(path) or real(path, *a, **k))
    again = Keeping(pair / "parent", 128, kept=ref.kept)
    second = evaluate(pair / "child", data, reference=again, **SETTINGS, kv_cache=False)
    assert loads == [pair / "child"] and [c[0] for c in again.calls] == ["known"]
    assert second["domains"]["text"]["agreement"] == mine["agreement"]


def test_a_reference_model_in_memory_is_scored_as_it_is(pair, monkeypatch):
    from mha2gqa.files.loading import load_causal_lm

    parent = load_causal_lm(pair / "parent", progress=False)
    loads = []
    real = M.load_model
    monkeypatch.setattr(M, "load_model", lambda path, *a, **k: loads.append(path) or real(path, *a, **k))
    ref = TopReference(pair / "parent", 16, model=parent)
    found = evaluate(pair / "child", {"text": str(pair / "text.txt")}, reference=ref, **SETTINGS, kv_cache=False)
    assert (
        loads == [pair / "child"] and found["domains"]["text"]["agreement"]["tokens"] == 93
    )  # 3 windows of 32 side by side, 31 scored each


def test_ids_beyond_the_vocabulary_and_a_broken_tokenizer_are_refused_in_one_line(pair, tmp_path):
    import shutil

    src = tmp_path / "m"
    shutil.copytree(pair / "child", src)
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    for token in ("e", "t", "▁"):
        tokenizer["model"]["vocab"][token] += 1000
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    args = [
        "eval",
        str(src),
        "--data",
        f"text={pair / 'text.txt'}",
        "--speed",
        "off",
        "--out",
        str(tmp_path / "r.json"),
    ]
    run = CliRunner().invoke(main, args)
    line = run.output.strip().splitlines()[-1]
    assert run.exit_code == 2 and "on the text text, outside its vocabulary of 128 tokens" in line, run.output
    (src / "tokenizer.json").write_text("{not json")
    run = CliRunner().invoke(main, args)
    line = run.output.strip().splitlines()[-1]
    assert run.exit_code == 2 and "the tokenizer in " in line and "could not be read by transformers" in line
    assert "Traceback" not in run.output and not (tmp_path / "r.json").exists()
