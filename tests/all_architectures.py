"""Tiny models of every causal-LM type the installed transformers offers, and the check that the
converter either converts each exactly or refuses it in one line.

Used by tests/test_architectures_all.py and scripts/supported_architectures.py (which writes
docs/architectures.md from the same results, so the supported list cannot drift).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HEADS = 8  # the tiny models' query and kv heads: converted to 4 (exact on planted pairs) and to 1
HEAD_DIM = 8
# Attribute -> tiny value, applied where the type's config has the attribute.
SIZES = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": 256,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "sliding_window": 16,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "first_k_dense_replace": 1,
}
IDS = torch.tensor([[5, 9, 17, 33, 60, 7, 21, 90]])


def causal_lm_types() -> list[str]:
    """Every model_type with a causal-LM class in the installed transformers (its auto mapping)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    """The type's config class with every size in SIZES it has shrunk; layer_types (if any) keeps
    one layer of each of the first two distinct kinds, so hybrids stay hybrids."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    aliases = getattr(cls, "attribute_map", {})  # gpt2: num_attention_heads -> n_head
    settings = {aliases.get(key, key): value for key, value in SIZES.items() if aliases.get(key, key) in defaults}
    kinds = defaults.get("layer_types")
    if kinds:
        distinct = list(dict.fromkeys(kinds))
        settings["layer_types"] = (distinct * 2)[:2] if len(distinct) > 1 else kinds[:2]
    return cls(**settings)


def plant_redundant_groups(model, layout, shape, groups: int | list[list[int]]) -> None:
    """Make the kv heads of each group identical in every layer (k/v rows and biases, key-norm slices),
    so pooling them changes nothing: the converted model must match its parent exactly. `groups` is a
    count of contiguous groups, or the kv-head indices of each group (scattered groups). unpack()
    returns views, so writing through them edits the model's parameters."""
    from mha2gqa.convert.roles import KV_ROLES, layer_names, unpack

    if isinstance(groups, int):
        size = shape.kv_heads // groups
        groups = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layer in range(shape.layers):
            stored = layer_names(layout, layer, shape.kv_heads, set(params))
            roles = unpack({role: params[name] for role, name in stored.items()}, shape)
            for role in KV_ROLES:
                if role in roles:
                    heads = roles[role].unflatten(0, (shape.kv_heads, -1))  # (n_kv, hd, ...) view
                    for group in groups:
                        heads[group[1:]] = heads[group[0]].clone()


@dataclass
class Outcome:
    model_type: str
    status: str  # "exact" (converted, loads clean, matches on planted heads), "refused", "no tiny model"
    reason: str = ""  # why refused; for an exact type, a kv-head count its class refuses (diffllama: 1)
    moe: bool = False
    layout: str = ""  # inspect's description: explicit entry, generic, or retargeted
    calibrated: str = ""  # "supported" or why not (a supported claim is checked: key maps fold exactly)


def check_type(model_type: str, workdir: Path) -> Outcome:
    """Build, plant, save, convert to half and to one kv head, reload, compare. Raises on anything
    that is neither an exact conversion nor a one-line InputError refusal."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is ~3x faster on a busy 2-core machine
    try:
        return _check_type(model_type, workdir)
    finally:
        torch.set_num_threads(threads)


def _check_type(model_type: str, workdir: Path) -> Outcome:
    from transformers import AutoModelForCausalLM

    from mha2gqa import convert
    from mha2gqa.architecture.layouts import attention_shape, describe_layout, layout_for
    from mha2gqa.convert.rope import rotary_dims
    from mha2gqa.runtime.errors import InputError

    try:
        config = tiny_config(model_type)
    except Exception as err:  # the harness's limit, not the converter's: reported, never counted as supported
        return Outcome(model_type, "no tiny model", _short(err))
    source = workdir / "source"
    config_dict = config.to_dict()
    try:
        layout, shape = layout_for(config_dict), attention_shape(config_dict)
    except InputError as err:
        config.save_pretrained(source)  # the refusal must hold on the real path too, before any weight is read
        with pytest.raises(InputError) as again:
            convert(source, workdir / "refused", groups=1, progress=False)
        assert _same_refusal(str(again.value), str(err)), (str(again.value), str(err))
        assert str(err) and "\n" not in str(err)
        assert not (workdir / "refused").exists()
        return Outcome(model_type, "refused", str(err))
    try:
        torch.manual_seed(0)
        parent = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    except Exception as err:
        return Outcome(model_type, "no tiny model", _short(err))
    with torch.no_grad():
        for param in parent.parameters():  # norms start at 1 and biases at 0: make mistakes visible
            param.add_(0.05 * torch.randn_like(param))
    # gpt2's grouped form (gpt_bigcode) is multi-query only: 1 kv head, planted all alike.
    targets = (1,) if layout.target else (shape.kv_heads // 2, 1)
    plant_redundant_groups(parent, layout, shape, targets[0])
    parent.save_pretrained(source)
    with torch.no_grad():
        expected = parent(IDS).logits
    moe = any("expert" in name for name, _ in parent.named_parameters())
    described = describe_layout(config_dict)
    if described["calibrated"] == "supported":
        _check_key_maps_fold(parent, layout, shape, rotary_dims(source, shape.head_dim), expected)
    note = ""
    for groups in targets:
        dst = workdir / f"kv{groups}"
        try:
            convert(source, dst, groups=groups, progress=False)
        except InputError as err:  # names/shapes disagree with the derived layout, or the class refuses `groups`
            assert str(err) and "\n" not in str(err) and not dst.exists()
            if groups == targets[0]:
                return Outcome(model_type, "refused", str(err))
            note = f"to {groups} kv head refused: {err}"
            continue
        child, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True, dtype=torch.float32)
        assert {key: value for key, value in info.items() if value} == {}, (model_type, info)
        assert _kv_rows(child, layout, shape) == groups * shape.head_dim
        child.eval()
        with torch.no_grad():
            logits = child(IDS).logits
            generated = child.generate(IDS, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
        assert generated.shape == (1, IDS.shape[1] + 3)
        assert torch.isfinite(logits).all()
        if groups == targets[0]:
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    if config.model_type != model_type:  # gpt-sw3's config class is GPT2Config: the same architecture
        note = f"alias: its config class builds model_type {config.model_type!r}"
    return Outcome(model_type, "exact", note, moe, described["layout"], described["calibrated"])


def _check_key_maps_fold(parent, layout, shape, rotary: int, expected) -> None:
    """What the calibrated merge relies on, checked on the model itself: a complex scalar per RoPE
    frequency pair applied to a kv head's key rows, with its inverse transpose on the rows of the
    query heads that read it, leaves the logits unchanged. It fails where a norm or a different RoPE
    convention sits between the projections and the scores."""
    import copy

    from mha2gqa.convert.roles import layer_names, unpack

    model = copy.deepcopy(parent)
    params = dict(model.named_parameters())
    hd, half, per_kv = shape.head_dim, rotary // 2, shape.heads // shape.kv_heads
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in range(shape.layers):
            stored = layer_names(layout, layer, shape.kv_heads, set(params))
            roles = unpack({role: params[name] for role, name in stored.items()}, shape)
            for j in range(shape.kv_heads):
                a, b = 0.5 + torch.rand(2, half, generator=generator)
                pairs = torch.arange(half)
                maps = torch.eye(hd)
                maps[pairs, pairs], maps[pairs, pairs + half] = a, -b
                maps[pairs + half, pairs], maps[pairs + half, pairs + half] = b, a
                query_maps = torch.linalg.inv(maps).T
                for kind in ("weight", "bias"):
                    if f"k.{kind}" in roles:
                        rows = roles[f"k.{kind}"][j * hd : (j + 1) * hd]
                        rows.copy_(maps @ rows)
                    if f"q.{kind}" in roles:
                        for i in range(j * per_kv, (j + 1) * per_kv):
                            rows = roles[f"q.{kind}"][i * hd : (i + 1) * hd]
                            rows.copy_(query_maps @ rows)
        torch.testing.assert_close(model(IDS).logits, expected, rtol=1e-4, atol=1e-4)


def _kv_rows(model, layout, shape) -> int:
    """Rows of layer 0's k_proj in the converted model (gpt_bigcode: of the k part of c_attn)."""
    prefix = layout.layer_prefix.format(layer=0)
    params = dict(model.named_parameters())
    fused = layout.qkv or layout.qkv_columns
    if fused:  # Linear rows [q (H*hd) | k | v] (gpt2's Conv1D is written as Linear for gpt_bigcode)
        return (params[prefix + fused + ".weight"].shape[0] - shape.heads * shape.head_dim) // 2
    return params[prefix + layout.k + ".weight"].shape[0]


def _short(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:120]}" if text else type(err).__name__


_NOT_BUILT = "transformers could not build it from this config ("


def _same_refusal(on_disk: str, in_memory: str) -> bool:
    """The same refusal, or, where transformers could not build the class, the same one but for transformers' own
    error: under transformers < 5.20 (the release vLLM pins) dbrx's config fails one way built from its dict and
    another read back from config.json."""
    if on_disk == in_memory:
        return True
    return _NOT_BUILT in in_memory and on_disk.split(_NOT_BUILT)[0] == in_memory.split(_NOT_BUILT)[0]
