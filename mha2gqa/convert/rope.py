"""What a merge may do to a model's keys: which head dims rotate, and which norms forbid per-head maps.

Transformers applies RoPE in the rotate_half convention: within the first `rotary_dims` dims of a head,
dim i and dim i + rotary_dims/2 form one frequency pair (a complex number); the remaining dims (phi,
stablelm, phi3 with partial_rotary_factor < 1) pass through unrotated. The only linear maps on a key
head that commute with every rotation are a complex scalar per pair (on the rotated dims) and any
map on the unrotated dims, so those are the maps the calibrated merge folds into q_proj.

A norm applied to keys or queries *before* RoPE (qwen3, olmo2, stablelm/phi with qk_layernorm) sits
between the projection and the rotation: a per-head map folded into q_proj would pass through it and
no longer be exact (RMSNorm's elementwise weight does not commute with a per-pair complex scalar, and
olmo2's norm spans all heads at once). Such types are refused for the calibrated merge.
"""

from __future__ import annotations

from pathlib import Path

from mha2gqa.errors import InputError

# Key/query norms that sit between projection and rotation, by model_type (qk_layernorm: when set).
_PRE_ROPE_NORMS = {
    "qwen3": "its q_norm/k_norm (one [head_dim] RMSNorm shared by all heads) sit between q/k_proj and RoPE",
    "olmo2": "its q_norm/k_norm normalise all heads together between q/k_proj and RoPE",
}
_QK_LAYERNORM = "its qk_layernorm sits between q/k_proj and RoPE"
# Norms with one slice per query head are not routed through the converter, so a query permutation
# would leave them behind.
_PER_QUERY_HEAD_NORMS = {
    "olmo2": "its q_norm has one slice per query head",
    "stablelm": "its q_layernorm has one norm per query head",
}


def rotary_dims(model_dir: Path, head_dim: int) -> int:
    """How many leading dims of each head RoPE rotates (head_dim unless partial_rotary_factor < 1).
    Read through transformers' own config class, which knows each type's default (phi: 0.5)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    dims = int(head_dim * float(factor))
    if dims % 2:
        raise InputError(f"rotary dims {dims} (head_dim {head_dim} x partial_rotary_factor {factor}) are odd: "
                         "RoPE needs pairs; check config.json")
    return dims


def check_calibrated(config: dict, method: str) -> None:
    """Refuse, in one line, a model whose key path a per-head map cannot cross exactly."""
    model_type = config.get("model_type")
    reason = _PRE_ROPE_NORMS.get(model_type)
    if reason is None and config.get("qk_layernorm"):
        reason = _QK_LAYERNORM
    if reason:
        raise InputError(
            f"--method {method} cannot convert model_type {model_type!r}: {reason}, so the per-head key maps "
            "it folds into q_proj would not be exact; use --method mean or mean-norm for this model"
        )


def check_grouping(config: dict) -> None:
    """Refuse similarity grouping where a query permutation would leave a per-query-head norm behind."""
    model_type = config.get("model_type")
    reason = _PER_QUERY_HEAD_NORMS.get(model_type)
    if model_type == "stablelm" and not config.get("qk_layernorm"):
        reason = None
    if reason:
        raise InputError(
            f"--grouping similarity cannot reorder the heads of model_type {model_type!r}: {reason}, which the "
            "converter does not rewrite; use --grouping contiguous"
        )
