"""What convert writes: shards and index, dtypes, copied files (the same bytes where copy_file_range is refused
or missing), provenance, dry run, atomicity."""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from tiny_models import make_tiny_tokenizer, save_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from mha2gqa import convert
from mha2gqa.files.checkpoint import ShardedWriter
from mha2gqa.records.provenance import latest


def test_sharded_source_gives_sharded_output_with_a_correct_index(tmp_path):
    save_tiny_model(tmp_path / "src", "llama", max_shard_size="100KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    convert(tmp_path / "src", tmp_path / "dst", groups=2, max_shard_size="60KB", progress=False)

    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total, seen = 0, {}
    for shard in shards:
        path = tmp_path / "dst" / shard
        assert path.stat().st_size <= 60_000 + 4096  # payload bound plus header
        with safe_open(path, "pt") as f:
            for name in f.keys():
                seen[name] = shard
                total += f.get_tensor(name).numel() * 4
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", output_loading_info=True)
    assert not any(info.values())


def _placed(model_dir):
    """name -> (shard file, absolute byte offset, bytes) of every tensor in a safetensors folder."""
    placed = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            placed[name] = (path.name, 8 + length + start, end - start)
    return placed


def test_output_shards_do_not_mix_copies_of_two_source_files(tmp_path):
    # one header pad can keep only one source file's offset within a page (checkpoint.assign_shards)
    save_tiny_model(tmp_path / "src", "llama", max_shard_size="100KB")
    convert(tmp_path / "src", tmp_path / "dst", groups=2, progress=False)  # 5GB would fit all in one shard
    source, output = _placed(tmp_path / "src"), _placed(tmp_path / "dst")
    copied = [name for name in output if output[name][2] == source[name][2] and "k_proj" not in name]
    files_per_shard = {}
    for name in copied:
        files_per_shard.setdefault(output[name][0], set()).add(source[name][0])
    assert all(len(files) == 1 for files in files_per_shard.values())
    assert len(files_per_shard) == len({source[n][0] for n in copied}) > 1
    for name in output:  # and the bytes are the source's (or the pooled ones, checked elsewhere)
        if name in copied:
            with (
                (tmp_path / "src" / source[name][0]).open("rb") as a,
                (tmp_path / "dst" / output[name][0]).open("rb") as b,
            ):
                a.seek(source[name][1])
                b.seek(output[name][1])
                assert a.read(source[name][2]) == b.read(output[name][2]), name


def test_bf16_stays_bf16_and_dtype_flag_casts(tmp_path):
    save_tiny_model(tmp_path / "src", "llama", dtype=torch.bfloat16)
    convert(tmp_path / "src", tmp_path / "kept", groups=4, progress=False)
    convert(tmp_path / "src", tmp_path / "cast", groups=4, dtype="float16", progress=False)
    with safe_open(tmp_path / "kept" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {torch.bfloat16}
    with safe_open(tmp_path / "cast" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {torch.float16}
    assert json.loads((tmp_path / "cast" / "config.json").read_text())["dtype"] == "float16"
    source_config = json.loads((tmp_path / "src" / "config.json").read_text())
    kept_config = json.loads((tmp_path / "kept" / "config.json").read_text())
    assert kept_config == dict(source_config, num_key_value_heads=4)  # nothing else changed


def test_tokenizer_and_generation_files_are_copied(tmp_path):
    save_tiny_model(tmp_path / "src", "mistral")
    make_tiny_tokenizer(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dst", groups=1, progress=False)
    copied = [p.name for p in (tmp_path / "src").iterdir() if p.name.startswith(("tokenizer", "generation"))]
    assert "tokenizer.json" in copied and "generation_config.json" in copied
    for name in copied:
        assert (tmp_path / "dst" / name).read_bytes() == (tmp_path / "src" / name).read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "dst")
    assert tokenizer.decode(tokenizer("a good fortune").input_ids) == "a good fortune"


def test_provenance_records_how_it_was_made(tmp_path):
    save_tiny_model(tmp_path / "src", "llama")
    convert(tmp_path / "src", tmp_path / "dst", groups=2, method="first", progress=False)
    record = json.loads((tmp_path / "dst" / "mha2gqa.json").read_text())
    conversion = latest(tmp_path / "dst", "conversion")
    assert record["tool"] == "mha2gqa" and conversion["version"] and conversion["date"]
    assert conversion["method"] == "first" and conversion["groups"] == 2 and conversion["source_kv_heads"] == 8
    assert (
        conversion["source_config_sha256"]
        == hashlib.sha256((tmp_path / "src" / "config.json").read_bytes()).hexdigest()
    )
    assert conversion["date"].startswith("20")


def test_dry_run_writes_nothing_and_plans_every_tensor(tmp_path):
    save_tiny_model(tmp_path / "src", "qwen2")
    result = convert(tmp_path / "src", tmp_path / "dst", groups=2, dry_run=True, progress=False)
    assert not (tmp_path / "dst").exists()
    assert result.dst is None
    outputs = {t.name: t.shape for t in result.tensors.output_tensors()}
    assert outputs["model.layers.1.self_attn.k_proj.weight"] == (16, 64)
    assert outputs["model.layers.1.self_attn.k_proj.bias"] == (16,)
    assert outputs["model.layers.1.self_attn.q_proj.weight"] == (64, 64)
    assert result.tensors.bytes_in - result.tensors.bytes_out == 2 * 2 * (64 - 16) * (64 + 1) * 4


def test_force_replaces_a_non_empty_destination(tmp_path):
    save_tiny_model(tmp_path / "src", "llama")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "stale.txt").write_text("old")
    convert(tmp_path / "src", tmp_path / "dst", groups=2, force=True, progress=False)
    assert not (tmp_path / "dst" / "stale.txt").exists()
    assert (tmp_path / "dst" / "model.safetensors").is_file()


def test_an_interrupted_run_leaves_no_destination(tmp_path, monkeypatch):
    save_tiny_model(tmp_path / "src", "llama")
    calls = []

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-way

    monkeypatch.setattr(ShardedWriter, "write_array", failing_write)  # both executors write through it
    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "src", tmp_path / "dst", groups=2, progress=False)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no dst, no partial directory


def test_python_api_stays_callable_after_submodules_are_imported(tmp_path):
    import mha2gqa
    import mha2gqa.convert.methods  # noqa: F401  (would shadow a plain function of the same name)

    save_tiny_model(tmp_path / "src", "llama")
    result = mha2gqa.convert(tmp_path / "src", tmp_path / "dst", groups=4, progress=False)
    assert result.dst == tmp_path / "dst" and result.tensors.groups == 4


def test_plain_copies_give_identical_shards_without_copy_file_range(tmp_path, monkeypatch):
    import mha2gqa.files.checkpoint as checkpoint

    save_tiny_model(tmp_path / "src", "llama")
    options = dict(groups=2, max_shard_size="20KB", progress=False)  # several shards, many copied tensors
    convert(tmp_path / "src", tmp_path / "fast", **options)

    def refuse(*args):
        raise OSError(18, "Invalid cross-device link")  # EXDEV: what some filesystem pairs answer

    calls = []
    monkeypatch.setattr(checkpoint.os, "copy_file_range", lambda *a: calls.append(a) or refuse(), raising=False)
    convert(tmp_path / "src", tmp_path / "fallback", **options)
    assert calls  # the fast path was tried, refused, and the user-space copy took over
    monkeypatch.delattr(checkpoint.os, "copy_file_range")  # and a platform without it at all
    convert(tmp_path / "src", tmp_path / "none", **options)
    names = sorted(p.name for p in (tmp_path / "fast").glob("*.safetensors"))
    assert len(names) > 1
    for name in names:
        expected = (tmp_path / "fast" / name).read_bytes()
        assert (tmp_path / "fallback" / name).read_bytes() == expected
        assert (tmp_path / "none" / name).read_bytes() == expected
