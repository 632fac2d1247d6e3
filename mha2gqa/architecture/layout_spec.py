"""The Layout record: what one architecture's attention tensors are called and what limits a merge.

Its own module, below both users: layouts.py holds the explicit entries and the lookups, and
generic_layout.py derives a Layout for a model_type without an entry; each imports this one, so
neither imports the other in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Names of one layer's attention tensors (without `.weight`/`.bias`), relative to the layer."""

    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    # Fused [q (H*hd) | k (n_kv*hd) | v (n_kv*hd)] rows in one Linear (phi3); q/k/v above unused then.
    qkv: str | None = None
    # The same fused q/k/v as columns of a Conv1D weight (in, out) (gpt2); written back as Linear rows.
    qkv_columns: str | None = None
    # Conv1D weights (in, out) of every layer, written transposed as Linear (out, in) for the target.
    transposed: tuple[str, ...] = ()
    # The model_type the converted checkpoint has, when it is not the source's (gpt2 -> gpt_bigcode).
    target: str | None = None
    # A norm over the concatenated keys of all kv heads, shape [n_kv*hd] (olmo2): pooled like k rows.
    k_norm_rows: str | None = None
    # One norm module per kv head, `{head}` in the name (stablelm's qk_layernorm): reduced per group.
    k_norm_per_head: str | None = None
    # Norms shared by all heads, shape [hd] (qwen3): left untouched, listed for the plan only.
    shared_norms: tuple[str, ...] = ()
    layer_prefix: str = "model.layers.{layer}."
    # The q/k norms below exist only when this config key is true (stablelm: qk_layernorm); None: always.
    norms_when: str | None = None
    # A norm between q/k_proj and RoPE, as the reason the calibrated merge gives for refusing.
    pre_rope_norm: str | None = None
    # A norm with one slice per query head, which the converter does not rewrite, so a query-head
    # permutation (similarity grouping) would leave it behind: the reason for refusing one.
    per_query_head_norm: str | None = None
    # Other reasons the calibrated merge (and --refine) or a query permutation cannot be exact here:
    # an unknown RoPE convention, modules on the key path, q/o stored as Conv1D.
    calibrated_barrier: str | None = None
    grouping_barrier: str | None = None
    # Why --refine (which fits the loaded attention modules, folding nothing) cannot run, or None.
    refine_barrier: str | None = None

    def _norms_present(self, config: dict) -> bool:
        return self.norms_when is None or bool(config.get(self.norms_when))

    def calibrated_refusal(self, config: dict) -> str | None:
        """Why a per-head key map folded into q_proj would not be exact for this config, or None."""
        return (self.pre_rope_norm if self._norms_present(config) else None) or self.calibrated_barrier

    def grouping_refusal(self, config: dict) -> str | None:
        """Why the query heads of this config cannot be permuted, or None."""
        return (self.per_query_head_norm if self._norms_present(config) else None) or self.grouping_barrier
