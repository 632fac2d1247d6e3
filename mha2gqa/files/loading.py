"""The one way mha2gqa loads a causal LM's weights (eval, its --reference, uptrain's student and
teacher, calibration): safetensors only, no code from the checkpoint, and every tensor accounted for.

transformers fills a missing, unexpected-shape or misnamed tensor with fresh random values and
carries on; a model built that way evaluates to a plausible number and trains without a word. Here
the loading info is checked and such a checkpoint is refused, naming the keys.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from mha2gqa.architecture.layouts import read_config
from mha2gqa.files.checkpoint import SafetensorsCheckpoint
from mha2gqa.files.sources import require_safetensors
from mha2gqa.nemotron_nas.blocks import MODEL_TYPE, validate_blocks
from mha2gqa.runtime.errors import InputError, first_line

SHOWN_KEYS = 4  # a config with 30 extra layers would otherwise print 300 names


def load_causal_lm(model_dir: Path, what: str = "model", progress: bool = True, **kwargs):
    """AutoModelForCausalLM.from_pretrained(model_dir, **kwargs), refusing (InputError) a checkpoint
    whose tensors do not match its config: missing, unexpected or of the wrong shape."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    require_safetensors(model_dir, what)
    # a binary or list config.json, bad head counts, sizes its weights cannot hold: one line, not
    # transformers' error (or a model of 10^9 layers built before any weight is read)
    prepare_classes(read_config(model_dir, SafetensorsCheckpoint(model_dir).shapes), model_dir)
    try:
        with _quiet_transformers(progress and _weight_bytes(model_dir) >= BAR_FROM_BYTES):
            # ignore_mismatched_sizes: report a wrong shape in the loading info instead of raising
            # transformers' multi-line RuntimeError; the check below refuses it all the same.
            model, info = AutoModelForCausalLM.from_pretrained(
                model_dir,
                use_safetensors=True,
                trust_remote_code=False,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
                **kwargs,
            )
    except (OSError, SafetensorError) as err:
        first = first_line(err, default=type(err).__name__)
        raise InputError(
            f"{what} {model_dir}: its weights could not be read ({first}): re-download or re-save the checkpoint"
        ) from err
    problems = loading_problems(info)
    if problems:
        raise InputError(
            f"{what} {model_dir} does not match its config.json ({'; '.join(problems)}): transformers would fill "
            "those tensors with random values; use the checkpoint's own config.json, or re-save a complete checkpoint"
        )
    return model


def prepare_classes(config: dict, model_dir: Path) -> None:
    """The model classes mha2gqa itself provides, registered with transformers' Auto classes before a config of
    their type is read: Nemotron-NAS (per-layer kv heads, nemotron_nas/), its block_configs checked first."""
    if config.get("model_type") == MODEL_TYPE:
        validate_blocks(config, Path(model_dir) / "config.json")
        from mha2gqa.nemotron_nas.modeling import register

        register()


def loading_problems(info: dict) -> list[str]:
    """transformers' output_loading_info -> one phrase per kind of problem, naming a few keys."""
    problems = []
    for kind, label in (("missing_keys", "missing"), ("unexpected_keys", "unexpected")):
        keys = sorted(info.get(kind) or ())
        if keys:
            problems.append(f"{label}: {_some(keys)}")
    wrong = sorted(info.get("mismatched_keys") or ())
    if wrong:
        shown = [f"{key} is {list(found)} not {list(expected)}" for key, found, expected in wrong]
        problems.append(f"wrong shape: {_some(shown)}")
    errors = [first_line(e) for e in info.get("error_msgs") or () if str(e).strip()]
    if errors:
        problems.append(f"errors: {_some(errors)}")
    return problems


def _some(items: list[str]) -> str:
    more = f" and {len(items) - SHOWN_KEYS} more" if len(items) > SHOWN_KEYS else ""
    return ", ".join(items[:SHOWN_KEYS]) + more


# transformers' "Loading weights" bar: worth watching for a checkpoint of gigabytes; on a small one (the
# embedded model: six bars per demo, each done in milliseconds) it is noise.
BAR_FROM_BYTES = 1 << 30


def _weight_bytes(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))


@contextlib.contextmanager
def _quiet_transformers(progress: bool):
    """No multi-line load report on stderr (its findings become our one line), and no progress bar
    unless `progress` (a large checkpoint, and the user did not ask for quiet); both restored afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not progress and bar_was_on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if not progress and bar_was_on:
            hf_logging.enable_progress_bar()
