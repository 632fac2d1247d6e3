"""The check's scores (convert/check.py): the parent's computed once per parent and kept in a cache, the
converted model's against them.

The parent's numbers per domain are its summed NLL and, at every scored position, its TOP_K most likely
tokens with their log-probabilities: enough for the converted model's perplexity ratio, top-1 agreement and
KL without loading the parent again. The KL is the one between the two distributions coarsened to the
parent's top tokens and one bucket for the rest: a lower bound of the full KL(parent || model) (the
data-processing inequality), and within a few percent of it on the models measured (docs/convert.md).
The cache sits in mha2gqa.cache.cache_dir() (MHA2GQA_CACHE, else ~/.cache/mha2gqa), one safetensors
file per parent, keyed by the parent's fingerprint (its config, tokenizer and weight files' headers, sizes
and modification times) and the check's settings; never pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa import jsontext
from mha2gqa.cache import cache_dir, model_key, update_with_model
from mha2gqa.convert.check import CheckPlan
from mha2gqa.corpus import textdata
from mha2gqa.corpus.probe import probe_paths
from mha2gqa.errors import InputError
from mha2gqa.writing import write_atomic

TOP_K = 512
CHARS_PER_TOKEN = 16  # read this many characters a token of a domain's text at most (no tokenizer does worse)
CACHE_VERSION = 1  # bump when what the cache holds or how it is computed changes


@dataclass
class ParentScores:
    """One domain's parent numbers: summed NLL over `tokens` scored positions and its top tokens there."""

    nll: float
    tokens: int
    top_logp: torch.Tensor  # (tokens, TOP_K) float32, descending
    top_ids: torch.Tensor  # (tokens, TOP_K) int64


def probe_ids(tokenizer, plan: CheckPlan) -> dict[str, torch.Tensor]:
    """The first plan.tokens ids of each probe domain, tokenized as eval tokenizes a text."""
    ids = {}
    for name, path in probe_paths().items():
        if name not in plan.domains:
            continue
        text = "".join(textdata.iter_texts(textdata.resolve("--data", [path])))[: CHARS_PER_TOKEN * plan.tokens]
        tokens = tokenizer(text, add_special_tokens=True, return_attention_mask=False, verbose=False)["input_ids"]
        ids[name] = torch.tensor(tokens[: plan.tokens], dtype=torch.long)
    return ids


def window_log_probs(model, ids: torch.Tensor, window: int):
    """(log-probabilities (n, V) float32, targets (n,)) of every position of `ids` that predicts a next token
    inside its window; windows of `window` tokens, not overlapping."""
    device = next(model.parameters()).device
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start : start + window]
        if chunk.numel() < 2:
            break
        with torch.no_grad():
            logits = model(chunk[None].to(device)).logits[0, :-1]  # (w-1, V)
        yield logits.float().log_softmax(-1).cpu(), chunk[1:]


def score_parent(model, ids: torch.Tensor, window: int) -> ParentScores:
    nll, tokens, top_logp, top_ids = 0.0, 0, [], []
    for logp, targets in window_log_probs(model, ids, window):
        nll -= logp.gather(1, targets[:, None]).double().sum().item()
        tokens += targets.numel()
        values, indices = logp.topk(min(TOP_K, logp.shape[-1]), dim=-1)
        top_logp.append(values)
        top_ids.append(indices)
    return ParentScores(nll, tokens, torch.cat(top_logp), torch.cat(top_ids))


def score_child(model, ids: torch.Tensor, window: int, parent: ParentScores) -> dict:
    """The converted model's perplexity, its ratio to the parent's, top-1 agreement and coarsened KL."""
    nll, agree, kl, row = 0.0, 0, 0.0, 0
    for logq, targets in window_log_probs(model, ids, window):
        n = targets.numel()
        p_logp, p_ids = parent.top_logp[row : row + n].double(), parent.top_ids[row : row + n]
        row += n
        nll -= logq.gather(1, targets[:, None]).double().sum().item()
        agree += int((logq.argmax(-1) == p_ids[:, 0]).sum())
        kl += coarse_kl(p_logp, logq.gather(1, p_ids).double()).sum().item()
    scores = {
        "perplexity": _exp(nll / parent.tokens),
        "parent_perplexity": _exp(parent.nll / parent.tokens),
        "ratio": _exp((nll - parent.nll) / parent.tokens),
        "kl": kl / parent.tokens,
        "top1": agree / parent.tokens,
        "tokens": parent.tokens,
    }
    return {k: v if math.isfinite(v) else None for k, v in scores.items()}  # mha2gqa.json is strict JSON


def coarse_kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL per position between p and q coarsened to the same K tokens plus one bucket for the rest:
    p_logp, q_logp (n, K) float64 log-probabilities of those tokens under each."""
    p = p_logp.exp()
    head = (p * (p_logp - q_logp)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q_logp.exp().sum(-1)).clamp_min(1e-300)
    tail = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-300).log() - q_rest.log()), 0.0)
    return head + tail


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


# ---- the parent's cache ----


def fingerprint(src: Path, plan: CheckPlan, ids: dict[str, torch.Tensor], device: str, dtype: str) -> str:
    """What the parent's numbers depend on: its config, tokenizer files and weight files (header, size and
    modification time: a changed file gets new numbers), the ids scored and the check's settings."""
    digest = hashlib.sha256(f"v{CACHE_VERSION} k{TOP_K} w{plan.window} {device} {dtype}".encode())
    update_with_model(digest, src)
    for name, domain_ids in ids.items():
        digest.update(name.encode() + domain_ids.numpy().tobytes())
    return f"{model_key(src)}-{digest.hexdigest()}"  # the parent's own key first: check.parent_cached finds it


def load_cached(key: str) -> dict[str, ParentScores] | None:
    from safetensors import SafetensorError, safe_open

    path = cache_dir() / "check" / f"{key}.safetensors"
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["domains"])
            return {
                name: ParentScores(row["nll"], row["tokens"], f.get_tensor(f"{name}.logp"), f.get_tensor(f"{name}.ids"))
                for name, row in meta.items()
            }
    except (SafetensorError, OSError, KeyError, ValueError):  # a damaged cache file is recomputed, not trusted
        return None


def save_cached(key: str, scores: dict[str, ParentScores]) -> None:
    """Best effort: a cache that cannot be written costs the next check the parent's forward, nothing else."""
    from safetensors.torch import save

    tensors = {}
    for name, s in scores.items():
        tensors[f"{name}.logp"] = s.top_logp.contiguous()
        tensors[f"{name}.ids"] = s.top_ids.contiguous()
    meta = {name: {"nll": s.nll, "tokens": s.tokens} for name, s in scores.items()}
    folder = cache_dir() / "check"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / f"{key}.safetensors", save(tensors, metadata={"domains": jsontext.dumps(meta)}))
    except (OSError, InputError):
        pass


def run_check(src: Path, dst: Path, plan: CheckPlan, progress: bool = True, parent_model=None) -> dict:
    """Score the parent (or read its cached numbers) and the converted model in `dst`; the record that
    mha2gqa.json keeps, the card shows and the command prints. `parent_model`: the parent as calibration
    loaded it (float32, on the CPU), scored as it is instead of loaded again."""
    import time

    from transformers import AutoTokenizer

    from mha2gqa.convert.check import verdict
    from mha2gqa.loading import load_causal_lm
    from mha2gqa.progress import progress_bar

    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else "auto"  # CPU matmuls in half precision are slow and inexact
    ids = probe_ids(AutoTokenizer.from_pretrained(src, trust_remote_code=False), plan)
    key = fingerprint(src, plan, ids, device, str(dtype))
    parent = load_cached(key)
    cached = parent is not None
    bar = progress_bar(len(ids) * (1 if cached else 2), "check", progress, unit="domain")
    if parent is None:
        model = parent_model or load_causal_lm(src, "SRC", progress=False, dtype=dtype)
        model = model.to(device).eval()
        parent = {}
        for name, domain_ids in ids.items():
            parent[name] = score_parent(model, domain_ids, plan.window)
            bar.update(1)
        del model
        save_cached(key, parent)
    model = load_causal_lm(dst, "the converted model", progress=False, dtype=dtype).to(device).eval()
    domains = {}
    for name, domain_ids in ids.items():
        domains[name] = score_child(model, domain_ids, plan.window, parent[name])
        bar.update(1)
    bar.close()
    found = verdict({name: row["ratio"] for name, row in domains.items()})
    return {
        "tokens_per_domain": plan.tokens,
        "window": plan.window,
        "top_k": next(iter(parent.values())).top_logp.shape[-1],  # TOP_K, or the whole vocabulary when smaller
        "device": device,
        "parent_cached": cached,
        "domains": domains,
        "verdict": found.kind,
        "verdict_line": found.line,
        "lossy": list(found.lossy),
        "seconds": round(time.perf_counter() - started, 1),
    }
