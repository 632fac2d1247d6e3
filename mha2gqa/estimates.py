"""How long a run will take, said before it starts: `convert --dry-run`, the start of `sweep` and of `demo`.

A calibrated convert of SmolLM2 showed an ETA of 1 h 49 min only once it had started, and the full demo
took 68 min with no word before. Each estimate is work (tokens x parameters, per stage) times a rate from
RATES, so it reads without torch and without running anything.

The rates come from two models on the 2-core development machine. The embedded model (6.2 M parameters)
was timed for this table, each phase at two sizes and the difference taken (start-up cancels), one phase
at a time, at load average 3-7 (other jobs beside it), with the torch threads the commands use (one for
eval and uptrain of a small model on a busy machine, mha2gqa/threads.py; torch's default for convert). SmolLM2-135M's are the quiet-machine timings of
docs/refine.md (calibration 5 min 1 s for 131,072 tokens, layer-wise refine 6 min 18 s, global stage
+555 s). Per parameter, the larger model is 4-10x cheaper (big matrices, less Python per FLOP; and its
machine was quiet): between and beyond the two the rate is interpolated on log(parameters), so a model
far larger than 135 M parameters gets the larger one's rate. Load can make a run 5x slower (issue 30's
ETA of 1 h 49 min for the SmolLM2 calibration was at load 4-13); a GPU is far faster.
"""

from __future__ import annotations

import math

SMALL, LARGE = 6_163_712, 134_515_008  # the embedded model's parameters and SmolLM2-135M's
# Seconds per token per parameter (refine_step: per attention parameter of one layer), on CPU, as
# (at SMALL, at LARGE); None where only the embedded model was timed.
RATES = {
    # embedded: calibrate() of 8,192 vs 40,960 tokens, 16.5 s vs 31.5 s, load 5.1-6.0; SmolLM2: 301 s / 131,072
    "calibrate": (7.5e-11, 1.7e-11),
    # evaluate() perplexity, 512-token windows, batch 8, of 8,192 vs 40,960 tokens, one torch thread (what eval
    # and demo use for a model under 1 GiB): 14.1 s vs 19.9 s, load 3.6-4.9 (two threads at load 5.7-6.3: 3.5x slower)
    "eval": (2.9e-11, None),
    # the same with --reference (KL, top-1 and the reference's perplexity): 9.4 s vs 39.5 s
    "eval_with_reference": (1.5e-10, None),
    # uptrain, the demo recipe (8 x 512 tokens a step, AdamW, every parameter), 2 vs 8 steps, one thread:
    # 35.5 s vs 58.1 s, load 4.8-5.8 (two threads at load 6.1-6.9: 53.9 s vs 99.1 s)
    "train": (1.5e-10, None),
    # --refine-steps 10 vs 50 (global 0), 16,384 calibration tokens: 139.9 s vs 244.5 s, load 6.3-6.7; per Adam
    # step of batch_blocks x seq_len tokens through one layer's attention. SmolLM2: 57% of its 378 s (the
    # embedded model's share of steps)
    "refine_step": (8.2e-10, 7.9e-11),
    # --refine's targets, solves and held-out checks, per refine token: the rest of those 139.9 s (less the
    # calibration pass); SmolLM2: the other 43% of 378 s over its 36,864 refine tokens
    "refine_pass": (8.9e-10, 3.3e-11),
    # --calibration parent, per sampled token (a forward of one token through the KV cache, batch 16, one torch
    # thread): embedded 1,024 vs 4,096 tokens in sequences of 512, 12.6 s vs 37.4 s, load 4.5-4.8; SmolLM2 2,048
    # tokens (sequences of 128) in 80 s at load 5: 0.039 s a token
    "sample": (1.3e-9, 2.9e-10),
    # --refine-global-steps, per token of a step's batch (a forward of the parent, a forward and backward of
    # the converted model, and the held-out checks): embedded --refine-steps 10 with 24 global steps vs 0,
    # 188.8 s vs 139.9 s, load 4.8-5.9 (an early stop may have cut steps: an overestimate); SmolLM2: 555 s / 24
    "refine_global": (1.6e-10, 8.4e-11),
}
# Seconds that do not grow with the work, measured the same way.
FIXED_S = {
    "torch_start": 15,  # importing torch and transformers and loading a small model, load 5-7
    "uptrain_start": 28,  # the demo recipe's 2-step run less its 2 steps (data, model, final save), one thread
    "speed_grid": 24,  # eval --speed cpu (batches 1,4 x context 32, 16 new tokens, repeats >= 1 s)
    "cloze_start": 10,  # lm-eval's task index and its run, one thread, load 2.8-3.4
}
# persuasion_cloze, --lm-eval-limit 10 vs 50, one thread: 10.5 s either way (load 2.8-3.4): too small to time
CLOZE_S_PER_EXAMPLE = 0.01
HELDOUT_TOKENS = 131_217  # the embedded held-out novel (Persuasion) in the embedded tokenizer
CAVEAT = "CPU rates of mha2gqa/estimates.py, measured at load 3-7 on 2 cores"


def duration(seconds: float) -> str:
    """'about 40 s', 'about 3 min', 'about 1 h 50 min': rounded as far as an estimate deserves."""
    if seconds < 60:
        return f"about {max(5, round(seconds / 5) * 5)} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"about {minutes} min"
    hours, rest = divmod(round(seconds / 600) * 10, 60)
    return f"about {hours} h" + (f" {rest} min" if rest else "")


def rate(name: str, parameters: int) -> float:
    """RATES[name] for a model of `parameters`: interpolated between the two timed models on log(parameters),
    the nearer one's outside them."""
    small, large = RATES[name]
    if large is None:
        return small
    where = min(1.0, max(0.0, math.log(parameters / SMALL) / math.log(LARGE / SMALL)))
    return small * (large / small) ** where


def attention_parameters(shape) -> int:
    """q, k, v and o of one layer of the source (an AttentionShape)."""
    q = shape.hidden * shape.heads * shape.head_dim
    return 2 * q + 2 * shape.hidden * shape.kv_heads * shape.head_dim


def calibration_seconds(tokens: int, parameters: int, passes: int = 1) -> float:
    return tokens * parameters * rate("calibrate", parameters) * passes


def convert_seconds(plan, start: bool = True, calibration: bool = True) -> float:
    """The CPU time of a ConversionPlan's stages (convert/prepare.py): with the process' start-up, and with
    its calibration pass when it gathers statistics (a sweep runs both once for every candidate)."""
    shape, options = plan.shape, plan.options
    parameters = sum(math.prod(info.shape) for info in plan.checkpoint.tensors.values())
    seconds = plan.bytes_written / 200e6
    check = getattr(plan, "check", None)
    checked = check is not None and check.skip is None
    if start:
        seconds += FIXED_S["torch_start"] if plan.torch_reason or checked else 1
    if calibration and plan.calibration is not None:
        seconds += plan.calibration.sampled_tokens * parameters * rate("sample", parameters)
    if calibration and plan.gathers_statistics:
        seconds += calibration_seconds(plan.calibration.tokens, parameters, plan.calibration_passes)
    budget, refine = plan.refine_budget, options.refine
    if refine is not None and budget is not None:
        batch = refine.batch_blocks * budget.seq_len
        seconds += shape.layers * refine.steps * batch * attention_parameters(shape) * rate("refine_step", parameters)
        seconds += budget.blocks * budget.seq_len * parameters * rate("refine_pass", parameters)
        seconds += refine.global_steps * batch * parameters * rate("refine_global", parameters)
    if checked:
        seconds += check.seconds
    return seconds


def convert_line(plan) -> str:
    """The one line `convert --dry-run` prints about time."""
    return f"time: {duration(convert_seconds(plan))} ({CAVEAT}; a busier machine takes longer, a GPU far less)"


def eval_seconds(tokens: int, parameters: int, reference: bool = False, speed: bool = False) -> float:
    per = rate("eval_with_reference" if reference else "eval", parameters)
    return FIXED_S["torch_start"] + tokens * parameters * per + (FIXED_S["speed_grid"] if speed else 0)


def check_seconds(tokens: int, parameters: int) -> float:
    """convert's check (convert/check.py): both models over `tokens` probe tokens, as eval with a reference
    (torch's start-up is counted once, by convert_seconds)."""
    return eval_seconds(tokens, parameters, reference=True) - FIXED_S["torch_start"]


def uptrain_seconds(tokens: int, parameters: int, evals: int, eval_tokens: int) -> float:
    work = (tokens * rate("train", parameters) + evals * eval_tokens * rate("eval", parameters)) * parameters
    return FIXED_S["uptrain_start"] + work


def demo_seconds(settings, parameters: int, train_tokens: int, cloze: bool) -> dict[str, float]:
    """Each stage of `mha2gqa demo` (demo/pipeline.py DemoSettings) in seconds: three evaluations (the
    converted and the uptrained against the parent), the uptraining, lm-eval's cloze when installed."""
    tokens = settings.eval_tokens or HELDOUT_TOKENS
    evals = eval_seconds(tokens, parameters, speed=settings.speed) + 2 * eval_seconds(
        tokens, parameters, reference=True, speed=settings.speed
    )
    evals -= 2 * FIXED_S["torch_start"]  # one process: torch starts once
    steps = -(-train_tokens // (8 * 512))  # the demo recipe: 8 blocks of 512 tokens a step, an eval every 5
    stages = {
        "evaluations": evals,
        "uptraining": uptrain_seconds(train_tokens, parameters, steps // 5 + 1, settings.eval_blocks * 512),
    }
    if cloze:
        examples = settings.cloze_examples or 355
        stages["cloze (lm-eval)"] = 3 * (FIXED_S["cloze_start"] + examples * CLOZE_S_PER_EXAMPLE)
    return stages


def demo_line(stages: dict[str, float]) -> str:
    total = sum(stages.values())
    parts = ", ".join(f"{name} {duration(s)}" for name, s in stages.items())
    return f"estimated time: {duration(total)} ({parts}; {CAVEAT})"


def sweep_seconds(plans: list, parameters: int, eval_tokens: int, calibration_tokens: int) -> float:
    """A sweep (its candidates' dry-run plans): the parent evaluated once, the calibration pass once, then
    per candidate its conversion (statistics passed in) and its evaluation against the parent."""
    seconds = eval_seconds(eval_tokens, parameters) + calibration_seconds(calibration_tokens, parameters)
    for plan in plans:
        seconds += convert_seconds(plan, start=False, calibration=False)
        seconds += eval_seconds(eval_tokens, parameters, reference=True) - FIXED_S["torch_start"]
    return seconds


def sweep_line(plans: list, parameters: int, eval_tokens: int, calibration_tokens: int) -> str:
    return f"sweep: estimated time {duration(sweep_seconds(plans, parameters, eval_tokens, calibration_tokens))} ({CAVEAT})"


CHARS_PER_TOKEN = 3.6  # the embedded held-out novel: 466,854 characters, 131,217 tokens
COMPRESSION = 3  # about what gzip, bz2, xz and zstd make of English text


def text_tokens(entries) -> int | None:
    """About how many tokens local text files hold, from their sizes (None for a hub dataset)."""
    from mha2gqa.corpus import textdata

    source = textdata.resolve("--data", entries)
    if source is None or source.hub is not None:
        return None
    size = sum(
        p.stat().st_size * (COMPRESSION if p.suffix.lower() in textdata.COMPRESSIONS else 1) for p in source.files
    )
    return int(size / CHARS_PER_TOKEN)


def sweep_start_line(plans: list, data, max_tokens: int | None, calibration_tokens: int) -> str:
    """The line a sweep prints before it starts, from its candidates' dry-run plans."""
    parameters = sum(math.prod(info.shape) for info in plans[0].checkpoint.tensors.values())
    found = text_tokens(data)
    tokens = min(t for t in (found, max_tokens) if t is not None) if (found or max_tokens) else 0
    return sweep_line(plans, parameters, tokens, calibration_tokens) + ("" if tokens else ", evaluations not counted")


def demo_start_line(settings) -> str:
    """The line `mha2gqa demo` prints before it starts (demo/pipeline.py DemoSettings)."""
    import importlib.util

    from mha2gqa import embedded

    train_tokens = int(settings.alpha * embedded.pretrain_tokens())
    cloze = importlib.util.find_spec("lm_eval") is not None
    return demo_line(demo_seconds(settings, SMALL, train_tokens, cloze))
