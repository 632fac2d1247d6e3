"""Model cards: convert and uptrain write README.md in the Hub's convention from mha2gqa.json; the source's
card is kept (SOURCE_README.md), never overwritten or dropped; eval results beside the model join it."""

from __future__ import annotations

import shutil

import pytest
import yaml
from uptrain_helpers import corpus, recipe_file, tiny_model_dir

from mha2gqa.convert.run import convert
from mha2gqa.eval import evaluate
from mha2gqa.records.card import CARD, MARKER, SOURCE_CARD, front_matter, kv_bytes_per_token
from mha2gqa.uptrain import load_recipe, train

SOURCE_CARD_TEXT = "---\nlicense: apache-2.0\nlanguage: en\n---\n# Tiny\n\nThe source's own words.\n"


@pytest.fixture(scope="module")
def hub_source(tmp_path_factory):
    """A tiny model laid out as the hub cache stores a download, with its own card."""
    snapshot = tmp_path_factory.mktemp("hub") / "models--someorg--tiny-llama" / "snapshots" / "0123abcd"
    tiny_model_dir(snapshot)
    (snapshot / CARD).write_text(SOURCE_CARD_TEXT)
    return snapshot


def _card(model_dir):
    text = (model_dir / CARD).read_text()
    return front_matter(text), text


def test_convert_writes_a_hub_card_and_keeps_the_source_card(hub_source, tmp_path):
    dst = tmp_path / "tiny-gqa2"
    convert(hub_source, dst, groups=2, progress=False)
    meta, text = _card(dst)
    assert meta["base_model"] == "someorg/tiny-llama" and meta["library_name"] == "transformers"
    assert {"gqa", "mha2gqa"} <= set(meta["tags"]) and meta["license"] == "apache-2.0" and meta["language"] == "en"
    assert MARKER in text and text.startswith("---\n") and "\n# tiny-gqa2\n" in text
    # what was done: 2 layers x (K, V) x kv heads x head_dim 8 x 4 bytes
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64}, 8) == 1024
    assert "| key/value heads | 8 → 2 (query heads: 8) |" in text
    assert "| KV cache per token | 1.0 KiB → 256 B (4× smaller, 768 B saved per token) |" in text
    assert "mha2gqa convert someorg/tiny-llama OUT --groups 2 --method mean" in text
    # the source card: unchanged where it was, kept beside the new one, linked, its license carried
    assert (hub_source / CARD).read_text() == SOURCE_CARD_TEXT
    assert (dst / SOURCE_CARD).read_text() == SOURCE_CARD_TEXT
    assert f"[{SOURCE_CARD}]({SOURCE_CARD})" in text and "Its license (apache-2.0)" in text


def test_eval_beside_the_model_joins_its_card(hub_source, tmp_path):
    dst = tmp_path / "tiny-mqa"
    convert(hub_source, dst, groups=1, progress=False)
    assert "mqa" in _card(dst)[0]["tags"]
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("It is a truth universally acknowledged. " * 40)
    result = evaluate(dst, data=str(held_out), context=64, speed_preset=None, out=dst / "eval.json", progress=False)
    _, text = _card(dst)
    assert "## Evaluation" in text and "[eval.json](eval.json)" in text
    assert f"| {result['perplexity']['perplexity']:.2f} |" in text
    # a result saved elsewhere leaves the card alone
    before = (dst / CARD).read_text()
    evaluate(dst, data=str(held_out), context=64, speed_preset=None, out=tmp_path / "elsewhere.json", progress=False)
    assert (dst / CARD).read_text() == before


def test_uptrain_card_records_the_training_and_carries_the_source_card(hub_source, tmp_path):
    converted = tmp_path / "tiny-gqa2"
    convert(hub_source, converted, groups=2, progress=False)
    recipe = load_recipe(
        recipe_file(
            tmp_path / "r.yaml",
            model=str(converted),
            output_dir=str(tmp_path / "up"),
            data={"train": str(corpus(tmp_path / "c.jsonl"))},
            budget={"max_steps": 2},
            trainable="lora",
            lora={"rank": 2},
        )
    )
    out = train(recipe)
    meta, text = _card(out)
    assert (
        "uptrained" in meta["tags"] and meta["base_model"] == "someorg/tiny-llama" and meta["license"] == "apache-2.0"
    )
    assert "## Training after the conversion" in text
    assert (
        "LoRA adapters (rank 2, alpha 32.0, on self_attn.k_proj, self_attn.o_proj, self_attn.q_proj, "
        "self_attn.v_proj), merged into the weights" in text
    )
    assert "| steps, tokens | 2 steps, 256 tokens (1 process) |" in text
    assert "| key/value heads | 8 → 2 (query heads: 8) |" in text  # the conversion is still described
    import torch  # what the machine chose is named where the weights depend on it (issue 55)

    threads = torch.get_num_threads()
    assert (
        f"# the same weights need the same torch threads and device: this ran with {threads} on cpu "
        f"(mha2gqa --threads {threads} uptrain ...)" in text
    )
    recipe_block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(recipe_block) == recipe.to_dict()
    assert (out / SOURCE_CARD).read_text() == SOURCE_CARD_TEXT  # carried through the converted model


def test_an_uptrain_card_names_its_files_by_absolute_paths(tmp_path, monkeypatch):
    """The card's recipe held the data paths as typed, relative to wherever the recipe was run: the record now
    holds them absolute, and the card says so (an older record's relative paths are said to be relative)."""
    tiny_model_dir(tmp_path / "tiny")
    corpus(tmp_path / "c.jsonl")
    monkeypatch.chdir(tmp_path)
    keys = dict(model="tiny", output_dir="up", data={"train": "c.jsonl"}, budget={"max_steps": 1}, eval_every=0)
    out = train(load_recipe(recipe_file(tmp_path / "r.yaml", **keys)))
    text = _card(out)[1]
    recipe = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert recipe["data"]["train"] == [str(tmp_path / "c.jsonl")] and recipe["model"] == str(tmp_path / "tiny")
    assert recipe["output_dir"] == str(tmp_path / "up") and recipe["data"]["eval"] is None
    assert "| steps, tokens | 1 step, 128 tokens (1 process) |" in text
    assert "# the resolved recipe is below (local paths absolute, as on the machine that ran it)" in text


def test_the_card_counts_processes_in_words():
    from mha2gqa.records.card import _uptrain_section

    stage = {"recipe": {"budget": {"max_steps": 2}}, "steps": 2, "tokens_seen": 64, "world_size": 2}
    assert "| steps, tokens | 2 steps, 64 tokens (2 processes) |" in _uptrain_section([stage], converted=True)


def test_a_source_without_a_card_says_so(tmp_path):
    src = tiny_model_dir(tmp_path / "plain")
    dst = tmp_path / "plain-gqa"
    convert(src, dst, groups=4, progress=False)
    meta, text = _card(dst)
    assert "base_model" not in meta and "license" not in meta
    assert "# base_model: set the source's hub id before pushing (converted from the local folder plain)" in text
    assert "The source model had no README.md card." in text and not (dst / SOURCE_CARD).exists()
    # converting the converted model again: our own card is not mistaken for a source card
    again = tmp_path / "again"
    shutil.copytree(dst, tmp_path / "copy")
    convert(tmp_path / "copy", again, groups=2, progress=False)
    assert not (again / SOURCE_CARD).exists() and "4 → 2" in _card(again)[1]


def test_a_partial_older_record_still_gives_a_card(tmp_path):
    """An mha2gqa.json of the old schema with only some conversion fields (as hand-written fixtures have)."""
    import json

    from mha2gqa.records.card import write_card

    model = tiny_model_dir(tmp_path / "old", num_key_value_heads=2)
    (model / "mha2gqa.json").write_text(json.dumps({"conversion": {"groups": 2, "method": "mean"}}))
    write_card(model)
    text = (model / CARD).read_text()
    assert "| method | mean |" in text and "| key/value heads | 8 → 2 (query heads: 8) |" in text


def test_an_mha_model_trained_from_scratch_carries_no_gqa_tags():
    from mha2gqa.files import embedded
    from mha2gqa.records.card import render

    text = render(embedded.model_dir(), None, "austen-mha")  # 8 heads, 8 kv heads, trained by uptrain
    meta = front_matter(text)
    assert meta["tags"] == ["mha2gqa"]
    # the run's own last eval says which tokens it was measured on
    assert (
        "| final held-out perplexity | 124.47 (the training run's own check: up to 64 blocks of 512 tokens, "
        "persuasion.txt.gz; an `mha2gqa eval` result is measured on its own tokens) |" in text
    )
    # its record is older than absolute paths: the card says what they are relative to
    assert "(relative paths are relative to the folder the run started in)" in text


def test_a_converted_card_points_to_an_evaluation_only_when_it_has_one(hub_source, tmp_path):
    dst = tmp_path / "tiny-gqa4"
    convert(hub_source, dst, groups=4, progress=False)
    text = _card(dst)[1]
    assert "see the evaluation" not in text and "## Evaluation" not in text
    assert "measure it with `mha2gqa eval`, see Reproduce" in text
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("It is a truth universally acknowledged. " * 40)
    evaluate(dst, data=str(held_out), context=64, speed_preset=None, out=dst / "eval.json", progress=False)
    text = _card(dst)[1]
    assert "see the evaluation below" in text and "## Evaluation" in text


def test_the_card_finds_eval_results_without_parsing_a_tokenizer(tmp_path, monkeypatch):
    """Issue 59: the card looked for eval results by parsing every *.json beside the weights, a 9 MB tokenizer.json
    included (about 0.4 s with read_json's checks, on every conversion); a file whose top does not name the eval
    schema is not read whole."""
    import json

    from mha2gqa.records import card

    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(1000)}}}))
    (tmp_path / "generation_config.json").write_text("{}")
    (tmp_path / "eval.json").write_text(json.dumps({"schema": card.EVAL_SCHEMA, "label": "x"}, indent=2))
    (tmp_path / "broken.json").write_text('{"schema": "' + card.EVAL_SCHEMA + '", ')  # names it, is not JSON
    parsed, read_json = [], card.read_json
    monkeypatch.setattr(card, "read_json", lambda path, *a, **k: parsed.append(path.name) or read_json(path, *a, **k))
    assert card.eval_results(tmp_path) == [("eval.json", {"schema": card.EVAL_SCHEMA, "label": "x"})]
    assert sorted(parsed) == ["broken.json", "eval.json"]
