"""Optional lm-evaluation-harness tasks (`pip install 'mha2gqa[lmeval]'`), folded into the result."""

from __future__ import annotations

import importlib.util

from mha2gqa.errors import InputError


def check_lm_eval_installed() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise InputError("--lm-eval-tasks needs lm-evaluation-harness: pip install 'mha2gqa[lmeval]'")


def run_lm_eval(model, tokenizer, tasks: list[str], limit: int | None = None, batch_size: int = 1) -> dict:
    """{task: {metric: value}} for the already loaded model (no second copy is loaded)."""
    check_lm_eval_installed()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = lm_eval.simple_evaluate(model=wrapped, tasks=list(tasks), limit=limit)
    # Keep numbers only: the raw output carries configs and samples that do not belong in a result.
    return {
        task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for task, metrics in out["results"].items()
    }
