"""Uptraining on the teacher's own samples (data.train: [parent]), mixes with shares, and `austen` in
data.train: the token count follows the budget, seeds per process, the record, the refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer
from uptrain_helpers import corpus, recipe_file, tiny_model_dir

from mha2gqa.corpus import sampling
from mha2gqa.files.embedded import train_paths
from mha2gqa.records.provenance import latest
from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain import load_recipe, sample_cache, train
from mha2gqa.uptrain.data import text_blocks
from mha2gqa.uptrain.mixed_data import EVAL_SEED_OFFSET, build, ids_sha256, merge_records, sample_blocks
from mha2gqa.uptrain.plan import total_steps

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("parent_data")
    teacher = tiny_model_dir(root / "teacher")
    model = tiny_model_dir(root / "model", seed=1)
    return {"model": model, "teacher": teacher, "train": corpus(root / "train.jsonl", docs=60)}


@pytest.fixture(scope="module")
def loaded(tiny):
    teacher = AutoModelForCausalLM.from_pretrained(tiny["teacher"]).eval()
    return teacher, AutoTokenizer.from_pretrained(tiny["teacher"])


def _recipe(tmp_path, tiny, train_data=("parent",), overrides=(), **keys):
    keys.setdefault("model", str(tiny["model"]))
    keys.setdefault("output_dir", str(tmp_path / "out"))
    keys.setdefault("distill", {"teacher": str(tiny["teacher"])})
    keys.setdefault("budget", {"max_steps": 3})
    data = {"train": list(train_data), "eval_blocks": 4, **keys.pop("data", {})}
    return load_recipe(recipe_file(tmp_path / "r.yaml", data=data, **keys), list(overrides))


def test_parent_samples_are_what_the_loop_consumes_seeded_per_process(tmp_path, tiny, loaded):
    teacher, tokenizer = loaded
    recipe = _recipe(tmp_path, tiny, grad_accum=2)
    ranks = [build(recipe, tokenizer, rank, 2, False, teacher) for rank in range(2)]
    # 3 steps x 2 micro-batches x 4 blocks a process: exactly one pass of the pool, nothing drawn in vain
    need = total_steps(recipe, 2) * 2 * 4
    assert [len(data.train.blocks) for data in ranks] == [need, need] == [24, 24]
    assert ranks[0].train.per_epoch == total_steps(recipe, 2) * recipe.grad_accum
    used = torch.cat([ranks[0].train.batch(m) for m in range(ranks[0].train.per_epoch)])
    assert sorted(map(tuple, used.tolist())) == sorted(map(tuple, ranks[0].train.blocks.long().tolist()))
    # rank r draws with seed + r: the ranks train on different samples, a rerun draws the same ones
    shas = [data.record["parts"][0]["ids_sha256"] for data in ranks]
    assert shas[0] != shas[1]
    again = build(recipe, tokenizer, 1, 2, False, teacher)
    assert again.record["parts"][0]["ids_sha256"] == shas[1] == [ids_sha256(again.train.blocks)]
    assert shas[1] == [ids_sha256(sample_blocks(teacher, tokenizer, 24, 32, recipe.seed + 1, progress=False))]
    other_seed = build(_recipe(tmp_path, tiny, grad_accum=2, seed=5), tokenizer, 1, 2, False, teacher)
    assert other_seed.record["parts"][0]["ids_sha256"] != shas[1]
    merged = merge_records([ranks[0].record, ranks[1].record])
    assert merged["parts"][0]["seeds"] == [0, 1] and merged["parts"][0]["ids_sha256"] == shas[0] + shas[1]
    assert merged["parts"][0]["blocks"] == 48 and merged["parts"][0]["tokens"] == 48 * 32


def test_held_out_eval_samples_have_a_seed_of_their_own_the_same_on_every_process(tmp_path, tiny, loaded):
    teacher, tokenizer = loaded
    recipe = _recipe(tmp_path, tiny)
    ranks = [build(recipe, tokenizer, rank, 2, False, teacher) for rank in range(2)]
    assert torch.equal(ranks[0].eval, ranks[1].eval) and ranks[0].eval.shape == (4, 32)
    evals = ranks[0].record["eval"]
    assert evals["data"] == "held out of data.train" and evals["parent_seed"] == EVAL_SEED_OFFSET
    assert evals["parent_ids_sha256"] == ids_sha256(ranks[0].eval)
    train_rows = {tuple(row) for data in ranks for row in data.train.blocks.tolist()}
    assert not train_rows & {tuple(row) for row in ranks[0].eval.tolist()}


def test_a_mix_gives_each_part_its_share_of_the_blocks(tmp_path, tiny, loaded):
    teacher, tokenizer = loaded
    recipe = _recipe(tmp_path, tiny, train_data=[f"{tiny['train']}:0.25", "parent:0.75"], budget={"max_steps": 4})
    data = build(recipe, tokenizer, 0, 1, False, teacher)
    text, parent = data.record["parts"]
    assert (text["blocks"], parent["blocks"]) == (4, 12) and len(data.train.blocks) == 16
    assert (text["share"], parent["share"]) == (0.25, 0.75) and not text["repeated"]
    assert text["files"] == [str(tiny["train"])] and "ids_sha256" not in text
    assert data.eval.shape == (4, 32)  # one held out of the text, three sampled: the same shares
    assert data.record["eval"]["parent_blocks"] == 3
    sampled = sample_blocks(teacher, tokenizer, 12, 32, 0, progress=False)
    pool = {tuple(row) for row in data.train.blocks.tolist()}
    assert {tuple(row) for row in sampled.tolist()} <= pool


def test_a_second_draw_of_the_same_samples_is_read_from_the_cache(tmp_path, tiny, loaded, monkeypatch, capsys):
    teacher, tokenizer = loaded
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tiny["teacher"], tmp_path / "teacher")
    recipe = _recipe(tmp_path, tiny, distill={"teacher": str(tmp_path / "teacher")})
    first = build(recipe, tokenizer, 0, 1, True, teacher)
    assert len(list((tmp_path / "cache" / "samples").glob("*.safetensors"))) == 2  # training and eval blocks
    drawn = []
    real = sampling.sample_ids
    monkeypatch.setattr(sampling, "sample_ids", lambda *a, **kw: drawn.append(a) or real(*a, **kw))
    capsys.readouterr()
    second = build(recipe, tokenizer, 0, 1, True, teacher)
    assert drawn == [] and torch.equal(second.train.blocks, first.train.blocks)
    assert torch.equal(second.eval, first.eval) and second.record["parts"] == first.record["parts"]
    assert "12 blocks of seed 0 read from the cache, not sampled again" in capsys.readouterr().out
    # another seed, a changed teacher file or a damaged cache file: drawn again, the same ids for the same draw
    build(
        _recipe(tmp_path, tiny, seed=3, distill={"teacher": str(tmp_path / "teacher")}), tokenizer, 0, 1, False, teacher
    )
    assert len(drawn) == 2
    weights = tmp_path / "teacher" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert torch.equal(build(recipe, tokenizer, 0, 1, False, teacher).train.blocks, first.train.blocks)
    assert len(drawn) == 4
    for kept in (tmp_path / "cache" / "samples").glob("*.safetensors"):
        kept.write_bytes(b"not safetensors")
    assert torch.equal(build(recipe, tokenizer, 0, 1, False, teacher).train.blocks, first.train.blocks)
    assert len(drawn) == 6
    # a hub id is not cached: its files are the hub cache's
    assert sample_cache.draw_key("HuggingFaceTB/SmolLM2-135M", teacher, tokenizer, 12, 32, 0) is None


def test_training_on_parent_samples_records_them(tmp_path, tiny, loaded):
    teacher, tokenizer = loaded
    recipe = _recipe(tmp_path, tiny, budget={"max_steps": 2})
    out = train(recipe)
    stage = latest(out, "uptrain")
    data = stage["data"]
    part = data["parts"][0]
    assert part["name"] == "parent" and part["seeds"] == [0] and part["tokens"] == 2 * 4 * 32
    assert part["ids_sha256"] == [ids_sha256(sample_blocks(teacher, tokenizer, 8, 32, 0, progress=False))]
    assert data["sampling"]["top_p"] == 0.95 and data["sampling"]["device"] == "cpu"
    assert data["eval"]["parent_seed"] == EVAL_SEED_OFFSET and data["eval"]["blocks"] == 4
    card = (out / "README.md").read_text()
    assert "sampled from the teacher" in card and part["ids_sha256"][0][:16] in card


def _cli(recipe_path, *overrides):
    from mha2gqa.cli import main

    return CliRunner().invoke(main, ["uptrain", "--recipe", str(recipe_path), *overrides])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["distill.teacher=null"],
            "data.train parent samples the teacher, and distill.teacher is unset: set distill.teacher=",
        ),
        (
            ["data.streaming=true"],
            "data.train parent is drawn in memory and cannot be streamed: set data.streaming=false",
        ),
        (["data.train=parnet"], "data.train parnet: no such file or folder; did you mean parent"),
        (["data.train=[parent,TEXT]"], "give every entry a share, e.g. data.train=[parent:0.5,TEXT:0.5]"),
        (["data.train=[parent:0.5,TEXT]"], "data.train TEXT has no share while others do"),
        (["data.eval=[parent]"], "data.eval parent: eval data is one text without shares"),
    ],
)
def test_refusals_are_one_line_exit_2_and_nothing_written(tmp_path, tiny, overrides, expected):
    path = recipe_file(
        tmp_path / "r.yaml",
        model=str(tiny["model"]),
        output_dir=str(tmp_path / "out"),
        distill={"teacher": str(tiny["teacher"])},
        data={"train": ["parent"]},
    )
    overrides = [o.replace("TEXT", str(tiny["train"])) for o in overrides]
    result = _cli(path, *overrides)
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and expected.replace("TEXT", str(tiny["train"])) in result.output
    assert not (tmp_path / "out").exists()


def test_the_refusal_comes_before_torch(tmp_path, tiny):
    path = recipe_file(
        tmp_path / "r.yaml", model=str(tiny["model"]), output_dir=str(tmp_path / "o"), data={"train": "parent"}
    )
    code = (
        "import sys; from mha2gqa.uptrain.recipe_load import load_recipe; from mha2gqa.runtime.errors import InputError\n"
        f"try:\n    load_recipe({str(path)!r})\nexcept InputError as err:\n    print(err)\n"
        "print('torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "distill.teacher is unset" in run.stdout and run.stdout.strip().endswith("False")


def test_austen_is_a_training_text_as_in_convert(tmp_path, tiny):
    recipe = _recipe(tmp_path, tiny, train_data=["austen"], distill={"teacher": None})
    (parts,) = [recipe.data.checked_sources["data.train"][1]]
    assert len(parts) == 1 and parts[0].share is None and list(parts[0].text.files) == train_paths()
    mixed = _recipe(tmp_path, tiny, train_data=["austen:0.5", "parent:0.5"]).data.checked_sources["data.train"][1]
    assert [(p.name, p.share, p.sampled) for p in mixed] == [("austen", 0.5, False), ("parent", 0.5, True)]
    with pytest.raises(InputError, match="did you mean austen"):
        _recipe(tmp_path, tiny, train_data=["austin"])
    evals = _recipe(tmp_path, tiny, data={"eval": "austen"}).data.checked_sources["data.eval"][1]
    assert list(evals[0].text.files) == train_paths()


def test_a_short_text_in_a_mix_repeats_and_one_too_short_is_refused(tmp_path, tiny, loaded):
    teacher, tokenizer = loaded
    short = tmp_path / "short.txt"
    short.write_text("a few words of text that pack into a handful of blocks of thirty-two tokens, no more. " * 2)
    recipe = _recipe(tmp_path, tiny, train_data=[f"{short}:0.5", "parent:0.5"], data={"eval_blocks": 2})
    short_blocks = len(
        text_blocks(recipe.data.checked_sources["data.train"][1][0].text, recipe.data, tokenizer, 32, False)
    )
    assert 2 <= short_blocks < 6  # fewer than its share of 6 training blocks, after one held out
    data = build(recipe, tokenizer, 0, 1, False, teacher)
    text = data.record["parts"][0]
    assert text["repeated"] and text["text_blocks"] == short_blocks - 1 and text["blocks"] == 6
    tiny_text = tmp_path / "tiny.txt"
    tiny_text.write_text("hi")
    recipe = _recipe(tmp_path, tiny, train_data=[f"{tiny_text}:0.5", "parent:0.5"])
    with pytest.raises(
        InputError, match=r"data.train .*tiny.txt packs into 0 blocks of seq_len tokens, not more than the 2"
    ):
        build(recipe, tokenizer, 0, 1, False, teacher)


def test_record_shape_is_json(tmp_path, tiny, loaded):
    teacher, tokenizer = loaded
    record = build(_recipe(tmp_path, tiny), tokenizer, 0, 1, False, teacher).record
    assert json.loads(json.dumps(record)) == record


def test_two_cpu_ranks_draw_their_own_samples_and_the_record_names_both(tmp_path, tiny):
    from test_uptrain_two_ranks import _launch  # the real launcher with two gloo ranks

    recipe = recipe_file(
        tmp_path / "r.yaml",
        model=str(tiny["model"]),
        output_dir=str(tmp_path / "out"),
        distill={"teacher": str(tiny["teacher"])},
        data={"train": ["parent"], "eval_blocks": 4},
        budget={"max_steps": 2},
    )
    result = _launch(["--recipe", str(recipe), "trace_samples=true"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    part = latest(tmp_path / "out", "uptrain")["data"]["parts"][0]
    assert part["seeds"] == [0, 1] and len(set(part["ids_sha256"])) == 2 and part["blocks"] == 2 * 2 * 4
    traces = [(tmp_path / "out" / "trace" / f"rank{r}.jsonl").read_text().splitlines() for r in range(2)]
    hashes = [{h for line in lines for h in json.loads(line).get("blocks", [])} for lines in traces]
    assert hashes[0] and hashes[1] and hashes[0].isdisjoint(hashes[1])
