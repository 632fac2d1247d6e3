"""`mha2gqa demo`: the whole job on the embedded default, offline, in minutes.

inspect -> convert (mean-pool) -> eval parent and converted -> uptrain for alpha x the parent's
pretraining tokens -> eval the uptrained model -> a side-by-side report, and the summary the CLI prints.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.convert.options import ConvertOptions
from mha2gqa.convert.prepare import prepare
from mha2gqa.demo.timing import demo_estimate
from mha2gqa.estimates.stages import DEMO
from mha2gqa.files import embedded, jsontext
from mha2gqa.files.run_folder import run_folder, validate_folder
from mha2gqa.runtime.errors import InputError, import_torch

DEMO_RECIPE = Path(__file__).parent / "demo-uptrain.yaml"


@dataclass(frozen=True)
class DemoSettings:
    """What `--quick` changes: fewer held-out tokens, a shorter uptraining, no decode-speed grid."""

    eval_tokens: int | None  # perplexity tokens of Persuasion (None: the whole novel)
    alpha: float  # uptraining budget as a fraction of the parent's pretraining tokens
    speed: bool
    eval_blocks: int
    cloze_examples: int | None  # examples of the offline persuasion_cloze lm-eval task (None: all 355)

    @classmethod
    def make(cls, quick: bool, alpha: float | None) -> DemoSettings:
        if quick:
            return cls(
                eval_tokens=16384,
                alpha=alpha if alpha is not None else 0.01,
                speed=False,
                eval_blocks=4,
                cloze_examples=40,
            )
        return cls(
            eval_tokens=None,
            alpha=alpha if alpha is not None else 0.05,
            speed=True,
            eval_blocks=16,
            cloze_examples=None,
        )


def embedded_run_overrides(model: Path, out: Path, eval_blocks: int) -> list[str]:
    """The shipped recipe pointed at `model`, `out` and the embedded novels (absolute paths, so any
    working directory works): five for training, Persuasion for evaluation."""
    train = [str(p) for p in embedded.train_paths()]
    return [
        f"model={model}",
        f"output_dir={out}",
        f"data.train={jsontext.dumps(train)}",
        f"data.eval={jsontext.dumps([str(embedded.heldout_path())])}",
        f"data.eval_blocks={eval_blocks}",
    ]


@dataclass(frozen=True)
class DemoPlan:
    """Everything a demo run was asked for, checked (plan_demo); run_demo executes it."""

    out: Path
    settings: DemoSettings
    conversion: object  # the ConversionPlan of the mean-pool conversion
    force: bool

    def describe(self) -> list[str]:
        s, groups = self.settings, self.conversion.options.groups
        tokens = "the whole held-out novel" if s.eval_tokens is None else f"{s.eval_tokens:,} held-out tokens"
        return [
            f"would write the demo run into {self.out}" + (" (replacing the earlier run)" if self.force else ""),
            f"  convert the embedded parent to {groups} kv heads by mean-pooling",
            f"  evaluate parent and converted on {tokens}" + (", with the decode-speed grid" if s.speed else ""),
            f"  uptrain for alpha={s.alpha:g} x {embedded.pretrain_tokens():,} pretraining tokens, evaluate again",
            "  write the report (markdown, html, plots)",
        ]


def plan_demo(
    out: Path, groups: int = 2, quick: bool = False, alpha: float | None = None, force: bool = False, progress=True
) -> DemoPlan:
    """Every check of a demo request, torch-free, before anything is written: --alpha, --groups (through
    convert's prepare) and --out (the rule of every output folder)."""
    settings = DemoSettings.make(quick, alpha)
    if not 0 < settings.alpha <= 1:
        raise InputError(f"--alpha {settings.alpha} must be in (0, 1]: e.g. 0.05 for 5% of the pretraining tokens")
    conversion = prepare(
        # no check at the conversion: the demo's own evaluation gives its verdict (check_line)
        embedded.model_dir(),
        ConvertOptions(groups=groups, method="mean", force=True, progress=progress, check=False),
    )
    out = validate_folder(out, "--out", "demo", RUN_ENTRIES, force)
    return DemoPlan(out, settings, conversion, force)


def run_demo(
    out: Path,
    groups: int = 2,
    quick: bool = False,
    alpha: float | None = None,
    echo: Callable[[str], None] = print,
    progress: bool = True,
    force: bool = False,
    plan: DemoPlan | None = None,
    clock=None,
) -> dict:
    """Run every stage into `out`; returns the paths written (report files included). An earlier run in
    `out` is refused unless `force`, and then replaced as a whole (see replacing_run). `plan`: one made
    by plan_demo (the other arguments are then ignored). clock: the estimates Clock that says the estimate,
    times the stages and says the time taken (default: one started now, speaking through `echo`)."""
    from mha2gqa.estimates import for_this_machine
    from mha2gqa.estimates.clock import Clock

    plan = plan or plan_demo(out, groups, quick, alpha, force, progress)
    clock = clock or Clock(echo=echo, started=time.time())
    with replacing_run(plan.out, plan.force) as out:
        import_torch()  # the probe runs on torch's threads (threads.apply: the CLI's)
        clock.begin(lambda: for_this_machine(demo_estimate(plan), "torch"))  # once --out is accepted
        written = _run_stages(plan.conversion.source, out, plan.conversion, plan.settings, echo, progress, clock)
    clock.finish()
    return written


def _run_stages(parent: Path, out: Path, conversion, settings: DemoSettings, echo, progress: bool, clock) -> dict:
    from mha2gqa.convert.inspect import inspect_model
    from mha2gqa.convert.run import execute
    from mha2gqa.eval import evaluate
    from mha2gqa.report import write_report

    info = inspect_model(parent)
    echo(
        f"[1/6] parent: {parent} ({info['layers']} layers, {info['heads']} heads, {info['kv_heads']} kv heads, "
        f"{info['parameters'] / 1e6:.1f}M parameters)"
    )

    converted = out / "converted"
    groups = conversion.options.groups
    clock.stage(DEMO.convert.name)
    execute(conversion, converted)
    echo(f"[2/6] converted to {groups} kv heads by mean-pooling: {converted}")

    results = out / "results"
    eval_kwargs = _eval_kwargs(settings, echo, progress)
    clock.stage(DEMO.evaluate_parent.name)
    evaluate(parent, role="parent", label="parent (MHA)", out=results / "parent.json", **eval_kwargs)
    clock.stage(DEMO.evaluate_converted.name)
    _evaluate_child(converted, "converted", parent, groups, results, settings.speed, eval_kwargs)
    echo(f"[3/6] evaluated parent and converted on held-out Persuasion: {results}")
    echo(f"      check: {check_line(results / 'parent.json', results / 'converted.json')}")

    clock.stage(DEMO.uptrain.name)
    uptrained = _uptrain(converted, out / "uptrained", settings, echo)
    clock.stage(DEMO.evaluate_uptrained.name)
    _evaluate_child(uptrained, "uptrained", parent, groups, results, settings.speed, eval_kwargs)
    echo("[5/6] evaluated the uptrained model")

    clock.stage(DEMO.report.name)
    names = ("parent", "converted", "uptrained")
    written = write_report([results / f"{n}.json" for n in names], out / "report", metrics=uptrained / "metrics.jsonl")
    echo(f"[6/6] report: {written.get('markdown') or out / 'report'}")
    return {"out": out, "converted": converted, "uptrained": uptrained, "results": results, **written}


def check_line(parent_json: Path, child_json: Path) -> str:
    """convert's check, read off the demo's own evaluation instead of run again at its conversion: the verdict
    (convert/check.py) from the child's perplexity ratio to the parent's on the same held-out text."""
    from mha2gqa.convert.check import verdict
    from mha2gqa.eval.schema import load_result, perplexity

    ratio = perplexity(load_result(child_json)) / perplexity(load_result(parent_json))
    return f"{verdict({'held-out': ratio}).line} (held-out perplexity {ratio:.2f}x the parent's)"


def _eval_kwargs(settings: DemoSettings, echo, progress: bool) -> dict:
    """What every evaluation of the demo measures, the same for the three models."""
    # Non-overlapping 512-token windows (the model's whole context), batched: the same measure as
    # scripts/embedded_stats.py, and 2x fewer forward passes than the default half-context stride.
    eval_kwargs = dict(
        data=str(embedded.heldout_path()),
        max_tokens=settings.eval_tokens,
        context=512,
        stride=512,
        batch_size=8,
        speed_preset="cpu" if settings.speed else None,
        progress=progress,
    )
    if importlib.util.find_spec("lm_eval") is not None:  # the [lmeval] extra: the report gains cloze accuracy
        eval_kwargs.update(lm_eval_tasks=["persuasion_cloze"], lm_eval_limit=settings.cloze_examples)
    else:
        echo("note: pip install 'mha2gqa[lmeval]' adds the last-word cloze accuracy (lm-eval) to the report")
    return eval_kwargs


def _evaluate_child(
    model: Path, role: str, parent: Path, groups: int, results: Path, speed: bool, eval_kwargs: dict
) -> None:
    """Evaluate the converted or the uptrained model against the parent into results/ROLE.json, and
    show the numbers on its card."""
    from mha2gqa.eval import evaluate

    evaluate(
        model,
        reference=str(parent),
        role=role,
        label=f"{role} (GQA-{groups})",
        out=results / f"{role}.json",
        speed_side_by_side=speed,  # the parent timed in turn with it: the report's speed-up is a real one
        **eval_kwargs,
    )
    _beside_model(results / f"{role}.json", model)


def _uptrain(converted: Path, run_dir: Path, settings: DemoSettings, echo) -> Path:
    """Uptrain the converted model into `run_dir` for alpha x the parent's pretraining tokens."""
    from mha2gqa.uptrain import load_recipe, train

    tokens = embedded.pretrain_tokens()
    budget = [f"budget.alpha={settings.alpha}", f"budget.pretrain_tokens={tokens}"]
    recipe = load_recipe(DEMO_RECIPE, embedded_run_overrides(converted, run_dir, settings.eval_blocks) + budget)
    uptrained = train(recipe)
    echo(f"[4/6] uptrained for alpha={settings.alpha:g} x {tokens:,} pretraining tokens: {uptrained}")
    return uptrained


def _beside_model(result: Path, model_dir: Path) -> None:
    """A copy of the demo's result as MODEL_DIR/eval.json, so the model's card shows the numbers of the
    demo's table (the card lists the eval results saved beside the model)."""
    from mha2gqa.eval.card_table import measured_cells
    from mha2gqa.records.card import write_card

    shutil.copyfile(result, model_dir / "eval.json")
    write_card(model_dir, measured=measured_cells(model_dir))


# What a demo run writes into --out: a folder holding only these is an earlier run, and --force may
# replace it; anything else there is the user's and is never moved or deleted (run_folder.validate_folder).
RUN_ENTRIES = frozenset({"converted", "results", "uptrained", "report"})


@contextmanager
def replacing_run(out: Path, force: bool):
    """Yield `out` to write a run into, by the rule of every output folder (mha2gqa/files/run_folder.py): an
    earlier run is refused without `force`; with it, it is moved aside before anything is written and
    deleted only after the new run has finished; a failure, an interruption, or a kill -9 (at the next
    start) removes the new files and puts the earlier run back."""
    with run_folder(out, "--out", "demo", RUN_ENTRIES, force) as folder:
        yield folder.path


def summary_rows(report_json: Path) -> tuple[list[str], list[list]]:
    """Headers and rows (numbers, None where unmeasured) of what was lost and what was saved, from the
    report's rows; the CLI prints them as a table."""
    headers = ["model", "perplexity", "KL vs parent", "top-1 agree", "KV/token", "recovery"]
    keys = ["label", "perplexity", "kl_mean", "top1_agreement", "kv_bytes_per_token", "recovery"]
    rows = json.loads(Path(report_json).read_text())["rows"]
    return headers, [[row.get(key) for key in keys] for row in rows]
