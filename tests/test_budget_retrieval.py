"""--kv-budget's retrieval term (issue 66): copy prompts built from the calibration ids, each layer's KL on their
answer tokens measured and recorded beside the text KL, a layer whose pooling breaks copying kept whole where the
budget allows, the chosen and the text-only placements measured whole (losses one layer at a time do not add up),
and the same record and bytes on a second run."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_model

from mha2gqa.architecture.layouts import AttentionShape, layout_for
from mha2gqa.cli import main
from mha2gqa.convert import layer_losses
from mha2gqa.convert.layer_losses import MeasuredLosses, choose
from mha2gqa.convert.sensitivity import layer_losses as measure_layers
from mha2gqa.convert.sensitivity import placement_losses, pooled_in_place
from mha2gqa.files.loading import load_causal_lm
from mha2gqa.scoring.copy_prompts import CUE, SPAN, copy_prompts, spans_in
from mha2gqa.scoring.kl import kl_divergence

SHAPE = AttentionShape("llama", layers=3, heads=8, kv_heads=4, head_dim=8, hidden=64)


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    src = tmp_path_factory.mktemp("budget-retrieval") / "llama"
    save_tiny_model(src, "llama", intermediate_size=256, num_key_value_heads=4, num_hidden_layers=3,
                    max_position_embeddings=128)  # fmt: skip
    make_tiny_tokenizer(src)
    (src.parent / "cal.txt").write_text(SAMPLE_TEXT * 40)
    return src


def test_copy_prompts_repeat_spans_of_their_haystack():
    ids = torch.arange(1000, 3000)
    prompts, scored = copy_prompts(ids, 256, most=3)
    spans = spans_in(256)
    haystack = 256 - spans * SPAN
    assert spans == 5 and prompts.shape == (3, 256) and scored.shape == (3, 255)
    assert torch.equal(prompts[1, :haystack], ids[haystack : 2 * haystack])  # consecutive pieces of the ids
    assert int(scored[0].sum()) == spans * (SPAN - CUE)
    for k in range(3):
        text = prompts[k, :haystack].tolist()
        for n in range(spans):
            repeat = prompts[k, haystack + n * SPAN : haystack + (n + 1) * SPAN].tolist()
            start = text.index(repeat[0])
            assert text[start : start + SPAN] == repeat  # a span of the haystack, asked for again
            answer = [
                j + 1 for j in range(255) if scored[k, j] and haystack + n * SPAN <= j + 1 < haystack + (n + 1) * SPAN
            ]
            assert answer == list(range(haystack + n * SPAN + CUE, haystack + (n + 1) * SPAN))
    assert torch.equal(copy_prompts(ids, 256, most=3)[0], prompts)  # no seed: the same ids, the same prompts
    assert copy_prompts(ids[:100], 256, most=3)[0].shape == (0, 256)  # no whole haystack
    assert copy_prompts(ids, 40, most=3)[0].shape == (0, 40)  # too short for a span


def test_retrieval_term_is_the_kl_on_answer_tokens(parent):
    """A layer's retrieval loss is KL(parent || model) on the copy prompts' answer positions only, with that layer
    pooled in place; measured whole, one pooled layer gives the same number."""
    model = load_causal_lm(parent)
    ids = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(1))
    prompts, scored = copy_prompts(ids, 128, most=2)
    losses = measure_layers(model, layout_for(model.config.to_dict()), prompts, SHAPE, [1, 2, 4], scored=scored)
    assert all(per[4] == 0.0 and per[1] > 0 for per in losses)
    pooled = load_causal_lm(parent)
    attention = pooled.model.layers[2].self_attn
    with torch.no_grad():
        for param in (attention.k_proj.weight, attention.k_proj.bias, attention.v_proj.weight, attention.v_proj.bias):
            param.copy_(pooled_in_place(param, 4, 1))
        expected = sum(
            float(kl_divergence(model(p[None]).logits[0, :-1][s], pooled(p[None]).logits[0, :-1][s]))
            for p, s in zip(prompts, scored)
        ) / len(prompts)
        everywhere = sum(
            float(kl_divergence(model(p[None]).logits[0, :-1], pooled(p[None]).logits[0, :-1])) for p in prompts
        ) / len(prompts)
    assert losses[2][1] == pytest.approx(expected, rel=1e-4) and expected != pytest.approx(everywhere, rel=1e-3)
    whole = placement_losses(model, layout_for(model.config.to_dict()), prompts, SHAPE, [(4, 4, 1), (4, 4, 4)], scored)
    assert whole[0] == pytest.approx(expected, rel=1e-4) and whole[1] == 0.0


class FakeWhole:
    """Whole-placement losses: the summed per-layer ones, plus `extra` retrieval loss where layers 0 and 2 are both
    pooled (losses that do not add up)."""

    def __init__(self, measured, extra: float):
        self.measured, self.extra, self.asked = measured, extra, []

    def measure(self, placements):
        self.asked.append(list(placements))
        found = []
        for counts in placements:
            text = sum(self.measured.losses[i][c] for i, c in enumerate(counts))
            copy = sum(self.measured.retrieval[i][c] for i, c in enumerate(counts))
            found.append((text, copy + (self.extra if counts[0] < 4 and counts[2] < 4 else 0.0)))
        return found


class Plan:
    budget_heads = 6
    options = type("Options", (), {"kv_budget": "0.5"})()


TEXT = [{4: 0.0, 2: 0.04, 1: 0.05}, {4: 0.0, 2: 0.05, 1: 0.06}, {4: 0.0, 2: 0.015, 1: 0.02}]


def test_a_layer_whose_pooling_breaks_copying_keeps_its_heads():
    """Layer 1 costs the text most yet the copy prompts nothing; layer 2 costs the text least but breaks copying:
    with the retrieval term, layer 2 keeps its 4 kv heads; without it (no copy prompts), layer 1 does."""
    retrieval = [{4: 0.0, 2: 0.01, 1: 0.02}, {4: 0.0, 2: 0.0, 1: 0.0}, {4: 0.0, 2: 3.0, 1: 5.0}]
    measured = MeasuredLosses(TEXT, {"data": "x"}, SHAPE, retrieval)
    counts, chosen = choose(Plan(), measured)
    assert counts == (1, 1, 4) and sum(counts) <= 6
    assert chosen["retrieval_weight"] == layer_losses.RETRIEVAL_WEIGHT and chosen["retrieval_losses"][2]["1"] == 5.0
    assert chosen["text_losses"][1]["1"] == 0.06 and chosen["losses"][2]["1"] == 0.02 + 5.0 * chosen["retrieval_weight"]
    assert chosen["whole"][0]["counts"] == [1, 1, 4] and "measured" not in chosen["whole"][0]
    text_only, _ = choose(Plan(), MeasuredLosses(TEXT, {"data": "x"}, SHAPE))
    assert text_only == (1, 4, 1)


def test_the_knapsacks_choice_stands_and_both_placements_are_measured_whole():
    """The knapsack at w pools layers 0 and 2 (each alone costs copying little); measured whole they break it
    (losses that do not add up). The choice stands (choosing by whole losses lost recall on SmolLM2), and the
    record holds both the chosen and the text-only placement, summed and measured whole."""
    retrieval = [{4: 0.0, 2: 0.5, 1: 0.03}, {4: 0.0, 2: 0.5, 1: 0.01}, {4: 0.0, 2: 0.5, 1: 0.02}]
    text = [{4: 0.0, 2: 0.04, 1: 0.05}, {4: 0.0, 2: 0.05, 1: 0.065}, {4: 0.0, 2: 0.015, 1: 0.02}]
    measured = MeasuredLosses(text, {"data": "x"}, SHAPE, retrieval)
    whole = FakeWhole(measured, extra=10.0)
    counts, chosen = choose(Plan(), MeasuredLosses(text, {"data": "x"}, SHAPE, retrieval, whole))
    assert counts == (4, 1, 1) and whole.asked == [[(4, 1, 1), (1, 4, 1)]]  # the choice, then text only
    first, text_only = chosen["whole"]
    assert first["counts"] == [4, 1, 1] and first["retrieval_scale"] == 1.0 and text_only["retrieval_scale"] == 0.0
    assert first["predicted"] == pytest.approx({"text": 0.085, "retrieval": 0.03})
    assert first["measured"]["retrieval"] == pytest.approx(0.03) and text_only["measured"]["retrieval"] > 10.0
    same = MeasuredLosses(TEXT, {"data": "x"}, SHAPE, [{4: 0.0, 2: 0.0, 1: 0.0}] * 3, FakeWhole(measured, 0.0))
    assert len(choose(Plan(), same)[1]["whole"]) == 1  # one placement at both scales: measured once


def _convert(parent, dst):
    cal = str(parent.parent / "cal.txt")
    args = ["convert", str(parent), str(dst), "--kv-budget", "0.5", "--calibration", cal, "-q", "--no-check"]
    result = CliRunner().invoke(main, [*args, "--calibration-tokens", "512"])
    assert result.exit_code == 0, result.output
    return result, json.loads((dst / "mha2gqa.json").read_text())["lineage"][-1]


def test_budget_records_the_retrieval_term_and_is_deterministic(parent, tmp_path):
    result, record = _convert(parent, tmp_path / "a")
    chosen, counts = record["kv_budget"], record["kv_heads_per_layer"]
    assert chosen["retrieval_weight"] == layer_losses.RETRIEVAL_WEIGHT
    assert chosen["calibration"]["copy_prompts"] >= 1 and chosen["calibration"]["copy_length"] == 128
    assert chosen["calibration"]["answers"] == chosen["calibration"]["copy_prompts"] * spans_in(128) * (SPAN - CUE)
    retrieval = chosen["retrieval_losses"]
    assert all(per["4"] == 0.0 for per in retrieval) and all(per["1"] > 0 for per in retrieval)
    for text, copy, weighed in zip(chosen["text_losses"], retrieval, chosen["losses"]):
        assert weighed["1"] == pytest.approx(text["1"] + chosen["retrieval_weight"] * copy["1"])
    assert chosen["whole"][0]["counts"] == counts and sum(counts) <= chosen["budget_kv_heads"]
    assert all(p["measured"]["text"] > 0 and p["measured"]["retrieval"] > 0 for p in chosen["whole"])
    assert f"kv heads per layer: {','.join(map(str, counts))}" in result.output
    _, again = _convert(parent, tmp_path / "b")
    assert again["kv_budget"] == chosen
    digest = [hashlib.sha256((tmp_path / d / "model.safetensors").read_bytes()).hexdigest() for d in "ab"]
    assert digest[0] == digest[1]
