"""Which kv heads share a group: contiguous (transformers' order), or chosen by calibrated similarity.

Similarity: for every pair of source kv heads, the fraction of their key and value energy (on the
calibration data) that the calibrated merge would lose by merging just those two (keys RoPE-aware,
values by subspace); heads are then partitioned into groups of r with a small total of pairwise
costs (greedy, then improving swaps). The chosen order is applied by permuting kv heads and, with
each kv head, the query heads it serves and their o_proj columns: an exact reparameterisation, after
which the chosen groups are contiguous and the ordinary merge applies.
"""

from __future__ import annotations

import torch

from mha2gqa.convert.calibrated import augment, projection_gram, rotary_hermitian
from mha2gqa.convert.roles import KV_ROLES

_PAIR_CHUNK = 256  # pairs per batched eigen decomposition: bounds memory at (chunk, 2p, 2p)


def pair_costs(roles: dict, gram: torch.Tensor, kv_heads: int, head_dim: int, rot: int) -> torch.Tensor:
    """(n, n) float64, zero diagonal: relative loss of merging each pair of kv heads (keys + values)."""
    keys = augment(roles["k.weight"], roles.get("k.bias"), gram.device)  # (n*hd, D)
    values = augment(roles["v.weight"], roles.get("v.bias"), gram.device)
    pg_k = projection_gram(keys, gram).reshape(kv_heads, head_dim, kv_heads, head_dim)
    pg_v = projection_gram(values, gram).reshape(kv_heads, head_dim, kv_heads, head_dim)
    lost_rot, total_rot = _rotary_pair_loss(pg_k[:, :rot, :, :rot])
    lost_pass, total_pass = _subspace_pair_loss(pg_k[:, rot:, :, rot:])
    lost_v, total_v = _subspace_pair_loss(pg_v)
    return (_ratio(lost_rot + lost_pass, total_rot + total_pass) + _ratio(lost_v, total_v)).cpu()


def _ratio(lost: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    return torch.where(total > 0, lost / total.clamp_min(1e-300), torch.zeros_like(lost))


def _rotary_pair_loss(pg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pg (n, rot, n, rot) -> lost, total (n, n): per frequency, the smaller eigenvalue of the 2x2
    Hermitian [[H_aa, H_ab], [H_ba, H_bb]], summed over frequencies."""
    n = pg.shape[0]
    if pg.shape[1] == 0:
        return pg.new_zeros(n, n), pg.new_zeros(n, n)
    herm = rotary_hermitian(pg)  # (rot/2, n, n)
    diag = herm.diagonal(dim1=-2, dim2=-1).real  # (rot/2, n)
    a, b = diag[:, :, None], diag[:, None, :]
    total = a + b
    smaller = (total - torch.sqrt((a - b) ** 2 + 4 * herm.abs() ** 2)) / 2
    return smaller.clamp_min(0).sum(0), total.sum(0)


def _subspace_pair_loss(pg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pg (n, p, n, p) -> lost, total (n, n): the energy outside the top-p subspace of each pair."""
    n, p = pg.shape[0], pg.shape[1]
    lost, total = pg.new_zeros(n, n), pg.new_zeros(n, n)
    if p == 0:
        return lost, total
    a_idx, b_idx = torch.triu_indices(n, n, offset=1, device=pg.device)
    for start in range(0, len(a_idx), _PAIR_CHUNK):
        a, b = a_idx[start : start + _PAIR_CHUNK], b_idx[start : start + _PAIR_CHUNK]
        top = torch.cat([pg[a, :, a], pg[a, :, b]], dim=-1)  # (P, p, 2p)
        bottom = torch.cat([pg[b, :, a], pg[b, :, b]], dim=-1)
        values = torch.linalg.eigvalsh(torch.cat([top, bottom], dim=-2))  # (P, 2p) ascending
        lost[a, b] = lost[b, a] = values[:, :p].clamp_min(0).sum(-1)
        total[a, b] = total[b, a] = values.sum(-1)
    return lost, total


def partition(costs: torch.Tensor, groups: int, max_sweeps: int = 100) -> list[list[int]]:
    """Split heads 0..n-1 into `groups` groups of equal size with a small sum of within-group costs."""
    n = costs.shape[0]
    size = n // groups
    remaining, chosen = list(range(n)), []
    while remaining:  # greedy: grow each group from the first free head by its cheapest companions
        group = [remaining.pop(0)]
        while len(group) < size:
            best = min(remaining, key=lambda h: float(costs[h, group].sum()))
            remaining.remove(best)
            group.append(best)
        chosen.append(group)
    for _ in range(max_sweeps):  # then the best improving swap between two groups, until none improves
        best_gain, best_swap = 1e-12, None
        for ga, group_a in enumerate(chosen):
            for gb in range(ga + 1, len(chosen)):
                group_b = chosen[gb]
                for ia, a in enumerate(group_a):
                    rest_a = [h for h in group_a if h != a]
                    for ib, b in enumerate(group_b):
                        rest_b = [h for h in group_b if h != b]
                        gain = float(
                            costs[a, rest_a].sum()
                            + costs[b, rest_b].sum()
                            - costs[b, rest_a].sum()
                            - costs[a, rest_b].sum()
                        )
                        if gain > best_gain:
                            best_gain, best_swap = gain, (ga, ia, gb, ib)
        if best_swap is None:
            break
        ga, ia, gb, ib = best_swap
        chosen[ga][ia], chosen[gb][ib] = chosen[gb][ib], chosen[ga][ia]
    return sorted(sorted(group) for group in chosen)


def similarity_order(roles: dict, gram: torch.Tensor, kv_heads: int, groups: int, head_dim: int, rot: int) -> list[int]:
    """The source kv heads in their new order: group g is new heads [g*r, (g+1)*r)."""
    costs = pair_costs(roles, gram, kv_heads, head_dim, rot)
    return [head for group in partition(costs, groups) for head in group]


def permute_heads(roles: dict, order: list[int], kv_heads: int, head_dim: int) -> dict:
    """New kv head p is source kv head order[p]; each moves with the query heads it serves (their
    q_proj rows and o_proj columns): the model computes exactly the same function."""
    kv_index = torch.tensor(order)
    out = dict(roles)
    for role in KV_ROLES:
        if role in roles:
            out[role] = _take_heads(roles[role], kv_index, head_dim, dim=0)
    per_kv = roles["q.weight"].shape[0] // head_dim // kv_heads
    q_index = (kv_index[:, None] * per_kv + torch.arange(per_kv)).flatten()  # (H,)
    for role in ("q.weight", "q.bias"):
        if role in roles:
            out[role] = _take_heads(roles[role], q_index, head_dim, dim=0)
    out["o.weight"] = _take_heads(roles["o.weight"], q_index, head_dim, dim=1)
    return out


def _take_heads(tensor: torch.Tensor, index: torch.Tensor, head_dim: int, dim: int) -> torch.Tensor:
    """Reorder the head_dim-sized blocks of `dim` by `index`."""
    blocks = tensor.unflatten(dim, (-1, head_dim))  # dim splits into (heads, hd)
    return blocks.index_select(dim, index).flatten(dim, dim + 1)
