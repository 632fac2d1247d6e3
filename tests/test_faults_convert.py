"""Fault injection for convert and inspect (issue 9): real broken files, real signals to real
subprocesses, real read-only, full and size-limited filesystems.

Every refusal case checks the whole promise: exit code 2, one `Error:` line (no traceback) with the
expected words, nothing left where DST would go (no DST, no `.DST.partial-*`, no lock), and SRC
byte-identical (sha256 of every file before and after).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_model

from mha2gqa.cli import main
from mha2gqa.files.writing import _exchange

K = "model.layers.0.self_attn.k_proj.weight"
V = "model.layers.0.self_attn.v_proj.weight"


# ---------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny llama (8 heads, 8 kv heads, 2 layers, q/k/v biases) with a tokenizer, saved once."""
    path = tmp_path_factory.mktemp("pristine") / "src"
    save_tiny_model(path, "llama")
    make_tiny_tokenizer(path)
    return path


@pytest.fixture
def src(pristine, tmp_path):
    """A private copy of the pristine model, free to break."""
    path = tmp_path / "src"
    shutil.copytree(pristine, path)
    return path


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def leftovers(dst: Path) -> list[str]:
    """DST itself and anything of ours beside it (partial directories, lock files)."""
    parent = dst.parent
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir() if p.name == dst.name or p.name.startswith(f".{dst.name}."))


def assert_refused(result, words: str, src: Path, before: dict, dst: Path) -> None:
    assert isinstance(result.exception, SystemExit), result.exception  # anything else would be a traceback
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    assert words in lines[0], lines[0]
    assert leftovers(dst) == [], leftovers(dst)
    assert digests(src) == before


def convert_refused(src: Path, dst: Path, words: str, *flags) -> None:
    before = digests(src)
    result = cli("convert", src, dst, "--groups", "2", "-q", *flags)
    assert_refused(result, words, src, before, dst)


def rewrite_header(file: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header with `edit(header)` (which may return a new object or
    raw bytes), keeping the data bytes as they are."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    new = edit(header)
    new = header if new is None else new
    blob = new if isinstance(new, bytes) else json.dumps(new).encode()
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def resave(src: Path, edit) -> None:
    """Re-save model.safetensors after `edit(state_dict)` (real tensors, a real safetensors file)."""
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, src / "model.safetensors", metadata={"format": "pt"})


def edit_config(src: Path, **changes) -> None:
    config = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    (src / "config.json").write_text(json.dumps(config))


# ------------------------------------------------------------------ class: safetensors headers
def _set(name, key, value):
    def edit(header):
        header[name][key] = value

    return edit


def _drop(name, key):
    def edit(header):
        del header[name][key]

    return edit


def _overlap(header):  # v_proj's bytes are k_proj's: the library refuses this, so must we
    header[V]["data_offsets"] = header[K]["data_offsets"]


HEADER_FAULTS = {
    "header is a list": (lambda h: [h], "not an object"),
    "entry is a number": (lambda h: {**h, K: 7}, "not an object"),
    "missing data_offsets": (_drop(K, "data_offsets"), "data_offsets"),
    "negative offsets": (_set(K, "data_offsets", [-8, 0]), "data_offsets"),
    "offsets reversed": (_set(K, "data_offsets", [64, 0]), "data_offsets"),
    "string shape": (_set(K, "shape", "64,64"), "shape"),
    "negative shape": (_set(K, "shape", [-64, -64]), "shape"),
    "string dimension": (_set(K, "shape", ["64", 64]), "shape"),
    "unknown dtype": (_set(K, "dtype", "F12"), "dtype 'F12'"),
    "dtype not a string": (_set(K, "dtype", 4), "dtype 4"),
    "bytes do not fit the shape": (_set(K, "shape", [32, 64]), "bytes for shape"),
    "overlapping ranges": (_overlap, "overlaps"),
    "not JSON": (lambda h: b"\xff\xfe{not json", "safetensors header is not UTF-8 text"),
}


@pytest.mark.parametrize("fault", HEADER_FAULTS)
def test_header_faults_are_refused(src, tmp_path, fault):
    edit, words = HEADER_FAULTS[fault]
    rewrite_header(src / "model.safetensors", edit)
    convert_refused(src, tmp_path / "out" / "dst", words)


@pytest.mark.parametrize(
    "fault,words",
    [
        ("truncated", "truncated"),
        ("trailing bytes", "data bytes but its header describes"),
        ("too short", "too short"),
        ("header length past the end", "corrupt safetensors header"),
    ],
)
def test_file_length_faults_are_refused(src, tmp_path, fault, words):
    file = src / "model.safetensors"
    raw = file.read_bytes()
    broken = {
        "truncated": raw[:-100],
        "trailing bytes": raw + b"\0" * 64,
        "too short": raw[:5],
        "header length past the end": struct.pack("<Q", len(raw)) + raw[8:],
    }[fault]
    file.write_bytes(broken)
    convert_refused(src, tmp_path / "dst", words)


# ------------------------------------------------------------------------- class: shard index
def _sharded(src: Path) -> dict:
    """Split the single file into two shards with an index, as save_pretrained does."""
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, src / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    return {"metadata": {"total_size": 0}, "weight_map": weight_map}


INDEX_FAULTS = {
    "escapes with ..": (
        lambda ix, src: ix["weight_map"].update({K: "../outside/model-00001-of-00002.safetensors"}),
        "not a file inside",
    ),
    "absolute path": (
        lambda ix, src: ix["weight_map"].update({K: str(src.parent / "outside" / "model-00001-of-00002.safetensors")}),
        "not a file inside",
    ),
    "value is a number": (lambda ix, src: ix["weight_map"].update({K: 3}), "not a file inside"),
    "missing shard": (
        lambda ix, src: ix["weight_map"].update({K: "model-00009-of-00009.safetensors"}),
        "missing shards",
    ),
    "no weight_map": (lambda ix, src: ix.pop("weight_map"), "no weight_map"),
    "weight_map is a list": (lambda ix, src: ix.update(weight_map=list(ix["weight_map"])), "no weight_map"),
    "index is a list": (lambda ix, src: [ix], "not a JSON object"),
    "not JSON": (lambda ix, src: b'{"weight_map": {', "not valid JSON"),
    "binary": (lambda ix, src: b"\x89PNG\r\n\x1a\n\xff\xff", "is not UTF-8 text"),
}


@pytest.mark.parametrize("fault", INDEX_FAULTS)
def test_shard_index_faults_are_refused(src, tmp_path, fault):
    index = _sharded(src)
    # A real shard outside SRC that a careless reader would copy into DST.
    (src.parent / "outside").mkdir()
    shutil.copy(src / "model-00001-of-00002.safetensors", src.parent / "outside")
    edit, words = INDEX_FAULTS[fault]
    new = edit(index, src)
    new = index if new is None else new
    (src / "model.safetensors.index.json").write_bytes(new if isinstance(new, bytes) else json.dumps(new).encode())
    convert_refused(src, tmp_path / "dst", words)


# -------------------------------------------------------------------------- class: config.json
CONFIG_FAULTS = {
    "a list": (lambda p: p.write_text("[1, 2]"), "not an object"),
    "binary": (lambda p: p.write_bytes(b"\x80\x81\xfe\xff" * 8), "config.json"),
    "invalid JSON": (lambda p: p.write_text('{"model_type": '), "not valid JSON"),
    "no model_type": (lambda p: edit_config(p.parent, model_type=...), "model_type=null"),
    "model_type a list": (lambda p: edit_config(p.parent, model_type=["llama"]), 'model_type=["llama"]'),
    "no num_attention_heads": (lambda p: edit_config(p.parent, num_attention_heads=...), "no num_attention_heads"),
    "zero kv heads": (lambda p: edit_config(p.parent, num_key_value_heads=0), "num_key_value_heads=0"),
    "string heads": (lambda p: edit_config(p.parent, num_attention_heads="8"), 'num_attention_heads="8"'),
    "negative hidden_size": (lambda p: edit_config(p.parent, hidden_size=-64), "hidden_size=-64"),
    "boolean head_dim": (lambda p: edit_config(p.parent, head_dim=True), "head_dim=true"),
    "heads not divisible": (lambda p: edit_config(p.parent, num_key_value_heads=3), "not divisible"),
    "more layers than the checkpoint": (
        lambda p: edit_config(p.parent, num_hidden_layers=4),
        "no tensors for layer(s) 2, 3",
    ),
    "10^12 layers": (
        lambda p: edit_config(p.parent, num_hidden_layers=10**12),
        "no tensors for layer(s) 2, 3, 4, 5, 6, 7, 8, 9, ...",
    ),
    "quantized": (
        lambda p: edit_config(p.parent, quantization_config={"quant_method": "gptq", "bits": 4}),
        "is quantized (quantization_config quant_method=gptq)",
    ),
}


@pytest.mark.parametrize("fault", CONFIG_FAULTS)
def test_config_faults_are_refused(src, tmp_path, fault):
    edit, words = CONFIG_FAULTS[fault]
    edit(src / "config.json")
    convert_refused(src, tmp_path / "dst", words)


def test_layers_beyond_the_config_are_copied_with_a_warning(src, tmp_path):
    """Multi-token-prediction layers (GLM-4.5) sit past num_hidden_layers and transformers ignores
    them: copied unconverted, with one line that names the first one."""
    edit_config(src, num_hidden_layers=1)
    before = digests(src)
    result = cli("convert", src, tmp_path / "dst", "--groups", "2", "-q")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning:")]
    assert "tensors for layer 1 (model.layers.1.*)" in warnings[0], result.stderr
    # transformers' loader refuses the layers its config does not hold, so the quality check says it could not run
    assert len(warnings) == 2 and warnings[1].startswith("Warning: the check could not run: SRC "), result.stderr
    assert result.output.splitlines()[-1].startswith("check: skipped (it could not run: SRC ")
    shapes = {n: list(t.shape) for n, t in load_file(tmp_path / "dst" / "model.safetensors").items()}
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [16, 64]  # converted
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == [64, 64]  # copied
    assert digests(src) == before


@pytest.mark.parametrize("fault", ["a list", "binary", "zero kv heads", "string heads", "10^12 layers"])
def test_inspect_refuses_the_same_configs(src, fault):
    edit, words = CONFIG_FAULTS[fault]
    edit(src / "config.json")
    before = digests(src)
    result = cli("inspect", src)
    assert_refused(result, words, src, before, src.parent / "no-dst")


@pytest.mark.parametrize("value", ["LlamaForCausalLM", {"LlamaForCausalLM": 1}, 5])
def test_inspect_reads_a_malformed_architectures_field_as_unknown(src, value):
    edit_config(src, architectures=value)
    result = cli("inspect", src, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["architecture"] == "?"


# ----------------------------------------------------------------------- class: tensor shapes
def _config_kv_heads_8_for_weights_with_4(src):
    save_tiny_model(src, "llama", num_key_value_heads=4)  # k/v_proj (32, 64): divisible by --groups 2
    edit_config(src, num_key_value_heads=8)


TENSOR_FAULTS = {
    "k_proj of 4 heads, config says 8": (_config_kv_heads_8_for_weights_with_4, f"{K} has shape [32, 64]"),
    "head_dim disagrees with q_proj": (lambda src: edit_config(src, head_dim=4), "q_proj.weight has shape [64, 64]"),
    "v_proj reads another width": (
        lambda src: resave(src, lambda t: t.update({V: t[V][:, :32]})),
        f"{V} has shape [64, 32]",
    ),
    "o_proj of the wrong width": (
        lambda src: resave(src, lambda t: t.update({"model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 32)})),
        "o_proj.weight has shape [64, 32]",
    ),
    "k bias of the wrong length": (
        lambda src: resave(src, lambda t: t.update({"model.layers.1.self_attn.k_proj.bias": torch.zeros(60)})),
        "k_proj.bias has shape [60]",
    ),
    "fp8 k_proj": (
        lambda src: resave(src, lambda t: t.update({K: t[K].to(torch.float8_e4m3fn)})),
        f"{K} is stored as F8_E4M3",
    ),
    "int8 v_proj": (lambda src: resave(src, lambda t: t.update({V: t[V].to(torch.int8)})), f"{V} is stored as I8"),
}


@pytest.mark.parametrize("fault", TENSOR_FAULTS)
def test_attention_tensors_that_do_not_fit_the_config_are_refused(src, tmp_path, fault):
    edit, words = TENSOR_FAULTS[fault]
    edit(src)
    convert_refused(src, tmp_path / "dst", words)


@pytest.mark.parametrize("name,value", [(K, float("nan")), ("model.layers.1.self_attn.v_proj.bias", float("inf"))])
def test_non_finite_kv_weights_convert_with_a_warning_naming_the_tensor(src, tmp_path, name, value):
    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = value

    resave(src, poison)
    before = digests(src)
    result = cli("convert", src, tmp_path / "dst", "--groups", "2", "-q")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 2 and name in warnings[0] and "1 non-finite" in warnings[0], result.stderr
    # SRC's own scores are NaN too: nothing to compare DST with, so the check is skipped, not DST blamed
    assert warnings[1].startswith("Warning: the check could not run: SRC's own numbers"), result.stderr
    assert (tmp_path / "dst" / "model.safetensors").is_file() and digests(src) == before


# ------------------------------------------------- class: OS-level faults of SRC (the central rule)
@pytest.mark.parametrize(
    "fault,words",
    [
        ("weights file is a directory", "model.safetensors: it is a directory where a file was expected"),
        ("weights file is a dangling link", "model.safetensors: no such file or directory"),
    ],
)
def test_os_errors_on_the_users_files_are_one_line(src, tmp_path, fault, words):
    (src / "model.safetensors").unlink()
    if fault == "weights file is a directory":
        (src / "model.safetensors").mkdir()
    else:
        (src / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    convert_refused(src, tmp_path / "dst", words)


def test_only_faults_of_the_users_files_become_one_line():
    import errno

    import click

    from mha2gqa.cli import _Group

    @click.group(cls=_Group)
    def group():
        pass

    @group.command()
    @click.argument("code", type=int)
    def fail(code):
        raise OSError(code, os.strerror(code), "/data/model.safetensors")

    full = CliRunner().invoke(group, ["fail", str(errno.ENOSPC)])
    assert full.exit_code == 2 and full.stderr.strip() == (
        "Error: /data/model.safetensors: no space left on the device: free space or choose a location with room"
    )
    bug = CliRunner().invoke(group, ["fail", str(errno.EBADF)])  # a bad file descriptor is our bug: traceback
    assert isinstance(bug.exception, OSError) and bug.exception.errno == errno.EBADF


# ------------------------------------------------------------------------ class: destinations
def test_dot_as_destination_is_refused(src, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    before = digests(src)
    result = cli("convert", src, ".", "--groups", "2", "--force", "-q")
    assert_refused(result, "names the current, a parent or the root directory", src, before, work / "absent")
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt"]


def test_dot_dot_as_destination_is_refused(src, tmp_path):
    (tmp_path / "x" / "a").mkdir(parents=True)
    convert_refused(src, tmp_path / "x" / "a" / "..", "names the current, a parent", "--force")
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["a"]


@pytest.mark.parametrize("dangling", [False, True])
def test_symlinked_destination_is_refused_and_left_as_it_was(src, tmp_path, dangling):
    target = tmp_path / "target"
    if not dangling:
        target.mkdir()
        (target / "old.txt").write_text("old")
    link = tmp_path / "link"
    link.symlink_to(target)
    before = digests(src)
    result = cli("convert", src, link, "--groups", "2", "--force", "-q")
    assert result.exit_code == 2 and "is a symbolic link" in result.stderr and "Traceback" not in result.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert dangling or [p.name for p in target.iterdir()] == ["old.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".link.")] and digests(src) == before


def test_destination_that_is_a_file_or_under_a_file_is_refused(src, tmp_path):
    (tmp_path / "file").write_text("x")
    before = digests(src)
    result = cli("convert", src, tmp_path / "file", "--groups", "2", "-q")
    assert result.exit_code == 2 and "is a file" in result.stderr and (tmp_path / "file").read_text() == "x"
    result = cli("convert", src, tmp_path / "file" / "deeper" / "dst", "--groups", "2", "-q")
    assert_refused(result, "is a file", src, before, tmp_path / "file" / "deeper" / "dst")


def test_missing_parents_created_for_a_refused_run_are_removed(src, tmp_path):
    (src / "config.json").write_text("[]")
    convert_refused(src, tmp_path / "new" / "deeper" / "dst", "not an object")
    assert not (tmp_path / "new").exists()


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A real small filesystem at `path` (root only); skip the test with the reason where mount is refused."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'not root'}): filesystem faults untested")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_read_only_filesystem_is_refused_before_any_work(src, tmp_path):
    with tmpfs(tmp_path / "ro", "size=4m") as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        convert_refused(src, mount / "dst", "not writable")
        convert_refused(src, mount / "new" / "dst", "not writable")


def test_full_filesystem_is_refused_before_any_work(src, tmp_path):
    with tmpfs(tmp_path / "small", "size=256k") as mount:
        convert_refused(src, mount / "dst", "MiB free")


@pytest.mark.parametrize("stage", ["tensors", "calibration statistics"])
def test_filesystem_that_fills_up_mid_run_leaves_nothing(src, tmp_path, stage):
    # Room for the bytes but only 4 inodes (the root takes one): after the lock and the partial
    # directory, the first shard fits and the next file gets ENOSPC after tensors were written; or,
    # calibrating, the statistics folder fits and its first layer file fails (safetensors' own error
    # type, which must still read as a full disk).
    flags = []
    if stage == "calibration statistics":
        (tmp_path / "text.txt").write_text(SAMPLE_TEXT * 4)
        flags = ["--method", "calibrated", "--calibration", tmp_path / "text.txt", "--calibration-tokens", "256"]
    with tmpfs(tmp_path / "inodes", "size=8m,nr_inodes=4") as mount:
        convert_refused(src, mount / "dst", f"{mount / 'dst'}: no space left on the device", *flags)
        assert sorted(p.name for p in mount.iterdir()) == []


def test_file_size_limit_mid_write_is_one_line_and_leaves_nothing(src, tmp_path):
    """A real EFBIG from the kernel (RLIMIT_FSIZE; Python ignores SIGXFSZ) while a shard is written."""
    before = digests(src)
    limit = 100_000  # the shard is ~340 kB
    done = subprocess.run(
        [sys.executable, "-m", "mha2gqa", "convert", str(src), str(tmp_path / "dst"), "--groups", "2", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith(f"Error: {tmp_path / 'dst'}: file too large"), lines
    assert leftovers(tmp_path / "dst") == [] and digests(src) == before


def test_exchange_swaps_two_directories_atomically(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "new").write_text("new")
    (tmp_path / "b" / "old").write_text("old")
    if not _exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here: --force falls back to two renames")
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["new"]
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["old"]


def test_force_replaces_in_place_and_leaves_no_debris(src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "stale.txt").write_text("old run")
    result = cli("convert", src, dst, "--groups", "4", "--force", "-q")
    assert result.exit_code == 0, result.output
    assert not (dst / "stale.txt").exists() and (dst / "model.safetensors").is_file()
    assert leftovers(dst) == ["dst"]


# ----------------------------------------------------------------------------- class: flags
@pytest.mark.parametrize(
    "args,words",
    [
        (
            ["convert", "{src}", "{dst}", "--groups", "2", "--calibration-memory", "0"],
            "--calibration-memory '0' must be positive",
        ),
        (
            ["convert", "{src}", "{dst}", "--groups", "2", "--calibration-memory", "lots"],
            "--calibration-memory 'lots' is not a size",
        ),
        (
            ["convert", "{src}", "{dst}", "--groups", "2", "--max-shard-size", "0"],
            "--max-shard-size '0' must be positive",
        ),
        (["inspect", "{src}", "--context", "-5", "--batch", "0"], "--context -5 must be a positive integer"),
        (["inspect", "{src}", "--batch", "0"], "--batch 0 must be a positive integer"),
    ],
)
def test_bad_sizes_and_counts_name_their_own_flag(src, tmp_path, args, words):
    before = digests(src)
    result = cli(*[a.format(src=src, dst=tmp_path / "dst") for a in args])
    assert_refused(result, words, src, before, tmp_path / "dst")


# --------------------------------------------------- class: signals and concurrent runs (subprocesses)
def _start_slow_convert(src: Path, dst: Path, tmp_path: Path) -> subprocess.Popen:
    """A real `python -m mha2gqa convert` whose calibration (after DST is claimed) runs for minutes."""
    text = tmp_path / "calibration.txt"
    if not text.exists():
        text.write_text(SAMPLE_TEXT * 10000)  # ~3.8 MB: minutes here, seconds even on a fast GPU machine
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mha2gqa",
            "convert",
            str(src),
            str(dst),
            "--groups",
            "2",
            "--method",
            "calibrated",
            "--calibration",
            str(text),
            "--calibration-tokens",
            "4000000",
            "-q",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_partial(process: subprocess.Popen, dst: Path, timeout: float = 240) -> Path:
    partial = dst.parent / f".{dst.name}.partial-{process.pid}"
    deadline = time.monotonic() + timeout
    while not partial.is_dir():
        if process.poll() is not None:
            raise AssertionError(f"convert ended before writing: {process.communicate()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("no partial directory appeared")
        time.sleep(0.05)
    time.sleep(0.3)  # well inside calibration now
    return partial


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_signals_clean_up_and_exit_128_plus_the_signal(src, tmp_path, signum):
    before = digests(src)
    dst = tmp_path / "dst"
    process = _start_slow_convert(src, dst, tmp_path)
    _wait_for_partial(process, dst)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr and f"Interrupted by {signal.Signals(signum).name}" in stderr
    assert leftovers(dst) == [] and digests(src) == before


def test_kill_9_debris_is_removed_by_the_next_run_and_live_runs_are_left_alone(src, tmp_path):
    before = digests(src)
    dst = tmp_path / "dst"
    process = _start_slow_convert(src, dst, tmp_path)
    partial = _wait_for_partial(process, dst)
    process.kill()
    process.communicate(timeout=60)
    assert partial.is_dir()  # what kill -9 leaves
    live = dst.parent / f".{dst.name}.partial-{os.getppid()}"  # a live PID's (pytest's parent): not debris
    live.mkdir()
    result = cli("convert", src, dst, "--groups", "2", "-q")
    assert result.exit_code == 0, result.output
    assert not partial.exists() and live.is_dir()
    assert leftovers(dst) == sorted(["dst", live.name]) and digests(src) == before


def test_a_second_run_to_the_same_destination_is_refused_while_the_first_runs(src, tmp_path):
    before = digests(src)
    dst = tmp_path / "dst"
    first = _start_slow_convert(src, dst, tmp_path)
    _wait_for_partial(first, dst)
    second = cli("convert", src, dst, "--groups", "4", "-q")
    assert second.exit_code == 2 and "is being written by another mha2gqa run" in second.stderr, second.output
    assert f"PID {first.pid}" in second.stderr and "Traceback" not in second.output
    assert not dst.exists()  # the second did not write; the first is still at work
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM
    assert leftovers(dst) == [] and digests(src) == before


# ------------------------------------------------------------------------- per-layer table order
def test_per_layer_error_table_is_in_layer_order(tmp_path):
    src = tmp_path / "src"
    save_tiny_model(
        src,
        "llama",
        num_hidden_layers=12,
        hidden_size=32,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    make_tiny_tokenizer(src)
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT * 4)
    result = cli(
        "convert",
        src,
        tmp_path / "dst",
        "--groups",
        "2",
        "--calibration",
        tmp_path / "text.txt",
        "--calibration-tokens",
        "256",
        "-q",
    )
    assert result.exit_code == 0, result.output
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert rows == [str(i) for i in range(12)]
