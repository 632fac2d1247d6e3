"""Shared pieces of the fault-injection suites (test_faults_uptrain.py, test_faults_eval.py): what
every case asserts (exit code, one `Error:` line, no traceback, sources byte-identical) and real
faulty filesystems (a small tmpfs, full or read-only; root only, skipped with the reason elsewhere)."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mha2gqa.cli import main


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under `path` (or of the file itself), by relative path."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {
        str(p.relative_to(path.parent if path.is_file() else path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in files
    }


def cli(*args, cwd: Path | None = None):
    """`mha2gqa ARGS...` in this process (click's runner: stdout and stderr apart)."""
    runner = CliRunner()
    if cwd is None:
        return runner.invoke(main, [str(a) for a in args])
    with contextlib.chdir(cwd):
        return runner.invoke(main, [str(a) for a in args])


def error_line(result, code: int = 2, strict: bool = True) -> str:
    """Assert the run failed with `code`, one `Error:` line and no traceback; return that line.
    strict: stderr holds nothing else but progress bars; otherwise other output (notes) may precede."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and "%|" not in ln]  # minus progress bars
    errors = [ln for ln in lines if ln.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    if strict:
        assert lines == errors, result.stderr
    return errors[0]


def assert_refused(result, *fragments: str, code: int = 2, strict: bool = True) -> str:
    line = error_line(result, code, strict)
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def subprocess_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The same checks on a real subprocess's exit code and stderr."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


def edit_weights(src: Path, dst: Path, edit) -> Path:
    """A copy of model dir `src` at `dst` whose weights are `edit(state_dict)` (edited in place)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def drop_tensor(name: str):
    return lambda w: w.pop(name)


def add_tensor(name: str):
    return lambda w: w.__setitem__(name, torch.zeros(4))


def reshape_tensor(name: str):
    return lambda w: w.__setitem__(name, w[name][: w[name].shape[0] // 2].clone())


def pickle_only(src: Path, dst: Path) -> Path:
    """A copy of `src` whose weights are a pickled pytorch_model.bin only."""
    shutil.copytree(src, dst)
    torch.save(load_file(str(dst / "model.safetensors")), dst / "pytorch_model.bin")
    (dst / "model.safetensors").unlink()
    return dst


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "1m"):
    """A real tmpfs of `size` mounted at `path` (created); skips the test where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount_readonly(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def fill(path: Path) -> None:
    """Fill the filesystem holding `path` to the last byte."""
    with open(path / "filler", "wb", buffering=0) as f:  # unbuffered: each write meets ENOSPC itself
        for chunk in (b"\0" * 65536, b"\0"):
            with contextlib.suppress(OSError):
                while True:
                    f.write(chunk)


def sweep_args(tiny: Path, out, *extra) -> list:
    """`mha2gqa sweep` of a tiny fixture folder (src/, cal.txt, eval.txt): 600 calibration tokens, 300 scored."""
    return [
        "sweep",
        tiny / "src",
        "--calibration",
        tiny / "cal.txt",
        "--data",
        tiny / "eval.txt",
        "--out",
        out,
        "--calibration-tokens",
        600,
        "--max-tokens",
        300,
        "--quiet",
        *extra,
    ]
