"""serve-bench against the real vLLM (marker `vllm`, left out of the default run): the embedded parent (8 kv
heads) and its `convert --groups 2` child, both served; the engine's greedy text equals transformers' on every
probe prompt, the KV tokens the engine reports equal our formula's for each, so their ratio is the formula's 4x
(up to one KV block of rounding), and the timed points run: at a 6 MiB KV budget the parent has 4 blocks, one
vLLM's null block, so it fits 3 requests and the child 15: the capacity point runs 6 and the engine's own gauge
never shows the parent running more than 3;
the decode-only point (2 requests, both fit) runs after the servers went quiet. Run it in a venv that has vLLM, as .ci/run
does: `python -m pytest -m vllm tests/vllm` (docs/serving.md)."""

from __future__ import annotations

import json
import sys

import psutil
import pytest
from fault_helpers import cli
from serving_helpers import EMBEDDED, convert_child

pytestmark = pytest.mark.vllm


def test_the_embedded_model_and_its_gqa2_child_serve_in_vllm_as_transformers_decodes_them(tmp_path):
    before = _vllm_processes()
    child = convert_child(tmp_path / "child")
    out = tmp_path / "serve.json"
    args = ["serve-bench", EMBEDDED, child, "--vllm-python", sys.executable, "--eager", "--context", "256"]
    args += ["--concurrency", "1,4", "--repeats", "1", "--prompt-tokens", "32", "--output-tokens", "16"]
    args += ["--kv-cache-memory", "6MiB", "--decode-concurrency", "2"]
    found = cli(*args, "--startup-timeout", "600", "--out", out)
    assert found.exit_code == 0, found.output
    data = json.loads(out.read_text())
    parent, converted = data["models"]
    for m in (parent, converted):
        assert m["greedy"]["equal"] == len(m["greedy"]["prompts"]) == 8, m["greedy"]["prompts"]
        assert m["kv"]["engine"]["tokens"] == m["kv"]["formula"]["tokens"], m["kv"]
        assert m["kv"]["engine"]["context"] == 256 and m["kv"]["engine"]["block_size"]
        assert [p["concurrency"] for p in m["throughput"]] == [1, 4] and m["throughput"][1]["output_tokens_per_s"] > 0
    assert (parent["kv_heads"], converted["kv_heads"]) == (8, 2)
    ratio = data["comparison"][0]
    block = parent["kv"]["engine"]["block_size"]
    assert ratio["formula_ratio"] == 4.0
    assert abs(ratio["kv_tokens_ratio"] - 4.0) <= 4 * block / parent["kv"]["engine"]["tokens"], ratio
    assert (parent["fits_requests"], converted["fits_requests"]) == (3, 15)
    assert data["settle"]["settled"] and data["settings"]["capacity_concurrency"] == 6
    for m in (parent, converted):
        assert m["decode"]["concurrency"] == 2 and m["decode"]["tpot_ms"] > 0 and m["decode"]["itl_ms"] > 0
        assert m["capacity"]["output_tokens_per_s"] > 0 and m["capacity"]["running_max"] is not None
    assert parent["capacity"]["running_max"] <= 3 and converted["capacity"]["running_max"] <= 6
    assert data["warnings"] == []
    assert _vllm_processes() - before == set()  # every engine core and worker ended with its server


def _vllm_processes() -> set[int]:
    """The pids of processes vLLM names VLLM::EngineCore, VLLM::Worker, ... (their command line is renamed)."""
    found = set()
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        title = " ".join(proc.info["cmdline"] or []) + (proc.info["name"] or "")
        if "VLLM::" in title and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.add(proc.info["pid"])
    return found
