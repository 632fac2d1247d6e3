"""The parent's numbers of convert's check (check_run.py), kept per parent so that a second conversion of it scores
only the converted model: its summed loss and top tokens per probe domain (eval/reference_tops.py's DomainTops,
what eval compares the converted model with in their place).

One safetensors file per parent and settings in mha2gqa.files.cache.cache_dir() / "check", named by the parent's model
key first (check.parent_cached finds it) and keyed by the parent's fingerprint (config, tokenizer, weight files'
headers, sizes, times and bytes), the ids scored and the check's settings; never pickle. A file is read only
after its content is checked against what this check would compute (domains, row counts, id range, finite
log-probabilities that sum to one, numbers of the right type): one that fails is scored again and replaced, so a
damaged cache costs time, never a wrong number or a verdict on the model.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.eval.reference_tops import DomainTops
from mha2gqa.files import jsontext
from mha2gqa.files.cache import cache_dir, model_digest
from mha2gqa.files.writing import write_atomic
from mha2gqa.runtime.errors import InputError
from mha2gqa.scoring.agreement import TopTokens

CACHE_VERSION = 2  # bump when what the cache holds or how it is computed changes (2: eval's scorer, sampled bytes)
SUM_TOLERANCE = 1e-3  # a row's probabilities (its top tokens and the rest) sum to 1 within this


@dataclass(frozen=True)
class Expected:
    """What a valid entry holds: per domain the targets of its scored positions, and the vocabulary its ids index."""

    targets: dict[str, torch.Tensor]  # (tokens,) int64 per domain: the ids the scored positions predict
    vocab: int
    top_k: int


def fingerprint(src: Path, settings: str, ids: dict[str, torch.Tensor]) -> str:
    """The cache key of a parent's numbers on `ids` under `settings` (the check's version, window, device,
    dtype): the parent's model key first, then a digest of everything the numbers depend on."""
    model = model_digest(src)  # read once: the key's prefix is its first 16 digits, check.parent_cached's model_key
    digest = hashlib.sha256(f"v{CACHE_VERSION} {settings} {model}".encode())
    for name, domain_ids in ids.items():
        digest.update(name.encode() + domain_ids.numpy().tobytes())
    return f"{model[:16]}-{digest.hexdigest()}"


def path_of(key: str) -> Path:
    return cache_dir() / "check" / f"{key}.safetensors"


def load(key: str, expected: Expected) -> dict[str, DomainTops] | None:
    """The cached numbers when present and valid, else None (scored again)."""
    from safetensors import SafetensorError, safe_open

    path = path_of(key)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("domains", "null"))
            if not isinstance(meta, dict) or set(meta) != set(expected.targets):
                return None
            scores = {
                name: _entry(row, f.get_tensor(f"{name}.ids"), f.get_tensor(f"{name}.coarse"))
                for name, row in meta.items()
            }
    except (SafetensorError, OSError, KeyError, ValueError, TypeError):  # damaged: scored again, not trusted
        return None
    return scores if all(problem(name, s, expected) is None for name, s in scores.items()) else None


def _entry(row, ids: torch.Tensor, coarse: torch.Tensor) -> DomainTops:
    if not isinstance(row, dict):
        raise TypeError("a domain's numbers are not an object")
    return DomainTops(row.get("nll"), row.get("tokens"), TopTokens(ids, coarse))


def problem(name: str, scores: DomainTops, expected: Expected) -> str | None:
    """What is wrong with one domain's numbers, or None: the same rules for a cache entry and for a fresh one."""
    return _form_problem(name, scores, expected) or _value_problem(name, scores, expected.targets[name])


def _form_problem(name: str, scores: DomainTops, expected: Expected) -> str | None:
    nll, tokens, ids, coarse = scores.nll, scores.tokens, scores.top.ids, scores.top.coarse
    rows = expected.targets[name].numel()
    if not _finite_number(nll) or nll < 0:
        return f"its summed loss on {name} is {nll!r}, not a finite number"
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens != rows:
        return f"it scored {tokens!r} tokens of {name}, not {rows}"
    width = expected.top_k + (expected.top_k < expected.vocab)
    if ids.dtype != torch.int64 or ids.shape != (rows, expected.top_k) or coarse.shape != (rows, width):
        return f"its top tokens on {name} have the wrong shape or type"
    if rows and (int(ids.min()) < 0 or int(ids.max()) >= expected.vocab):
        return f"its top tokens on {name} are not ids of a {expected.vocab}-token vocabulary"
    if coarse.dtype != torch.float32 or not torch.isfinite(coarse).all():
        return f"its log-probabilities on {name} are not finite float32"
    return None


def _value_problem(name: str, scores: DomainTops, targets: torch.Tensor) -> str | None:
    """The numbers agree with each other: each row's probabilities sum to 1, most likely first, and the summed loss
    is what the top tokens give the targets (exactly where every target is among them, at least otherwise: a
    target outside them is no likelier than the last of them or the rest)."""
    ids, coarse, k = scores.top.ids, scores.top.coarse.double(), scores.top.ids.shape[-1]
    if not targets.numel():
        return None
    if coarse.logsumexp(-1).abs().max() > SUM_TOLERANCE or (coarse[:, 1:k] > coarse[:, : k - 1]).any():
        return f"its probabilities on {name} do not sum to 1 in order, most likely first"
    hit = ids == targets[:, None]  # (tokens, k)
    bound = coarse[:, k - 1] if coarse.shape[-1] == k else coarse[:, k - 1].minimum(coarse[:, k])
    loss = torch.where(hit.any(-1), -(coarse[:, :k] * hit).sum(-1), -bound).sum().item()
    tolerance = SUM_TOLERANCE * max(1.0, loss)
    if scores.nll < loss - tolerance or (hit.any(-1).all() and scores.nll > loss + tolerance):
        return f"its summed loss on {name} ({scores.nll:.6g}) does not match its log-probabilities ({loss:.6g})"
    return None


def _finite_number(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


def save(key: str, scores: dict[str, DomainTops]) -> None:
    """Best effort: a cache that cannot be written costs the next check the parent's forward, nothing else."""
    from safetensors.torch import save as to_bytes

    tensors = {}
    for name, s in scores.items():
        tensors[f"{name}.ids"] = s.top.ids.contiguous()
        tensors[f"{name}.coarse"] = s.top.coarse.contiguous()
    meta = {name: {"nll": s.nll, "tokens": s.tokens} for name, s in scores.items()}
    try:
        path = path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, to_bytes(tensors, metadata={"domains": jsontext.dumps(meta)}))
    except (OSError, InputError):
        pass
