"""The torch-free executor (convert/fast.py) writes exactly what the torch executor writes, and runs
exactly where it should: every file of DST byte for byte (mha2gqa.json apart from its date), on every
explicit layout, in fp32/fp16/bf16, sharded, with --dtype and --max-shard-size, with NaN/inf planted."""

import hashlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import MODEL_TYPES, make_tiny_tokenizer, save_tiny_model

from mha2gqa.architecture.layouts import LAYOUTS, attention_shape, layout_for, read_config
from mha2gqa.convert import fast
from mha2gqa.convert.options import ConvertOptions
from mha2gqa.convert.plan import make_plan, output_shapes
from mha2gqa.convert.roles import KV_ROLES, layer_names, pack, unpack
from mha2gqa.convert.run import convert
from mha2gqa.files.checkpoint import SafetensorsCheckpoint
from mha2gqa.runtime.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def files(directory: Path) -> dict[str, str]:
    """Every file's sha256; mha2gqa.json's without its date (the one field the two runs may differ in)."""
    out = {}
    for path in sorted(directory.iterdir()):
        data = path.read_bytes()
        if path.name == "mha2gqa.json":
            record = json.loads(data)
            for stage in record["lineage"]:
                stage.pop("date")
            data = json.dumps(record).encode()
        out[path.name] = hashlib.sha256(data).hexdigest()
    return out


def both_ways(src: Path, out: Path, monkeypatch, **options) -> tuple[list[str], list[str]]:
    """Convert SRC twice, to out/fast/dst and out/torch/dst (the same DST name: the card names it);
    returns the warnings of each run, and checks which executor ran."""
    messages, ran = {}, []
    original = fast.write_tensors
    monkeypatch.setattr(fast, "write_tensors", lambda *args: (ran.append(1), original(*args)))
    for way in ("fast", "torch"):
        if way == "torch":
            monkeypatch.setenv(fast.TORCH_ENV, "1")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            convert(src, out / way / "dst", progress=False, **options)
        messages[way] = [str(w.message) for w in caught]
    monkeypatch.delenv(fast.TORCH_ENV)
    assert ran == [1], "the fast executor ran for the plain request and only there"
    return messages["fast"], messages["torch"]


def assert_same_output(out: Path) -> None:
    fast_files, torch_files = files(out / "fast" / "dst"), files(out / "torch" / "dst")
    assert list(fast_files) == list(torch_files)
    assert [name for name in fast_files if fast_files[name] != torch_files[name]] == []


OPTION_SETS = {
    "mean": dict(groups=2),
    "first-mqa": dict(groups=1, method="first"),
    "mean-to-bf16-sharded": dict(groups=4, dtype="bfloat16", max_shard_size="40KB"),
    "first-to-fp16": dict(groups=2, method="first", dtype="float16"),
    "mean-to-fp32": dict(groups=2, dtype="float32"),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_layout_and_dtype_converts_to_the_same_bytes(tmp_path, monkeypatch, model_type, dtype):
    src = tmp_path / "src"
    save_tiny_model(src, model_type, dtype=DTYPES[dtype], max_shard_size="60KB")  # sharded source
    make_tiny_tokenizer(src)
    assert model_type in LAYOUTS and len(list(src.glob("*.safetensors"))) > 1
    for name, options in OPTION_SETS.items():
        assert both_ways(src, tmp_path / name, monkeypatch, **options) == ([], [])
        assert_same_output(tmp_path / name)
    assert len(list((tmp_path / "mean-to-bf16-sharded" / "fast" / "dst").glob("*.safetensors"))) > 2


def _poisoned(path: Path, dtype: torch.dtype) -> Path:
    """6 kv heads (r = 3 for --groups 2: a division that is not a power of two) and the values where
    conversions differ: NaN of both signs in torch's vectorised body and its scalar tail, inf, -inf and
    inf in one group (NaN after pooling), finite values whose group sum overflows, fp32 subnormals."""
    save_tiny_model(
        path, "qwen2", dtype=dtype, num_attention_heads=12, num_key_value_heads=6, hidden_size=48, head_dim=4
    )
    file = path / "model.safetensors"
    tensors = load_file(file)
    k = tensors["model.layers.0.self_attn.k_proj.weight"]  # (24, 48)
    k[0, 0], k[5, 2], k[23, 47] = float("nan"), -float("nan"), float("nan")
    k[1, 1], k[9, 1] = float("inf"), -float("inf")  # heads 0 and 2: one group of 3 at --groups 2
    k[6, 3] = 1e-40 if dtype != torch.float16 else 1e-7
    v = tensors["model.layers.1.self_attn.v_proj.weight"]
    v.mul_(3e4 if dtype == torch.float16 else 1e37)  # sums past the largest finite value
    tensors["model.layers.1.self_attn.v_proj.bias"][0] = -float("inf")
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_inf_and_overflow_convert_to_the_same_bytes_and_warnings(tmp_path, monkeypatch, dtype):
    src = _poisoned(tmp_path / "src", DTYPES[dtype])
    runs = {
        "mean": dict(groups=2),
        "first": dict(groups=3, method="first"),
        "mean-bf16": dict(groups=2, dtype="bfloat16"),
        "mean-fp16": dict(groups=1, dtype="float16"),
    }
    if dtype != "float16":  # v's 1e37 does not fit float16: both executors refuse the cast alike (casts.py)
        refusals, options = [], runs.pop("mean-fp16")
        for way in ("fast", "torch"):
            monkeypatch.setenv(fast.TORCH_ENV, "1" if way == "torch" else "0")
            with pytest.raises(InputError, match="beyond float16's range") as refused:
                convert(src, tmp_path / "fp16" / way, progress=False, **options)
            refusals.append(str(refused.value))
        monkeypatch.delenv(fast.TORCH_ENV)
        assert refusals[0] == refusals[1] and "model.layers.1.self_attn.v_proj.weight" in refusals[0]
    for name, options in runs.items():
        fast_warnings, torch_warnings = both_ways(src, tmp_path / name, monkeypatch, **options)
        assert fast_warnings == torch_warnings
        assert [w.split(" has ")[0] for w in fast_warnings] == [
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.bias",
        ]
        assert "has 5 non-finite values" in fast_warnings[0] and "has 1 non-finite" in fast_warnings[1]
        assert_same_output(tmp_path / name)


def heavy_after_cli(*args: str) -> tuple[list[str], str]:
    """Run the CLI in a fresh interpreter; the heavy modules it imported, and its stderr."""
    script = (
        "import sys, json\nfrom mha2gqa.cli import main\n"
        f"try:\n    main({list(args)!r})\nexcept SystemExit as end:\n    assert not end.code, end.code\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_the_cli_converts_plainly_without_torch_and_otherwise_with_it(tmp_path):
    src = tmp_path / "src"
    save_tiny_model(src, "llama", dtype=torch.bfloat16)
    plain = heavy_after_cli("convert", str(src), str(tmp_path / "mean"), "--groups", "2", "-q")[0]
    first = heavy_after_cli(
        "convert", str(src), str(tmp_path / "first"), "--groups", "2", "--method", "first", "--dtype", "float32", "-q"
    )[0]
    dry = heavy_after_cli("convert", str(src), str(tmp_path / "dry"), "--groups", "2", "--dry-run")[0]
    assert plain == first == dry == []  # a torch-free plan's dry run does not probe the machine with torch
    assert (
        "torch"
        in heavy_after_cli("convert", str(src), str(tmp_path / "random"), "--groups", "2", "--method", "random", "-q")[
            0
        ]
    )
    assert (
        "torch"
        in heavy_after_cli(
            "convert", str(src), str(tmp_path / "mean-norm"), "--groups", "2", "--method", "mean-norm", "-q"
        )[0]
    )
    assert (tmp_path / "mean" / "model.safetensors").is_file() and (tmp_path / "random" / "mha2gqa.json").is_file()


def test_a_nan_in_k_is_named_in_one_warning_line_by_the_torch_free_cli(tmp_path):
    src = tmp_path / "src"
    save_tiny_model(src, "llama", dtype=torch.bfloat16)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name][3, 5] = float("inf")  # inf: no NaN to round, so torch is never needed
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    heavy, stderr = heavy_after_cli("convert", str(src), str(tmp_path / "dst"), "--groups", "2", "-q")
    assert heavy == []
    lines = [line for line in stderr.splitlines() if line.startswith("Warning:")]
    assert lines == [
        f"Warning: {name} has 1 non-finite values (NaN/inf): the merged kv heads of layer 1 carry them; "
        "check the source checkpoint"
    ]


def _refusal(src: Path, **options) -> str | None:
    options = ConvertOptions(**{"groups": 2, **options})
    config = read_config(src)
    reason = fast.request_refusal(options, config)
    if reason:
        return reason
    checkpoint = SafetensorsCheckpoint(src)
    out = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(options.dtype)
    plan = make_plan(
        checkpoint.tensors, layout_for(config), attention_shape(config), options.groups, options.method.value, out
    )
    return fast.plan_refusal(plan, checkpoint.tensors)


def test_torch_runs_what_the_fast_executor_cannot_match(tmp_path, monkeypatch):
    src = tmp_path / "src"
    save_tiny_model(src, "llama")
    assert _refusal(src) is None and _refusal(src, method="first", dtype="bfloat16") is None
    assert "method random" in _refusal(src, method="random")  # torch's generator
    assert "method mean-norm" in _refusal(src, method="mean-norm")
    assert "calibration" in _refusal(src, calibration="austen")
    monkeypatch.setenv(fast.TORCH_ENV, "1")
    assert fast.TORCH_ENV in _refusal(src)
    monkeypatch.delenv(fast.TORCH_ENV)
    gpt2 = tmp_path / "gpt2"
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32)).save_pretrained(gpt2)
    assert "no explicit layout" in _refusal(gpt2, groups=1)  # retargeted: Conv1D transposes
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"].double()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert _refusal(src) == "model.layers.0.self_attn.k_proj.weight is F64"
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"].float()
    tensors["model.norm.weight"] = tensors["model.norm.weight"].double()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert _refusal(src) is None  # copied as it is
    assert _refusal(src, dtype="float16") == "model.norm.weight would be cast from F64"


def test_the_fast_methods_are_the_plain_ones():
    """fast.py assumes what Method says: no calibration, q/o left alone."""
    for method in fast.NUMPY_METHODS:
        assert not method.needs_calibration and not method.rewrites_query_output


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_planned_shapes_are_what_pack_writes(tmp_path, model_type):
    save_tiny_model(tmp_path, model_type)
    config = read_config(tmp_path)
    layout, shape, tensors = layout_for(config), attention_shape(config), SafetensorsCheckpoint(tmp_path).tensors
    for groups in (1, 2, 4):
        stored = layer_names(layout, 0, shape.kv_heads, set(tensors))
        roles = unpack({role: torch.empty(tensors[name].shape, device="meta") for role, name in stored.items()}, shape)
        for role in KV_ROLES:
            if role in roles:
                roles[role] = torch.empty(
                    (roles[role].shape[0] * groups // shape.kv_heads, *roles[role].shape[1:]), device="meta"
                )
        packed = {role: tuple(t.shape) for role, t in pack(roles, list(stored), groups).items()}
        assert output_shapes(stored, tensors, shape, groups) == packed


def test_copied_tensors_keep_their_offset_within_a_page(tmp_path):
    """Shard headers are padded so that copy_file_range copies page-aligned (2.4x faster on ext4): more
    copied bytes keep their source's offset within a page than share any other shift, and read back."""
    src = tmp_path / "src"
    save_tiny_model(src, "llama", dtype=torch.bfloat16, max_shard_size="150KB")
    convert(src, tmp_path / "dst", groups=2, progress=False, max_shard_size="1GB")
    source, out = SafetensorsCheckpoint(src).tensors, SafetensorsCheckpoint(tmp_path / "dst").tensors
    copied = [name for name in out if "k_proj" not in name and "v_proj" not in name]
    by_shift: dict = {}
    for name in copied:
        shift = (source[name].start - out[name].start) % 4096
        by_shift[shift] = by_shift.get(shift, 0) + out[name].nbytes
    assert len(by_shift) > 1 and by_shift.get(0, 0) == max(by_shift.values())
    for name in copied:
        assert (
            source[name].file.read_bytes()[source[name].start : source[name].end]
            == out[name].file.read_bytes()[out[name].start : out[name].end]
        )
