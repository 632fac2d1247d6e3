"""The demo's estimate: its six stages costed by the same parts as the commands they run (convert's, eval's
and uptrain's, mha2gqa.estimates), in one process (torch starts once)."""

from __future__ import annotations

import importlib.util
import math

from mha2gqa import estimates
from mha2gqa.architecture.layouts import converted_config
from mha2gqa.estimates import EvalWork, Part, StageCost, UptrainWork, combined
from mha2gqa.estimates.stages import DEMO
from mha2gqa.files import embedded
from mha2gqa.uptrain.plan import config_size, peak_memory
from mha2gqa.uptrain.recipe import Recipe

HELDOUT_TOKENS = 131_217  # the embedded held-out novel (Persuasion) in the embedded tokenizer
CLOZE_EXAMPLES = 355  # persuasion_cloze, every passage
CONTEXT = 512  # the demo's windows: the model's whole context, not overlapping (pipeline._eval_kwargs)
UPTRAIN_TOKENS_PER_STEP = 8 * 512  # demo-uptrain.yaml: 8 blocks of 512 a step, an eval every 5 steps
EVAL_EVERY = 5


def _evaluation(name: str, params: int, reference: int | None, settings, speed_points: int) -> StageCost:
    """One of the demo's evaluations: the held-out novel in 512-token windows, the KV cache, the speed grid
    (side by side with the parent for a child), the cloze task when lm-eval is installed. The parent's comes
    first and pays each kind's fixed seconds; a child's runs warm in the same process."""
    tokens = min(settings.eval_tokens or HELDOUT_TOKENS, HELDOUT_TOKENS)
    windows = math.ceil(tokens / CONTEXT)
    cloze = settings.cloze_examples or CLOZE_EXAMPLES if importlib.util.find_spec("lm_eval") else None
    weights = 4 * (params + (reference or 0))
    work = EvalWork(params, reference, 4096, weights, {"held-out": (tokens, tokens - windows)}, speed_points, cloze)
    return combined(name, estimates.eval_stages(work, start=False, warm=reference is not None))


def demo_estimate(plan) -> estimates.Estimate:
    """The stages of a checked DemoPlan (pipeline.plan_demo) at the stored rates (estimates.for_this_machine
    scales them)."""
    settings, conversion = plan.settings, plan.conversion
    parent = conversion.parameters
    child = sum(math.prod(out.shape) for out in conversion.tensors.output_tensors())
    grid = 2 if settings.speed else 0  # the cpu preset: batches 1 and 4 at context 32
    train_tokens = int(settings.alpha * embedded.pretrain_tokens())
    steps = -(-train_tokens // UPTRAIN_TOKENS_PER_STEP)
    data = estimates.text_tokens([str(p) for p in embedded.train_paths()]) or 0
    uptrain = UptrainWork(
        child, None, 4 * child, steps * UPTRAIN_TOKENS_PER_STEP, 1 + -(-steps // EVAL_EVERY),
        settings.eval_blocks * CONTEXT, data_tokens=data,
    )  # fmt: skip
    stages = (
        StageCost(DEMO.start.name, (Part("torch_start", parent),)),
        combined(DEMO.convert.name, conversion.priced(start=False)),
        _evaluation(DEMO.evaluate_parent.name, parent, None, settings, grid),
        _evaluation(DEMO.evaluate_converted.name, child, parent, settings, 2 * grid),
        combined(DEMO.uptrain.name, estimates.uptrain_stages(uptrain, start=False, warm=True)),
        _evaluation(DEMO.evaluate_uptrained.name, child, parent, settings, 2 * grid),
        StageCost(DEMO.report.name, (Part("report", parent),)),
    )
    # its largest stage: uptraining (uptrain/plan.py's formula, as `uptrain --dry-run` says it)
    recipe = Recipe(seq_len=CONTEXT, micro_batch_size=UPTRAIN_TOKENS_PER_STEP // CONTEXT)
    peak = peak_memory(
        recipe, config_size(converted_config(conversion.config, conversion.options.groups), recipe), None
    )
    return estimates.Estimate(stages, estimates.STORED, peak.total)
