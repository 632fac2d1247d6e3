"""Fault injection, second round (issue 21): hostile files, resource bombs, special files, what
crosses the SRC boundary, casts that overflow, one-line errors.

Every refusal asserts exit code 2, exactly one `Error:` line (no traceback), nothing left behind
beside DST or in $TMPDIR, and every source byte-identical (sha256 of every file). The cases run on
real files, real FIFOs, sockets and character devices, real symbolic links and a real full tmpfs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import struct
from pathlib import Path

import pytest
import torch
from fault_helpers import cli, error_line, fill, tmpfs, tree_digest
from safetensors.torch import load_file, save_file
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_model

from mha2gqa.files.checkpoint import SafetensorsCheckpoint

K = "model.layers.0.self_attn.k_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"
DEEP = 5000  # levels: Python's JSON decoder and PyYAML's composer recurse past their limit here


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny llama (8 heads, 8 kv heads, 2 layers) with a tokenizer and a README, saved once."""
    path = tmp_path_factory.mktemp("trust") / "src"
    save_tiny_model(path, "llama")
    make_tiny_tokenizer(path)
    (path / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    return path


@pytest.fixture
def src(pristine, tmp_path, tmpdir_env):
    path = tmp_path / "src"
    shutil.copytree(pristine, path)
    return path


def _digests(root: Path) -> dict:
    """sha256 of every regular file under root; special files and links by their kind and target."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = "link:" + os.readlink(p)
        elif stat.S_ISREG(p.lstat().st_mode):
            out.update({str(p.relative_to(root)): v for v in tree_digest(p).values()})
        elif not p.is_dir():
            out[str(p.relative_to(root))] = f"mode:{stat.S_IFMT(p.lstat().st_mode)}"
    return out


def _leftovers(dst: Path) -> list[str]:
    parent = dst.parent
    if not parent.is_dir():
        return []  # not even the parent directories a run would create are left
    return sorted(p.name for p in parent.iterdir() if p.name == dst.name or p.name.startswith(f".{dst.name}."))


def refused(result, *words, dst: Path | None = None, tmpdir: Path | None = None, strict: bool = True) -> str:
    """The whole promise: exit 2, one Error line naming `words`, sources unchanged (checked by the
    caller's digests), nothing beside DST, $TMPDIR empty. strict=False: progress lines may precede."""
    line = error_line(result, 2, strict=strict)
    for word in words:
        assert word in line, (word, line)
    if dst is not None:
        assert _leftovers(dst) == [], _leftovers(dst)
    if tmpdir is not None:
        assert list(tmpdir.iterdir()) == [], list(tmpdir.iterdir())
    return line


def convert_refused(src: Path, dst: Path, *words, flags=(), tmpdir=None) -> str:
    before = _digests(src)
    result = cli("convert", src, dst, "--groups", "2", "-q", *flags)
    line = refused(result, *words, dst=dst, tmpdir=tmpdir)
    assert _digests(src) == before
    return line


def inspect_refused(src: Path, *words) -> str:
    before = _digests(src)
    line = refused(cli("inspect", src), *words)
    assert _digests(src) == before
    return line


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _rewrite_header(file: Path, blob: bytes) -> None:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + length :])


def _edit_config(src: Path, **changes) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (src / "config.json").write_text(json.dumps(config))


def _fifo(path: Path) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)


# ------------------------------------------------------------------------- class: bounded JSON
def _deep_header(src):
    header = json.loads(_header_text(src / "model.safetensors"))
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header)[:-1] + ', "x": ' + _nested(DEEP) + "}"
    _rewrite_header(src / "model.safetensors", text.encode())


def _header_text(file: Path) -> str:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + length].decode()


def _deep_index(src):
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    save_file(tensors, src / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    weight_map = json.dumps(dict.fromkeys(tensors, "model-00001-of-00001.safetensors"))
    (src / "model.safetensors.index.json").write_text('{"x": ' + _nested(DEEP) + ', "weight_map": ' + weight_map + "}")


def _legacy_chain(src):
    """A provenance file of the old nested schema, DEEP conversions long."""
    record = {"tool": "mha2gqa", "conversion": {"method": "mean"}}
    text = json.dumps(record)
    for _ in range(DEEP):
        text = '{"tool": "mha2gqa", "conversion": {"method": "mean"}, "parent_provenance": ' + text + "}"
    (src / "mha2gqa.json").write_text(text)


DEEP_JSON = {
    "safetensors header": (_deep_header, "safetensors header nests JSON deeper than 64 levels"),
    "config.json": (lambda s: (s / "config.json").write_text('{"a": ' + _nested(DEEP) + "}"), "config.json nests"),
    "shard index": (_deep_index, "index.json nests JSON deeper than 64 levels"),
    "mha2gqa.json": (lambda s: (s / "mha2gqa.json").write_text(_nested(DEEP)), "mha2gqa.json nests"),
    "long provenance chain": (_legacy_chain, "mha2gqa.json nests JSON deeper than 64"),
    "mha2gqa.json binary": (lambda s: (s / "mha2gqa.json").write_bytes(b"\x89PNG\xff\xfe\0"), "is not UTF-8 text"),
    "config.json huge integer": (lambda s: _edit_config(s, vocab_size=10**400), "an integer of 401 digits"),
}


@pytest.mark.parametrize("fault", DEEP_JSON)
def test_convert_refuses_hostile_json(src, tmp_path, tmpdir_env, fault):
    """Each was a RecursionError (or UnicodeDecodeError) traceback of thousands of lines."""
    edit, words = DEEP_JSON[fault]
    edit(src)
    convert_refused(src, tmp_path / "out" / "dst", words, tmpdir=tmpdir_env)


@pytest.mark.parametrize("fault", ["safetensors header", "config.json", "shard index", "config.json huge integer"])
def test_inspect_refuses_hostile_json(src, fault):
    edit, words = DEEP_JSON[fault]
    edit(src)
    inspect_refused(src, words)


def test_header_over_the_size_cap_is_named_not_called_corrupt(src, tmp_path, tmpdir_env):
    """A well-formed header of 100 MB + 8: the cap (the safetensors library's), not 'corrupt'."""
    file = src / "model.safetensors"
    with open(file, "r+b") as f:
        f.write(struct.pack("<Q", 100_000_008))
        f.truncate(100_000_016 + 8)  # sparse: the length fits in the file
    convert_refused(src, tmp_path / "dst", "over the format's limit of 100,000,000", tmpdir=tmpdir_env)


def test_config_over_the_size_cap_is_refused_before_reading(src, tmp_path, tmpdir_env):
    with open(src / "config.json", "r+b") as f:
        f.truncate(65 << 20)  # sparse, 65 MiB
    convert_refused(src, tmp_path / "dst", "over mha2gqa's limit of 67,108,864 bytes", tmpdir=tmpdir_env)


# ------------------------------------------------------------------------- class: bounded YAML
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model and its training text for recipes."""
    from uptrain_helpers import corpus, tiny_model_dir

    root = tmp_path_factory.mktemp("trust_uptrain")
    return {"model": tiny_model_dir(root / "model"), "data": corpus(root / "train.jsonl"), "root": root}


def _recipe(trained, tmp_path, extra: str = "") -> Path:
    """uptrain_helpers' tiny recipe (2 steps), with `extra` YAML text appended."""
    from uptrain_helpers import recipe_file

    path = recipe_file(
        tmp_path / "recipe.yaml",
        model=str(trained["model"]),
        output_dir=str(tmp_path / "run"),
        data={"train": str(trained["data"])},
        budget={"max_steps": 2},
    )
    path.write_text(path.read_text() + extra)
    return path


BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
BOMB = "l0: &l0 [lol]\n" + BOMB
YAML_FAULTS = {
    "recipe nested deeply": ("file", "x: " + "[" * DEEP + "]" * DEEP + "\n", "nests YAML deeper than 64 levels"),
    "recipe alias bomb": ("file", BOMB, "expands to more than 100,000 YAML nodes"),
    "recipe self-referencing alias": ("file", "x: &a [*a]\n", "expands to more than 100,000 YAML nodes"),
    "override alias bomb": ("override", "tags=[" + BOMB.replace("\n", ", ") + "]", ""),
    "override nested deeply": ("override", "optim.lr=" + "[" * DEEP + "]" * DEEP, "nests YAML deeper than 64"),
    "override flow alias bomb": (
        "override",
        "optim.lr={a: &a [x, x, x, x, x, x, x, x, x, x], b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a], "
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c], "
        "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d], f: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]}",
        "expands to more than 100,000 YAML nodes",
    ),
}


@pytest.mark.parametrize("fault", YAML_FAULTS)
def test_uptrain_refuses_hostile_yaml(trained, tmp_path, tmpdir_env, fault):
    """Deep YAML printed ~3,000 lines of RecursionError; an alias bomb exhausted memory."""
    kind, text, words = YAML_FAULTS[fault]
    before = tree_digest(trained["model"])
    if kind == "file":
        recipe = _recipe(trained, tmp_path, text)
        result = cli("uptrain", "--recipe", recipe)
    else:
        recipe = _recipe(trained, tmp_path)
        result = cli("uptrain", "--recipe", recipe, text)
    line = refused(result, words, tmpdir=tmpdir_env)
    assert "YAML" in line or "override" in line
    assert not (tmp_path / "run").exists() and tree_digest(trained["model"]) == before


def test_recipe_over_the_size_cap(trained, tmp_path, tmpdir_env):
    recipe = _recipe(trained, tmp_path)
    with open(recipe, "r+b") as f:
        f.truncate(2 << 20)
    refused(cli("uptrain", "--recipe", recipe), "over mha2gqa's limit of 1,048,576 bytes", tmpdir=tmpdir_env)


# ---------------------------------------------- class: the SRC boundary and special files
def _link_out(name: str):
    def edit(src: Path):
        target = src.parent / f"outside-{name}"
        if (src / name).exists():
            shutil.copyfile(src / name, target)
        else:
            target.write_text("secret\n")
        (src / name).unlink(missing_ok=True)
        (src / name).symlink_to(target)

    return edit


def _link_to(name: str, target: str):
    def edit(src: Path):
        (src / name).unlink(missing_ok=True)
        (src / name).symlink_to(target)

    return edit


def _socket(name: str):
    def edit(src: Path):
        (src / name).unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(src / name))
        sock.close()  # the socket file stays

    return edit


def _char_device(name: str):
    def edit(src: Path):
        (src / name).unlink(missing_ok=True)
        try:
            os.mknod(src / name, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            pytest.skip("mknod of a character device needs root")

    return edit


SPECIAL_FILES = {
    "README.md linked to /etc/passwd": (_link_to("README.md", "/etc/passwd"), "outside the model directory"),
    "tokenizer.json linked out of SRC": (_link_out("tokenizer.json"), "outside the model directory"),
    "model.safetensors linked out of SRC": (_link_out("model.safetensors"), "outside the model directory"),
    "config.json linked out of SRC": (_link_out("config.json"), "outside the model directory"),
    "SOURCE_README.md linked out of SRC": (_link_to("SOURCE_README.md", "/etc/hostname"), "outside the model"),
    "model.safetensors a FIFO": (lambda s: _fifo(s / "model.safetensors"), "is a named pipe (FIFO)"),
    "tokenizer.json a FIFO": (lambda s: _fifo(s / "tokenizer.json"), "tokenizer.json is a named pipe (FIFO)"),
    "README.md a FIFO": (lambda s: _fifo(s / "README.md"), "README.md is a named pipe (FIFO)"),
    "config.json a FIFO": (lambda s: _fifo(s / "config.json"), "config.json is a named pipe (FIFO)"),
    "mha2gqa.json a FIFO": (lambda s: _fifo(s / "mha2gqa.json"), "mha2gqa.json is a named pipe (FIFO)"),
    "shard index a FIFO": (lambda s: _fifo(s / "model.safetensors.index.json"), "is a named pipe (FIFO)"),
    "tokenizer_config.json a socket": (_socket("tokenizer_config.json"), "is a socket"),
    "config.json a character device": (_char_device("config.json"), "is a character device"),
    "special_tokens_map.json a character device": (_char_device("special_tokens_map.json"), "a character device"),
}


@pytest.mark.parametrize("fault", SPECIAL_FILES)
def test_convert_reads_only_regular_files_inside_src(src, tmp_path, tmpdir_env, fault):
    """A README.md linked to /etc/passwd was copied into DST; a FIFO model.safetensors blocked forever;
    a FIFO tokenizer.json was silently left out."""
    edit, words = SPECIAL_FILES[fault]
    edit(src)
    convert_refused(src, tmp_path / "out" / "dst", words, tmpdir=tmpdir_env)


@pytest.mark.parametrize(
    "fault", ["model.safetensors a FIFO", "config.json a FIFO", "config.json linked out of SRC", "shard index a FIFO"]
)
def test_inspect_reads_only_regular_files_inside_src(src, fault):
    edit, words = SPECIAL_FILES[fault]
    edit(src)
    inspect_refused(src, words)


def test_links_inside_src_and_hub_cache_blobs_are_followed(pristine, tmp_path):
    """The rule is the boundary, not links: a hub cache snapshot links every file into ../../blobs."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(p for p in pristine.iterdir() if p.is_file())):
        shutil.copyfile(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    result = cli("convert", snapshot, tmp_path / "dst", "--groups", "2", "-q")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "dst" / "tokenizer.json").read_bytes() == (pristine / "tokenizer.json").read_bytes()


# ------------------------------------------------------------------- class: short reads
def _truncate_after_headers(monkeypatch, file_name: str, keep: int):
    """Cut a real SRC file short right after convert read the headers (as a download or a copy in
    progress would): the conversion then meets the short file."""
    original = SafetensorsCheckpoint.__init__

    def init(self, model_dir):
        original(self, model_dir)
        path = Path(model_dir) / file_name
        with open(path, "r+b") as f:
            f.truncate(keep if keep >= 0 else path.stat().st_size + keep)

    monkeypatch.setattr(SafetensorsCheckpoint, "__init__", init)


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail (not hang) where the old code spun forever. A hang guard, not a speed bound: torch's first
    import alone took up to 69 s at load 13 on 2 cores, so the callers allow 300 s."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("executor", ["numpy", "torch"])
@pytest.mark.parametrize("cut", ["last bytes", "to the header"])
def test_a_shard_cut_short_during_convert_is_one_line(src, tmp_path, tmpdir_env, monkeypatch, executor, cut):
    """It spun at 100% CPU forever (a zero-byte copy_file_range was read as 'copied nothing yet')."""
    if executor == "torch":
        monkeypatch.setenv("MHA2GQA_CONVERT_WITH_TORCH", "1")
    header_end = 8 + struct.unpack("<Q", (src / "model.safetensors").read_bytes()[:8])[0]
    dst = tmp_path / "dst"
    before = _digests(src)
    _truncate_after_headers(monkeypatch, "model.safetensors", -100 if cut == "last bytes" else header_end)
    with _deadline(300):
        result = cli("convert", src, dst, "--groups", "2", "-q")
    refused(result, "ended before", "truncated or changed while being read", dst=dst, tmpdir=tmpdir_env)
    assert set(_digests(src)) == set(before)  # the file this test cut is the only change


def test_a_copied_file_that_shrinks_is_one_line(src, tmp_path, tmpdir_env, monkeypatch):
    """tokenizer.json cut after it was checked: a changing source, not a short copy in DST."""
    from mha2gqa.convert import prepare

    original = prepare.files_to_copy

    def checked_then_cut(source):
        found = original(source)
        with open(source / "tokenizer.json", "r+b") as f:
            f.truncate(10)
        return found

    monkeypatch.setattr(prepare, "files_to_copy", checked_then_cut)
    dst = tmp_path / "dst"
    refused(cli("convert", src, dst, "--groups", "2", "-q"), "tokenizer.json ended before", dst=dst, tmpdir=tmpdir_env)


# ------------------------------------------------- class: config sizes against the tensors
SIZES = {
    "10^9 layers": ({"num_hidden_layers": 10**9}, "num_hidden_layers=1,000,000,000, more than the weights hold (2"),
    "10^12 heads": ({"num_attention_heads": 10**12, "num_key_value_heads": 10**12}, "num_attention_heads=1,000,000,"),
    "10^6 experts": ({"num_local_experts": 10**6}, "num_local_experts=1,000,000, more than the weights hold"),
    "hidden 10^9": ({"hidden_size": 10**9}, "hidden_size=1,000,000,000, more than the weights hold"),
    "head_dim 10^7": ({"head_dim": 10**7}, "head_dim=10,000,000, more than the weights hold"),
}


@pytest.mark.parametrize("fault", SIZES)
def test_convert_checks_config_sizes_against_the_tensors(src, tmp_path, tmpdir_env, fault):
    """10^9 layers or 10^12 heads hung convert (minutes to forever); 10^6 experts was copied through."""
    changes, words = SIZES[fault]
    _edit_config(src, **changes)
    with _deadline(300):
        convert_refused(src, tmp_path / "dst", words, tmpdir=tmpdir_env)


@pytest.mark.parametrize("fault", SIZES)
def test_inspect_checks_config_sizes_against_the_tensors(src, fault):
    """inspect printed a hidden size of 10^9 for tensors 128 wide, and hung on 10^9 layers."""
    changes, words = SIZES[fault]
    _edit_config(src, **changes)
    with _deadline(300):
        inspect_refused(src, words)


def test_inspect_without_weights_has_ceilings(src):
    (src / "model.safetensors").unlink()
    _edit_config(src, num_hidden_layers=10**9)
    with _deadline(300):
        inspect_refused(src, "more than mha2gqa accepts (10,000 at most)")


def test_eval_checks_config_sizes_before_building_the_model(src, tmp_path, tmpdir_env):
    _edit_config(src, num_hidden_layers=10**9)
    text = tmp_path / "t.txt"
    text.write_text(SAMPLE_TEXT * 4)
    out = tmp_path / "r.json"
    with _deadline(300):
        result = cli("eval", src, "--data", text, "--speed", "off", "--quiet", "--out", out)
    refused(result, "num_hidden_layers=1,000,000,000", tmpdir=tmpdir_env)
    assert not out.exists()


# ------------------------------------------------------------------------------ class: casts
def _with_values(src: Path, name: str, value: float, dtype=None, whole=False) -> None:
    tensors = load_file(src / "model.safetensors")
    if whole:
        tensors[name] = torch.full_like(tensors[name], value)
    else:
        tensors[name][0, 0] = value
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


CASTS = {
    "k_proj 1e6 to float16": (K, 1e6, None, False, "float16", "holds values up to |2.5e+05|, beyond float16's range"),
    "MLP 2e5 to float16": (UP, 2e5, None, False, "float16", f"tensor {UP} holds values up to |2e+05|"),
    "bf16 source 1e6 to float16": (UP, 1e6, torch.bfloat16, False, "float16", "beyond float16's range"),
    "MLP underflows to zero in float16": (UP, 1e-9, None, True, "float16", "would write all zeros"),
    "k_proj underflows to zero in float16": (K, 1e-9, None, True, "float16", "would write all zeros"),
}


@pytest.mark.parametrize("executor", ["numpy", "torch"])
@pytest.mark.parametrize("fault", CASTS)
def test_a_cast_that_overflows_or_flushes_a_tensor_is_refused(src, tmp_path, tmpdir_env, monkeypatch, executor, fault):
    """It wrote inf (exit 0, no word); the output's logits were not finite."""
    name, value, dtype, whole, target, words = CASTS[fault]
    if executor == "torch":
        monkeypatch.setenv("MHA2GQA_CONVERT_WITH_TORCH", "1")
    _with_values(src, name, value, dtype, whole)
    line = convert_refused(src, tmp_path / "dst", words, "use --dtype bfloat16", flags=("--dtype", target))
    assert name in line and "--dtype float16" in line


def test_the_same_values_cast_to_bfloat16(src, tmp_path):
    """The fix the message names works: bfloat16 holds float32's range."""
    _with_values(src, K, 1e6)
    assert cli("convert", src, tmp_path / "dst", "--groups", "2", "-q", "--dtype", "bfloat16").exit_code == 0
    assert all(torch.isfinite(t.float()).all() for t in load_file(tmp_path / "dst" / "model.safetensors").values())


# ------------------------------------------------------ class: what the card quotes from SRC
CARDS = {
    "script in the license": "---\nlicense: <script>alert(1)</script>\n---\nbody\n",
    "front matter alias bomb": "---\n" + BOMB + "license: mit\n---\nbody\n",
    "nested front matter": "---\nlicense: " + "[" * DEEP + "]" * DEEP + "\n---\n",
    "dashes in the license": "---\nlicense: \"x\\n---\\nevil: true\\n---\"\nlanguage: [en, '<b>']\n---\n",
}


@pytest.mark.parametrize("fault", CARDS)
def test_the_card_quotes_the_source_safely(src, tmp_path, fault):
    """The source's front matter was copied through; an alias bomb in it exhausted memory."""
    (src / "README.md").write_text(CARDS[fault])
    with _deadline(300):
        result = cli("convert", src, tmp_path / "dst", "--groups", "2", "-q")
    assert result.exit_code == 0, result.output
    card = (tmp_path / "dst" / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "<script" not in card and "<b>" not in card and "evil" not in card and "lol" not in card
    assert "license" not in front and card.count("\n---\n") == 1  # one front matter block, ours
    assert (tmp_path / "dst" / "SOURCE_README.md").read_text() == CARDS[fault]  # kept unchanged beside it


def test_a_plain_license_is_still_carried(src, tmp_path):
    assert cli("convert", src, tmp_path / "dst", "--groups", "2", "-q").exit_code == 0
    card = (tmp_path / "dst" / "README.md").read_text()
    assert "license: apache-2.0" in card.split("---\n")[1]


# ------------------------------------------------------------ class: names that break lines
def test_a_dst_name_with_a_newline_is_one_error_line(src, tmp_path, tmpdir_env):
    (tmp_path / "out").write_text("a file")
    dst = tmp_path / "out" / "dst\nsecond line"
    line = convert_refused(src, dst, "\\n", tmpdir=tmpdir_env)
    assert "second line" in line


def test_a_dst_name_that_is_not_utf8_converts(src, tmp_path):
    """write_card raised UnicodeEncodeError: a legal Linux name is a name, shown with a replacement."""
    dst = Path(os.fsdecode(bytes(tmp_path) + b"/dst-\xff"))
    result = cli("convert", src, dst, "--groups", "2", "-q")
    assert result.exit_code == 0, result.output
    assert "# dst-\ufffd" in (dst / "README.md").read_text()


# --------------------------------------------------------------- class: a real full tmpfs
def test_a_full_tmpdir_does_not_matter_to_convert(src, tmp_path, tmpdir_env):
    """convert writes nothing to $TMPDIR: its temporary files live in DST's partial directory."""
    with tmpfs(tmpdir_env, "1m") as mount:
        fill(mount)
        (mount / "filler").unlink()
        fill(mount)
        result = cli("convert", src, tmp_path / "dst", "--groups", "2", "-q")
        assert result.exit_code == 0, result.output
        assert [p.name for p in mount.iterdir()] == ["filler"]


def test_a_full_dst_filesystem_while_copying_files_is_one_line(src, tmp_path, tmpdir_env):
    """The tokenizer does not fit: room was checked, then filled by someone else."""
    from mha2gqa.convert import prepare

    with tmpfs(tmp_path / "mnt", "1m") as mount:
        original = prepare.files_to_copy

        def then_fill(source):
            found = original(source)
            fill(mount)
            return found

        import unittest.mock

        with unittest.mock.patch.object(prepare, "files_to_copy", then_fill):
            before = _digests(src)
            result = cli("convert", src, mount / "dst", "--groups", "2", "-q")
        refused(result, "no space left on the device", tmpdir=tmpdir_env)
        assert sorted(p.name for p in mount.iterdir()) == ["filler"] and _digests(src) == before


# ------------------------------------------------------------------- class: eval and report inputs
@pytest.fixture(scope="module")
def evaluated(pristine, tmp_path_factory):
    """A real result file of the tiny model, and a metrics.jsonl."""
    root = tmp_path_factory.mktemp("trust_report")
    text = root / "heldout.txt"
    text.write_text(SAMPLE_TEXT * 8)
    result = root / "result.json"
    ran = cli("eval", pristine, "--data", text, "--speed", "off", "--quiet", "--out", result)
    assert ran.exit_code == 0, ran.output
    metrics = root / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in range(5)))
    return {"result": result, "metrics": metrics, "text": text}


def _result_edit(change):
    def edit(path: Path):
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return edit


REPORT_FAULTS = {
    "result nested deeply": (lambda p: p.write_text('{"schema": ' + _nested(DEEP) + "}"), "nests JSON deeper than 64"),
    "integer of 10^400": (lambda p: p.write_text(p.read_text()[:-2] + ', "x": 1' + "0" * 400 + "}"), "401 digits"),
    "lm_eval.tasks a list": (_result_edit(lambda d: d.update(lm_eval={"tasks": ["hellaswag"]})), "lm_eval.tasks is"),
    "a metric as text": (
        _result_edit(lambda d: d.update(lm_eval={"tasks": {"t": {"metrics": {"acc": {"value": "high"}}}}})),
        "lm_eval.tasks is",
    ),
    "model.params as text": (_result_edit(lambda d: d["model"].update(params="many")), "model.params is"),
    "data.tokens as text": (_result_edit(lambda d: d["data"].update(tokens="lots")), "data.tokens is"),
    "result a FIFO": (lambda p: _fifo(p), "is a named pipe (FIFO)"),
    "result over the cap": (lambda p: os.truncate(p, 65 << 20), "over mha2gqa's limit"),
}


@pytest.mark.parametrize("fault", REPORT_FAULTS)
def test_report_refuses_hostile_results_and_writes_nothing(evaluated, tmp_path, tmpdir_env, fault):
    """Tracebacks, and for params/tokens as text PNGs and a half report left behind."""
    edit, words = REPORT_FAULTS[fault]
    bad = tmp_path / "bad.json"
    shutil.copyfile(evaluated["result"], bad)
    edit(bad)
    before = tree_digest(evaluated["result"])
    out = tmp_path / "rep_out"
    refused(cli("report", evaluated["result"], bad, "--out", out), words, tmpdir=tmpdir_env)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["TMPDIR", "bad.json"]  # no rep_out, no partial
    assert tree_digest(evaluated["result"]) == before


@pytest.mark.parametrize(
    "fault,line,words",
    [("metrics line nested deeply", _nested(DEEP), "line 2 nests JSON deeper"), ("metrics FIFO", None, "FIFO")],
)
def test_report_refuses_hostile_metrics(evaluated, tmp_path, tmpdir_env, fault, line, words):
    metrics = tmp_path / "metrics.jsonl"
    if line is None:
        _fifo(metrics)
    else:
        metrics.write_text(json.dumps({"step": 0, "loss": 5.0}) + "\n" + line + "\n")
    out = tmp_path / "rep"
    refused(cli("report", evaluated["result"], "--metrics", metrics, "--out", out), words, tmpdir=tmpdir_env)
    assert not out.exists()


def test_a_model_name_matplotlib_would_read_as_mathtext_is_drawn_as_text(evaluated, tmp_path):
    named = tmp_path / "named.json"
    data = json.loads(evaluated["result"].read_text())
    data["label"] = r"$\frac{x$ (gqa)"
    named.write_text(json.dumps(data))
    result = cli("report", named, "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rep" / "quality_vs_kv.png").stat().st_size > 0 and not list(tmp_path.glob(".rep.partial-*"))


EVAL_FAULTS = {
    "config.json nested deeply": (lambda s: (s / "config.json").write_text('{"a": ' + _nested(DEEP) + "}"), "nests"),
    "mha2gqa.json binary": (lambda s: (s / "mha2gqa.json").write_bytes(b"\x89PNG\xff\xfe\0"), "is not UTF-8 text"),
    "mha2gqa.json nested deeply": (lambda s: (s / "mha2gqa.json").write_text(_nested(DEEP)), "nests JSON deeper"),
    "config.json a FIFO": (lambda s: _fifo(s / "config.json"), "config.json is a named pipe (FIFO)"),
    "weights a FIFO": (lambda s: _fifo(s / "model.safetensors"), "model.safetensors is a named pipe (FIFO)"),
}


@pytest.mark.parametrize("fault", EVAL_FAULTS)
def test_eval_refuses_hostile_model_files(src, evaluated, tmp_path, tmpdir_env, fault):
    edit, words = EVAL_FAULTS[fault]
    edit(src)
    before = _digests(src)
    out = tmp_path / "r.json"
    with _deadline(300):
        result = cli("eval", src, "--data", evaluated["text"], "--speed", "off", "--quiet", "--out", out)
    refused(result, words, tmpdir=tmpdir_env)
    assert not out.exists() and _digests(src) == before


# ------------------------------------------------------------- class: wrong accepts, misleading words
@pytest.mark.parametrize("tasks", ["", ",, ,"])
def test_lm_eval_tasks_that_name_nothing_are_refused(src, evaluated, tmp_path, tasks):
    out = tmp_path / "r.json"
    result = cli("eval", src, "--data", evaluated["text"], "--lm-eval-tasks", tasks, "--out", out)
    refused(result, "names no task")
    assert not out.exists()


def test_learning_rate_suggests_lr(trained, tmp_path):
    recipe = _recipe(trained, tmp_path)
    refused(cli("uptrain", "--recipe", recipe, "optim.learning_rate=1e-4"), "(did you mean optim.lr?)")


def test_a_lora_target_that_is_not_linear_says_so(trained, tmp_path, tmpdir_env):
    recipe = _recipe(trained, tmp_path, "trainable: lora\nlora:\n  rank: 4\n  target_modules: [mlp]\n")
    line = refused(
        cli("uptrain", "--recipe", recipe),
        "'mlp' matches",
        "not Linear layers",
        "up_proj",
        tmpdir=tmpdir_env,
        strict=False,
    )
    assert "LlamaMLP" in line and not (tmp_path / "run" / "model.safetensors").exists()


def test_a_dst_name_near_the_length_limit_converts(src, tmp_path):
    """A legal 245-character DST was refused as too long because of the derived .DST.partial-PID name."""
    dst = tmp_path / ("d" * 245)
    result = cli("convert", src, dst, "--groups", "2", "-q")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["TMPDIR", "src", dst.name])


# ------------------------------------------------------------------------- class: divergence
def test_the_guard_sees_guessing_through_noise():
    """lr=1e30 for one step left an eval loss 2e-6 below log(4096): 'better than guessing' passed it."""
    import math

    from mha2gqa.uptrain.guard import Guard

    guard = Guard(4096, best_eval=5.0, weight_scale=1.0)
    assert "no better than guessing" in guard.eval_problem(math.log(4096) - 2e-6, 1.0)
    assert guard.eval_problem(5.1, 1.5) is None  # ordinary noise and growth pass


def test_the_guard_sees_weights_grown_by_orders_of_magnitude():
    from mha2gqa.uptrain.guard import Guard

    guard = Guard(4096, best_eval=5.0, weight_scale=1.0)
    assert "grew from 1 to 1e+30" in guard.eval_problem(4.0, 1e30)
    assert "non-finite" in guard.eval_problem(4.0, float("nan"))


def test_a_destroyed_model_is_not_saved_and_not_named_good(trained, tmp_path, tmpdir_env):
    """One step at lr=1e30: exit 1, no final model, no checkpoint called 'the last good' one."""
    recipe = _recipe(trained, tmp_path)
    before = tree_digest(trained["model"])
    result = cli("uptrain", "--recipe", recipe, "budget.max_steps=3", "save_every=1", "optim.lr=1e30")
    line = error_line(result, 1, strict=False)
    assert "diverged" in line and "last good checkpoint" not in line
    assert not (tmp_path / "run" / "model.safetensors").exists() and tree_digest(trained["model"]) == before


# ----------------------------------------------------------------- class: a real process, real FIFO
def test_a_fifo_never_blocks_a_real_convert_process(src, tmp_path):
    """model.safetensors as a FIFO blocked `mha2gqa convert` forever; now one line at once. The
    process is ended by SIGKILL if it is still running after 60 s (the old behaviour)."""
    import subprocess
    import sys

    _fifo(src / "model.safetensors")
    dst = tmp_path / "dst"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "mha2gqa", "convert", src, dst, "--groups", "2", "-q"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.communicate()
        raise AssertionError("convert blocked on a FIFO") from None
    assert process.returncode == 2 and "Traceback" not in stderr
    assert [ln for ln in stderr.splitlines() if ln.startswith("Error: ")] == [
        f"Error: {src / 'model.safetensors'} is a named pipe (FIFO), not a regular file: mha2gqa reads only "
        "regular files; put the file itself there"
    ]
    assert _leftovers(dst) == []


@pytest.mark.parametrize("where", ["file", "in a folder"])
def test_text_data_that_is_a_fifo_is_refused(src, evaluated, tmp_path, tmpdir_env, where):
    """eval --data on a FIFO blocked; one in a data folder was silently left out."""
    if where == "file":
        data = tmp_path / "held.txt"
    else:
        (tmp_path / "texts").mkdir()
        (tmp_path / "texts" / "a.txt").write_text(SAMPLE_TEXT * 4)
        data = tmp_path / "texts"
    _fifo(data if where == "file" else data / "b.txt")
    out = tmp_path / "r.json"
    with _deadline(300):
        result = cli("eval", src, "--data", data, "--speed", "off", "--quiet", "--out", out)
    refused(result, "is a named pipe (FIFO), not a regular file", tmpdir=tmpdir_env)
    assert not out.exists()
