"""The calibrated merge (the math: docs/calibrated.md): pure float64 functions on one layer's projections.

Notation: n source kv heads in G groups of r, head dim hd, D = d + 1 (each projection is augmented
with its bias as a last column, and the calibration gram `C = [X 1]^T [X 1]` is (D, D), so biases are
merged with the weights). Every merge returns the group's shared projection and, per source head j,
a map M_j (hd, hd) with `K_j ~= M_j K_shared` (or V_j): the merge is exact where that holds.
- values: the top-hd principal subspace of the group's concatenated projections under C;
  M_j = E_j (head j's rows of the eigenvectors), folded into o_proj: `Wo_q <- Wo_q E_j`.
- keys, rotated dims: a complex scalar per frequency pair (the only maps that commute with RoPE),
  the top eigenvector v of the r x r Hermitian `W_z^H C W_z` per pair; M_j multiplies by conj(v_j).
- keys, unrotated dims (no RoPE, or partial rotary): the subspace method, like values.
Keys fold into q_proj as `Wq_q <- M_j^T Wq_q` (q . M k = M^T q . k; M^T commutes with RoPE too).
"""

from __future__ import annotations

import torch

from mha2gqa.runtime.errors import InputError


def augment(weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, d), (rows,) -> (rows, d+1) float64 on `device`; a missing bias is a zero column."""
    weight = weight.to(device, torch.float64)
    column = weight.new_zeros(weight.shape[0], 1) if bias is None else bias.to(device, torch.float64)[:, None]
    return torch.cat([weight, column], dim=1)


def projection_gram(w: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """(..., rows, D), (D, D) -> (..., rows, rows): second moments of the projected outputs, W C W^T."""
    return w @ gram @ w.transpose(-1, -2)


def merge_subspace(w: torch.Tensor, pg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (G, r, p, D), pg (G, r*p, r*p) -> shared (G, p, D), maps (G, r, p, p): the top-p eigenvectors E
    of each group's output moments; shared = E^T W_cat and head j ~= E_j shared."""
    groups, r, p, width = w.shape
    if p == 0:
        return w.new_zeros(groups, 0, width), w.new_zeros(groups, r, 0, 0)
    _, vectors = torch.linalg.eigh(pg)  # ascending eigenvalues
    basis = vectors[..., -p:]  # (G, r*p, p)
    shared = basis.transpose(-1, -2) @ w.reshape(groups, r * p, width)  # (G, p, D)
    return shared, basis.reshape(groups, r, p, p)


def rotary_hermitian(pg: torch.Tensor) -> torch.Tensor:
    """pg (..., r, rot, r, rot) -> (..., rot/2, r, r) complex: per frequency pair i, H[a, b] = w_a^H C w_b
    with w_a = row i + 1j * row i + rot/2 of head a (rotate_half pairing)."""
    half = pg.shape[-1] // 2
    first = torch.arange(half, device=pg.device)
    second = first + half

    def block(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        # advanced indices at dims -3 and -1 broadcast to the front: (half, ..., r, r)
        return pg[..., rows, :, cols].movedim(0, -3)

    real = block(first, first) + block(second, second)
    imag = block(first, second) - block(second, first)
    return torch.complex(real, imag)


def merge_rotary(w: torch.Tensor, pg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (G, r, rot, D), pg (G, r, rot, r, rot) -> shared (G, rot, D), maps (G, r, rot, rot).
    Per pair, Z = X W_z (N, r) is best approximated at rank one by (Z v) v^H: the shared key is
    W_z v and head j's pair is conj(v_j) times it."""
    groups, r, rot, width = w.shape
    half = rot // 2
    if half == 0:
        return w.new_zeros(groups, 0, width), w.new_zeros(groups, r, 0, 0)
    _, vectors = torch.linalg.eigh(rotary_hermitian(pg))  # (G, half, r, r)
    top = vectors[..., -1]  # (G, half, r)
    w_z = torch.complex(w[:, :, :half], w[:, :, half:])  # (G, r, half, D)
    shared = torch.einsum("gir,grid->gid", top, w_z)  # (G, half, D)
    scale = top.conj().permute(0, 2, 1)  # (G, r, half): K_j pair ~= scale * shared pair
    a, b = scale.real, scale.imag
    i = torch.arange(half, device=w.device)
    maps = w.new_zeros(groups, r, rot, rot)
    maps[..., i, i], maps[..., i, i + half] = a, -b  # (x1, x2) -> (a x1 - b x2, b x1 + a x2)
    maps[..., i + half, i], maps[..., i + half, i + half] = b, a
    return torch.cat([shared.real, shared.imag], dim=1), maps


def merge_keys(
    w: torch.Tensor, gram: torch.Tensor, groups: int, head_dim: int, rot: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n*hd, D) -> shared (G*hd, D), maps (n, hd, hd): rotated dims [0, rot) per frequency pair,
    the unrotated rest [rot, hd) by subspace; the maps are block diagonal over the two parts."""
    n = w.shape[0] // head_dim
    r, width = n // groups, w.shape[1]
    heads = w.reshape(groups, r, head_dim, width)  # (G, r, hd, D)
    pg = projection_gram(w.reshape(groups, r * head_dim, width), gram).reshape(groups, r, head_dim, r, head_dim)
    pass_dims = head_dim - rot
    rot_shared, rot_maps = merge_rotary(heads[:, :, :rot], pg[:, :, :rot, :, :rot])
    pass_pg = pg[:, :, rot:, :, rot:].reshape(groups, r * pass_dims, r * pass_dims)
    pass_shared, pass_maps = merge_subspace(heads[:, :, rot:], pass_pg)
    maps = w.new_zeros(groups, r, head_dim, head_dim)
    maps[..., :rot, :rot], maps[..., rot:, rot:] = rot_maps, pass_maps
    shared = torch.cat([rot_shared, pass_shared], dim=1)  # (G, hd, D)
    return shared.reshape(groups * head_dim, width), maps.reshape(n, head_dim, head_dim)


def merge_values(w: torch.Tensor, gram: torch.Tensor, groups: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n*hd, D) -> shared (G*hd, D), maps (n, hd, hd)."""
    return merge_keys(w, gram, groups, head_dim, rot=0)


def fold_queries(q: torch.Tensor, key_maps: torch.Tensor) -> torch.Tensor:
    """q (H*hd, D) augmented query projection, key_maps (n, hd, hd) -> (H*hd, D): query head h, served
    by kv head h // (H/n), becomes M_j^T q_h."""
    n, head_dim, _ = key_maps.shape
    heads = q.reshape(-1, head_dim, q.shape[-1])  # (H, hd, D)
    per_query = key_maps.repeat_interleave(heads.shape[0] // n, dim=0)  # (H, hd, hd)
    return torch.einsum("hab,had->hbd", per_query, heads).reshape(q.shape)


def fold_outputs(o: torch.Tensor, value_maps: torch.Tensor) -> torch.Tensor:
    """o (d, H*hd) -> (d, H*hd): the columns of query head h become Wo_h E_j."""
    n, head_dim, _ = value_maps.shape
    heads = o.double().reshape(o.shape[0], -1, head_dim)  # (d, H, hd)
    per_query = value_maps.repeat_interleave(heads.shape[1] // n, dim=0)  # (H, hd, hd)
    return torch.einsum("dha,hab->dhb", heads, per_query).reshape(o.shape)


def relative_error(w: torch.Tensor, shared: torch.Tensor, maps: torch.Tensor, gram: torch.Tensor) -> float:
    """sum_j ||[X 1] (W_j - M_j W_shared(j))^T||^2 / sum_j ||[X 1] W_j^T||^2 over the calibration tokens.
    w (n*hd, D), shared (G*hd, D), maps (n, hd, hd)."""
    n, head_dim, _ = maps.shape
    groups = shared.shape[0] // head_dim
    source = shared.reshape(groups, 1, head_dim, -1).expand(groups, n // groups, head_dim, -1)
    rebuilt = maps @ source.reshape(n, head_dim, -1)  # (n, hd, D)
    diff = w - rebuilt.reshape(w.shape)

    def energy(a: torch.Tensor) -> torch.Tensor:
        return ((a @ gram) * a).sum()  # trace(A C A^T)

    total = energy(w)
    return float(energy(diff) / total) if total > 0 else 0.0


def calibrated_layer(roles: dict, ctx) -> tuple[dict, dict]:
    """The `calibrated` method on one layer's canonical roles; ctx.stats is a calibration.LayerStats.
    Returns the converted roles and the relative key/value reconstruction errors through its own maps."""
    if ctx.stats is None:
        raise InputError("--method calibrated needs calibration data: pass --calibration DATA")
    if any(role.startswith("k_norm") for role in roles):
        raise InputError("--method calibrated cannot fold per-head maps through a key norm: use --method mean")
    gram, head_dim = ctx.stats.gram.double(), ctx.shape.head_dim
    device = gram.device  # the GPU when the statistics were loaded there: float64 d^3 work per layer
    k = augment(roles["k.weight"], roles.get("k.bias"), device)  # (n*hd, D)
    v = augment(roles["v.weight"], roles.get("v.bias"), device)
    weights = ctx.kv_weights()
    k_shared, k_maps = _weighted(merge_keys, k, weights, gram, ctx.groups, head_dim, ctx.stats.rotary_dims)
    v_shared, v_maps = _weighted(merge_values, v, weights, gram, ctx.groups, head_dim)
    out = dict(roles)
    _store(out, roles, "k", k_shared)
    _store(out, roles, "v", v_shared)
    _store(out, roles, "q", fold_queries(augment(roles["q.weight"], roles.get("q.bias"), device), k_maps))
    out["o.weight"] = fold_outputs(roles["o.weight"].to(device), v_maps).to("cpu", roles["o.weight"].dtype)
    report = {
        "key_error": relative_error(k, k_shared, k_maps, gram),
        "value_error": relative_error(v, v_shared, v_maps, gram),
    }
    return out, report


def _weighted(merge, w: torch.Tensor, weights: torch.Tensor | None, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge` minimising sum_j weights[j] x head j's error (--keep-retrieval-heads), or the plain one: the
    weighted problem is the plain one on heads scaled by sqrt(weights[j]), whose maps are then divided by it."""
    if weights is None:
        return merge(w, *args)
    root = weights.to(w.device, torch.float64).sqrt()  # (n,)
    n = root.shape[0]
    shared, maps = merge((w.reshape(n, -1, w.shape[-1]) * root[:, None, None]).reshape(w.shape), *args)
    return shared, maps / root[:, None, None]


def _store(out: dict, roles: dict, part: str, augmented: torch.Tensor) -> None:
    """Split an augmented (rows, D) projection back into weight and (when the source has one) bias."""
    out[f"{part}.weight"] = augmented[:, :-1].to("cpu", roles[f"{part}.weight"].dtype).contiguous()
    if f"{part}.bias" in roles:
        out[f"{part}.bias"] = augmented[:, -1].to("cpu", roles[f"{part}.bias"].dtype).contiguous()
