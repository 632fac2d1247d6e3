"""What a conversion kept, said at its end: the parent and the converted model scored on the first tokens of
every probe-set domain, one verdict, and the next command to run. Torch-free (prepare plans it, `--dry-run`
lists it with its cost); check_run.py runs it as one `evaluate` against the parent, check_cache.py keeps the
parent's numbers.

Mean-pooling a real model (the GQA paper's recipe, a start for uptraining) gives 1,141x its parent's perplexity
on SmolLM2 3 -> 1 kv heads, and finishes in a second with "KV cache 3x smaller". A user learns what that model
is worth only if the tool says so: a table per domain, a verdict, what to do next (DESIGN.md, section 9).
The probe set measures; it never enters a calibration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.architecture.layouts import config_vocab
from mha2gqa.corpus.probe import DOMAINS
from mha2gqa.files.cache import cache_dir, model_key
from mha2gqa.runtime.errors import InputError

CHECK_TOKENS = 512  # scored per domain: a few hundred tokens keep a 135M model's check well under a minute on CPU
CHECK_WINDOW = 512  # tokens per forward, or the model's context when shorter
# The verdict's thresholds, on each domain's perplexity ratio to the parent. The usable bounds are the
# target the project set a real model's no-data conversion (issue 28: at most 1.5x by the geometric mean,
# no domain above 2x); "close" is within the run-to-run spread of a few hundred tokens' perplexity.
CLOSE_RATIO = 1.10
USABLE_GEOMEAN = 1.5
USABLE_MAX = 2.0
# On a CPU, a check estimated longer than this is skipped with one line (a 1B model's takes minutes there).
CPU_CHECK_BUDGET_S = 120

CLOSE, USABLE, NOT_USABLE = "close", "usable", "not usable"


@dataclass(frozen=True)
class CheckPlan:
    """The check a conversion will run (or why not): planned by prepare, run by execute."""

    tokens: int  # scored per domain
    window: int  # tokens per forward
    domains: tuple[str, ...]
    seconds: float  # estimated on the rates' machine (a cached parent costs less)
    skip: str | None = None  # why it will not run; None: it runs
    parts: tuple = ()  # its work (estimates.check_parts), which the estimate adds
    device: str = "cpu"  # where both models are scored: the plan's decision, never asked again at run time
    retrieval: bool = (
        False  # --check-retrieval: eval's retrieval probe on both models too (eval --retrieval's measurement)
    )

    def describe(self) -> str:
        if self.skip:
            return f"check: skipped ({self.skip})"
        probe = "; the retrieval probe's recall per context length, DST beside the parent" if self.retrieval else ""
        return (
            f"check: the parent and DST scored on the first {self.tokens} tokens of each probe domain "
            f"({', '.join(self.domains)}): perplexity ratio, KL and top-1 agreement, a verdict and the next step"
            + probe
        )


def parent_cached(src: Path) -> bool:
    """Whether the cache holds a check of this parent (check_cache names each file by the parent's model key
    first): the estimate's guess, without torch or the tokenizer, that its forward will not run again."""
    try:
        return any((cache_dir() / "check").glob(f"{model_key(src)}-*.safetensors"))
    except (OSError, InputError):  # an unusable cache: the check says so when it runs
        return False


def plan_check(config: dict, params: int, wanted: bool, seconds: float, device: str, parts: tuple = ()) -> CheckPlan:
    """The check of a conversion of a model of `params` parameters whose check would take `seconds` (the sum of
    its `parts` of work)."""
    context = config.get("max_position_embeddings")
    window = min(CHECK_WINDOW, context) if isinstance(context, int) and context > 1 else CHECK_WINDOW
    skip = None
    if not wanted:
        skip = "--no-check"
    elif device == "cpu" and seconds > CPU_CHECK_BUDGET_S:
        skip = (
            f"a {params / 1e9:.1f}B-parameter model's check would take about {math.ceil(seconds / 60)} min on this "
            "CPU; run `mha2gqa eval DST --reference SRC --max-tokens 512` on a GPU instead"
        )
    return CheckPlan(CHECK_TOKENS, window, DOMAINS, seconds, skip, parts, device)


def check_logits_bytes(config: dict) -> int:
    """One window's float32 logits and log-probabilities, the most the check holds besides a model."""
    return 3 * CHECK_WINDOW * config_vocab(config) * 4


@dataclass(frozen=True)
class Verdict:
    kind: str  # CLOSE, USABLE or NOT_USABLE
    line: str  # what the user reads
    lossy: tuple[str, ...]  # the domains above CLOSE_RATIO, worst first


def geometric_mean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def verdict(ratios: dict[str, float]) -> Verdict:
    """One verdict from each domain's perplexity ratio to the parent (None: not finite, NaN logits)."""
    broken = [d for d, r in ratios.items() if r is None or not math.isfinite(r)]
    if broken:
        return Verdict(
            NOT_USABLE, f"not usable: its scores on {', '.join(broken)} are not finite (NaN or inf)", tuple(broken)
        )
    lossy = tuple(sorted((d for d, r in ratios.items() if r > CLOSE_RATIO), key=lambda d: -ratios[d]))
    mean, worst = geometric_mean(ratios.values()), max(ratios.values())
    if not lossy:
        return Verdict(CLOSE, f"close to the parent (every domain within {CLOSE_RATIO:g}x)", lossy)
    if math.isfinite(mean) and mean <= USABLE_GEOMEAN and worst <= USABLE_MAX:
        named = ", ".join(f"{d} {ratios[d]:.2f}x" for d in lossy)
        return Verdict(USABLE, f"usable, with losses on {named}", lossy)
    return Verdict(
        NOT_USABLE,
        f"not usable without uptraining (geometric mean {mean:.3g}x, worst {worst:.3g}x; usable is at most "
        f"{USABLE_GEOMEAN:g}x and no domain above {USABLE_MAX:g}x)",
        lossy,
    )


def next_steps(kind: str, src: str, dst: str, target: list[str], calibrated_refined: bool, device: str) -> list[str]:
    """The commands to run next: uptraining on the parent's own samples (no data needed) with the shipped recipe
    for the device the check ran on, and, when the conversion was not calibrated + refined, that first. `target`:
    the flag and value that gave the counts (--groups 8, --kv-heads-per-layer 4,2,1)."""
    if kind == CLOSE:
        return []
    recipe = "distill-parent-gpu" if device.startswith("cuda") else "distill-parent-cpu"
    uptrain = (
        f"mha2gqa uptrain --recipe {recipe} model={_quoted(dst)} distill.teacher={_quoted(src)} "
        f"output_dir={_quoted(dst + '-uptrained')}"
    )
    steps = [uptrain]
    if not calibrated_refined:
        steps.append(
            f"mha2gqa convert {_quoted(src)} {_quoted(dst + '-refined')} {' '.join(map(_quoted, target))} "
            "--method calibrated --refine"
        )
    return steps


def _quoted(path: str) -> str:
    import shlex

    return shlex.quote(path)
