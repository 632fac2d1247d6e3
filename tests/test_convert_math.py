"""The conversion arithmetic: exactness on redundant heads, mean/first/random against hand references,
regrouping, and the RoPE-permutation invariant."""

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import MODEL_TYPES, make_tiny_model
from transformers import AutoModelForCausalLM

from mha2gqa import convert
from mha2gqa.convert.methods import group_heads, group_mean, ungroup
from mha2gqa.records.provenance import latest, lineage

KV, HD = 8, 8  # tiny models: 8 kv heads of head_dim 8 (gemma: 16)


def _head_dim(model):
    return getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads


def _copy_first_head_of_each_group(rows: torch.Tensor, kv: int, groups: int) -> None:
    """In place: every head of a group becomes a copy of the group's first head (rows are heads * hd)."""
    per_head = rows.view(kv, -1, *rows.shape[1:])
    r = kv // groups
    for g in range(groups):
        for j in range(g * r + 1, (g + 1) * r):
            per_head[j] = per_head[g * r]


def make_redundant(model, groups):
    """Make the kv heads within each group identical, in every kv-carrying tensor of every layout."""
    kv, hd = model.config.num_key_value_heads, _head_dim(model)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):  # phi3: rows [q | k | v]
                q_rows = model.config.num_attention_heads * hd
                for start in (q_rows, q_rows + kv * hd):
                    _copy_first_head_of_each_group(attn.qkv_proj.weight[start : start + kv * hd], kv, groups)
                continue
            for proj in (attn.k_proj, attn.v_proj):
                _copy_first_head_of_each_group(proj.weight, kv, groups)
                if proj.bias is not None:
                    _copy_first_head_of_each_group(proj.bias, kv, groups)
            if hasattr(attn, "k_norm") and attn.k_norm.weight.shape[0] == kv * hd:  # olmo2
                _copy_first_head_of_each_group(attn.k_norm.weight, kv, groups)
            if hasattr(attn, "k_layernorm"):  # stablelm: one norm per kv head
                norms = attn.k_layernorm.norms
                r = kv // groups
                for j in range(kv):
                    norms[j].weight.copy_(norms[(j // r) * r].weight)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("method", ["mean", "first"])
def test_redundant_heads_convert_with_unchanged_logits(tmp_path, model_type, method):
    parent = make_tiny_model(model_type, seed=1)
    make_redundant(parent, groups=2)
    parent.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dst", groups=2, method=method, progress=False)
    child = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        torch.testing.assert_close(child(ids).logits, parent(ids).logits)


def test_mean_pooling_of_distinct_heads_changes_logits(tmp_path):
    """The converse: the test above can fail, because pooling distinct heads does change the model."""
    parent = make_tiny_model("llama", seed=1)
    parent.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dst", groups=2, progress=False)
    child = AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    ids = torch.tensor([[3, 14, 15, 92]])
    with torch.no_grad():
        assert (child(ids).logits - parent(ids).logits).abs().max() > 1e-3


def _arange_checkpoint(path, model_type="llama"):
    """A saved tiny model whose layer-0 kv tensors are arange-filled, so each row names its head."""
    model = make_tiny_model(model_type)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers.0." in name and any(
                key in name for key in ("k_proj", "v_proj", "k_norm", "qkv_proj", "k_layernorm")
            ):
                param.copy_(torch.arange(param.numel(), dtype=torch.float32).reshape(param.shape))
    model.save_pretrained(path)
    return load_file(path / "model.safetensors")


def _reference_pool(rows, kv, groups, pick=None):
    """Hand arithmetic: output head g = mean (or the `pick`-th) of source heads g*r .. g*r+r-1."""
    hd, r = rows.shape[0] // kv, kv // groups
    heads = [rows[j * hd : (j + 1) * hd] for j in range(kv)]
    out = []
    for g in range(groups):
        members = heads[g * r : (g + 1) * r]
        out.append(members[pick] if pick is not None else sum(members) / r)
    return torch.cat(out)


@pytest.mark.parametrize(
    "model_type,tensors",
    [
        ("llama", ["k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"]),
        ("qwen2", ["k_proj.bias", "v_proj.bias"]),
        ("olmo2", ["k_norm.weight", "k_proj.weight"]),
    ],
)
@pytest.mark.parametrize("groups", [4, 1])
def test_mean_pool_matches_reference_arithmetic(tmp_path, model_type, tensors, groups):
    source = _arange_checkpoint(tmp_path / "src", model_type)
    convert(tmp_path / "src", tmp_path / "dst", groups=groups, progress=False)
    result = load_file(tmp_path / "dst" / "model.safetensors")
    for tensor in tensors:
        name = f"model.layers.0.self_attn.{tensor}"
        torch.testing.assert_close(result[name], _reference_pool(source[name], KV, groups))
    # q and o are untouched by mean-pooling
    for tensor in ("q_proj.weight", "o_proj.weight"):
        name = f"model.layers.0.self_attn.{tensor}"
        assert torch.equal(result[name], source[name])


def test_fused_qkv_pools_only_its_kv_rows(tmp_path):
    source = _arange_checkpoint(tmp_path / "src", "phi3")
    convert(tmp_path / "src", tmp_path / "dst", groups=2, progress=False)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    fused, out = source[name], load_file(tmp_path / "dst" / "model.safetensors")[name]
    q, k, v = fused[:64], fused[64:128], fused[128:]
    expected = torch.cat([q, _reference_pool(k, KV, 2), _reference_pool(v, KV, 2)])
    torch.testing.assert_close(out, expected)


def test_stablelm_per_head_norms_reduce_to_group_means(tmp_path):
    source = _arange_checkpoint(tmp_path / "src", "stablelm")
    convert(tmp_path / "src", tmp_path / "dst", groups=2, progress=False)
    result = load_file(tmp_path / "dst" / "model.safetensors")
    prefix = "model.layers.0.self_attn.k_layernorm.norms"
    assert sorted(n for n in result if n.startswith(prefix)) == [f"{prefix}.0.weight", f"{prefix}.1.weight"]
    for g in range(2):
        expected = torch.stack([source[f"{prefix}.{j}.weight"] for j in range(4 * g, 4 * g + 4)]).mean(0)
        torch.testing.assert_close(result[f"{prefix}.{g}.weight"], expected)


def test_first_keeps_the_first_head_of_each_group(tmp_path):
    source = _arange_checkpoint(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dst", groups=2, method="first", progress=False)
    name = "model.layers.0.self_attn.v_proj.weight"
    result = load_file(tmp_path / "dst" / "model.safetensors")[name]
    torch.testing.assert_close(result, _reference_pool(source[name], KV, 2, pick=0))


def test_random_is_seeded_and_matches_the_source_std(tmp_path):
    model = make_tiny_model("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=8)
    model.save_pretrained(tmp_path / "src")
    name = "model.layers.1.self_attn.k_proj.weight"
    outputs = {}
    for run, seed in (("a", 7), ("b", 7), ("c", 8)):
        convert(tmp_path / "src", tmp_path / run, groups=2, method="random", seed=seed, progress=False)
        outputs[run] = load_file(tmp_path / run / "model.safetensors")[name]
    source = model.state_dict()[name]
    assert torch.equal(outputs["a"], outputs["b"])
    assert not torch.equal(outputs["a"], outputs["c"])
    assert outputs["a"].shape == (2 * 32, 256)
    assert abs(outputs["a"].std().item() / source.std().item() - 1) < 0.05
    assert latest(tmp_path / "a", "conversion")["seed"] == 7


def test_regrouping_in_two_steps_equals_one_step(tmp_path):
    """8 -> 4 -> 2 by means of equal-sized groups is the same as 8 -> 2."""
    make_tiny_model("qwen2").save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "gqa4", groups=4, progress=False)
    convert(tmp_path / "gqa4", tmp_path / "two_steps", groups=2, progress=False)
    convert(tmp_path / "src", tmp_path / "one_step", groups=2, progress=False)
    two, one = (load_file(tmp_path / d / "model.safetensors") for d in ("two_steps", "one_step"))
    assert two.keys() == one.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name])
    history = lineage(tmp_path / "two_steps")
    assert [(s["stage"], s["source_kv_heads"], s["groups"]) for s in history] == [
        ("conversion", 8, 4),
        ("conversion", 4, 2),
    ]


def _meta_to_hf_rope_permutation(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """The row permutation transformers' Llama conversion applies to q/k (interleaved -> rotate_half)."""
    out_features, in_features = rows.shape
    return (
        rows.view(heads, out_features // heads // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)
    )


def test_mean_pooling_commutes_with_the_llama_rope_permutation():
    torch.manual_seed(0)
    weight = torch.randn(KV * HD, 32)  # (n_kv*hd, d)
    pooled_then_permuted = _meta_to_hf_rope_permutation(ungroup(group_mean(group_heads(weight, KV, 2))), 2)
    permuted_then_pooled = ungroup(group_mean(group_heads(_meta_to_hf_rope_permutation(weight, KV), KV, 2)))
    torch.testing.assert_close(pooled_then_permuted, permuted_then_pooled)


def test_group_heads_follows_repeat_kv_order():
    """Query head i reads kv head i // (H // G): the groups are contiguous runs of source heads."""
    rows = torch.arange(KV).repeat_interleave(HD).float()  # each row holds its head index
    grouped = group_heads(rows, KV, 2)  # (G, r, hd)
    assert grouped.shape == (2, 4, HD)
    assert grouped[:, :, 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
