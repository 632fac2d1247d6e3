"""What `evaluate` measures, as a list: each measurement checks its own flags before any model is loaded
and then writes its sections of the result.

A new measurement is one `Measurement` in MEASUREMENTS (its check, its function) plus, for the report, one
`Metric` in eval/metrics.py reading the field it writes; docs/eval.md shows a worked example.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mha2gqa.estimates.stages import EVAL
from mha2gqa.eval.batching import AUTO, auto_batch_size, validate_batch_size
from mha2gqa.eval.options import DecodePath, EvalOptions, SpeedPreset
from mha2gqa.eval.reference_tops import TopReference
from mha2gqa.runtime.errors import InputError


@dataclass
class Loaded:
    """What the measurements read: the options, the loaded models and texts, the result so far."""

    options: EvalOptions
    model: Any
    ref_model: Any
    tokenizer: Any
    shape: Any  # layouts.AttentionShape
    device: Any  # torch.device
    context: int
    stride: int
    texts: dict  # {domain: eval.data.EvalText}, {} without --data
    result: dict
    prepared: dict = field(default_factory=dict)  # what each check returned, by measurement key
    clock: Any = None  # the run's estimates Clock (its stages are marked as they start), or None
    dtype: Any = None  # the models' (eval/model.py pick_dtype)
    reference_tops: dict | None = None  # a TopReference's numbers on the texts (eval/reference_tops.py)

    def reference_model(self):
        """The reference model: loaded beside the model, or a TopReference's when the retrieval probe asks it."""
        ref = self.options.reference
        if self.ref_model is None and isinstance(ref, TopReference):
            self.ref_model = ref.loaded(self.dtype, self.device)
        return self.ref_model


@dataclass(frozen=True)
class Measurement:
    key: str
    """Its name (and, for most, the result section it fills)."""
    validate: Callable[[EvalOptions], Any]
    """Refuses its flags' bad values before any model is loaded (InputError); what it returns is kept in
    Loaded.prepared[key] for the measure."""
    measure: Callable[[Loaded], dict]
    """The result keys it sets, from the loaded models."""
    wanted: Callable[[EvalOptions], bool] = lambda o: True
    """Whether it runs for these options (its check runs either way)."""
    stage: str = ""
    """Its stage's name for the run's clock and its progress bars (default: the key)."""


def at_least(flag: str, value, low: int, hint: str = "") -> None:
    if value is not None and value < low:
        raise InputError(f"{flag} {value} must be at least {low}{hint}")


# ---- quality: perplexity on every text of --data, and agreement with --reference on the same windows ----


def _validate_quality(o: EvalOptions) -> None:
    from mha2gqa.scoring import perplexity as P

    if o.reference and not o.domains and not o.retrieval:  # the retrieval probe answers beside it without text
        raise InputError("--reference needs --data: agreement is measured on the same text")
    if o.context is not None:
        P.validate_window(o.context, o.stride or max(1, o.context // 2))
    validate_batch_size(o.batch_size)
    at_least("--max-tokens", o.max_tokens, 2)


def window_batch(run: Loaded) -> int:
    """--batch-size, with auto resolved for the models that run the windows together (eval/batching.py)."""
    if run.options.batch_size != AUTO:
        return run.options.batch_size
    return auto_batch_size(run.model, run.context, run.device, 1 if run.ref_model is None else 2)


def bar_label(run: Loaded, *stage: str) -> str:
    """A progress bar's label: the model, then the domain and the stage ('gqa1 · prose · perplexity, KL vs
    smollm2'), so that a run of several bars says which is which."""
    return " · ".join([run.result["label"], *stage])


def _one_domain(run: Loaded, name: str, text) -> dict:
    """Perplexity on one text, and agreement with the reference in the same pass when there is one."""
    from mha2gqa.scoring import perplexity as P
    from mha2gqa.scoring.agreement import agreement, agreement_with_top

    o, ids, batch = run.options, text.ids, window_batch(run)
    found = {"data": text.identity, "perplexity": None, "agreement": None}
    bar = o.progress and bar_label(run, name, "perplexity")
    if run.reference_tops is not None:  # a reference known by its top tokens (eval/reference_tops.py)
        ref = run.reference_tops[name]
        bar = bar and f"{bar}, KL vs {run.result['reference']['label']}'s top {o.reference.top_k}"
        agree, ppl = agreement_with_top(run.model, ids, run.context, run.stride, ref.top, batch, bar)
        return {**found, "perplexity": ppl, "agreement": {**agree, "reference_perplexity": ref.perplexity}}
    if run.ref_model is None:
        found["perplexity"] = P.perplexity(run.model, ids, run.context, run.stride, batch, bar)
        return found
    bar = bar and f"{bar}, KL vs {run.result['reference']['label']}"
    agree, ppl, ref_ppl = agreement(run.model, run.ref_model, ids, run.context, run.stride, batch, bar)
    return {**found, "perplexity": ppl, "agreement": {**agree, "reference_perplexity": ref_ppl["perplexity"]}}


def _quality(run: Loaded) -> dict:
    """Every domain apart (`domains`), and over all of them: one text's numbers as they always were; for
    several, the token-weighted pool of their sums and the geometric mean of the per-domain perplexity
    ratios to the reference (`quality`)."""
    from mha2gqa.eval import domains as D

    per = {}
    for name, text in run.texts.items():
        if run.clock is not None:
            run.clock.stage(EVAL.quality.member(name))
        per[name] = _one_domain(run, name, text)
    if len(per) == 1:
        (only,) = per.values()
        top = dict(only)
    else:
        top = {"data": D.pooled_data(per), "perplexity": D.pooled_perplexity(per), "agreement": D.pooled_agreement(per)}
    found = {**top, "domains": per, "quality": D.summary(per)}
    if run.options.batch_size == AUTO:  # what auto chose, beside the numbers it does not change
        found["batch_size"] = {"asked": AUTO, "windows": window_batch(run)}
    return found


# ---- long-context retrieval: a fact far back in the context, asked for at its end ----


def _validate_retrieval(o: EvalOptions) -> None:
    from mha2gqa.scoring.retrieval_items import validate_values

    validate_values(o.retrieval_lengths, o.retrieval_depths, o.retrieval_samples)
    given = (("--retrieval-lengths", o.retrieval_lengths), ("--retrieval-depths", o.retrieval_depths))
    for flag, value in (*given, ("--retrieval-samples", o.retrieval_samples)):
        if value is not None and not o.retrieval:
            raise InputError(f"{flag} shapes the retrieval probe: add --retrieval, or drop {flag}")


def retrieval_grid(o: EvalOptions, config):
    """The probe's grid for a model of this config (its lengths checked against its max positions)."""
    from mha2gqa.scoring.retrieval_items import probe_grid

    max_positions = getattr(config, "max_position_embeddings", None)
    return probe_grid(o.retrieval_lengths, o.retrieval_depths, o.retrieval_samples, o.seed, max_positions)


def _retrieval(run: Loaded) -> dict:
    from mha2gqa.scoring.retrieval import answer_scores, summarize
    from mha2gqa.scoring.retrieval_items import build_items

    grid = retrieval_grid(run.options, run.model.config)
    items = build_items(run.tokenizer, grid)
    bar = run.options.progress and bar_label(run, "retrieval")
    mine = answer_scores(run.model, items, run.device, bar)
    reference = None
    if run.reference_model() is not None:
        reference = answer_scores(
            run.ref_model, items, run.device, bar and f"{bar}, {run.result['reference']['label']}"
        )
    found = summarize(grid, items, mine, reference)
    found["heads"] = _retrieval_heads(run, items, bar and f"{bar}, heads")
    return {"retrieval": found}


def _retrieval_heads(run: Loaded, items, bar) -> dict | None:
    """The model's retrieval heads on the questions short enough to hold every attention map (scoring/retrieval_heads.py)."""
    from mha2gqa.scoring.retrieval_heads import MAX_LENGTH, head_scores, heads_section

    scores = head_scores(run.model, items, run.device, bar)
    questions = sum(i.length <= MAX_LENGTH for i in items)
    return None if scores is None else heads_section(scores, run.shape.kv_heads, questions)


# ---- the KV cache: bytes per token, the formula against the live cache ----


def _validate_kv(o: EvalOptions) -> None:
    at_least("--kv-batch", o.kv_batch, 1)
    at_least("--kv-tokens", o.kv_tokens, 1)


def _kv_cache(run: Loaded) -> dict:
    from mha2gqa.eval.kvcache import measure_kv_cache

    o = run.options
    found = measure_kv_cache(run.model, run.shape, o.kv_batch, o.kv_tokens, o.seed)
    if "warning" in found:
        run.result["warnings"].append(found["warning"])
    return {"kv_cache": found}


# ---- decode speed over the preset's grid ----


def speed_grid(o: EvalOptions, device_type: str):
    """The grid of --speed ("auto": the gpu preset on CUDA, else cpu), its values checked; None when off."""
    from mha2gqa.eval import speed

    preset = o.speed
    if preset is None:
        return None
    if preset == SpeedPreset.AUTO:
        preset = "gpu" if device_type == "cuda" else "cpu"
    return speed.make_grid(preset, o.speed_batches, o.speed_contexts, o.new_tokens, o.repeats)


def _validate_speed(o: EvalOptions) -> None:
    speed_grid(o, "cpu")  # the values are checked the same way for either preset
    if o.speed_side_by_side and not o.reference:
        raise InputError("--speed-side-by-side needs --reference: it times the reference's decode beside the model's")
    if o.speed_side_by_side and o.speed is None:
        raise InputError("--speed-side-by-side times decode speed: drop --speed off, or drop --speed-side-by-side")
    _validate_decode_path(o)


def _validate_decode_path(o: EvalOptions) -> None:
    """--decode-path is a path; one that gives GQA's decode saving away is warned about now, in one line."""
    import warnings

    from mha2gqa.runtime.errors import WeightWarning

    if o.decode_path not in {p.value for p in DecodePath}:
        raise InputError(
            f"--decode-path {o.decode_path!r} is not a path (use {', '.join(p.value for p in DecodePath)})"
        )
    if o.speed is not None and o.decode_path != DecodePath.GROUPED:
        from mha2gqa.eval.decode_path import SLOW_FOR_GQA

        warnings.warn(
            f"--decode-path {o.decode_path} {SLOW_FOR_GQA[DecodePath(o.decode_path)]}: a grouped model's decode "
            "speed-up over its parent shrinks or vanishes (docs/eval.md, 'Decode path'); leave the flag out to time 'grouped'",
            WeightWarning,
            stacklevel=2,
        )


def _speed(run: Loaded) -> dict:
    from mha2gqa.eval import speed

    o = run.options
    grid = speed_grid(o, run.device.type)
    beside = run.ref_model if o.speed_side_by_side else None
    bar = o.progress and bar_label(run, "decode speed") + (
        f" beside {run.result['reference']['label']}" if beside else ""
    )
    found = speed.decode_speed(run.model, grid, o.seed, bar, beside=beside, path=o.decode_path)
    if beside is not None:  # what the reference's points are: the report pairs them with its own result
        reference = run.result["reference"]
        found["side_by_side"].update(reference_label=reference["label"], reference_resolved=reference["resolved"])
    return {"speed": found}


# ---- attention maps of one layer, as a PNG ----


def _validate_attention(o: EvalOptions) -> None:
    from mha2gqa.eval.schema import validate_writable

    if o.attention_text and not (o.attention_png or o.out):
        raise InputError("--attention-maps needs --out or --attention-png to know where to save the PNG")
    if o.attention_png:  # a read-only or full destination fails now, not after the whole evaluation
        validate_writable(Path(o.attention_png), "--attention-png")


def _attention(run: Loaded) -> dict:
    from mha2gqa.eval.attention_maps import attention_maps, plot_attention_maps

    o, result = run.options, run.result
    png = Path(o.attention_png) if o.attention_png else Path(o.out).with_suffix(".attention.png")
    found = attention_maps(run.model, run.tokenizer, o.attention_text, o.attention_layer, run.ref_model)
    labels = {"model": result["label"], "reference": f"{(result['reference'] or {}).get('label', '')} (reference)"}
    drawn = plot_attention_maps(found, png, labels, run.shape.kv_heads)
    return {"attention_maps": {"png": str(drawn), "layer": found["layer"]}}


# ---- lm-evaluation-harness tasks on the loaded model ----


def _validate_lm_eval(o: EvalOptions):
    """The harness is installed and the task names exist (the task index is built now, before any weights
    are loaded, and kept for the run)."""
    from mha2gqa.eval.lmeval import task_manager, validate_lm_eval_installed
    from mha2gqa.eval.schema import validate_writable

    if o.lm_eval_limit is not None and o.lm_eval_limit < 1:
        raise InputError(f"--lm-eval-limit {o.lm_eval_limit} must be at least 1 (or left out for every example)")
    for flag, used in (("--chat-template", o.chat_template), ("--log-samples", o.log_samples)):
        if used and not o.lm_eval_tasks:
            raise InputError(f"{flag} applies to lm-eval's examples: add --lm-eval-tasks, or drop {flag}")
    if o.log_samples:
        validate_writable(Path(o.log_samples), "--log-samples")
    if not o.lm_eval_tasks:
        return None
    validate_lm_eval_installed()
    return task_manager(o.lm_eval_tasks)


def _lm_eval(run: Loaded) -> dict:
    from mha2gqa.eval.lmeval import run_lm_eval

    o = run.options
    found = run_lm_eval(
        run.model,
        run.tokenizer,
        o.lm_eval_tasks,
        o.lm_eval_limit,
        o.batch_size,
        run.prepared["lm_eval"],
        chat_template=o.chat_template,
        log_samples=Path(o.log_samples) if o.log_samples else None,
    )
    return {"lm_eval": found}


def validate_tokenizer(o: EvalOptions, tokenizer) -> None:
    """What the tokenizer must offer the options, checked before any weights are loaded."""
    if o.chat_template and o.lm_eval_tasks and not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "--chat-template: this tokenizer has no chat template (tokenizer_config.json chat_template): "
            "use an instruct model's tokenizer (--tokenizer), or drop --chat-template"
        )


MEASUREMENTS: list[Measurement] = [
    Measurement("quality", _validate_quality, _quality, wanted=lambda o: bool(o.domains)),
    Measurement("retrieval", _validate_retrieval, _retrieval, wanted=lambda o: o.retrieval, stage=EVAL.retrieval.name),
    Measurement("kv_cache", _validate_kv, _kv_cache, wanted=lambda o: o.kv_cache, stage=EVAL.kv_cache.name),
    Measurement("speed", _validate_speed, _speed, wanted=lambda o: o.speed is not None, stage=EVAL.speed.name),
    Measurement(
        "attention_maps",
        _validate_attention,
        _attention,
        wanted=lambda o: bool(o.attention_text),
        stage=EVAL.attention_maps.name,
    ),
    Measurement(
        "lm_eval", _validate_lm_eval, _lm_eval, wanted=lambda o: bool(o.lm_eval_tasks), stage=EVAL.lm_eval.name
    ),
]


def validate_all(options: EvalOptions) -> dict:
    """Every refusal the options can get before a model is loaded: the options' own, then each
    measurement's; returns what the checks prepared, by measurement key."""
    from mha2gqa.runtime.limits import validate_limits

    options.validate()
    prepared = {m.key: m.validate(options) for m in MEASUREMENTS}
    validate_limits("eval", options.counts())  # the bounds (limits.py), after each flag's own rule in its words
    return prepared
