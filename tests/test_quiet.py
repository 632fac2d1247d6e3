"""Third-party chatter stays out of our output (mha2gqa.runtime.quiet): lm-eval's notes about the model we hand it,
datasets' split bars, transformers' loading bar on a small model, accelerate's shared-tensor notice and the
FutureWarning peft triggers; each filter lasts only for its call, and other messages still show."""

from __future__ import annotations

import logging
import warnings

import pytest
from uptrain_helpers import corpus, recipe_file, tiny_model_dir

from mha2gqa.files import embedded
from mha2gqa.runtime.quiet import LM_EVAL_NOISE, without_log_messages

NOISE = (
    "bootstrapping for stddev",
    "model kwarg is not of type",
    "Passed an already-initialized model",
    "Custom kwargs can be passed",
    "Generating test split",
    "Generating train split",
    "Loading weights",
    "Removed shared tensor",
    "is_gradient_checkpointing",
    "Writing model shards",
)


def _noise_in(text: str) -> list[str]:
    return [phrase for phrase in NOISE if phrase in text]


def test_only_the_known_messages_are_dropped_and_only_inside(caplog):
    logger = logging.getLogger("lm_eval.models.huggingface")
    with caplog.at_level(logging.INFO), without_log_messages(LM_EVAL_NOISE):
        logger.warning("Passed an already-initialized model through `pretrained`, assuming single-process")
        logger.warning("Truncating the context: it is longer than the model's")
    logger.warning("Passed an already-initialized model through `pretrained`, after")
    assert [r.getMessage() for r in caplog.records] == [
        "Truncating the context: it is longer than the model's",
        "Passed an already-initialized model through `pretrained`, after",
    ]
    assert not logger.filters


def test_eval_with_lm_eval_on_the_embedded_model_prints_no_library_chatter(tmp_path, capfd):
    pytest.importorskip("lm_eval")
    from mha2gqa.eval import evaluate

    evaluate(
        embedded.model_dir(),
        data=str(embedded.heldout_path()),
        max_tokens=1024,
        context=512,
        stride=512,
        speed_preset=None,
        lm_eval_tasks=["persuasion_cloze"],
        lm_eval_limit=3,
        out=tmp_path / "r.json",
    )
    out, err = capfd.readouterr()
    assert _noise_in(out + err) == [], (out + err)[-3000:]
    assert (tmp_path / "r.json").is_file()


def test_a_lora_run_with_checkpoints_of_a_tied_model_prints_no_library_chatter(tmp_path, capfd):
    pytest.importorskip("peft")
    from mha2gqa.uptrain import load_recipe, train

    model = tiny_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    capfd.readouterr()  # the test's own model, saved by transformers (its "Writing model shards" bar): not the run's
    recipe = load_recipe(
        recipe_file(
            tmp_path / "r.yaml",
            model=str(model),
            output_dir=str(tmp_path / "up"),
            data={"train": str(corpus(tmp_path / "c.jsonl"))},
            budget={"max_steps": 2},
            save_every=1,
            trainable="lora",
            lora={"rank": 2},
            gradient_checkpointing=True,
        )
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(recipe)
    out, err = capfd.readouterr()
    shown = out + err + "\n".join(str(w.message) for w in caught)
    assert _noise_in(shown) == [], shown[-3000:]
    assert (tmp_path / "up" / "final").is_dir() or any((tmp_path / "up").iterdir())


def test_the_final_save_shows_no_writing_shards_bar_and_restores_the_setting(tmp_path, capfd):
    # transformers' "Writing model shards" bar of a one-shard save showed beside uptrain's own bar.
    from accelerate import Accelerator
    from tiny_models import make_tiny_model, make_tiny_tokenizer
    from transformers.utils import logging as hf_logging

    from mha2gqa.uptrain.loop import save_final

    model = make_tiny_model("llama")
    save_final(Accelerator(cpu=True), model, make_tiny_tokenizer(), tmp_path, model.dtype)
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err, err
    assert (tmp_path / "model.safetensors").is_file() and hf_logging.is_progress_bar_enabled()
