"""uptrain's `retrieval` source (copy_task.py): the same blocks for the same seed, never a question of eval's probe,
answers marked where they are copies, batches that resume mid-epoch, the answer-weighted loss, the refusals, and
eval's probe in metrics.jsonl (eval_retrieval, eval_domains)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from uptrain_helpers import corpus, metrics, recipe_file, tiny_model_dir

from mha2gqa.corpus.tokens import document_ids
from mha2gqa.runtime.errors import InputError
from mha2gqa.scoring.retrieval_items import build_items, probe_grid
from mha2gqa.uptrain import load_recipe, train
from mha2gqa.uptrain.copy_task import COPY_ANSWER, TEMPLATES, retrieval_blocks
from mha2gqa.uptrain.data import text_blocks
from mha2gqa.uptrain.distill import DistillLoss, plain_distill_loss, position_weights
from mha2gqa.uptrain.mixed_data import build

SEQ = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval_source")
    teacher = tiny_model_dir(root / "teacher")
    return {
        "root": root,
        "model": tiny_model_dir(root / "model", seed=1),
        "teacher": teacher,
        "tokenizer": AutoTokenizer.from_pretrained(teacher),
        "train": corpus(root / "train.jsonl", docs=80),
    }


@pytest.fixture(scope="module")
def haystack(tiny):
    recipe = _recipe(tiny["root"] / "h", tiny, ["x"], validate=False)
    return text_blocks(_text_source(tiny), recipe.data, tiny["tokenizer"], SEQ, False)


def _text_source(tiny):
    from mha2gqa.uptrain.data_spec import data_parts

    return data_parts("data.train", [str(tiny["train"])], [])[0].text


def _recipe(tmp_path, tiny, train_data=None, overrides=(), validate=True, **keys):
    keys.setdefault("model", str(tiny["model"]))
    keys.setdefault("output_dir", str(tmp_path / "out"))
    keys.setdefault("distill", {"teacher": str(tiny["teacher"]), "kl_weight": 1.0})
    keys.setdefault("seq_len", SEQ)
    data = {"train": train_data or [f"{tiny['train']}:0.75", "retrieval:0.25"], "eval_blocks": 4}
    path = recipe_file(tmp_path / "r.yaml", data=data, **keys)
    return load_recipe(path, list(overrides), validate_files=validate)


def _ids(tokenizer, text: str) -> list[int]:
    return list(next(document_ids([text], tokenizer, batch=1)))


def _holds(row: list[int], piece: list[int]) -> bool:
    return any(row[i : i + len(piece)] == piece for i in range(len(row) - len(piece) + 1))


def test_the_same_seed_gives_the_same_blocks_and_another_seed_others(tiny, haystack):
    tok = tiny["tokenizer"]
    first, again, other = (retrieval_blocks(haystack, tok, 12, SEQ, seed) for seed in (0, 0, 1))
    assert first[0].shape == (12, SEQ) and first[0].dtype == torch.int32 and first[1].dtype == torch.bool
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])
    assert 0 < int(first[1].sum()) < first[1].numel() // 4  # answers marked, and only answers


def test_no_item_is_a_question_of_evals_probe(tiny, haystack):
    """The probe asks " The secret word of KEY is"; no training block holds that phrase, no probe prompt holds a
    training template's, and no probe needle (question and answer) is in a training block."""
    tok = tiny["tokenizer"]
    ids, _ = retrieval_blocks(haystack, tok, 40, SEQ, 0)
    rows = [row.tolist() for row in ids]
    probe = build_items(tok, probe_grid([128, 256], None, 2, 0, 256))
    phrase = _ids(tok, " The secret word of")
    assert not any(_holds(row, phrase) for row in rows)
    for before, _ in TEMPLATES:
        assert "secret word" not in before
        assert not any(_holds(list(item.prompt), _ids(tok, before)) for item in probe)
    for item in probe:
        needle = list(item.prompt[-len(phrase) - 6 :]) + list(item.answer)  # the question's end and its answer
        assert not any(_holds(row, needle) for row in rows)
    # and the templates are used: each opens at least one question in 40 blocks
    assert sum(any(_holds(row, _ids(tok, before)) for row in rows) for before, _ in TEMPLATES) >= 4


def test_every_answer_is_marked_where_it_copies_the_context(tiny, haystack):
    """Each marked span follows its question (needle, kv) or cue (copy), and that question or cue followed by the
    same answer stands earlier in the block: the answer is a copy of the context."""
    tok = tiny["tokenizer"]
    ids, marks = retrieval_blocks(haystack, tok, 30, SEQ, 3)
    spans = 0
    for row, marked in zip(ids.tolist(), marks.tolist()):
        at = 0
        while at < SEQ:
            if not marked[at]:
                at += 1
                continue
            end = at
            while end < SEQ and marked[end]:
                end += 1
            cue = row[at - 4 : end]  # the question's (or the cue's) last 4 tokens and the answer
            assert _holds(row[: at - 4], cue), tok.decode(row[:end])
            assert not any(marked[at - 4 : at])
            spans += 1
            at = end
    assert spans >= 30  # one item a block at least
    assert max(int(m.sum()) for m in marks) >= COPY_ANSWER


def test_a_mix_with_retrieval_resumes_mid_epoch_with_the_same_batches(tmp_path, tiny):
    recipe = _recipe(tmp_path, tiny, budget={"max_steps": 6})
    first = build(recipe, tiny["tokenizer"], 0, 1, False)
    again = build(recipe, tiny["tokenizer"], 0, 1, False)
    assert torch.equal(first.train.blocks, again.train.blocks) and torch.equal(first.train.marks, again.train.marks)
    parts = {row["name"]: row for row in first.record["parts"]}
    assert parts["retrieval"]["blocks"] == 6 and parts["retrieval"]["answer_tokens"] > 0
    assert int(first.train.marks.sum()) == parts["retrieval"]["answer_tokens"]
    per_epoch = first.train.per_epoch
    whole = first.train.batches(0)
    run = [next(whole) for _ in range(per_epoch + 3)]  # past the first epoch's end
    start = per_epoch - 1  # resumed mid-run, one micro-step before the epoch turns
    resumed = again.train.batches(start)
    for ids, marks in run[start:]:
        ids_again, marks_again = next(resumed)
        assert torch.equal(ids, ids_again) and torch.equal(marks, marks_again)
    held = [part for part in first.record["parts"] if part["name"] == "retrieval"]
    assert held and len(first.eval) == 4  # the eval blocks held out in the shares, retrieval's made too


def _models(tiny):
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_pretrained(tiny["model"]).train()
    teacher = AutoModelForCausalLM.from_pretrained(tiny["teacher"]).eval()
    return student, teacher


def _weighted_reference(student, teacher, batch, marks, answer_weight, kl_weight):
    """The weighted loss written out: each position's KL and cross-entropy times its weight, over the weights."""
    logits = student(input_ids=batch).logits.reshape(-1, 128)
    with torch.no_grad():
        parent = teacher(input_ids=batch).logits.reshape(-1, 128)
    kl = (parent.log_softmax(-1).exp() * (parent.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)
    labels = torch.nn.functional.pad(batch[:, 1:], (0, 1), value=-100).reshape(-1)
    ce = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    answer = torch.nn.functional.pad(marks[:, 1:], (0, 1), value=False).reshape(-1)
    w = torch.where(answer, torch.tensor(answer_weight), torch.tensor(1.0))
    lm = (ce * w).sum() / w[labels != -100].sum()
    return (1 - kl_weight) * lm + kl_weight * (kl * w).sum() / w.sum()


@pytest.mark.parametrize("answer_weight", [1.0, 10.0])
def test_the_answer_weight_weighs_the_positions_that_predict_answers(tiny, haystack, answer_weight):
    import contextlib

    student, teacher = _models(tiny)
    ids, marks = retrieval_blocks(haystack, tiny["tokenizer"], 2, SEQ, 0)
    batch = ids.long()
    loss = DistillLoss(student, student, teacher, 0.5, 1.0, contextlib.nullcontext, answer_weight)
    found = loss(batch, marks)
    expected = _weighted_reference(student, teacher, batch, marks, answer_weight, 0.5)
    assert loss.chunked and float(found) == pytest.approx(float(expected), rel=1e-4)
    found.backward()
    chunked = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    weights = position_weights(marks, answer_weight)
    plain = plain_distill_loss(student, teacher, batch, 0.5, 1.0, contextlib.nullcontext, weights)
    plain.backward()
    assert float(plain) == pytest.approx(float(expected), rel=1e-4)
    for a, p in zip(chunked, student.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-3, atol=1e-6)
    student.zero_grad()
    unweighted = DistillLoss(student, student, teacher, 0.5, 1.0, contextlib.nullcontext)(batch)
    assert (float(unweighted) == pytest.approx(float(found), rel=1e-6)) == (answer_weight == 1.0)
    assert (weights is None) == (answer_weight == 1.0)


@pytest.mark.parametrize(
    "train_data, overrides, expected",
    [
        (["retrieval:1"], [], "data.train retrieval is made of the other parts of a mix: give every entry a share"),
        (None, ["data.eval=[retrieval]"], "data.eval retrieval: the copy-task prompts are training data"),
        (["austen", "retrieval"], [], "data.train=[austen:0.75,retrieval:0.25]"),
        (None, ["distill.teacher=null", "distill.answer_weight=4"], "distill.answer_weight=4.0 weighs the"),
        (None, ["distill.answer_weight=0"], "distill.answer_weight=0.0 must be positive"),
    ],
)
def test_refusals(tmp_path, tiny, train_data, overrides, expected):
    with pytest.raises(InputError, match=expected.replace("[", r"\[").replace(".", r"\.")):
        _recipe(tmp_path, tiny, train_data, overrides)


def test_a_haystack_too_poor_in_words_is_refused(tiny):
    poor = torch.full((4, SEQ), _ids(tiny["tokenizer"], "a")[0], dtype=torch.int32)
    with pytest.raises(InputError, match="fewer than 16 for its keys and values"):
        retrieval_blocks(poor, tiny["tokenizer"], 2, SEQ, 0)


def test_a_run_writes_recall_and_domain_perplexity_at_its_evals(tmp_path, tiny):
    recipe = _recipe(
        tmp_path,
        tiny,
        eval_retrieval=True,
        eval_domains=True,
        eval_every=2,
        micro_batch_size=2,
        budget={"max_steps": 2},
        distill={"teacher": str(tiny["teacher"]), "answer_weight": 5.0},
    )
    out = train(recipe)
    lines = [line for line in metrics(out) if "eval_loss" in line]
    assert [line["step"] for line in lines] == [0, 2]
    for line in lines:
        assert 0 <= line["eval_recall"] <= 1 and line["eval_answer_logprob"] < 0
        assert set(line["eval_recall_lengths"]) == {"128", "256"}  # the tiny model's 256 positions
        assert set(line["eval_domain_ppl"]) == {"prose", "code", "python_docs", "licences"}
        assert line["teacher_domain_ppl"].keys() == line["eval_domain_ppl"].keys()
        assert line["eval_geomean_ppl_ratio"] > 0 and 0 <= line["teacher_recall"] <= 1
    assert lines[0]["eval_domain_ppl"] != lines[1]["eval_domain_ppl"]  # measured at each eval


def test_dry_run_names_the_retrieval_part_and_prices_the_probe(tmp_path, tiny):
    from mha2gqa.scoring.retrieval_items import probe_grid as grid
    from mha2gqa.uptrain.plan import plan_run, probe_eval_tokens

    plain = _recipe(tmp_path, tiny, budget={"max_steps": 4})
    asked = _recipe(tmp_path, tiny, budget={"max_steps": 4}, eval_retrieval=True, eval_domains=True)
    lines = plan_run(asked).describe()
    assert any("retrieval (25% of the blocks): 5 blocks of 128 tokens of copy-task prompts" in line for line in lines)
    probe = grid(None, None, None, 0, 256).forward_tokens()  # 128 and 256 tokens: the tiny model's positions
    assert probe_eval_tokens(asked) == probe + 4 * 8 * SEQ and probe_eval_tokens(plain) == 0
    assert f"eval_retrieval and eval_domains: {probe + 4 * 8 * SEQ:,} tokens forwarded at each eval" in "\n".join(lines)
    assert plan_run(asked).work().eval_tokens > plan_run(plain).work().eval_tokens


def test_the_curve_driver_tabulates_the_runs_eval_lines(tmp_path, capsys):
    """bench/recall_curve.py reads the eval lines of metrics.jsonl (not the plain log lines) and compares two runs."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "recall_curve.py"
    spec = importlib.util.spec_from_file_location("recall_curve", path)
    curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curve)
    parent = {"prose": 10.0, "code": 5.0, "python_docs": 4.0, "licences": 2.0}
    for name, geomean, recall in (("a", 2.0, 0.25), ("b", 1.6, 0.0)):
        (tmp_path / name).mkdir()
        lines = [
            {"step": 5, "tokens": 100, "loss": 1.0},
            {
                "step": 10,
                "tokens": 200,
                "eval_recall": recall,
                "teacher_recall": 0.5,
                "eval_answer_logprob": -3.0,
                "eval_recall_lengths": {"128": recall, "512": 0.0},
                "eval_domain_ppl": {d: 2 * v for d, v in parent.items()},
                "teacher_domain_ppl": parent,
                "eval_geomean_ppl_ratio": geomean,
            },
        ]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert curve.main([f"with={tmp_path / 'a'}", f"without={tmp_path / 'b'}", "--out", str(tmp_path / "c.json")]) == 0
    shown = capsys.readouterr().out
    assert "| 200 | 25% (50%) | 25% / 0% | -3.00 | 2.00x | 2.00x | 2.00x | 2.00x | **2.00x** |" in shown
    assert "geometric mean ratio, with / without: 200 tokens: 1.250" in shown
    del lines[1]["eval_recall"]  # a run without eval_retrieval: no recall, not 0%
    assert curve.table(lines[1:])[-1].startswith("| 200 | - |")
    assert list(json.loads((tmp_path / "c.json").read_text())) == ["with", "without"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "metrics.jsonl").write_text('{"step": 1, "tokens": 2}\n')
    assert curve.main([str(tmp_path / "d")]) == 2
