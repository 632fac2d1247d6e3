"""Similarity grouping: the head permutation is exact, the partition finds planted groups, and the
calibrated merge after it is exact where contiguous grouping is not."""

import pytest
import torch
from calibrated_models import save_redundant_model, write_calibration_text
from click.testing import CliRunner
from tiny_models import make_tiny_model, save_tiny_model
from transformers import AutoModelForCausalLM

from mha2gqa.architecture.layouts import attention_shape, layout_for
from mha2gqa.cli import main
from mha2gqa.convert.grouping import pair_costs, partition, permute_heads
from mha2gqa.convert.roles import layer_names, pack, unpack
from mha2gqa.convert.run import convert
from mha2gqa.records.provenance import latest
from mha2gqa.runtime.errors import InputError

SCATTERED = [0, 3, 5, 6, 1, 2, 4, 7]  # planted groups {0, 3, 5, 6} and {1, 2, 4, 7}


def run(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        ("llama", {"num_key_value_heads": 4}),
        ("phi3", {}),
        ("qwen3", {}),
        ("stablelm", {"qk_layernorm": False}),
    ],
)
def test_head_permutation_alone_leaves_logits_unchanged(model_type, overrides):
    model = make_tiny_model(model_type, **overrides)
    config = model.config.to_dict()
    shape, layout = attention_shape(config), layout_for(config)
    ids = torch.randint(4, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    before = run(model, ids)
    state = model.state_dict()
    first_q = {name: tensor.clone() for name, tensor in state.items() if "layers.0." in name}
    order = list(reversed(range(shape.kv_heads)))
    with torch.no_grad():
        for layer in range(shape.layers):
            names = layer_names(layout, layer, shape.kv_heads, set(state))
            roles = permute_heads(
                unpack({r: state[n].clone() for r, n in names.items()}, shape), order, shape.kv_heads, shape.head_dim
            )
            for role, tensor in pack(roles, list(names), shape.kv_heads).items():
                state[names[role]].copy_(tensor)
    after = run(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    changed = [name for name, tensor in first_q.items() if not torch.equal(tensor, state[name])]
    assert any("o_proj" in name or "dense" in name for name in changed) and len(changed) >= 2


def test_permutation_moves_query_heads_with_their_kv_head():
    roles = {
        "k.weight": torch.arange(4.0).repeat_interleave(2)[:, None],  # 4 kv heads of hd 2
        "v.weight": torch.arange(4.0).repeat_interleave(2)[:, None],
        "q.weight": torch.arange(8.0).repeat_interleave(2)[:, None],  # 8 query heads, 2 per kv head
        "o.weight": torch.arange(8.0).repeat_interleave(2)[None, :],
    }
    out = permute_heads(roles, [2, 0, 3, 1], kv_heads=4, head_dim=2)
    assert out["k.weight"][::2, 0].tolist() == [2, 0, 3, 1]
    assert out["q.weight"][::2, 0].tolist() == [4, 5, 0, 1, 6, 7, 2, 3]
    assert out["o.weight"][0, ::2].tolist() == [4, 5, 0, 1, 6, 7, 2, 3]


def test_partition_finds_planted_groups():
    n, groups = 12, 3
    planted = [[0, 4, 7, 9], [1, 2, 8, 11], [3, 5, 6, 10]]
    costs = torch.full((n, n), 1.0, dtype=torch.float64) + 0.1 * torch.rand(
        n, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    costs = (costs + costs.T) / 2
    for group in planted:
        for a in group:
            for b in group:
                costs[a, b] = 0.05
    costs.fill_diagonal_(0)
    assert partition(costs, groups) == planted


def test_pair_costs_are_zero_for_planted_pairs(tmp_path):
    model = save_redundant_model(tmp_path / "src", "llama", groups=4, order=SCATTERED)
    shape = attention_shape(model.config.to_dict())
    x = torch.cat([torch.randn(300, 64, dtype=torch.float64), torch.ones(300, 1, dtype=torch.float64)], dim=1)
    state = model.state_dict()
    names = layer_names(layout_for(model.config.to_dict()), 0, 8, set(state))
    costs = pair_costs(unpack({r: state[n] for r, n in names.items()}, shape), x.T @ x, 8, 8, 8)
    torch.testing.assert_close(costs, costs.T)
    for g in range(4):
        a, b = SCATTERED[2 * g], SCATTERED[2 * g + 1]
        assert costs[a, b] < 1e-10
    assert costs[0, 1] > 1e-2


def test_similarity_grouping_makes_the_merge_exact_on_scattered_groups(tmp_path):
    src = tmp_path / "src"
    save_redundant_model(src, "llama", groups=2, order=SCATTERED)
    cal = write_calibration_text(tmp_path / "cal.txt")
    ids = torch.randint(4, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    parent = run(AutoModelForCausalLM.from_pretrained(src), ids)
    outs = {}
    for grouping in ("contiguous", "similarity"):
        result = convert(
            src,
            tmp_path / grouping,
            groups=2,
            method="calibrated",
            calibration=str(cal),
            calibration_tokens=400,
            grouping=grouping,
            progress=False,
        )
        outs[grouping] = (result, run(AutoModelForCausalLM.from_pretrained(tmp_path / grouping), ids))
    result, similar = outs["similarity"]
    assert [row["kv_order"] for row in result.layers] == [SCATTERED, SCATTERED]
    torch.testing.assert_close(similar, parent, rtol=1e-4, atol=1e-4)
    assert (outs["contiguous"][1] - parent).abs().max() > 1e-2
    record = latest(tmp_path / "similarity", "conversion")
    assert record["grouping"] == "similarity" and record["layers"][0]["kv_order"] == SCATTERED


def test_similarity_grouping_with_mean_rewrites_q_and_o(tmp_path):
    src = tmp_path / "src"
    save_redundant_model(src, "llama", groups=2, order=SCATTERED)
    cal = write_calibration_text(tmp_path / "cal.txt")
    result = convert(
        src,
        tmp_path / "dst",
        groups=2,
        method="mean",
        calibration=str(cal),
        calibration_tokens=300,
        grouping="similarity",
        progress=False,
    )
    assert result.layers[0]["kv_order"] == SCATTERED
    source = AutoModelForCausalLM.from_pretrained(src).state_dict()
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(out[q][8:16], source[q][24:32])  # new query head 1 is source head 3


def test_similarity_grouping_refusals(tmp_path):
    save_tiny_model(tmp_path / "src", "llama")
    with pytest.raises(InputError, match="--calibration needs the source's tokenizer"):  # default: its samples
        convert(tmp_path / "src", tmp_path / "dst", groups=2, grouping="similarity")
    with pytest.raises(InputError, match="--grouping 'best' is unknown"):
        convert(tmp_path / "src", tmp_path / "dst", groups=2, grouping="best", calibration="x")
    save_tiny_model(tmp_path / "olmo2", "olmo2")
    result = CliRunner().invoke(
        main,
        [
            "convert",
            str(tmp_path / "olmo2"),
            str(tmp_path / "dst"),
            "-g",
            "2",
            "--grouping",
            "similarity",
            "--calibration",
            str(write_calibration_text(tmp_path / "c.txt")),
        ],
    )
    assert result.exit_code == 2 and "q_norm has one slice per query head" in result.output
    assert not (tmp_path / "dst").exists()
    save_tiny_model(tmp_path / "stablelm", "stablelm")  # qk_layernorm: one norm per query head
    with pytest.raises(InputError, match="q_layernorm has one norm per query head"):
        convert(tmp_path / "stablelm", tmp_path / "dst", groups=2, grouping="similarity", calibration="x")
