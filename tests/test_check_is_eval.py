"""convert's check is an eval of the child against the parent: one scorer (scoring/agreement.py), one KL formula
(kl.py's), one set of names. A second formula in the package, or a check whose numbers are not eval's on the same
models and tokens, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import mha2gqa
from mha2gqa import convert

PACKAGE = Path(mha2gqa.__file__).parent
# The shapes a KL between two distributions is written in: sum p * (log p - log q) (with p an .exp() or a name),
# its dot-product form, or torch's own kl_div.
KL_FORMULA = re.compile(
    r"\.exp\(\)\s*\*\s*\(|\*\s*\(\s*[\w.]+\s*-\s*[\w.\[\]():, ]+\)\s*\)\s*\.sum\(|vecdot\(|\bkl_div\(|F\.kl_div"
)


def _formulas(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if KL_FORMULA.search(line)]


def test_the_package_writes_the_kl_once_in_kl_py():
    assert _formulas(PACKAGE / "scoring" / "kl.py")  # the pattern finds the one formula where it is
    elsewhere = {
        str(path.relative_to(PACKAGE)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "kl.py" and (found := _formulas(path))
    }
    assert elsewhere == {}, "a KL formula outside mha2gqa/scoring/kl.py: call kl.kl_divergence instead"


def test_the_old_coarse_formula_would_be_found():
    """The shape check_scores.py's second KL had before it was removed (2026-12-06)."""
    old = "    head = (p * (p_logp - q_logp)).sum(-1)\n"
    assert KL_FORMULA.search(old)


def test_the_checks_numbers_are_evals_on_the_same_models_and_tokens(tmp_path, monkeypatch):
    """A tiny parent whose whole vocabulary (128) is within the check's top tokens: the check's KL, top-1 and
    perplexities are eval's agreement() on the same windows of the same probe ids."""
    from tiny_models import make_tiny_tokenizer, save_tiny_model
    from transformers import AutoTokenizer

    from mha2gqa.convert.check_run import eval_options
    from mha2gqa.eval.run import read_texts
    from mha2gqa.files.loading import load_causal_lm
    from mha2gqa.scoring.agreement import agreement

    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_tiny_model(src, "llama", max_position_embeddings=64)
    make_tiny_tokenizer(src)
    result = convert(src, dst, 1, method="random", progress=False)  # far from its parent: KL well above 0
    plan, record = result.plan.check, result.check
    assert record["top_k"] == 128 and set(record["domains"]) == set(plan.domains)
    parent, child = load_causal_lm(src, progress=False), load_causal_lm(dst, progress=False)
    probe = read_texts(eval_options(plan, None, False), AutoTokenizer.from_pretrained(src))  # SRC's tokenizer
    assert set(probe) == set(plan.domains) and all(t.ids.numel() == plan.tokens for t in probe.values())
    for name, text in probe.items():
        agreed, ppl, parent_ppl = agreement(child, parent, text.ids, plan.window, plan.window)
        row = record["domains"][name]
        assert row["kl_mean"] > 1e-4  # a random tiny model's logits are near uniform: small, not zero
        # the same formula on the same float32 log-probabilities, summed in another order: within rounding
        assert row["kl_mean"] == pytest.approx(agreed["kl_mean"], rel=1e-4)
        assert row["top1_agreement"] == agreed["top1_agreement"] and row["tokens"] == agreed["tokens"]
        assert row["perplexity"] == pytest.approx(ppl["perplexity"], rel=1e-6)
        assert row["parent_perplexity"] == pytest.approx(parent_ppl["perplexity"], rel=1e-6)


def test_the_check_is_one_evaluate_call_on_the_probe_with_the_parent_known_by_its_top_tokens(tmp_path, monkeypatch):
    """convert's check runs nothing of its own: one evaluate of DST, the probe domains as its data (the plan's
    tokens, window and device), SRC as a reference known by its top tokens; a calibrated conversion's parent, in
    memory already, is scored as it is, never loaded again (one load of SRC, one of DST, in the whole run)."""
    from tiny_models import make_tiny_tokenizer, save_tiny_model

    import mha2gqa.eval as E
    from mha2gqa.corpus.probe import probe_paths
    from mha2gqa.eval.reference_tops import TopReference
    from mha2gqa.files import loading

    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_tiny_model(src, "llama", max_position_embeddings=64)
    make_tiny_tokenizer(src)
    calls, loads = [], []
    evaluate, load = E.evaluate, loading.load_causal_lm
    monkeypatch.setattr(E, "evaluate", lambda *a, **k: calls.append((a, k)) or evaluate(*a, **k))
    monkeypatch.setattr(loading, "load_causal_lm", lambda path, *a, **k: loads.append(path) or load(path, *a, **k))
    result = convert(src, dst, 2, method="calibrated", progress=False)
    plan, record = result.plan.check, result.check
    ((args, kwargs),) = calls
    o = kwargs["options"]
    assert isinstance(o.reference, TopReference) and o.reference.name == "SRC" and o.reference.path == src
    assert o.reference.model is not None  # calibration's parent
    assert o.domains == probe_paths() and o.max_tokens == plan.tokens and o.context == o.stride == plan.window
    assert o.device == plan.device == record["device"] and o.speed is None and not o.kv_cache and o.out is None
    assert not o.retrieval and "retrieval" not in record and record["parent_cached"] is False
    assert sorted(Path(p).name for p in loads) == sorted([src.name, Path(args[0]).name])
    rows = record["domains"].values()  # 512 tokens in 8 windows of 64 side by side, 63 scored each
    assert set(record["domains"]) == set(plan.domains) and all(r["tokens"] == 504 for r in rows)


# "check" names one thing: convert's quality check of the child against the parent. Input validation is
# validate_*, a live condition ensure_*, refine's held-out measurements heldout_* (issue 54, item 6).
QUALITY_CHECK_NAMES = {
    "CheckPlan", "plan_check", "_plan_check", "check_logits_bytes", "CheckFailed", "run_check_or_skip", "run_check",
    "_kept_for_check", "_check", "check_parts", "check_report", "check_verdict", "check_line", "quality_check",
}  # fmt: skip
DEFINED = re.compile(r"^\s*(?:def|class)\s+(\w+)", re.M)


def _check_names(text: str) -> set[str]:
    return {n for n in DEFINED.findall(text) if "check" in n.lower() and "checkpoint" not in n.lower()}


def test_check_in_a_package_name_means_the_quality_check():
    found = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in _check_names(path.read_text())
        if name not in QUALITY_CHECK_NAMES
    }
    assert found == set(), "name input validation validate_* (the word check is the quality check's)"


def test_an_input_validator_named_check_would_be_found():
    assert _check_names(
        "def check_groups(shape, groups):\n    def _check_kv(o): ...\nclass SafetensorsCheckpoint:"
    ) == {
        "check_groups",
        "_check_kv",
    }
