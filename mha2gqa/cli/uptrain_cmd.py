"""`mha2gqa uptrain --recipe R [key=value ...]`: the same code as `accelerate launch -m mha2gqa.uptrain`."""

from __future__ import annotations

import click

from mha2gqa.cli.paths import file_option
from mha2gqa.estimates.stages import UPTRAIN


def _print_keys(ctx, _param, value):
    if not value or ctx.resilient_parsing:
        return
    from mha2gqa.uptrain.recipe import describe

    for key, default, doc in describe():
        click.echo(f"{key} (default {default})\n    {doc}")
    ctx.exit()


@click.command(
    "uptrain",
    short_help="Uptrain (continue pre-training) a model as a YAML recipe says.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@file_option(
    "--recipe",
    "YAML recipe, or the name of one shipped in the package: distill-parent-cpu or distill-parent-gpu (distil a "
    "converted model from its parent on the parent's own samples: no data needed; give model=, distill.teacher= "
    "and output_dir=). The repository's recipes/ holds more; each starts with the command that runs it.",
    required=True,
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the run in the recipe's output_dir from its last checkpoint: same data order, step, "
    "learning rate, optimizer and RNG state.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check the recipe and print the run: the recipe as resolved, the data it reads or samples, its steps and "
    "tokens, its time and peak memory; write nothing.",
)
@click.option(
    "--keys",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_keys,
    help="List every recipe key with its default and meaning, then exit.",
)
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def uptrain(recipe, resume, dry_run, overrides):
    """Uptrain (continue pre-training) a model as the YAML RECIPE says, in this process.

    KEY=VALUE pairs after the options override recipe keys, dotted for sections:
    `optim.lr=1e-4 budget.max_steps=200 data.train=corpus.jsonl`. Unknown keys and bad values are
    reported together. `data.train=parent` (with distill.teacher) trains on sequences sampled from the
    teacher, no data needed; `data.train=[parent:0.5,corpus.jsonl:0.5]` mixes (docs/uptrain.md). Writes output_dir/: resumable checkpoints (checkpoints/step-N, the last
    keep_last kept), metrics.jsonl, and at the end a plain HF checkpoint (safetensors, config,
    tokenizer) with mha2gqa.json provenance.

    For several GPUs (DDP, FSDP, DeepSpeed) run the same recipe with
    `accelerate launch --config_file recipes/accelerate/<fsdp|ddp|zero3>.yaml -m mha2gqa.uptrain --recipe R`.
    """
    from mha2gqa.estimates.clock import Clock
    from mha2gqa.runtime import threads
    from mha2gqa.runtime.errors import import_torch
    from mha2gqa.uptrain import load_recipe, train

    loaded = load_recipe(recipe, list(overrides))  # torch-free: a bad recipe is refused in a second, not after torch
    if dry_run:
        _dry_run(recipe, loaded, resume)
        return
    clock = Clock()  # the estimate before the models are loaded, and the time taken at the end
    import_torch()  # with interrupts held: a signal during torch's start-up would abort
    clock.stage(UPTRAIN.load.name)
    from mha2gqa.uptrain.guard import TrainingDiverged

    threads.apply(threads.for_model(loaded.model or loaded.init_from_config))
    try:
        out = train(loaded, resume=resume, clock=clock)
    except TrainingDiverged as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"output: {out}")


def _dry_run(path, recipe, resume: bool) -> None:
    """What the run would do, torch-free, nothing written (mha2gqa.uptrain.plan); refused where the run would
    refuse before its first write (mha2gqa.uptrain.preflight: the same functions)."""
    import yaml

    from mha2gqa.uptrain.plan import plan_run
    from mha2gqa.uptrain.preflight import validate_as_the_run_does
    from mha2gqa.uptrain.recipe_load import recorded

    plan = plan_run(recipe)
    validate_as_the_run_does(recipe, resume, plan.student, plan.teacher)

    resolved = yaml.safe_dump(recorded(recipe), sort_keys=False).rstrip().splitlines()
    click.echo(f"recipe {path}, as resolved (local paths absolute):")
    click.echo("\n".join(f"  {line}" for line in resolved))
    for line in plan.describe():
        click.echo(line)
    click.echo(
        f"would write {recipe.output_dir}: checkpoints, metrics.jsonl, the final model (--dry-run: nothing written)"
    )
