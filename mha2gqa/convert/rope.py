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

from mha2gqa.architecture.layouts import attention_shape, layout_for
from mha2gqa.runtime.errors import InputError


def rotary_dims(model_dir: Path, head_dim: int) -> int:
    """How many leading dims of each head RoPE rotates (head_dim unless partial_rotary_factor < 1).
    Read through transformers' own config class, which knows each type's default (phi: 0.5)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    return _even_rotary_dims(head_dim, factor)


def validate_rotary_dims(config: dict) -> None:
    """Refuse, before anything runs, a partial_rotary_factor that config.json sets to rotate an odd number of
    dims (a type's own default always rotates whole pairs; rotary_dims reads those at run time)."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor:
        _even_rotary_dims(attention_shape(config).head_dim, factor)


def _even_rotary_dims(head_dim: int, factor: float) -> int:
    dims = int(head_dim * float(factor))
    if dims % 2:
        raise InputError(
            f"rotary dims {dims} (head_dim {head_dim} x partial_rotary_factor {factor}) are odd: "
            "RoPE needs pairs; check config.json"
        )
    return dims


def validate_calibrated(config: dict, method: str) -> None:
    """Refuse, in one line, a model whose key path a per-head map cannot cross exactly."""
    reason = layout_for(config).calibrated_refusal(config)
    if reason:
        raise InputError(
            f"--method {method} cannot convert model_type {config.get('model_type')!r}: {reason}, so the per-head "
            "key maps it folds into q_proj would not be exact; use --method mean or mean-norm for this model"
        )


def validate_refine_layout(config: dict) -> None:
    """Refuse --refine where the parent and converted models do not share attention modules. It
    folds no map, so RoPE conventions and norms on the key path do not limit it."""
    reason = layout_for(config).refine_barrier
    if reason:
        raise InputError(
            f"--refine cannot refine model_type {config.get('model_type')!r}: {reason}; convert without --refine"
        )


def validate_grouping(config: dict) -> None:
    """Refuse similarity grouping where a query permutation would leave a per-query-head norm behind."""
    reason = layout_for(config).grouping_refusal(config)
    if reason:
        raise InputError(
            f"--grouping similarity cannot reorder the heads of model_type {config.get('model_type')!r}: {reason}, "
            "which the converter does not rewrite; use --grouping contiguous"
        )
