"""--dtype takes the names people type (bf16, fp16, half, torch.bfloat16, ...): one table, mha2gqa/architecture/dtypes.py,
read by convert and eval alike. `--dtype bf16` used to be refused."""

from __future__ import annotations

import json

import pytest
from fault_helpers import cli
from tiny_models import save_tiny_model

from mha2gqa.architecture.dtypes import dtype_name
from mha2gqa.cli.early import validate_eval
from mha2gqa.convert.options import ConvertOptions
from mha2gqa.runtime.errors import InputError


@pytest.mark.parametrize(
    "typed, name",
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("torch.float16", "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("F32", "float32"),
        (" float32 ", "float32"),
    ],
)
def test_every_alias_names_one_dtype(typed, name):
    assert dtype_name(typed) == name
    assert ConvertOptions(2, dtype=typed).dtype == name


def test_an_unknown_name_is_refused_with_the_names_accepted():
    with pytest.raises(InputError, match=r"--dtype 'int8' is unknown: use float32, bfloat16, float16 \(or fp32, bf16"):
        dtype_name("int8")
    assert dtype_name(None) is None and ConvertOptions(2).dtype is None


def test_eval_keeps_auto_and_reads_aliases():
    assert dtype_name("AUTO", keep=("auto",)) == "auto"
    with pytest.raises(InputError, match="'auto' is unknown"):
        dtype_name("auto")  # convert has no auto: leaving --dtype out keeps each tensor's
    from mha2gqa.files import embedded

    assert validate_eval(str(embedded.model_dir()), {"dtype": "bf16"}, None, False)["dtype"] == "bfloat16"


def test_convert_dtype_bf16_writes_bfloat16(tmp_path):
    save_tiny_model(tmp_path / "src", "llama")
    result = cli("convert", tmp_path / "src", tmp_path / "dst", "--groups", "2", "--dtype", "bf16", "-q")
    assert result.exit_code == 0, result.output
    header = (tmp_path / "dst" / "model.safetensors").read_bytes()
    size = int.from_bytes(header[:8], "little")
    tensors = {k: v for k, v in json.loads(header[8 : 8 + size]).items() if k != "__metadata__"}
    assert {t["dtype"] for t in tensors.values()} == {"BF16"}
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
