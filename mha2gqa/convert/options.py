"""What `convert` is asked to do: a typed schema, one docstring per field, importable without torch.

`mha2gqa.convert(src, dst, groups, **fields)` builds a ConvertOptions from its keywords; the CLI
builds one from its flags. Strings that choose a behaviour are `str` enums, so "mean" and
Method.MEAN compare equal, hash alike and serialise to the same JSON.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from enum import Enum

from mha2gqa.architecture.dtypes import dtype_name
from mha2gqa.corpus.mix import PARENT
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.limits import validate_limits
from mha2gqa.runtime.typed import StrEnum, validate_keywords
from mha2gqa.runtime.units import parse_size

OUT_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # --dtype -> safetensors code
# Three quarters the parent's samples, a quarter the embedded novels: the best of the calibrations measured on
# SmolLM2's four probe domains and two others (docs/calibration.md "Three quarters samples, 48 global steps"; half
# and half before it), and still no data of the user's. The novels keep the prose the samples hold little of; the
# samples' chat turns hold the code the novels lack.
DEFAULT_CALIBRATION = (f"{PARENT}:0.75", "austen:0.25")
DEFAULT_CALIBRATION_TOKENS = 131072  # of a text; the parent's samples default to 128 x hidden (inputs.default_tokens)
DEFAULT_CALIBRATION_MEMORY = 4 << 30  # bytes of calibration accumulators held at once
DEFAULT_REFINE_STEPS = 50
DEFAULT_REFINE_LR = 1e-3
DEFAULT_REFINE_MEMORY = 4 << 30
DEFAULT_REFINE_GLOBAL_STEPS = 64  # 2 passes over the default fit blocks of a hidden-576 model (docs/calibration.md)
DEFAULT_REFINE_GLOBAL_LR = 2e-4
DEFAULT_REFINE_OPENING_WEIGHT = 0.25  # an opening token weighs as a block token (docs/calibration.md)
# Default --refine-tokens per unit of hidden size, and the parent's samples' default --calibration-tokens: 128 x
# 576 = 73,728 on SmolLM2, whose MQA conversion over five seeds gave 2.63x-2.91x (mean 2.74x) against 2.85x-3.36x
# at 64 (docs/calibration.md "Twice the samples"); 41 min alone on 2 cores. 64 until 2026-12-04.
REFINE_TOKENS_PER_HIDDEN = 128
REFINE_TOKENS_PER_HIDDEN_BEFORE = 64  # what a record that does not name it ran with (sweep --resume)


class Method(StrEnum):
    """How each group's kv heads become one (tensor functions in methods.py)."""

    MEAN = "mean"
    FIRST = "first"
    RANDOM = "random"
    MEAN_NORM = "mean-norm"
    CALIBRATED = "calibrated"

    @property
    def needs_calibration(self) -> bool:
        """It merges from calibration statistics: refused without --calibration (or stats)."""
        return self in _CALIBRATED_METHODS

    @property
    def rewrites_query_output(self) -> bool:
        """It folds a mixing into q_proj/o_proj, so the plan routes q and o through the layer step."""
        return self in _CALIBRATED_METHODS


_CALIBRATED_METHODS = frozenset({Method.CALIBRATED})

# One line on each method, for `--method`'s help; kept here so that `convert --help` needs no torch.
METHOD_SUMMARIES = {
    Method.MEAN.value: "mean-pool each group's K/V heads (Ainslie et al. 2023): the paper's start for uptraining",
    Method.FIRST.value: "keep the first K/V head of each group (ablation)",
    Method.RANDOM.value: "random K/V with the source's mean and std, seeded (ablation)",
    Method.MEAN_NORM.value: "mean-pool, each pooled K/V head rescaled to its group's mean norm",
    Method.CALIBRATED.value: "RoPE-aware merge from calibration statistics, maps folded into q_proj/o_proj "
    "(reads --calibration; unset: its default)",
}


class Grouping(StrEnum):
    """Which kv heads share a group."""

    CONTIGUOUS = "contiguous"
    """transformers' order, group g holds heads [g*r, (g+1)*r)."""
    SIMILARITY = "similarity"
    """chosen per layer from calibrated K/V similarity, then query heads and o_proj columns permuted to match
    (reads --calibration; unset: its default)."""


class GlobalPrecision(StrEnum):
    """What the global refine stage's fit steps compute in (convert/refine/precision.py). The parameters, Adam's
    state, the KL and the held-out checks that pick the step kept are float32 whichever is chosen."""

    AUTO = "auto"
    """bfloat16 on a CPU with native bfloat16 products (flags amx_bf16, avx512_bf16 or arm64 bf16: at least twice
    float32's speed; with AMX SmolLM2's global stage ran 1.6x faster a step), else float32 (a GPU: float32); decided
    once by the plan and recorded as the value chosen."""
    FLOAT32 = "float32"
    """float32 throughout: the same result on every CPU at the same threads."""
    BFLOAT16 = "bfloat16"
    """bfloat16 autocast wherever the device has it."""


COUNTED = ("steps", "tokens", "global_steps", "batch_blocks", "seed")  # RefineOptions' counts, bounded in limits.py


@dataclass(frozen=True)
class RefineOptions:
    """How `--refine` fits each layer (convert/refine/; the defaults were chosen by measurement,
    docs/refine.md)."""

    steps: int = DEFAULT_REFINE_STEPS
    """Adam steps per layer for --refine (0: only the closed-form o_proj solve)."""
    lr: float = DEFAULT_REFINE_LR
    """Peak Adam learning rate for --refine (cosine-decayed to 0)."""
    memory: int = DEFAULT_REFINE_MEMORY
    """Most memory for one layer's activations during --refine (4 x tokens x hidden float32), a size such as
    4GiB (in Python: bytes); beyond it they are memory-mapped files inside DST's partial folder (their room
    is checked and reserved before the run, and a killed run's are removed with its other debris). The
    global stage keeps the parent's logits on the held-out tokens within the same budget (they spare the
    parent's forwards at every check); beyond it they are computed again at each check."""
    tokens: int | None = None
    """Calibration tokens --refine fits and checks on, in whole sequences spread evenly over the calibration
    tokens (all of them when fewer). Unset: 128 x the model's hidden size (twice the o_proj solve's unknowns
    per output), e.g. 32,768 for hidden 256 and 524,288 for hidden 4096."""
    global_steps: int = DEFAULT_REFINE_GLOBAL_STEPS
    """After the layer-wise stages, Adam steps on every refined parameter together against the parent's
    next-token distribution (KL) on the fit blocks, the held-out KL checked every 10 steps, the best check
    kept and an early stop after 2 checks without a gain (0: off). Each step costs a forward of the parent
    and a forward and backward of the converted model on --refine's batch of blocks."""
    global_lr: float = DEFAULT_REFINE_GLOBAL_LR
    """Learning rate of the global stage (after a warmup over the first tenth of the steps)."""
    global_precision: GlobalPrecision = GlobalPrecision.AUTO
    """What the global stage's forwards and backward compute in: bfloat16 autocast or float32 (auto: bfloat16 on a
    CPU with native bfloat16 products, recorded as the value it chose). The parameters, Adam's state, the KL and the
    held-out checks stay float32."""
    batch_blocks: int = 4
    """Calibration sequences per Adam step."""
    opening_weight: float = DEFAULT_REFINE_OPENING_WEIGHT
    """Weight of the openings (short sequences whose first tokens cover the vocabulary, which keep the parent's
    first-position state, the attention sink, for every token a text may open with) beside the blocks, in both
    stages' losses and in the checks that keep a layer's refit and pick the global stage's best step (0: measured,
    not fitted)."""
    solve_output: bool = True
    """Finish each layer's attention with the closed-form least-squares o_proj."""
    seed: int = 0
    """Seeds the mini-batch order, the held-out split and the openings' draw (on the command line: --seed, unless
    --refine-seed is given)."""

    def __post_init__(self):  # frozen: the text a config file or a call gives becomes the member, once
        object.__setattr__(
            self, "global_precision", GlobalPrecision.parse(self.global_precision, "--refine-global-precision")
        )

    def validate(self) -> None:
        """Refuse settings no fit can run with; a NaN or infinite learning rate would run every Adam step
        on NaN and leave each layer as merged, so it is refused here rather than after minutes."""
        if not _is_int(self.steps) or self.steps < 0:
            raise InputError(f"--refine-steps {self.steps} must be 0 or more (e.g. {DEFAULT_REFINE_STEPS})")
        if not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or not self.lr > 0:
            raise InputError(f"--refine-lr {self.lr} must be a finite positive number (e.g. {DEFAULT_REFINE_LR})")
        if not _is_int(self.memory) or self.memory < 1:
            raise InputError(f"--refine-memory {self.memory} must be positive (e.g. 4GiB)")
        if not _is_int(self.global_steps) or self.global_steps < 0:
            raise InputError(
                f"--refine-global-steps {self.global_steps} must be 0 or more (e.g. {DEFAULT_REFINE_GLOBAL_STEPS})"
            )
        if not isinstance(self.global_lr, (int, float)) or not math.isfinite(self.global_lr) or not self.global_lr > 0:
            raise InputError(
                f"--refine-global-lr {self.global_lr} must be a finite positive number (e.g. {DEFAULT_REFINE_GLOBAL_LR})"
            )
        if self.tokens is not None and (not _is_int(self.tokens) or self.tokens < 1):
            raise InputError(f"--refine-tokens {self.tokens} must be positive (e.g. 32768)")
        weight = self.opening_weight
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise InputError(
                f"--refine-opening-weight {weight} must be a finite number, 0 or more (e.g. {DEFAULT_REFINE_OPENING_WEIGHT})"
            )
        if not _is_int(self.batch_blocks) or self.batch_blocks < 1:
            raise InputError(f"--refine-batch-blocks {self.batch_blocks} must be at least 1 (e.g. 4)")
        validate_limits("convert", {"--refine-" + name.replace("_", "-"): getattr(self, name) for name in COUNTED})


# Fields RefineOptions once had, each with the value at which it changed nothing: a record of then (mha2gqa.json,
# a sweep.json's settings) holding it at that value means the same settings as one without it. --refine-mlp's
# block stage went to bench/ (issue 27: it lost on held-out text on a real model).
RETIRED_REFINE_FIELDS = {"mlp_output": False}


# Fields RefineOptions gained, each with the value that does what a record of before, which lacks it, ran with.
ADDED_REFINE_FIELDS = {"opening_weight": 1.0, "global_precision": "float32"}


def current_refine_fields(recorded: dict) -> dict:
    """A recorded RefineOptions dict less each retired field at its no-op value (one at another value is kept, so
    that the record still reads as other settings than any RefineOptions of now), and with each added field it
    lacks at the value it ran with."""
    kept = {k: v for k, v in recorded.items() if k not in RETIRED_REFINE_FIELDS or v != RETIRED_REFINE_FIELDS[k]}
    return {**{k: v for k, v in ADDED_REFINE_FIELDS.items() if k not in kept}, **kept}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ConvertOptions:
    groups: int | None = None
    """Target number of kv heads (1 = multi-query). Must divide the source's kv heads. Needed unless
    --kv-heads-per-layer or --kv-budget gives each layer its own count."""
    method: Method | str = Method.MEAN
    """How each group's kv heads become one."""
    seed: int = 0
    """Seed of the random method (and of --refine's held-out split)."""
    dtype: str | None = None
    """Cast floating tensors to float32, float16 or bfloat16 (default: keep each tensor's dtype)."""
    max_shard_size: str | int = "5GB"
    """Largest output shard, e.g. 5GB, 500MB, 2GiB, or bytes."""
    force: bool = False
    """Replace DST if it exists and is not empty (SRC is never touched)."""
    dry_run: bool = False
    """Plan only, write nothing: the plan is returned, and the command prints its summary first (what would be
    written, the stages, memory and time), every output tensor and what it is made of with --plan-tensors."""
    progress: bool = True
    """Show progress bars."""
    calibration: str | list[str] | dict | None = None
    """Calibration text for --method calibrated, --grouping similarity, --refine and the per-layer
    reconstruction errors: a .txt/.md/.jsonl/.json/.parquet file (.gz/.bz2/.xz/.zst too), a folder of them,
    'austen' (the embedded novels), a hub dataset with a 'text' column (online), or 'parent': text sampled
    from SRC itself, which needs no data of yours (per-domain measurements: docs/calibration.md); repeat the flag for several files (in Python: a list), or give each entry a share
    to mix sources, e.g. --calibration parent:0.5 --calibration corpus.txt:0.5 (in Python: a dict); commas
    say the same as repeating the flag: --calibration parent:0.5,corpus.txt:0.5. Unset
    where a stage needs it: parent:0.75 and austen:0.25, three quarters the parent's samples, a quarter the embedded
    novels (the best mix measured, docs/calibration.md). Sampling costs about one forward of SRC per token (on 2 CPU cores, tens
    of tokens a second for a 135M model; --dry-run shows the stage). In Python a sweep passes the statistics
    it gathered once as convert(..., stats=...) instead."""
    calibration_tokens: int | None = None
    """How many calibration tokens to run through SRC (once) to gather statistics, all sources together.
    Unset: 131,072 of a text; with the parent's samples, 128 x the model's hidden size (73,728 for hidden
    576), the tokens --refine fits on."""
    grouping: Grouping | str = Grouping.CONTIGUOUS
    """Which kv heads share a group."""
    calibration_memory: str | int = DEFAULT_CALIBRATION_MEMORY
    """Most memory for the statistics ((hidden+1)^2 float64 per layer); beyond it the tokens go through SRC
    once per slice of layers."""
    refine: RefineOptions | None = None
    """After the merge, fit each layer's attention parameters, layer by layer, so that its output on the
    calibration tokens matches the parent's (inputs from the already-refined layers below). Reads
    --calibration (unset: its default); works with every --method and --grouping. Per-layer errors on fit and held-out
    calibration tokens go to the terminal and mha2gqa.json. Then all layers together against the parent's
    next-token distribution (--refine-global-steps; 0: off). Settings: the --refine-* flags (in Python a
    RefineOptions; None: no refinement). Off by default; on the command line on with --kv-budget (--no-refine:
    off)."""
    check: bool = True
    """After the write, score SRC and DST on the first 512 tokens of each probe domain (prose, code, Python docs,
    licences): per domain the perplexity ratio, KL and top-1 agreement to SRC, one verdict (close / usable /
    not usable without uptraining) and the next command; kept in mha2gqa.json and on the card. SRC's numbers
    are cached per SRC (MHA2GQA_CACHE, else ~/.cache/mha2gqa). Skipped with one line where SRC has no
    tokenizer, or on a CPU where it would take over 2 minutes (a model over about 1B parameters)."""
    check_retrieval: bool = False
    """The check also runs eval's retrieval probe (eval --retrieval at its defaults: a fact far back in contexts of
    128 to 2,048 tokens, 24 questions a length) on SRC and DST: recall per length beside SRC's, and the share of
    SRC's answer probability kept, in mha2gqa.json and the terminal. Perplexity does not see the heads that copy from
    far back. Its forwards (about 33,000 tokens a model for a 2,048-token context) are in the check's estimate."""
    keep_retrieval_heads: bool = False
    """Find SRC's retrieval heads (query heads that copy a fact from far back: scored on 48 retrieval-probe questions
    of 128 and 512 tokens over an embedded novel, eager attention) and keep the kv heads they read: each weighs 1 +
    --retrieval-weight x its heads' scores in its group's merge (mean, mean-norm, calibrated), and with several groups
    such kv heads go to different groups where there are enough. Recorded in mha2gqa.json (retrieval_heads);
    measured in docs/eval.md "Keeping retrieval heads"."""
    retrieval_weight: float | None = None
    """With --keep-retrieval-heads: how much a retrieval head's score adds to its kv head's weight in the merge
    (0: spread only). Unset: 8."""
    kv_heads_per_layer: str | None = None
    """One kv-head count per layer, comma-separated (e.g. 4,2,2,1), each a divisor of the source's kv heads,
    instead of --groups. Every --method, --grouping and --refine works at these counts; counts that differ are
    written as a Nemotron-NAS (DeciLM) checkpoint (Llama parents; docs/convert.md), equal ones as --groups writes
    them."""
    kv_budget: str | None = None
    """A KV-cache budget instead of --groups: a fraction of the parent's KV bytes per token (0.5) or bytes per
    token (12KiB). Each layer's loss at each kv-head count is measured first (the "layer losses" stage: 8
    calibration blocks of --calibration, or its first 8 where a stage that shapes the weights reads it too): the
    KL to SRC on those blocks plus the KL on the answer tokens of copy prompts built from them (a span planted
    early, asked for at the end: the layers that copy from far back keep their kv heads where the budget allows).
    The counts whose losses sum least within the budget (an exact knapsack) are converted as with
    --kv-heads-per-layer (they and the text-only choice are also measured whole, all pooled layers at once, and
    recorded), then merged: by default (on the command line, --method and --refine unset) with --method calibrated
    --refine, our best merge (docs/convert.md, "Per-layer kv heads"); --method mean --no-refine is the fast one,
    which loses far more. In Python give method and refine as for any conversion."""

    def __post_init__(self):
        if self.groups is None and self.kv_heads_per_layer is None and self.kv_budget is None:
            raise TypeError("ConvertOptions needs groups (or, per layer, kv_heads_per_layer or kv_budget)")
        self.method = Method.parse(self.method, "--method")
        self.grouping = Grouping.parse(self.grouping, "--grouping")
        # every path (--groups, per layer, a budget) reads these: refused here, before any of them starts
        # --groups 0 or less: the plan's rule refuses it in better words (a divisor of SRC's kv heads, the valid ones)
        groups = None if _is_int(self.groups) and self.groups < 1 else self.groups
        values = {"--groups": groups, "--seed": self.seed, "--calibration-tokens": self.calibration_tokens}
        validate_limits("convert", values)
        self.dtype = dtype_name(
            self.dtype
        )  # bf16, fp16, torch.float32, ... -> the one name (mha2gqa/architecture/dtypes.py)

    @property
    def calibration_shapes_weights(self) -> bool:
        """Some stage that writes weights reads the calibration text (without one, it only feeds the
        per-layer reconstruction errors of the record)."""
        return self.method.needs_calibration or self.grouping == Grouping.SIMILARITY or self.refine is not None

    @classmethod
    def from_kwargs(cls, groups: int | None, kwargs: dict) -> ConvertOptions:
        """The options of `convert(src, dst, groups, **kwargs)`; an unknown keyword is a TypeError, as it was
        when these were convert's own parameters."""
        validate_keywords(cls, kwargs, "convert")
        counted = ("groups", "kv_heads_per_layer", "kv_budget")
        if groups is None and all(kwargs.get(key) is None for key in counted):
            raise TypeError("convert() missing 1 required argument: 'groups' (or kv_heads_per_layer, or kv_budget)")
        return cls(**({"groups": groups} if groups is not None else {}), **kwargs)


@dataclass(frozen=True)
class Flag:
    """One `mha2gqa convert` flag and the options field it sets. CONVERT_FLAGS is the one table: the click
    options (cli/convert_cmd.py), the options built from a command line (options_from_flags) and the command
    line that makes a conversion again (flag_words, the model card's Reproduce line) are all read from it,
    so a new option is one entry here plus its field (a RefineOptions field gets its --refine- flag by itself)."""

    flag: str
    # A ConvertOptions field; "refine.X" for RefineOptions.X (set only with --refine). Unset: the flag's
    # own name, as click names its parameter: --max-shard-size -> max_shard_size, --refine-lr -> refine.lr.
    field: str = ""
    short: str | None = None
    type: type | None = None  # the value's type where the field's default does not tell (None defaults)
    size: bool = False  # a byte count the user writes as a size (4GiB); the field holds the text or the bytes
    repeat: bool = False  # may be given several times: a list in the options (one value: the value itself)
    changes_output: bool = True  # False for --force, --dry-run and --quiet: no byte of DST depends on them
    required: bool = False
    default_from: str | None = None  # unset on the command line: this ConvertOptions field's value (--refine-seed)
    inverted: bool = False  # the flag sets the field to False (--quiet: progress)
    help: str | None = None  # only where the field's docstring does not describe the flag (--quiet)
    default_words: str | None = None  # --help's [default: ...] where the default depends on another flag
    metavar: str | None = None

    def __post_init__(self):
        if not self.field:  # frozen: the field the flag names is set once, here
            key = self.key  # --refine-lr -> refine_lr -> refine.lr (a RefineOptions field)
            field = "refine." + key.removeprefix("refine_") if key.startswith("refine_") else key
            object.__setattr__(self, "field", field)

    @property
    def owner(self) -> type:
        return RefineOptions if self.field.startswith("refine.") else ConvertOptions

    @property
    def name(self) -> str:
        """The field's name in its owner."""
        return self.field.rsplit(".", 1)[-1]

    @property
    def key(self) -> str:
        """The name click gives the flag's parameter: --refine-global-steps -> refine_global_steps."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def default(self):
        found = next(f for f in fields(self.owner) if f.name == self.name)
        return None if self.default_from else found.default

    @property
    def switch(self) -> bool:
        """A flag without a value: its field is a bool (or the refine switch)."""
        return self.field == "refine" or isinstance(self.default, bool)


def _refine_flags(**extras: dict) -> tuple[Flag, ...]:
    """--refine-X for every RefineOptions field X, in the fields' order, so that a new refine setting is its field
    (with `extras`, the Flag settings a field needs besides its name)."""
    return tuple(Flag("--refine-" + f.name.replace("_", "-"), **extras.get(f.name, {})) for f in fields(RefineOptions))


CONVERT_FLAGS: tuple[Flag, ...] = (
    Flag("--groups", short="-g", type=int),
    Flag("--kv-heads-per-layer", type=str, metavar="COUNTS"),  # --groups' alternatives, beside it in --help
    Flag("--kv-budget", type=str, metavar="X"),
    Flag("--method", default_words="mean; with --kv-budget, calibrated"),
    Flag("--seed"),
    Flag("--dtype", type=str),
    Flag("--max-shard-size", size=True),
    Flag("--force", changes_output=False),
    Flag("--dry-run", changes_output=False),
    Flag(
        "--quiet",
        "progress",
        short="-q",
        inverted=True,
        changes_output=False,
        help="No progress bar, no estimate and no time taken.",
    ),
    Flag("--calibration", type=str, repeat=True, metavar="DATA"),
    Flag("--calibration-tokens", type=int),
    Flag("--calibration-memory", size=True),
    Flag("--grouping"),
    Flag("--check", changes_output=False),
    Flag("--check-retrieval", changes_output=False),
    Flag("--keep-retrieval-heads"),
    Flag("--retrieval-weight", type=float),
    Flag("--refine"),
    *_refine_flags(memory=dict(size=True), tokens=dict(type=int), seed=dict(type=int, default_from="seed")),
)


# A --kv-budget conversion's merge when the command line leaves --method or --refine unset: our best merge, which
# keeps the most of the parent (SmolLM2-135M at 2/3 of the KV: mean 5.18x the parent's perplexity, calibrated 2.72x
# at the same counts; calibrated + refine, its losses through the merge, 1.35x: docs/convert.md "Per-layer kv
# heads"). --groups and
# --kv-heads-per-layer keep mean, the GQA paper's recipe; a budget has no such recipe to keep, and its layer losses
# already cost the parent's forwards that calibration needs.
BUDGET_DEFAULTS = {"method": Method.CALIBRATED.value, "refine": True}


def options_from_flags(values: dict, unset: frozenset[str] | set[str] = frozenset()) -> ConvertOptions:
    """The ConvertOptions of a parsed command line: `values` maps each Flag.key to what the user gave (click's
    parameters; an unset flag holds its default). `unset`: the keys the user gave neither on the command line nor
    in --config; with --kv-budget, an unset --method or --refine takes BUDGET_DEFAULTS."""
    if values.get("kv_budget") is not None:
        values = {**values, **{key: value for key, value in BUDGET_DEFAULTS.items() if key in unset}}
    convert, refine = {}, {}
    for flag in CONVERT_FLAGS:
        value = values[flag.key]
        if flag.field == "refine":
            continue
        if flag.inverted:
            value = not value
        if flag.repeat:
            value = (list(value) if len(value) > 1 else value[0]) if value else None
        if flag.default_from and value is None:
            value = values[flag.default_from]
        if flag.size and flag.owner is RefineOptions:  # RefineOptions holds bytes; ConvertOptions the text
            value = parse_size(value, flag.flag)
        (refine if flag.owner is RefineOptions else convert)[flag.name] = value
    if not values["refine"]:
        _refuse_refine_settings(values)
    return ConvertOptions(**convert, refine=RefineOptions(**refine) if values["refine"] else None)


def _refuse_refine_settings(values: dict) -> None:
    """A --refine-X given without --refine would be dropped without a word: refused, naming it."""
    for flag in CONVERT_FLAGS:
        value = values[flag.key]
        if flag.owner is RefineOptions and value is not None and not _same(flag, value, flag.default):
            raise InputError(f"{flag.flag} {value} sets --refine, which is off: add --refine, or leave {flag.flag} out")


def flag_words(options: ConvertOptions) -> list[str]:
    """The flags that make `options` again: every flag that changes the output and is not at its default
    (--groups and --method always), in the table's order."""
    return [word for flag, value in changed_flags(options) for word in _written(flag, value)]


def changed_flags(options: ConvertOptions) -> list[tuple[Flag, object]]:
    """(flag, value) of every flag that changes the output and is not at its default (--groups and --method
    always), in the table's order: the command line (flag_words) and convert.yaml (config_file) both write these."""
    changed = []
    for flag in CONVERT_FLAGS:
        if not flag.changes_output:
            continue
        if flag.field == "refine":
            changed += [(flag, True)] if options.refine is not None else []
            continue
        holder = options if flag.owner is ConvertOptions else options.refine
        if holder is None:
            continue
        value = getattr(holder, flag.name)
        default = getattr(options, flag.default_from) if flag.default_from else flag.default
        if not flag.required and flag.flag != "--method" and _same(flag, value, default):
            continue
        changed.append((flag, value))
    return changed


def _same(flag: Flag, value, default) -> bool:
    if flag.size and value is not None and default not in (None, MISSING):
        return parse_size(value, flag.flag) == parse_size(default, flag.flag)
    return value == default


def _written(flag: Flag, value) -> list[str]:
    """One flag with its value as the command line takes it back."""
    if flag.switch:
        return [flag.flag] if value else [_negated(flag.flag)]
    if flag.repeat and isinstance(value, (list, tuple)):
        return [word for entry in value for word in (flag.flag, str(entry))]
    if isinstance(value, Enum):
        value = value.value
    return [flag.flag, repr(value) if isinstance(value, float) else str(value)]


def _negated(flag: str) -> str:
    """--refine-solve-output -> --no-refine-solve-output (a switch that is on by default is turned off so)."""
    return "--no-" + flag[2:]
