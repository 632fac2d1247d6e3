"""convert's check, run (convert/check.py plans it): one `evaluate` of the converted model against the parent on
the first tokens of every probe domain (the probe as eval's --data, eval's windows, perplexity, top-1 agreement and
kl.py's KL under eval's names, and with --check-retrieval eval's retrieval probe), the parent given as a reference
known by its top tokens (eval/reference_tops.py): its numbers read from check_cache.py when they are there and
valid, else scored by eval once and kept there.

The check only ever adds to a conversion: run_check_or_skip is the one boundary around it, so whatever fails
inside (a tokenizer that cannot be read or gives ids beyond the vocabulary, a model transformers cannot build,
an unusable MHA2GQA_CACHE, the parent's own numbers not finite) becomes one warning and a recorded skip, and
the model is written whole as with --no-check (docs/guarantees.md).
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import torch

from mha2gqa.convert import check_cache
from mha2gqa.convert.check import CheckPlan, verdict
from mha2gqa.corpus.probe import probe_paths
from mha2gqa.eval.reference_tops import DomainTops, TopReference
from mha2gqa.runtime.errors import InputError, InputWarning, first_line
from mha2gqa.scoring.perplexity import windows

TOP_K = 512  # the parent's tokens kept per position in the cache: the KL is exact up to this vocabulary size
RETRIEVAL_SEED = 0  # eval's default --seed: the check asks eval's questions, so its recall is eval --retrieval's
_RETRIEVAL_KEYS = ("items", "recall", "reference_recall", "answer_probability_kept")


class CheckFailed(Exception):
    """Something inside the check failed: its message is the reason the skip records."""


def run_check_or_skip(src: Path, dst: Path, plan: CheckPlan, progress: bool = True, parent_model=None) -> dict:
    """run_check's record, or {"skipped": why} when anything in it fails: the conversion is written either way."""
    try:
        return run_check(src, dst, plan, progress, parent_model)
    except Exception as err:  # the boundary: no fault inside the check may cost the conversion it checks
        reason = str(err) if isinstance(err, (InputError, CheckFailed)) else _described(err)
        warnings.warn(f"the check could not run: {reason}", InputWarning, stacklevel=2)
        return {"skipped": f"it could not run: {reason}"}


def _described(err: BaseException) -> str:
    return f"{type(err).__name__}: {first_line(err, 300, default='no message')}"


def run_check(src: Path, dst: Path, plan: CheckPlan, progress: bool = True, parent_model=None) -> dict:
    """Evaluate the converted model in `dst` against the parent (its numbers cached, or scored by eval); the record
    that mha2gqa.json keeps, the card shows and the command prints. `parent_model`: the parent as calibration
    loaded it (float32, on the CPU), scored as it is instead of loaded again."""
    from mha2gqa.eval import evaluate

    started = time.perf_counter()
    device = plan.device  # prepare decided it (CheckPlan.device)
    dtype = torch.float32 if device == "cpu" else "auto"  # CPU matmuls in half precision are slow and inexact
    parent = CachedParent(src, f"k{TOP_K} w{plan.window} {device} {dtype}", parent_model)
    try:
        result = evaluate(dst, options=eval_options(plan, parent, progress))
    except (InputError, CheckFailed):  # each names its value already
        raise
    except Exception as err:
        raise CheckFailed(f"the eval of DST against SRC: {_described(err)}") from err
    domains = {
        name: _row(d["perplexity"], d["agreement"], parent.numbers[name]) for name, d in result["domains"].items()
    }
    found = verdict({name: row["ratio"] for name, row in domains.items()})
    return {
        "tokens_per_domain": plan.tokens,
        "window": plan.window,
        "top_k": parent.expected.top_k,  # TOP_K, or the whole vocabulary when smaller: then the KL is the full one
        "device": device,
        "parent_cached": parent.cached,
        "domains": domains,
        "verdict": found.kind,
        "verdict_line": found.line,
        "lossy": list(found.lossy),
        **({"retrieval": _retrieval(result["retrieval"])} if plan.retrieval else {}),
        "seconds": round(time.perf_counter() - started, 1),
    }


def eval_options(plan: CheckPlan, parent: TopReference, progress: bool):
    """What the check asks eval: the probe domains' first plan.tokens tokens as --data, read with SRC's tokenizer
    (the reference's), in windows of plan.window side by side, one at a time, on the plan's device; the retrieval
    probe at eval's defaults when planned; no decode speed, no KV cache measurement, nothing written."""
    from mha2gqa.eval.options import EvalOptions

    return EvalOptions(
        data={name: path for name, path in probe_paths().items() if name in plan.domains},
        reference=parent,
        max_tokens=plan.tokens,
        context=plan.window,
        stride=plan.window,
        batch_size=1,
        dtype="float32" if plan.device == "cpu" else "auto",
        device=plan.device,
        speed_preset=None,
        kv_cache=False,
        retrieval=plan.retrieval,
        seed=RETRIEVAL_SEED,
        label="DST",
        progress=progress,
    )


class CachedParent(TopReference):
    """SRC as the check's reference: its numbers from check_cache.py when there and valid, else scored by eval, held
    to the same rules (check_cache.problem) and kept."""

    def __init__(self, src: Path, settings: str, model=None):
        super().__init__(src, TOP_K, model, "SRC")
        self.settings = settings  # the cache key's: the check's window, device and dtype
        self.numbers: dict[str, DomainTops] = {}
        self.cached = False
        self.expected: check_cache.Expected | None = None
        self.key = ""

    def known(self, ids: dict[str, torch.Tensor], context: int, stride: int, vocab: int) -> dict | None:
        targets = {name: _targets(t, context, stride) for name, t in ids.items()}
        self.expected = check_cache.Expected(targets, vocab, min(self.top_k, vocab))
        self.key = check_cache.fingerprint(self.path, self.settings, ids)
        found = check_cache.load(self.key, self.expected)
        self.cached = found is not None
        self.numbers = found or {}
        return found

    def scored(self, numbers: dict[str, DomainTops]) -> None:
        for name, scores in numbers.items():
            problem = check_cache.problem(name, scores, self.expected)
            if problem is not None:
                raise CheckFailed(f"SRC's own numbers cannot be compared with: {problem}")
        check_cache.save(self.key, numbers)
        self.numbers = numbers


def _targets(ids: torch.Tensor, context: int, stride: int) -> torch.Tensor:
    """The ids eval's windows score, in order (the rows of the parent's numbers)."""
    return torch.cat([ids[w.end - w.scored : w.end] for w in windows(ids.numel(), context, stride)])


def _retrieval(found: dict) -> dict:
    """eval's retrieval section, as much of it as the check records: recall overall and per context length, SRC's
    beside it, SRC's answer probability kept, and the questions' grid and seed."""
    return {
        **{key: found[key] for key in _RETRIEVAL_KEYS},
        "lengths": [{"length": x["length"], **{key: x[key] for key in _RETRIEVAL_KEYS}} for x in found["lengths"]],
        "grid": found["grid"],
        "seed": found["seed"],
    }


def _row(perplexity: dict, agreement: dict, parent: DomainTops) -> dict:
    """One domain's numbers under eval's names, with the perplexity ratio the verdict reads."""
    nll = perplexity["nll_per_token"] * perplexity["tokens_scored"]
    row = {
        "perplexity": _exp(nll / parent.tokens),
        "parent_perplexity": _exp(parent.nll / parent.tokens),
        "ratio": _exp((nll - parent.nll) / parent.tokens),
        "kl_mean": agreement["kl_mean"],
        "top1_agreement": agreement["top1_agreement"],
        "tokens": parent.tokens,
    }
    return {k: v if math.isfinite(v) else None for k, v in row.items()}  # mha2gqa.json is strict JSON


def _exp(x: float) -> float:
    return float("inf") if x > 709 else math.exp(x)  # math.exp raises past 709.78; NaN stays NaN
