"""The hub paths, mocked (these machines are offline): a hub model id downloads safetensors only, then
converts, and is refused in one line offline; a hub dataset is read through `datasets`, streaming."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_model

import mha2gqa
from mha2gqa.runtime.errors import InputError


def test_a_hub_model_id_downloads_safetensors_only_then_converts(tmp_path, monkeypatch):
    import huggingface_hub

    local = tmp_path / "hub-copy"
    save_tiny_model(local, "llama")
    asked = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.update(repo_id=repo_id, allow_patterns=allow_patterns)
        return str(local)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    result = mha2gqa.convert("org/tiny-llama", tmp_path / "gqa", groups=2, progress=False)
    assert asked["repo_id"] == "org/tiny-llama" and result.dst == tmp_path / "gqa"
    assert "*.safetensors" in asked["allow_patterns"] and not any(
        p.endswith((".bin", ".pt", ".pth")) for p in asked["allow_patterns"]
    )
    assert json.loads((tmp_path / "gqa" / "config.json").read_text())["num_key_value_heads"] == 2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match=r"org/tiny-llama is not a local directory and the hub is offline"):
        mha2gqa.convert("org/tiny-llama", tmp_path / "gqa-offline", groups=2, progress=False)


def test_a_hub_dataset_is_read_through_datasets_streaming(monkeypatch):
    import datasets

    from mha2gqa.corpus import textdata

    calls = []

    def fake_load_dataset(name, config=None, split=None, streaming=False, **kwargs):
        calls.append((name, config, split, streaming))
        return [{"text": "first row", "id": 0}, {"text": "second row", "id": 1}, {"text": "third row", "id": 2}]

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    source = textdata.resolve("--data", "org/corpus")
    assert source.hub == "org/corpus"
    assert list(textdata.iter_texts(source, hub_config="en", hub_split="test")) == [
        "first row",
        "second row",
        "third row",
    ]
    assert calls == [("org/corpus", "en", "test", True)]
    with pytest.raises(InputError, match=r"--data org/corpus: has no 'body' column \(columns: text, id\)"):
        list(textdata.iter_texts(source, "body", field_key="--data-column"))
    from mha2gqa.eval.data import read_documents

    docs, identity = read_documents("org/corpus", "en", "test", max_chars=12)
    assert docs == ["first row", "second row"]  # stops once the character budget is met
    assert identity == {"source": "hub", "name": "org/corpus", "config": "en", "split": "test", "column": "text"}
