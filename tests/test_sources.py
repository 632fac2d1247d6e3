"""The one hub-id rule (mha2gqa.files.sources): single-segment ids are hub ids, a name that looks like a
mistyped local path is answered locally without asking the hub, and a hub fetch says what it does."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from mha2gqa.cli import main
from mha2gqa.files import sources
from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain.recipe_load import load_recipe


@pytest.mark.parametrize("name", ["gpt2", "distilgpt2", "bert-base-uncased", "org/name", "meta-llama/Llama-2-7b-hf"])
def test_hub_ids_with_one_or_two_parts(name):
    assert sources.is_hub_id(name)


@pytest.mark.parametrize("name", ["a/b/c", ".hidden", "-x", "a--b", "a..b", "repo.git", "with space", "x/", ""])
def test_not_hub_ids(name):
    assert not sources.is_hub_id(name)


@pytest.fixture
def no_hub(monkeypatch):
    """Online as far as the environment says, but any hub access fails the test."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def refuse(repo_id):
        raise AssertionError(f"asked the hub for {repo_id}")

    monkeypatch.setattr(sources, "_download", refuse)


def test_single_segment_id_is_not_refused_as_a_non_hub_id(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    result = CliRunner().invoke(main, ["convert", "gpt2", str(tmp_path / "dst"), "--groups", "1"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: gpt2 is not a local directory and the hub is offline (HF_HUB_OFFLINE=1), and the hub cache "
        f"({tmp_path / 'empty-cache'}) holds no snapshot of it: download it first or pass a local path"
    ]
    assert not (tmp_path / "dst").exists()


def test_single_segment_id_is_fetched_when_online(tmp_path, monkeypatch):
    asked = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "_download", lambda repo_id: asked.append(repo_id) or str(tmp_path))
    assert sources.resolve_model_dir("gpt2") == tmp_path and asked == ["gpt2"]


def test_missing_path_under_a_local_folder_is_answered_locally(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(InputError) as err:
        sources.resolve_model_dir("runs/nonexistent")
    assert str(err.value) == (
        "runs/nonexistent: no such directory (runs/ is a local folder here), and not a hub id like gpt2 or org/name"
    )


@pytest.mark.parametrize("name", ["./gone", "/nowhere/model", "~/gone-model", "a/b/c"])
def test_path_shaped_names_never_reach_the_hub(name, no_hub):
    with pytest.raises(InputError, match="no such directory"):
        sources.resolve_model_dir(name)


def test_uptrain_model_that_looks_local_names_the_model_not_the_tokenizer(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "train.txt").write_text("hello\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"output_dir": "out", "data": {"train": "train.txt"}, "budget": {"max_steps": 1}}))
    with pytest.raises(InputError) as err:
        load_recipe(recipe, ["model=runs/nonexistent"])
    assert "model=runs/nonexistent: no such directory (runs/ is a local folder here)" in str(err.value)
    assert "tokenizer" not in str(err.value)


def test_a_hub_fetch_says_what_it_does_and_bounds_each_request(monkeypatch, capsys):
    import huggingface_hub

    seen = {}

    def fake_snapshot(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        raise OSError("unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    with pytest.raises(InputError, match="could not download gpt2 from the hub"):
        sources._download("gpt2")
    assert seen["etag_timeout"] == sources.HUB_TIMEOUT_S and "*.bin" not in seen["allow_patterns"]
    assert "fetching gpt2 from the Hugging Face hub" in capsys.readouterr().err


@pytest.mark.parametrize("typo", ["austin", "Austen", "austn"])
def test_a_typo_of_the_embedded_corpus_gets_did_you_mean_without_the_hub(tmp_path, monkeypatch, typo):
    import datasets

    from mha2gqa.files.embedded import model_dir

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("asked the hub for a dataset"))
    dst = tmp_path / "dst"
    args = ["convert", str(model_dir()), str(dst), "--groups", "2", "--method", "calibrated", "--calibration", typo]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: --calibration {typo}: no such file or folder; did you mean austen (the embedded novels)?"
    ]
    assert not dst.exists()
