"""What `sweep` is asked to do: a typed schema, one docstring per field, importable without torch
(`mha2gqa sweep --help` builds its help from these docstrings)."""

from __future__ import annotations

from dataclasses import dataclass

from mha2gqa.convert.options import DEFAULT_CALIBRATION, Method, RefineOptions
from mha2gqa.corpus.probe import PROBE, parse_domains
from mha2gqa.eval.options import DEFAULT_MAX_TOKENS
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.limits import validate_limits

DEFAULT_METHODS = (Method.MEAN.value, Method.CALIBRATED.value)
DEFAULT_TOLERANCE = 0.05
# A candidate is broken on a domain of --data when its perplexity there is more than 1 + BROKEN_SLACK x
# tolerance times the parent's: twice what the geometric mean may lose (sweep/run.py recommend).
BROKEN_SLACK = 2


@dataclass
class SweepOptions:
    out: str
    """Directory for sweep.json, sweep.md, sweep.html and the plots (created; it may hold only an earlier
    sweep, replaced with --force or continued with --resume)."""
    data: str | tuple[str, ...] | dict = (PROBE,)
    """Held-out texts every candidate and the parent are evaluated on (perplexity, KL and top-1 agreement
    against the parent), each a domain measured apart: NAME=PATH (repeatable) or PATH, the forms of eval's
    --data; default 'probe', the probe set shipped in the package (docs/eval.md). A candidate is recommended
    only when the geometric mean of its per-domain perplexity ratios to the parent is within --tolerance and
    no domain is broken (its ratio above 1 + 2 x --tolerance)."""
    calibration: str | tuple[str, ...] | list[str] | dict = DEFAULT_CALIBRATION
    """Calibration text, read once for every candidate: what convert --calibration takes (a file, a folder,
    'austen', 'parent', a hub dataset, a NAME:SHARE mix, repeated or comma-separated: parent:0.75,austen:0.25),
    by default convert's: parent:0.75 and austen:0.25."""
    groups: tuple[int, ...] | None = None
    """kv-head counts to try, e.g. 8,4,2,1; each must divide the source's kv heads and be below it (values
    that do not are skipped, and said so). Default: every divisor of the source's kv heads below it."""
    methods: tuple[str, ...] = DEFAULT_METHODS
    """Conversion methods to try at every kv-head count, e.g. mean,calibrated (the --method values of
    convert)."""
    kv_budgets: tuple[str, ...] | None = None
    """Per-layer candidates beside the uniform ones, e.g. 0.5,0.75: KV budgets, each a fraction of the parent's
    KV bytes per token or bytes per token (12KiB), each converted as convert --kv-budget does with every
    --methods method (and --refine): each layer's kv heads chosen from its measured loss, written in the
    Nemotron-NAS format; Llama-family parents. The layer losses are measured once, for every budget and method,
    on the first 8 blocks of the calibration text. Default: none, the uniform candidates only."""
    refine: RefineOptions | None = None
    """Refine every candidate layer by layer after the merge (convert --refine, its default settings); the
    report then shows each layer's output error at every kv-head count as a heat map."""
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    """Evaluate on at most this many tokens of each --data text, its first ones, as `eval` does by default (all:
    every token; None in Python)."""
    calibration_tokens: int | None = None
    """Calibration tokens run through the source, once for the whole sweep (unset: convert's default, 131,072
    of a text, 128 x hidden of the parent's samples)."""
    tolerance: float = DEFAULT_TOLERANCE
    """How much worse than the parent's perplexity a recommended candidate may be, as a fraction (0.05 =
    5%), in the geometric mean over the --data domains; any one domain may be at most twice as much worse;
    between 0 and 10, both excluded."""
    keep: bool = False
    """Keep every converted model in OUT/models/ (default: each is written to a temporary directory inside
    OUT and removed once evaluated)."""
    retrieval: bool = False
    """Also run eval's retrieval probe (eval --retrieval, its default grid: a fact far back in contexts of 128 to
    2,048 tokens) on the parent and every candidate: the retrieval recall and answer probability kept columns, and
    recall per length in the result each row keeps. Perplexity does not see the heads that copy from far back."""
    seed: int = 0
    """Seed of the conversions (random method, --refine's split) and of the evaluations."""
    progress: bool = True
    """Show the progress bar over candidates."""
    force: bool = False
    """Replace an earlier sweep in OUT (as a whole: it is put back if the new one fails before its first
    candidate)."""
    dry_run: bool = False
    """Check everything (every candidate through convert's own plan, OUT, the room) and print what would
    run; write nothing."""
    resume: bool = False
    """Continue the sweep in OUT after an interruption: the candidates it finished are kept, not run again
    (the source and every setting that changes a number must be the same; --groups, --methods and
    --tolerance may differ)."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Refuse values no sweep can run with, each naming its flag (the style of RefineOptions.validate and
        EvalOptions.validate)."""
        self.methods = tuple(Method.parse(m, "--methods").value for m in self.methods)
        if not self.methods:
            raise InputError("--methods names no method: give at least one, e.g. mean,calibrated")
        if self.groups is not None and (not self.groups or any(g < 1 for g in self.groups)):
            given = ",".join(map(str, self.groups)) or "(nothing)"
            raise InputError(
                f"--groups {given}: give kv-head counts of at least 1, e.g. 4,2,1 (leave --groups out for every "
                "divisor of the source's kv heads)"
            )
        if self.force and self.resume:
            raise InputError("--force and --resume contradict each other: --force replaces OUT, --resume continues it")
        if not 0 < self.tolerance < 10:
            raise InputError(
                f"--tolerance {self.tolerance:g} must be between 0 and 10, both excluded: it is a fraction of the "
                "parent's perplexity (0.05 = 5%)"
            )
        if self.max_tokens is not None and self.max_tokens < 2:
            raise InputError(f"--max-tokens {self.max_tokens} must be at least 2 (a token and the one it predicts)")
        if self.calibration_tokens is not None and self.calibration_tokens < 1:
            raise InputError(f"--calibration-tokens {self.calibration_tokens} must be at least 1 (e.g. 131072)")
        if self.refine is not None:
            self.refine.validate()
        counts = {"--max-tokens": self.max_tokens, "--calibration-tokens": self.calibration_tokens, "--seed": self.seed}
        validate_limits("sweep", {**counts, "--groups": self.groups})
        if not parse_domains(self.data):
            raise InputError("--data names no text: give one or more, e.g. --data probe or --data prose=held.txt")
