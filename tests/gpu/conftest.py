"""The GPU checks as tests (marker `gpu`), one module a part of bench/gpu_check.py, which runs each in a pytest
process of its own on a lent GPU. Without CUDA they skip, unless gpu_check --smoke set GPU_CHECK_SMOKE=1 (the same
code at toy sizes on CPU). The `part` fixture carries what gpu_check reads back: the part's measurements and what
it skipped go to the JSON file GPU_CHECK_RESULT names, with the error when the part failed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


class Part:
    """One part's record: `result` (its numbers, set before its assertions so that a failed check keeps them)
    and `skipped` (what needs CUDA and was left out, with why)."""

    def __init__(self, name: str, work: Path, smoke: bool):
        self.name, self.work, self.smoke = name, work, smoke
        self.result: dict | None = None
        self.skipped: list[dict] = []

    def skip(self, what: str, reason: str) -> None:
        self.skipped.append({"what": what, "reason": reason})


@pytest.fixture
def part(request, tmp_path) -> Part:
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    work = Path(os.environ["GPU_CHECK_WORK"]) if os.environ.get("GPU_CHECK_WORK") else tmp_path
    work.mkdir(parents=True, exist_ok=True)
    record = Part(name, work, os.environ.get("GPU_CHECK_SMOKE") == "1")
    request.node.gpu_part = record
    if os.environ.get("GPU_CHECK_FAIL") == name:
        raise RuntimeError(f"deliberate failure of part {name} (--fail {name})")
    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Write the part's record for gpu_check after the test body, or with the error of the phase that failed."""
    report = (yield).get_result()
    record, path = getattr(item, "gpu_part", None), os.environ.get("GPU_CHECK_RESULT")
    if not path or not (report.failed or report.skipped or report.when == "call"):
        return
    data = {"result": record.result if record else None, "skipped": record.skipped if record else []}
    if report.skipped:  # no CUDA and no --smoke: gpu_check reports the part as not run, with why
        data = {"error": "skipped: " + str(report.longrepr[2]).removeprefix("Skipped: "), "skipped": []}
    elif report.failed:
        error = call.excinfo.value
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        data["error"] = f"{type(error).__name__}: {message}"[:500]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1))
