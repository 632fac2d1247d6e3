"""`convert --kv-budget`: the budget read, the counts chosen (an exact knapsack), the per-layer losses measured
(the pooled layer in place is the converted model), and the command end to end."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import torch
from click.testing import CliRunner
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_model

from mha2gqa.architecture.layouts import AttentionShape, layout_for
from mha2gqa.cli import main
from mha2gqa.convert.kv_budget import budget_heads, choose_counts
from mha2gqa.convert.sensitivity import layer_losses, pooled_in_place
from mha2gqa.files.loading import load_causal_lm
from mha2gqa.runtime.errors import InputError
from mha2gqa.scoring.kl import kl_divergence

SHAPE = AttentionShape("llama", layers=3, heads=8, kv_heads=4, head_dim=8, hidden=64)  # 3 x 4 kv heads, 192 B/token


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    src = tmp_path_factory.mktemp("budget") / "llama"
    save_tiny_model(src, "llama", intermediate_size=256, num_key_value_heads=4, num_hidden_layers=3,
                    max_position_embeddings=64)  # fmt: skip
    make_tiny_tokenizer(src)
    (src.parent / "cal.txt").write_text(SAMPLE_TEXT * 20)
    return src


@pytest.mark.parametrize(
    "spec, heads",
    [
        ("0.5", 6),
        (".25", 3),
        ("0.6", 7),
        ("1", None),
        ("384", 6),
        ("400B", 6),
        ("0.4KiB", 6),
        ("192", 3),
        ("191", None),
    ],
)
def test_budget_as_fraction_or_bytes(spec, heads):
    """One kv head of one layer is 2 x 8 x 4 = 64 bytes per token: a fraction of the parent's 12, or bytes, rounded
    down to whole heads; under one head per layer, or the parent's whole cache, refused naming both bounds."""
    if heads is None:
        with pytest.raises(InputError, match="--kv-budget"):
            budget_heads(spec, SHAPE, 4)
    else:
        assert budget_heads(spec, SHAPE, 4) == heads


def test_budget_refusals_say_the_bounds():
    with pytest.raises(InputError, match=r"less than one kv head per layer \(192 bytes per token"):
        budget_heads("0.2", SHAPE, 4)
    with pytest.raises(InputError, match=r"holds the parent's whole KV cache \(768 bytes per token\)"):
        budget_heads("1KiB", SHAPE, 4)


def brute_force(losses, budget):
    options = [sorted(per) for per in losses]
    fits = [c for c in itertools.product(*options) if sum(c) <= budget]
    return min(sum(losses[i][g] for i, g in enumerate(c)) for c in fits)


def test_choice_is_the_least_summed_loss_under_the_budget():
    rng = random.Random(0)
    for _trial in range(200):
        layers = rng.randint(1, 5)
        losses = [{8: 0.0, **{g: rng.random() * (9 - g) for g in (4, 2, 1)}} for _ in range(layers)]
        budget = rng.randint(layers, 8 * layers)
        counts = choose_counts(losses, budget)
        assert len(counts) == layers and sum(counts) <= budget
        assert sum(losses[i][g] for i, g in enumerate(counts)) == pytest.approx(brute_force(losses, budget))


def test_choice_spends_on_the_layer_that_loses_most():
    losses = [{4: 0.0, 2: 0.01, 1: 0.02}, {4: 0.0, 2: 1.0, 1: 3.0}, {4: 0.0, 2: 0.02, 1: 0.04}]
    assert choose_counts(losses, 6) == (1, 4, 1)
    assert choose_counts(losses, 3) == (1, 1, 1)


def test_measured_loss_is_the_converted_models_kl(parent, tmp_path):
    """The loss of (layer 1, 2 heads), measured with the pooled layer in place, is the KL to the parent of the model
    that convert --kv-heads-per-layer 4,2,4 writes."""
    model = load_causal_lm(parent)
    blocks = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    shape = AttentionShape("llama", layers=3, heads=8, kv_heads=4, head_dim=8, hidden=64)
    losses = layer_losses(model, layout_for(model.config.to_dict()), blocks, shape, [1, 2, 4])
    assert all(per[4] == 0.0 for per in losses) and all(per[1] > per[2] > 0 for per in losses)
    assert losses[1][2] == pytest.approx(converted_kl(parent, tmp_path / "c", model, blocks), rel=1e-4)
    with torch.no_grad():  # every (layer, count) against the whole model run with that layer pooled in place
        for layer, count in itertools.product(range(3), (1, 2)):
            pooled = load_causal_lm(parent)
            attention = pooled.model.layers[layer].self_attn
            for param in (
                attention.k_proj.weight,
                attention.k_proj.bias,
                attention.v_proj.weight,
                attention.v_proj.bias,
            ):
                param.copy_(pooled_in_place(param, 4, count))
            full = sum(
                float(kl_divergence(model(b[None]).logits[0, :-1], pooled(b[None]).logits[0, :-1])) for b in blocks
            ) / len(blocks)
            assert losses[layer][count] == pytest.approx(full, rel=1e-4, abs=1e-7)
    parent_weights = load_causal_lm(parent).state_dict()
    assert all(torch.equal(t, parent_weights[n]) for n, t in model.state_dict().items())  # restored after each


def test_kv_budget_end_to_end(parent, tmp_path):
    cal = str(parent.parent / "cal.txt")
    args = ["convert", str(parent), str(tmp_path / "dst"), "--kv-budget", "0.5", "--calibration", cal, "-q"]
    result = CliRunner().invoke(main, [*args, "--calibration-tokens", "128"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "dst" / "mha2gqa.json").read_text())["lineage"][-1]
    counts, chosen = record["kv_heads_per_layer"], record["kv_budget"]
    assert f"kv heads per layer: {','.join(map(str, counts))}" in result.output
    assert chosen["budget_kv_heads"] == 6 and sum(counts) <= 6 and chosen["kv_heads_used"] == sum(counts)
    assert chosen["calibration"]["blocks"] == 2 and chosen["calibration"]["seq_len"] == 64
    losses = [{int(c): v for c, v in per.items()} for per in chosen["losses"]]
    assert sum(losses[i][g] for i, g in enumerate(counts)) == pytest.approx(brute_force(losses, 6))
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert [8 // b["attention"]["n_heads_in_group"] for b in config["block_configs"]] == counts
    assert load_causal_lm(tmp_path / "dst").model.layers[0].self_attn.k_proj.weight.shape[0] == counts[0] * 8


def test_kv_budget_refused_before_any_work(parent, tmp_path):
    for extra, message in [
        (["--kv-budget", "0.1"], "less than one kv head per layer"),
        (["--kv-budget", "2"], "2 bytes per token is less than one kv head per layer"),
        (["--kv-budget", "half"], "give a fraction of the parent's KV bytes per token (0 < X < 1, e.g. 0.5)"),
    ]:
        result = CliRunner().invoke(main, ["convert", str(parent), str(tmp_path / "dst"), *extra, "-q"])
        assert result.exit_code == 2 and message in result.output, result.output
        assert not (tmp_path / "dst").exists()


def test_the_byte_example_a_refusal_gives_is_a_budget_this_parent_takes():
    """The example was a fixed 12KiB, the embedded parent's whole KV, which that parent itself refuses: the example
    is now half of the parent's bytes per token."""
    for shape in (SHAPE, AttentionShape("llama", layers=6, heads=8, kv_heads=8, head_dim=32, hidden=256)):
        with pytest.raises(InputError) as refused:
            budget_heads("lots", shape, 4)
        example = re.search(r"e\.g\. (\d+), half of this parent's", str(refused.value)).group(1)
        assert budget_heads(example, shape, 4) == shape.layers * shape.kv_heads // 2


def test_a_calibrated_conversions_loss_is_its_converted_models_kl(parent, tmp_path):
    """With --method calibrated the losses convert a layer by the calibrated merge (maps folded into q_proj and
    o_proj, sensitivity.LayerMerge): the loss of (layer 1, 2 heads) is the KL to the parent of the model that
    convert --kv-heads-per-layer 4,2,4 --method calibrated writes from the same calibration text."""
    from mha2gqa.convert.layer_losses import merge_for
    from mha2gqa.convert.options import ConvertOptions
    from mha2gqa.convert.run import plan_conversion
    from mha2gqa.convert.stage_work import RunState, calibrate

    cal = str(parent.parent / "cal.txt")
    given = dict(method="calibrated", calibration=cal, calibration_tokens=128, progress=False, check=False)
    plan = plan_conversion(parent, tmp_path / "unused", ConvertOptions(kv_heads_per_layer="4,2,4", **given))
    (tmp_path / "scratch").mkdir()
    state = RunState(plan, tmp_path / "scratch", tmp_path / "scratch", tmp_path / "unused")
    calibrate(state)
    merge, words = merge_for(plan.options, state.stats)
    assert words == "calibrated, contiguous grouping"
    model = load_causal_lm(parent)
    blocks = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = layer_losses(model, plan.layout, blocks, SHAPE, [1, 2, 4], merge=merge)
    pooled = layer_losses(model, plan.layout, blocks, SHAPE, [1, 2, 4])
    assert losses != pooled  # the merge is what the losses measure
    args = ["--method", "calibrated", "--calibration", cal, "--calibration-tokens", "128", "--no-check"]
    assert losses[1][2] == pytest.approx(converted_kl(parent, tmp_path / "c", model, blocks, *args), rel=1e-4)
    parent_weights = load_causal_lm(parent).state_dict()
    assert all(torch.equal(t, parent_weights[n]) for n, t in model.state_dict().items())  # restored after each


def converted_kl(parent, dst, model, blocks, *args) -> float:
    """KL(parent || the model `convert --kv-heads-per-layer 4,2,4 ARGS` writes) per token of `blocks`."""
    result = CliRunner().invoke(main, ["convert", str(parent), str(dst), "--kv-heads-per-layer", "4,2,4", "-q", *args])
    assert result.exit_code == 0, result.output
    converted = load_causal_lm(dst)
    with torch.no_grad():
        return sum(
            float(kl_divergence(model(b[None]).logits[0, :-1], converted(b[None]).logits[0, :-1])) for b in blocks
        ) / len(blocks)
