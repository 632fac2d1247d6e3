"""Keeping the libraries' own chatter out of our output, one known message at a time, for the length of
a call, through the libraries' logging and warnings (nothing is patched, nothing is silenced globally).

Each message left out here tells the user nothing the command does not already say or handle:
- lm-eval, on the model we hand it: "`pretrained` model kwarg is not of type `str` ... do not launch via
  accelerate" and "Passed an already-initialized model through `pretrained` ..." (we pass our loaded
  model on purpose, in one process), and "<task>: Custom kwargs can be passed to `--metadata` ..." (our
  offline tasks take none);
- datasets' "Generating train split" / "Generating test split" bars on small local files;
- accelerate's "Removed shared tensor {...} while saving" for tied embeddings at a checkpoint (expected;
  resume is tested to be bit-identical);
- transformers' FutureWarning "`is_gradient_checkpointing` is deprecated", raised inside peft's
  get_peft_model, not by our code;
- transformers' "Writing model shards" bar of save_pretrained (uptrain's final model): the stage already has
  our bar, and one bar per stage is the rule.
Every other message of these libraries still shows.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager

LM_EVAL_NOISE = {
    "lm_eval.models.huggingface": (
        "`pretrained` model kwarg is not of type `str`",
        "Passed an already-initialized model through `pretrained`",
    ),
    "lm_eval.api.task": ("Custom kwargs can be passed to `--metadata`",),
}
SHARED_TENSOR_NOISE = {"accelerate.utils.other": ("Removed shared tensor",)}


class _Drop(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


@contextmanager
def without_log_messages(noise: dict[str, tuple[str, ...]]):
    """Drop the records of each named logger that contain one of its fragments, while inside."""
    added = [(logging.getLogger(name), _Drop(fragments)) for name, fragments in noise.items()]
    for logger, drop in added:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in added:
            logger.removeFilter(drop)


@contextmanager
def without_datasets_bars():
    """No datasets progress bars (Generating ... split) while inside; the previous setting restored."""
    from datasets.utils import logging as ds_logging

    was_on = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            ds_logging.enable_progress_bar()


@contextmanager
def without_transformers_bars():
    """No transformers progress bars (save_pretrained's "Writing model shards") while inside; restored after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextmanager
def without_peft_deprecation():
    """transformers' FutureWarning about is_gradient_checkpointing, which peft's get_peft_model triggers."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
