"""Files as the hub ships them read: transformers writes a tokenizer's "no limit" as int(1e30), a 31-digit
integer in most tokenizer_config.json files, and serve-bench, the check and sampling read that file. The bound
on integers (reading.py) stays: far longer ones are refused in one line."""

from __future__ import annotations

import json

import pytest

from mha2gqa.files.reading import read_json
from mha2gqa.runtime.errors import InputError
from mha2gqa.serving.children import tokenizer_identity

NO_LIMIT = int(1e30)  # transformers' VERY_LARGE_INTEGER


def _tokenizer_folder(path, max_length):
    path.mkdir()
    config = {"model_max_length": max_length, "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}}}))
    return path


def test_the_no_limit_length_reads_and_two_such_tokenizers_are_the_same(tmp_path):
    folder = _tokenizer_folder(tmp_path / "a", NO_LIMIT)
    assert "1000000000000000019884624838656" in (folder / "tokenizer_config.json").read_text()
    assert read_json(folder / "tokenizer_config.json", "fix")["model_max_length"] == NO_LIMIT
    other = _tokenizer_folder(tmp_path / "b", NO_LIMIT)
    assert tokenizer_identity(folder) == tokenizer_identity(other)


def test_an_integer_of_hundreds_of_digits_is_still_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"vocab_size": 1' + "0" * 100 + "}")
    with pytest.raises(InputError, match="holds an integer of 101 digits, over 64: fix it"):
        read_json(path, "fix it")
