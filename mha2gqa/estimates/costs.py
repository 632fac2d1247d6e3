"""What each long command's stages cost, as work: the estimate every one prints before it starts.

A stage is costed by one or more parts, each a kind of work at a model size: `("eval_quality", params,
{"forward": tokens x parameters})`. rates.py turns a part into seconds on the
machine the rates were measured on (fixed seconds plus a rate per unit of each term), and the probe scales
that to this machine now. The kinds and their terms are what bench/estimate_rates.py fits. A kind's fixed
seconds are what a process pays once for it (imports, first calls, the texts read): a demo's or a sweep's later
evaluations and its uptraining run in the process that paid them, and their parts are `warm` (rates only).

Reads no torch and runs nothing: `convert --dry-run` and `uptrain --dry-run` print the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mha2gqa.corpus.sampling import forward_work
from mha2gqa.estimates import rates
from mha2gqa.estimates.rates import LARGE, SMALL, Machine  # noqa: F401 (re-exported)
from mha2gqa.estimates.stages import CONVERT, EVAL, UPTRAIN


@dataclass(frozen=True)
class Part:
    """One kind of work of a stage: seconds = the kind's fixed seconds + sum of work[term] x its rate."""

    kind: str
    parameters: int
    work: dict = field(default_factory=dict)
    warm: bool = False  # in a process that has run this kind already: its fixed seconds are paid

    def seconds(self) -> float:
        return rates.load().seconds(self.kind, self.parameters, self.work, fixed=not self.warm)


@dataclass(frozen=True)
class StageCost:
    """A stage as the clock (clock.py) times it: its name and its parts."""

    name: str
    parts: tuple[Part, ...] = ()

    def seconds(self) -> float:
        return sum(part.seconds() for part in self.parts)

    def seconds_on(self, machine: Machine) -> float:
        """The stage's seconds on `machine`: each part scaled by its kind's factor."""
        return sum(part.seconds() * machine.factor_for(part.kind) for part in self.parts)

    def record(self) -> dict:
        """What the clock's record holds beside the measured seconds (clock.observe), for the rates' fit."""
        return {"parts": [_part_record(p) for p in self.parts]}


def _part_record(part: Part) -> dict:
    found = {"kind": part.kind, "parameters": part.parameters, "work": part.work}
    return {**found, "warm": True} if part.warm else found


@dataclass(frozen=True)
class Estimate:
    """A run's stages, the machine factor, and its peak memory: the line printed before it starts."""

    stages: tuple[StageCost, ...]
    machine: Machine
    peak_bytes: int | None = None

    def stage_seconds(self) -> list[float]:
        return [stage.seconds_on(self.machine) for stage in self.stages]

    def seconds(self) -> float:
        return sum(self.stage_seconds())

    def line(self) -> str:
        """'estimate: about 4 min, peak memory about 1.2 GiB (start 5%, quality: prose 24%, ...; rates ...)'."""
        from mha2gqa.runtime.units import format_bytes

        total = self.seconds()
        shares = ", ".join(
            f"{stage.name} {100 * s / total:.0f}%" for stage, s in zip(self.stages, self.stage_seconds()) if total
        )
        memory = f", peak memory about {format_bytes(self.peak_bytes, digits=1)}" if self.peak_bytes else ""
        return f"estimate: {duration(total)}{memory} ({shares + '; ' if shares else ''}{self.machine.words()})"


def for_this_machine(priced: Estimate, kind: str | None, fine: bool = False) -> Estimate:
    """`priced` (an estimate at the stored rates) on this machine: the one place every command's estimate meets
    the machine (convert, sweep, eval, uptrain, demo). rates.this_machine probes only when the priced work is long
    enough, with a probe sized to a small share of it; a short run keeps the stored rates and says so (issue 59).
    `kind`: the library the run's work is mostly in (torch, numpy); `fine`: it has FINE_KINDS stages."""
    return Estimate(priced.stages, rates.this_machine(kind, fine, priced.seconds()), priced.peak_bytes)


def duration(seconds: float) -> str:
    """'about 40 s', 'about 3 min', 'about 1 h 50 min': rounded as far as an estimate deserves."""
    if seconds < 60:
        return f"about {max(5, round(seconds / 5) * 5)} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"about {minutes} min"
    hours, rest = divmod(round(seconds / 600) * 10, 60)
    return f"about {hours} h" + (f" {rest} min" if rest else "")


def took(seconds: float) -> str:
    """A measured duration: '42 s', '3 min 5 s', '1 h 2 min'."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, rest = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


CAVEAT = "rates measured on a quiet reference machine, not scaled to this one"


# ---- convert ----


# A global refine step in bfloat16 autocast against float32 (convert/refine/precision.py), at SMALL and LARGE: one
# block's parent forward, converted forward and backward took 0.38 s against 0.50 s on the embedded model (one
# thread) and 1.56 s against 2.49 s on SmolLM2 (two threads), a 2-core CPU with AMX (docs/refine.md). The rates are
# float32's, so a bfloat16 step counts as 1/speedup of a step's work; the checks stay float32.
BF16_GLOBAL_STEP_SPEEDUP = (1.3, 1.6)


@dataclass(frozen=True)
class RefineWork:
    """What --refine will do, in counts (convert/prepare.py fills it from its plan and budget)."""

    layer_step_work: int  # layers x steps x tokens a step x one layer's attention parameters
    fit_tokens: int  # the calibration blocks (and openings) each layer's fit forwards through the parent
    step_tokens: int  # tokens one step reads (a global step forwards them through both models)
    global_steps: int = 0
    global_heldout_forwards: int = 0  # token forwards of the global stage's held-out checks (RefineBudget)
    global_bf16: bool = False  # the global steps in bfloat16 autocast (decided in prepare: convert/decide.py)


@dataclass(frozen=True)
class ConvertWork:
    """What a conversion will do, known before a tensor is read (ConversionPlan.work fills it): every number its
    stages are priced from, so that the costing reads no plan."""

    parameters: int
    torch: bool  # the torch executor (else fast.py's numpy one, no torch)
    bytes_written: int
    parent_bytes: int = 0  # the parent loaded in float32 when a stage reads it
    sampled_tokens: int = 0  # drawn from the parent for calibration (its chat template, block length and batch)
    sample_seq_len: int = 0
    sample_chat: bool = False
    sample_batch: int | None = None
    calibrate_tokens: int = 0  # tokens through the parent for the statistics, all passes (0: none gathered)
    loss_tokens: int = 0  # --kv-budget's layer losses as tokens through the whole parent (kv_budget.loss_tokens)
    retrieval_tokens: int = 0  # --keep-retrieval-heads: the parent's forwards over its scoring questions
    refine: RefineWork | None = None


def convert_parts(work: ConvertWork) -> dict[str, tuple[Part, ...]]:
    """What each stage of a conversion costs, by the stage's name: the process' start, the parent's load (when a
    stage reads it), the samples, the statistics, the layer losses, the merge or refine's stages, the metadata.
    prepare puts each stage's parts on the stage it plans (the quality check brings its own: check_parts); the
    global refine stage's steps are priced in the precision the plan decided (convert/decide.py)."""
    p, refine = work.parameters, work.refine
    write = "write_torch" if work.torch else "write_numpy"
    parts = {CONVERT.start.name: (Part("torch_start" if work.torch else "numpy_start", p),)}
    if work.torch:  # the parent loaded when a stage reads it, the calibration text read
        parts[CONVERT.load.name] = (Part("convert_load", p, {"bytes": work.parent_bytes}),)
    if work.sampled_tokens:
        sample = sample_part(p, work.sampled_tokens, work.sample_seq_len, work.sample_chat, batch=work.sample_batch)
        parts[CONVERT.sample.name] = (sample,)
    if work.calibrate_tokens:
        parts[CONVERT.calibrate.name] = (Part("calibrate", p, {"tokens": work.calibrate_tokens * p}),)
    if work.loss_tokens:
        parts[CONVERT.layer_losses.name] = (Part("calibrate", p, {"tokens": work.loss_tokens * p}),)
    if work.retrieval_tokens:  # the parent's forwards over its questions, eager attention: an evaluation's rate
        parts[CONVERT.retrieval_heads.name] = (Part("eval_quality", p, {"forward": work.retrieval_tokens * p}),)
    if refine is None:
        parts[CONVERT.merge.name] = (Part(write, p, {"bytes": work.bytes_written}),)
    else:
        layer_work = {"steps": refine.layer_step_work, "tokens": refine.fit_tokens * p}
        parts[CONVERT.refine.name] = (Part("refine", p, layer_work),)
        if refine.global_steps:
            speedup = rates.between(BF16_GLOBAL_STEP_SPEEDUP, p) if refine.global_bf16 else 1
            steps = refine.global_steps * refine.step_tokens * p / speedup
            global_work = {"steps": steps, "checks": refine.global_heldout_forwards * p}
            parts[CONVERT.refine_global.name] = (Part("refine_global", p, global_work),)
        parts[CONVERT.write.name] = (Part(write, p, {"bytes": work.bytes_written}),)
    parts[CONVERT.metadata.name] = (Part("metadata", p, {}),)
    return parts


# The stages a sweep runs once for all its candidates: not priced again in each candidate's conversion.
CALIBRATION_STAGES = (CONVERT.sample.name, CONVERT.calibrate.name, CONVERT.layer_losses.name)


def check_parts(
    tokens: int, parameters: int, vocab: int = 0, torch_start: bool = False, parent_cached: bool = False
) -> tuple[Part, ...]:
    """convert's quality check (convert/check.py) as work of its own kind, fitted on convert's checks (its short
    windows run faster a token than eval's): the conversion loaded, the forwards of `tokens` probe tokens through
    it and, unless the cache holds its numbers, through the parent; `cold_start` when the conversion itself ran
    without torch, so that the check starts torch and transformers. The check's Stage carries these parts
    (prepare.py); its skip on a CPU compares their seconds with its budget."""
    models = 1 if parent_cached else 2
    work = {"forward": models * tokens * parameters, "tally": tokens * vocab, "cold_start": int(torch_start)}
    return (Part("check", parameters, work),)


def convert_line(seconds: float, scaled: Estimate | None = None) -> str:
    """The one line `convert --dry-run` prints about time: the rates' machine's `seconds`, or `scaled` (the run's
    estimate, probed on this machine) when given."""
    if scaled is not None:
        seconds = scaled.seconds()
    words = CAVEAT if scaled is None else scaled.machine.words()
    return f"time: {duration(seconds)} ({words}; a busier machine takes longer, a GPU far less)"


# ---- eval ----


@dataclass(frozen=True)
class EvalWork:
    """What an evaluation will do, known before any model is loaded (eval/run.py fills it)."""

    parameters: int
    reference_parameters: int | None  # None without --reference
    vocab: int
    weight_bytes: int  # of both models, as loaded
    texts: dict  # {domain: (forward tokens, scored tokens)} from the windows
    speed_points: int  # decode-speed grid points (x2 timed side by side)
    lm_eval_examples: int | None = None
    retrieval_tokens: int = 0  # tokens one model forwards over the retrieval probe (scoring/retrieval_items.py)
    retrieval_head_tokens: int = 0  # of those, the ones forwarded again for the heads' scores (the model alone)
    attention_tokens: int = 0  # of --attention-maps' text, forwarded through the model and the reference


def eval_stages(work: EvalWork, start: bool = True, warm: bool = False) -> list[StageCost]:
    """start (the interpreter, torch: not in a demo's evaluations), load (tokenizer, texts, weights), each
    domain's quality, the retrieval probe, the KV cache, decode speed, the attention maps, lm-eval; `warm`: a later evaluation of a demo or a sweep."""
    p, ref = work.parameters, work.reference_parameters
    stages = [StageCost(EVAL.start.name, (Part("torch_start", p),))] if start else []
    stages.append(StageCost(EVAL.load.name, (Part("eval_load", p, {"bytes": work.weight_bytes}, warm),)))
    for name, (forward, scored) in work.texts.items():
        parts = [Part("eval_quality", p, {"forward": forward * (p + (ref or 0))}, warm)]
        if ref:  # the KL, top-1 and agreement against the reference: work over the vocabulary, any model size
            parts.append(Part("eval_tally", p, {"tally": scored * work.vocab}, warm))
        stages.append(StageCost(EVAL.quality.member(name), tuple(parts)))
    if work.retrieval_tokens:
        part = retrieval_part(p, ref, work.retrieval_tokens, work.retrieval_head_tokens, warm)
        stages.append(StageCost(EVAL.retrieval.name, (part,)))
    stages.append(StageCost(EVAL.kv_cache.name, (Part("eval_kv", p, {}, warm),)))
    if work.speed_points:
        stages.append(StageCost(EVAL.speed.name, (Part("eval_speed", p, {"points": work.speed_points}, warm),)))
    if work.attention_tokens:  # a forward like a window's, then one figure drawn (matplotlib: the report's kind)
        forward = {"forward": work.attention_tokens * (p + (ref or 0))}
        parts = (Part("eval_quality", p, forward, warm), Part("report", p, {}, warm))
        stages.append(StageCost(EVAL.attention_maps.name, parts))
    if work.lm_eval_examples is not None:
        stages.append(StageCost(EVAL.lm_eval.name, (Part("lm_eval", p, {"examples": work.lm_eval_examples}, warm),)))
    return stages


def retrieval_part(
    parameters: int, reference_parameters: int | None, tokens: int, head_tokens: int, warm: bool = False
) -> Part:
    """eval's retrieval probe (eval --retrieval, and convert's check with --check-retrieval): every question through
    the model and the reference, those short enough for the heads' maps through the model again; forwards like the
    perplexity windows', priced at their rate."""
    forward = tokens * (parameters + (reference_parameters or 0)) + head_tokens * parameters
    return Part("eval_quality", parameters, {"forward": forward}, warm)


def eval_peak_bytes(work: EvalWork, window_bytes: int, batch: int) -> int:
    """Both models' weights, a batch of windows through each, and the runtime (torch and the libraries)."""
    return RUNTIME_BYTES + work.weight_bytes + window_bytes * batch * (2 if work.reference_parameters else 1)


RUNTIME_BYTES = 400 << 20  # python, torch, transformers and a tokenizer imported (peak RSS before any model)


# ---- uptrain ----


@dataclass(frozen=True)
class UptrainWork:
    """What an uptraining run will do (uptrain/loop.py fills it from the recipe)."""

    parameters: int
    teacher_parameters: int | None
    weight_bytes: int  # student and teacher, as loaded
    tokens: int  # trained: steps x tokens a step
    evals: int
    eval_tokens: int  # per eval
    sampled_tokens: int = 0  # drawn from the teacher before the first step
    data_tokens: int = 0  # of data.train's text, tokenized at the start
    checkpointing: bool = False  # gradient checkpointing: every forward runs twice
    trained: int = 0  # parameters that train (all, the attention's, ...): their gradients and AdamW's update
    sample_seq_len: int = 512  # the teacher's samples: sequence length, and whether its tokenizer has a chat template
    sample_chat: bool = False

    def effective(self) -> float:
        """Parameters a training token costs as: a forward and the backward's activation gradients through every
        parameter, the weight gradients only through those that train."""
        trained = self.trained or self.parameters
        return (2 * self.parameters + trained) / 3


def uptrain_stages(work: UptrainWork, start: bool = True, warm: bool = False) -> list[StageCost]:
    """start (the interpreter, torch), load (models, data: the teacher's samples too), train (steps, evals, the
    teacher's forwards), save; `warm`: a demo's uptraining, after its evaluations in the same process."""
    p, t = work.parameters, work.teacher_parameters
    load = [Part("uptrain_load", p, {"bytes": work.weight_bytes, "data_tokens": work.data_tokens}, warm)]
    if work.sampled_tokens and t:
        load.append(sample_part(t, work.sampled_tokens, work.sample_seq_len, work.sample_chat, warm))
    tokens = work.tokens * work.effective() * (1.25 if work.checkpointing else 1)
    train = [Part("train", p, {"tokens": tokens}, warm)]
    train.append(Part("eval_quality", p, {"forward": work.evals * work.eval_tokens * p}, warm))
    if t:
        train.append(Part("eval_quality", t, {"forward": work.tokens * t}, warm))  # the teacher's forwards
    stages = [StageCost(UPTRAIN.start.name, (Part("torch_start", p),))] if start else []
    return stages + [
        StageCost(UPTRAIN.load.name, tuple(load)),
        StageCost(UPTRAIN.train.name, tuple(train)),
        StageCost(UPTRAIN.save.name, (Part("uptrain_save", p, {"bytes": work.weight_bytes}),)),
    ]


def sample_part(
    parameters: int, tokens: int, seq_len: int, chat: bool, warm: bool = False, batch: int | None = None
) -> Part:
    """Drawing `tokens` from a model, up to `batch` sequences at once (default the recipe's): its batched forwards
    and the tokens they draw, each times its parameters (a small batch costs about what a full one does:
    corpus.sampling.forward_work)."""
    steps, drawn = forward_work(tokens, seq_len, chat, batch=batch)
    return Part("sample", parameters, {"steps": steps * parameters, "tokens": drawn * parameters}, warm)


def combined(name: str, stages: list[StageCost]) -> StageCost:
    """Several commands' stages as one stage of a longer run (a demo's "evaluate parent")."""
    return StageCost(name, tuple(part for stage in stages for part in stage.parts))


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
