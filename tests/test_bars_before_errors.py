"""An error ends the program below the progress bars: a bar left open held the cursor, so the `Error:` line
was printed on the bar's line (`convert --dtype float16` of a tensor that overflows), and the bar redrew
itself after it at exit. Run as a subprocess: the redraw happened when the bar was collected."""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_model

K = "model.layers.1.self_attn.k_proj.weight"


@pytest.mark.parametrize("executor", ["numpy", "torch"])
def test_the_error_line_comes_below_the_bar_and_nothing_after_it(tmp_path, monkeypatch, executor):
    save_tiny_model(tmp_path / "src", "llama")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    tensors[K][0, 0] = 1e6  # beyond float16's 65504
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    if executor == "torch":
        monkeypatch.setenv("MHA2GQA_CONVERT_WITH_TORCH", "1")
    command = [sys.executable, "-m", "mha2gqa", "convert", tmp_path / "src", tmp_path / "dst", "-g", "2"]
    done = subprocess.run([*map(str, command), "--dtype", "float16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    before, _, after = done.stderr.partition("Error: --dtype float16: tensor " + K)
    assert "convert:" in before and before.endswith("\n"), repr(done.stderr)  # the bar was drawn, and ended
    assert after.count("\n") == 1 and after.endswith("\n") and "\r" not in after, repr(after)  # no redraw


def test_close_open_bars_closes_every_open_bar(capsys):
    from mha2gqa.runtime.progress import close_open_bars, progress_bar

    close_open_bars()  # nothing open: nothing to do
    first, second = progress_bar(10, "a", True), progress_bar(10, "b", True)
    first.update(3)
    close_open_bars()
    assert first.disable and second.disable  # what tqdm sets on close
    assert capsys.readouterr().err.endswith("\n")


def rendered_lines(stream: str) -> list[str]:
    """What a terminal shows of `stream`: a carriage return moves back to the line's start, later text
    overwrites earlier (tqdm's redraws and clears), a newline starts the next line."""
    lines = []
    for raw in stream.split("\n"):
        shown: list[str] = []
        column = 0
        for ch in raw:
            if ch == "\r":
                column = 0
                continue
            if column < len(shown):
                shown[column] = ch
            else:
                shown.append(ch)
            column += 1
        lines.append("".join(shown).rstrip())
    return lines


@pytest.mark.parametrize("executor", ["numpy", "torch"])
def test_a_warning_starts_a_line_of_its_own_while_a_bar_is_drawn(tmp_path, monkeypatch, executor):
    # The NaN-weights warning of `convert` was printed onto the convert bar's line.
    save_tiny_model(tmp_path / "src", "llama")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    tensors[K][0, 0] = float("inf")
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    if executor == "torch":
        monkeypatch.setenv("MHA2GQA_CONVERT_WITH_TORCH", "1")
    command = [sys.executable, "-m", "mha2gqa", "convert", tmp_path / "src", tmp_path / "dst", "-g", "2"]
    done = subprocess.run([*map(str, command)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    shown = rendered_lines(done.stderr)
    warned = [line for line in shown if "Warning:" in line]
    assert len(warned) == 1 and warned[0].startswith(f"Warning: {K} has 1 non-finite values"), shown
    assert any(line.startswith("convert:") for line in shown), shown  # the bar was drawn too


def test_write_line_puts_text_above_an_open_bar(capsys):
    from mha2gqa.runtime.progress import progress_bar, write_line

    bar = progress_bar(10, "stage", True)
    bar.update(4)
    write_line("Warning: something")
    bar.update(2)
    bar.close()
    shown = rendered_lines(capsys.readouterr().err)
    assert "Warning: something" in shown and any(line.startswith("stage:") for line in shown), shown
