"""convert's check, run (convert/check.py plans it): the parent and the converted model scored on the first
tokens of every probe domain by eval's scorer (scoring/agreement.py: its windows, perplexity, top-1 agreement and
kl.py's KL, under eval's names), the parent's numbers read from check_cache.py when they are there and valid.

The check only ever adds to a conversion: run_check_or_skip is the one boundary around it, so whatever fails
inside (a tokenizer that cannot be read or gives ids beyond the vocabulary, a model transformers cannot build,
an unusable MHA2GQA_CACHE, the parent's own numbers not finite) becomes one warning and a recorded skip, and
the model is written whole as with --no-check (docs/guarantees.md).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from mha2gqa.convert import check_cache
from mha2gqa.convert.check import CheckPlan, verdict
from mha2gqa.corpus import textdata
from mha2gqa.corpus.probe import probe_paths
from mha2gqa.corpus.tokens import joined, stream_ids
from mha2gqa.errors import InputError, InputWarning, first_line
from mha2gqa.layouts import config_vocab, read_config
from mha2gqa.scoring.agreement import agreement_with_top, reference_top
from mha2gqa.scoring.perplexity import windows
from mha2gqa.units import counted

TOP_K = 512  # the parent's tokens kept per position in the cache: the KL is exact up to this vocabulary size
CHARS_PER_TOKEN = 16  # read this many characters a token of a domain's text at most (no tokenizer does worse)


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


@contextmanager
def _step(what: str) -> Iterator[None]:
    """Name the step a library's error came from (an InputError names its value already)."""
    try:
        yield
    except (InputError, CheckFailed):
        raise
    except Exception as err:
        raise CheckFailed(f"{what}: {_described(err)}") from err


def run_check(src: Path, dst: Path, plan: CheckPlan, progress: bool = True, parent_model=None) -> dict:
    """Score the parent (or read its cached numbers) and the converted model in `dst`; the record that
    mha2gqa.json keeps, the card shows and the command prints. `parent_model`: the parent as calibration
    loaded it (float32, on the CPU), scored as it is instead of loaded again."""
    from mha2gqa.progress import progress_bar

    started = time.perf_counter()
    device = plan.device  # prepare decided it (CheckPlan.device)
    dtype = torch.float32 if device == "cpu" else "auto"  # CPU matmuls in half precision are slow and inexact
    vocab = config_vocab(read_config(src))
    with _step("reading the probe texts with SRC's tokenizer"):
        ids = probe_ids(src, plan)
    expected = _expected(ids, plan.window, vocab)
    key = check_cache.fingerprint(src, f"k{TOP_K} w{plan.window} {device} {dtype}", ids)
    parent = check_cache.load(key, expected)
    cached = parent is not None
    bar = progress_bar(len(ids) * (1 if cached else 2), "check", progress, unit="domain")
    try:
        if parent is None:
            with _step("scoring SRC"):
                parent = _score_parent(src, ids, plan.window, dtype, device, parent_model, bar)
            _require_valid(parent, expected)
            check_cache.save(key, parent)
        with _step("scoring the converted model"):
            domains = _score_child(dst, ids, plan.window, dtype, device, parent, bar)
    finally:
        bar.close()  # before a skip's warning line, not under it
    found = verdict({name: row["ratio"] for name, row in domains.items()})
    retrieval = None
    if plan.retrieval:
        with _step("the retrieval probe"):
            retrieval = retrieval_section(src, dst, dtype, device, parent_model)
    return {
        "tokens_per_domain": plan.tokens,
        "window": plan.window,
        "top_k": expected.top_k,  # TOP_K, or the whole vocabulary when smaller: then the KL is the full one
        "device": device,
        "parent_cached": cached,
        "domains": domains,
        "verdict": found.kind,
        "verdict_line": found.line,
        "lossy": list(found.lossy),
        **({"retrieval": retrieval} if retrieval is not None else {}),
        "seconds": round(time.perf_counter() - started, 1),
    }


RETRIEVAL_SEED = 0  # eval's default --seed: the check asks eval's questions, so its recall is eval --retrieval's
_RETRIEVAL_KEYS = ("items", "recall", "reference_recall", "answer_probability_kept")


def retrieval_section(src: Path, dst: Path, dtype, device: str, parent_model=None) -> dict:
    """--check-retrieval: eval's retrieval probe at its defaults (scoring/retrieval*.py) on DST beside SRC, the
    same questions for both: recall overall and per context length, and SRC's answer probability kept."""
    from transformers import AutoTokenizer

    from mha2gqa.loading import load_causal_lm
    from mha2gqa.scoring.retrieval import answer_scores, summarize
    from mha2gqa.scoring.retrieval_items import build_items, probe_grid

    tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    grid = probe_grid(None, None, None, RETRIEVAL_SEED, read_config(src).get("max_position_embeddings"))
    items = build_items(tokenizer, grid)
    parent = parent_model or load_causal_lm(src, "SRC", progress=False, dtype=dtype)
    theirs = answer_scores(parent.to(device).eval(), items, device)
    del parent
    child = load_causal_lm(dst, "the converted model", progress=False, dtype=dtype).to(device).eval()
    found = summarize(grid, items, answer_scores(child, items, device), theirs)
    return {
        **{key: found[key] for key in _RETRIEVAL_KEYS},
        "lengths": [{"length": x["length"], **{key: x[key] for key in _RETRIEVAL_KEYS}} for x in found["lengths"]],
        "grid": found["grid"],
        "seed": found["seed"],
    }


def probe_ids(src: Path, plan: CheckPlan) -> dict[str, torch.Tensor]:
    """The first plan.tokens ids of each probe domain, tokenized as eval tokenizes a text (corpus/tokens.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    ids = {}
    for name, path in probe_paths().items():
        if name not in plan.domains:
            continue
        text = joined(textdata.iter_texts(textdata.resolve("--data", [path])))[: CHARS_PER_TOKEN * plan.tokens]
        ids[name] = stream_ids(text, tokenizer, plan.tokens)
    return ids


def _expected(ids: dict[str, torch.Tensor], window: int, vocab: int) -> check_cache.Expected:
    """What the parent's numbers on `ids` must look like; refuses ids a forward cannot take."""
    if vocab < 1:
        raise CheckFailed("SRC's config.json gives no vocab_size to check the tokenizer's ids against")
    for name, domain_ids in ids.items():
        if domain_ids.numel() < 2:
            raise CheckFailed(
                f"SRC's tokenizer gives {counted(domain_ids.numel(), 'token')} for the {name} text, fewer than 2"
            )
        low, high = int(domain_ids.min()), int(domain_ids.max())
        if low < 0 or high >= vocab:
            raise CheckFailed(
                f"SRC's tokenizer gives id {high if high >= vocab else low} on the {name} text, outside its "
                f"vocabulary of {vocab} tokens (config.json vocab_size): the tokenizer does not belong to the model"
            )
    return check_cache.Expected({name: _targets(t, window) for name, t in ids.items()}, vocab, min(TOP_K, vocab))


def _targets(ids: torch.Tensor, window: int) -> torch.Tensor:
    """The ids eval's windows of `window` tokens score, in order (the rows of the parent's numbers)."""
    return torch.cat([ids[w.end - w.scored : w.end] for w in windows(ids.numel(), window, window)])


def _require_valid(parent: dict[str, check_cache.ParentScores], expected: check_cache.Expected) -> None:
    for name, scores in parent.items():
        problem = check_cache.problem(name, scores, expected)
        if problem is not None:
            raise CheckFailed(f"SRC's own numbers cannot be compared with: {problem}")


def _score_parent(src, ids, window, dtype, device, parent_model, bar) -> dict[str, check_cache.ParentScores]:
    from mha2gqa.loading import load_causal_lm

    model = parent_model or load_causal_lm(src, "SRC", progress=False, dtype=dtype)
    model = model.to(device).eval()
    parent = {}
    for name, domain_ids in ids.items():
        result, top = reference_top(model, domain_ids, window, window, TOP_K)
        parent[name] = check_cache.ParentScores(
            result["nll_per_token"] * result["tokens_scored"], result["tokens_scored"], top
        )
        bar.update(1)
    return parent


def _score_child(dst, ids, window, dtype, device, parent, bar) -> dict[str, dict]:
    from mha2gqa.loading import load_causal_lm

    model = load_causal_lm(dst, "the converted model", progress=False, dtype=dtype).to(device).eval()
    domains = {}
    for name, domain_ids in ids.items():
        agreement, perplexity = agreement_with_top(model, domain_ids, window, window, parent[name].top)
        domains[name] = _row(perplexity, agreement, parent[name])
        bar.update(1)
    return domains


def _row(perplexity: dict, agreement: dict, parent: check_cache.ParentScores) -> dict:
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
