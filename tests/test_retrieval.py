"""eval --retrieval: the probe's questions (scoring/retrieval_items.py), their scoring (scoring/retrieval.py), and the
command that writes recall per length and depth beside the reference's."""

import json

import pytest
from click.testing import CliRunner
from retrieval_models import CopyModel
from tiny_models import make_tiny_model, make_tiny_tokenizer, save_tiny_model
from transformers import AutoTokenizer

from mha2gqa.cli import main as cli
from mha2gqa.files.embedded import model_dir
from mha2gqa.runtime.errors import InputError
from mha2gqa.scoring.retrieval import answer_scores, summarize
from mha2gqa.scoring.retrieval_items import TASKS, build_items, probe_grid

GRID = dict(lengths=(128, 384), depths=(0.0, 0.5, 1.0), samples=2)


@pytest.fixture(scope="module")
def austen_tokenizer():
    return AutoTokenizer.from_pretrained(model_dir())  # a real byte-level BPE, shipped in the package


def _probe(model, tokenizer, reference=None, seed=0, **grid):
    grid = probe_grid(**{**GRID, **grid}, seed=seed, max_positions=512)
    items = build_items(tokenizer, grid)
    mine = answer_scores(model, items, "cpu")
    theirs = answer_scores(reference, items, "cpu") if reference is not None else None
    return summarize(grid, items, mine, theirs)


def test_a_model_that_copies_recalls_every_fact_and_ones_that_cannot_recall_none(austen_tokenizer):
    vocab = len(austen_tokenizer)
    copier = _probe(CopyModel(vocab), austen_tokenizer)
    assert copier["recall"] == 1.0 and all(c["recall"] == 1.0 for c in copier["cells"])
    broken = _probe(CopyModel(vocab, uniform=True), austen_tokenizer)  # sees the context, cannot pick the fact
    assert broken["recall"] < 0.1
    random_llama = make_tiny_model(vocab_size=vocab, max_position_embeddings=512)
    assert _probe(random_llama, austen_tokenizer)["recall"] < 0.1
    # beside the copier as its reference, the broken model keeps almost none of its answers' probability
    beside = _probe(CopyModel(vocab, uniform=True), austen_tokenizer, reference=CopyModel(vocab))
    assert beside["reference_recall"] == 1.0 and beside["answer_probability_kept"] < 0.01
    same = _probe(CopyModel(vocab), austen_tokenizer, reference=CopyModel(vocab))
    assert same["answer_probability_kept"] == pytest.approx(1.0)


def test_recall_per_length_and_depth_shows_where_a_short_reach_loses_the_fact(austen_tokenizer):
    """A model that sees only its last 64 tokens answers when the fact sits just before the question (depth 1)
    and not when it sits at the start of a long context: the cells resolve it."""
    found = _probe(CopyModel(len(austen_tokenizer), window=64), austen_tokenizer)
    cell = {(c["task"], c["length"], c["depth"]): c["recall"] for c in found["cells"]}
    assert set(cell) == {(t, n, d) for t in TASKS for n in GRID["lengths"] for d in GRID["depths"]}
    for task in TASKS:
        assert cell[(task, 128, 1.0)] == 1.0 and cell[(task, 384, 1.0)] == 1.0
        assert cell[(task, 128, 0.0)] == 0.0 and cell[(task, 384, 0.0)] == 0.0 and cell[(task, 384, 0.5)] == 0.0
    by_length = {x["length"]: x for x in found["lengths"]}
    assert by_length[384]["recall"] == pytest.approx(1 / 3) and by_length[384]["items"] == 12


def test_questions_are_the_lengths_asked_their_fact_once_at_its_depth(austen_tokenizer):
    grid = probe_grid(**GRID, seed=3, max_positions=512)
    items = build_items(austen_tokenizer, grid)
    assert len(items) == len(TASKS) * 2 * 3 * 2
    for item in items:
        assert len(item.prompt) + len(item.answer) == item.length
        text = austen_tokenizer.decode(list(item.prompt))
        question = text[text.rindex(" The secret word of") :]
        assert text.count(question) == 2  # stated once in the context, asked once at its end
    needles = [i for i in items if i.task == "needle" and i.length == 384]
    where = {}
    for item in needles:
        text = austen_tokenizer.decode(list(item.prompt))
        where.setdefault(item.depth, []).append(text.index(" The secret word of") / len(text))
    assert max(where[0.0]) < 0.05 and 0.35 < min(where[0.5]) and max(where[0.5]) < 0.65 and min(where[1.0]) > 0.85


def test_the_same_seed_asks_the_same_questions_and_another_seed_others(austen_tokenizer):
    grid = probe_grid(**GRID, seed=7, max_positions=512)
    assert build_items(austen_tokenizer, grid) == build_items(austen_tokenizer, grid)
    other = probe_grid(**GRID, seed=8, max_positions=512)
    assert build_items(austen_tokenizer, grid) != build_items(austen_tokenizer, other)
    model = make_tiny_model(vocab_size=len(austen_tokenizer), max_position_embeddings=512)
    assert _probe(model, austen_tokenizer, seed=7) == _probe(model, austen_tokenizer, seed=7)


def test_default_lengths_fit_the_model_and_values_that_cannot_be_probed_are_refused():
    assert probe_grid(None, None, None, 0, 512).lengths == (128, 512)
    assert probe_grid(None, None, None, 0, 300).lengths == (128, 300)
    assert probe_grid(None, None, None, 0, 8192).lengths == (128, 512, 2048)
    assert probe_grid((512, 128, 512), (0.9, 0.1, 0.9), None, 0, 512) == probe_grid((128, 512), (0.1, 0.9), 2, 0, 512)
    for args, words in (
        (((1024,), None, None, 0, 512), "--retrieval-lengths 1024 exceeds the model's max_position_embeddings=512"),
        (((32,), None, None, 0, 512), "--retrieval-lengths 32 must be at least 64"),
        ((None, (1.5,), None, 0, 512), "--retrieval-depths 1.5 must be between 0 and 1"),
        ((None, None, 0, 0, 512), "--retrieval-samples 0 must be at least 1"),
        ((None, None, None, 0, 48), "max_position_embeddings=48 is below the probe's shortest context, 64 tokens"),
        (((), None, None, 0, 512), "--retrieval-lengths names no value"),
    ):
        with pytest.raises(InputError, match=words):
            probe_grid(*args)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    for name, kv in (("parent", 4), ("child", 1)):
        save_tiny_model(root / name, "llama", num_key_value_heads=kv, seed=kv)
        make_tiny_tokenizer().save_pretrained(root / name)
    return root


def test_eval_retrieval_writes_recall_per_length_and_depth_beside_the_reference(tiny_pair, tmp_path):
    out = tmp_path / "child.json"
    args = ["eval", str(tiny_pair / "child"), "--reference", str(tiny_pair / "parent"), "--retrieval"]
    args += ["--retrieval-lengths", "160,256", "--retrieval-depths", "0,1", "--retrieval-samples", "1"]
    run = CliRunner().invoke(
        cli, [*args, "--speed", "off", "--max-tokens", "64", "--out", str(out)]
    )  # with its estimate
    assert run.exit_code == 0, run.output
    found = json.loads(out.read_text())["retrieval"]
    assert [x["length"] for x in found["lengths"]] == [160, 256]
    assert {(c["task"], c["length"], c["depth"]) for c in found["cells"]} == {
        (t, n, d) for t in TASKS for n in (160, 256) for d in (0.0, 1.0)
    }
    for part in [found, *found["lengths"], *found["cells"], *found["tasks"].values()]:
        assert 0.0 <= part["recall"] <= 1.0 and 0.0 <= part["reference_recall"] <= 1.0
        assert part["answer_probability_kept"] > 0 and part["answer_logprob"] < 0
    assert len(found["heads"]["scores"]) == 2 and len(found["heads"]["scores"][0]) == 8  # the tiny llama's heads
    assert found["heads"]["questions"] == 8 and len(found["heads"]["top"]) == 10
    assert found["items"] == 8 and found["grid"] == {"lengths": [160, 256], "depths": [0.0, 1.0], "samples": 1}
    assert "retrieval recall" in run.output and "at 256 tokens:" in run.output
    from mha2gqa.report import write_report

    report = write_report([out], tmp_path / "report")["markdown"].read_text()
    assert "## Retrieval recall per context length" in report and "recall @ 256 tokens (by depth)" in report
    assert "retrieval recall" in report and "answer prob. kept" in report
    from mha2gqa.eval.card_table import measured_cells

    card = dict(measured_cells(tmp_path)["child.json"])  # a card beside the result shows it too
    assert card["retrieval recall ↑"] == f"{100 * found['recall']:.0f}%"
    kept = found["answer_probability_kept"]
    at_256 = next(x for x in found["lengths"] if x["length"] == 256)
    assert card["recall @ 256 tokens (by depth) ↑"].startswith(f"{100 * at_256['recall']:.0f}% (0: ")
    assert card["answer prob. kept ↑"] == (f"{100 * kept:.0f}%" if kept >= 0.1 else f"{100 * kept:.2g}%")


def test_the_estimate_prices_the_probe_by_the_tokens_it_forwards():
    from mha2gqa.estimates import EvalWork, eval_stages

    grid = probe_grid(None, None, None, 0, 8192)
    assert grid.forward_tokens() == len(TASKS) * 3 * 2 * (128 + 512 + 2048)
    params = 134_515_008

    def retrieval_seconds(tokens, reference):
        work = EvalWork(params, reference, 49_152, 0, {}, 0, None, tokens)
        return [s.seconds() for s in eval_stages(work) if s.name == "retrieval"]

    assert retrieval_seconds(0, params) == []  # not asked: no stage
    (alone,) = retrieval_seconds(grid.forward_tokens(), None)
    (beside,) = retrieval_seconds(grid.forward_tokens(), params)
    (half,) = retrieval_seconds(grid.forward_tokens() // 2, params)
    assert 0 < half < beside and beside == pytest.approx(2 * alone, rel=0.05)  # two models forward every question
    heads = grid.tokens_up_to(512)
    assert heads == len(TASKS) * 3 * 2 * (128 + 512)
    work = EvalWork(params, params, 49_152, 0, {}, 0, None, grid.forward_tokens(), heads)
    (scored,) = [s.seconds() for s in eval_stages(work) if s.name == "retrieval"]
    assert scored > beside  # the heads' scores forward the short questions once more


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--retrieval-lengths", "512"], "--retrieval-lengths 512 exceeds the model's max_position_embeddings=256"),
        (["--retrieval-depths", "0.5,2"], "--retrieval-depths 2.0 must be between 0 and 1"),
        (["--retrieval-lengths", "64"], "--retrieval-lengths 64 is too short for this tokenizer"),
        (["--retrieval-depths", "deep"], "'deep' is not a comma-separated list of numbers"),
        (["--retrieval-depths", ","], "--retrieval-depths names no value"),
    ],
)
def test_bad_retrieval_flags_are_one_line_and_exit_2_with_nothing_written(tiny_pair, tmp_path, flags, words):
    """Each refused before any weights are loaded (the length against the config's max positions)."""
    out = tmp_path / "r.json"
    args = ["eval", str(tiny_pair / "child"), "--retrieval", *flags, "--speed", "off", "--out", str(out), "-q"]
    run = CliRunner().invoke(cli, args)
    assert run.exit_code == 2 and words in run.output, run.output
    assert "Traceback" not in run.output and not out.exists()


def test_a_head_scores_where_its_strongest_attention_lands_on_the_copied_token():
    import torch

    from mha2gqa.scoring.retrieval_heads import copy_hits, heads_section

    layers, heads, length = 2, 4, 12
    maps = torch.full((layers, heads, length, length), 1.0 / length)
    rows, targets = torch.tensor([9, 10, 11]), torch.tensor([3, 4, 5])
    maps[1, 2, rows, targets] = 0.9  # layer 1, head 2 copies every answer token
    maps[0, 1, rows[0], targets[0]] = 0.9  # layer 0, head 1 only the first
    maps[0, 3, rows, 0] = 0.9  # layer 0, head 3 looks at the first token: no copy
    hits = copy_hits(maps, rows, targets)
    assert hits.tolist() == [[0, 1, 0, 0], [0, 0, 3, 0]]
    section = heads_section(hits.float() / 3, kv_heads=2, questions=1)
    assert section["retrieving"] == 2 and section["heads"] == 8
    assert section["top"][0] == {"layer": 1, "head": 2, "kv_head": 1, "score": 1.0}
    assert section["top"][1] == {"layer": 0, "head": 1, "kv_head": 0, "score": round(1 / 3, 4)}


def test_each_question_names_where_its_fact_answers(austen_tokenizer):
    for item in build_items(austen_tokenizer, probe_grid(**GRID, seed=1, max_positions=512)):
        assert item.prompt[item.source : item.source + len(item.answer)] == item.answer
        # the fact's own question precedes it: " The secret word of KEY is", 6 tokens at least
        assert item.source >= 6 and item.prompt[item.source - 6 : item.source] == item.prompt[-6:]


def test_head_scores_run_under_eager_attention_and_switch_back(austen_tokenizer):
    from mha2gqa.scoring.retrieval_heads import head_scores

    model = make_tiny_model(vocab_size=len(austen_tokenizer), max_position_embeddings=1024)
    model.set_attn_implementation("sdpa")
    items = build_items(austen_tokenizer, probe_grid((128, 640), (0.5,), 1, 0, 1024))
    scores = head_scores(model, items, "cpu")
    assert scores.shape == (2, 8) and 0.0 <= scores.min() and scores.max() <= 1.0
    assert model.config._attn_implementation == "sdpa"
    assert head_scores(model, [i for i in items if i.length > 512], "cpu") is None  # every map too large to hold


@pytest.mark.parametrize("flag, value", [("--retrieval-lengths", "128"), ("--retrieval-samples", "3")])
def test_a_probe_flag_without_retrieval_is_refused_not_ignored(tiny_pair, tmp_path, flag, value):
    out = tmp_path / "r.json"
    run = CliRunner().invoke(cli, ["eval", str(tiny_pair / "child"), flag, value, "--speed", "off", "--out", str(out)])
    assert run.exit_code == 2 and f"{flag} shapes the retrieval probe: add --retrieval, or drop {flag}" in run.output
    assert not out.exists()


def test_in_python_the_probe_runs_beside_a_reference_without_any_text(tiny_pair):
    from mha2gqa.eval import evaluate

    found = evaluate(
        tiny_pair / "child", None, reference=tiny_pair / "parent", retrieval=True, retrieval_lengths=(160,),
        retrieval_depths=(0.5,), retrieval_samples=1, speed_preset="off", progress=False,
    )  # fmt: skip
    assert found["perplexity"] is None and found["retrieval"]["items"] == 2
    assert "reference_recall" in found["retrieval"] and found["retrieval"]["answer_probability_kept"] > 0
