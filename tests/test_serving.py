"""serve-bench without vLLM: the log and /metrics parsing, finding vLLM's Python, the options' refusals, the
comparison, and the server's process group against a fake server (tests/fake_vllm) that starts, fails to start,
hangs or dies as a test asks. The run against the real vLLM is tests/vllm/test_vllm_smoke.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import assert_refused, cli
from serving_helpers import EMBEDDED, QUICK, convert_child, core_pids, fake_python, gone

from mha2gqa.runtime.errors import InputError
from mha2gqa.serving import engine, kvlog, result, server
from mha2gqa.serving.options import ServeOptions

CPU_LOG = (
    "(EngineCore pid=11346) INFO 12-02 19:55:12 [kv_cache_utils.py:2327] CPU KV cache size: 87,296 tokens, "
    "Maximum concurrency for 512 tokens per request: 170.50x\n"
)
GPU_LOG = (
    "INFO [kv_cache_utils.py:1087] GPU KV cache size: 1,234,560 tokens\n"
    "INFO [kv_cache_utils.py:1091] Maximum concurrency for 4,096 tokens per request: 301.41x\n"
)
METRICS = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="128",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="87296",'
    'num_gpu_blocks="682"} 1.0\n'
)


def test_the_kv_line_is_read_from_a_cpu_log_and_a_gpu_log():
    assert kvlog.from_log(CPU_LOG) == {"device": "CPU", "tokens": 87296, "context": 512, "max_concurrency": 170.5}
    assert kvlog.from_log(GPU_LOG) == {"device": "GPU", "tokens": 1234560, "context": 4096, "max_concurrency": 301.41}
    assert kvlog.from_log("no such line") == {"device": None, "tokens": None, "context": None, "max_concurrency": None}


def test_the_block_size_and_budget_come_from_metrics_and_the_formula_predicts_the_engine_exactly():
    reported = kvlog.engine_kv(CPU_LOG, METRICS)
    assert (reported["block_size"], reported["budget_bytes"]) == (128, 2**30)
    # the embedded parent: 6 layers x 8 kv heads x 32 dims x K and V x 4 bytes = 12,288 bytes per token
    formula = kvlog.formula_kv(12288, 2**30, 512, reported["block_size"])
    assert formula == {"bytes_per_token": 12288, "tokens": 87296, "max_concurrency": 170.5}
    assert kvlog.formula_kv(12288, 2**30, 512, None)["tokens"] == 87381  # no block size: no rounding
    # a log without the line: the metrics' count stands in
    assert kvlog.engine_kv("", METRICS)["tokens"] == 87296


def test_vllm_not_found_is_refused_in_one_line(tmp_path):
    with pytest.raises(InputError, match=r"^vLLM not found: no --vllm-python, no MHA2GQA_VLLM_PYTHON, no vllm on PATH"):
        engine.find_engine(None, {"PATH": str(tmp_path)})
    with pytest.raises(InputError, match=r"--vllm-python .*/nope: no such executable file"):
        engine.find_engine(str(tmp_path / "nope"), {})
    # a Python without site-packages cannot import vllm, even in a venv that has it (.ci/vllm runs this test there)
    bare = tmp_path / "python-without-site-packages"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    with pytest.raises(InputError, match=r"MHA2GQA_VLLM_PYTHON .* cannot import vllm"):
        engine.find_engine(None, {engine.ENV: str(bare)})


def test_the_python_of_vllm_on_path_is_found_from_its_script(tmp_path):
    python = fake_python(tmp_path)
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "vllm"
    script.write_text(f"#!{python}\nimport sys\n")
    script.chmod(0o755)
    found = engine.find_engine(None, {"PATH": str(tmp_path / "bin")})
    assert (found.python, found.found_by, found.version) == (str(python), "vllm on PATH", "0.0.0+fake")
    assert engine.find_engine(str(python), {}).found_by == "--vllm-python"


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"dtype": "int8"}, "--dtype 'int8' is not supported"),
        ({"repeats": 0}, "--repeats 0 must be at least 1"),
        ({"concurrency": (1, 0)}, "--concurrency 1,0: each value must be at least 1"),
        ({"context": 100, "prompt_tokens": 90, "output_tokens": 20}, "= 110 exceeds --context 100"),
        ({"kv_cache_memory": "lots"}, "--kv-cache-memory 'lots' is not a size"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(fields, fragment):
    with pytest.raises(InputError, match=fragment.replace("(", r"\(").replace("+", r"\+")):
        ServeOptions(**fields).validate()


def test_a_kv_cache_too_small_for_one_context_is_refused(tmp_path, converted):
    python, child = fake_python(tmp_path), converted
    args = ["--vllm-python", python, "--kv-cache-memory", "1MiB", "--context", "512"]
    result_ = cli("serve-bench", EMBEDDED, child, *args)
    assert_refused(result_, "--kv-cache-memory 1MiB holds 85 tokens of austen-mha's KV cache, fewer than --context 512")


@pytest.mark.parametrize("value", ["1GiB", "35389440"])
def test_the_old_kv_budget_flag_of_serve_bench_names_its_new_name(converted, value):
    """serve-bench's --kv-budget took vLLM's name: the old spelling is one line naming the new one, with its value,
    before any other check (--kv-budget is now only convert's and sweep's per-token fraction)."""
    line = assert_refused(cli("serve-bench", EMBEDDED, converted, "--concurrency", "x", "--kv-budget", value))
    assert line.startswith("Error: serve-bench --kv-budget is now --kv-cache-memory (each server's whole KV-cache")
    assert f"give --kv-cache-memory {value}" in line and "concurrency" not in line


def test_leading_equal_and_the_comparison_over_the_parent():
    assert result.leading_equal([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert result.leading_equal([1, 2], [1, 2]) == 2

    def model(label, tokens, per_token, speeds):
        kv = {"engine": {"tokens": tokens, "max_concurrency": tokens / 512}, "formula": {"bytes_per_token": per_token}}
        points = [{"concurrency": c, "output_tokens_per_s": v} for c, v in speeds.items()]
        return {"label": label, "kv": kv, "throughput": points}

    rows = result.comparison(
        [model("p", 87296, 12288, {1: 10.0, 8: 40.0}), model("c", 349440, 3072, {1: 11.0, 8: 60.0})]
    )
    assert rows[0]["kv_tokens_ratio"] == pytest.approx(349440 / 87296)
    assert rows[0]["formula_ratio"] == 4.0
    assert rows[0]["throughput_ratio"] == {"1": pytest.approx(1.1), "8": pytest.approx(1.5)}


# --- the process group, with the fake server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The embedded parent converted to 2 kv heads, once for the module."""
    return convert_child(tmp_path_factory.mktemp("child") / "child")


def _server(tmp_path, python, mode: str, timeout: float = 60.0, port: int | None = None):
    port = port or server.free_port()
    args = engine.ServerArgs(dtype="float32", context=256, kv_cache_bytes=2**30, eager=True)
    found = engine.Engine(str(python), "--vllm-python", "0", "vllm")
    command = engine.server_command(found, str(EMBEDDED), "parent", port, args)
    env = {**engine.server_environment(), "FAKE_VLLM": mode}
    return server.Server("parent", command, port, tmp_path / "logs" / "parent.log", env, timeout)


def test_a_server_that_answers_is_ready_and_its_whole_group_ends_with_the_block(tmp_path):
    with _server(tmp_path, fake_python(tmp_path), "ok") as s:
        assert s.wait_ready() < 60
        assert "CPU KV cache size: 87,296 tokens" in s.log_text()
        leader = s.process.pid
    pids = core_pids(tmp_path / "logs")
    assert len(pids) == 1 and gone(pids[0]) and gone(leader)


@pytest.mark.parametrize(
    "mode, timeout, fragment",
    [
        ("exit", 60, "exited with code 1 before it was ready: last log line: ValueError: the fake cannot load"),
        ("hang", 3, "did not answer /health within 3 s (--startup-timeout)"),
    ],
)
def test_a_server_that_does_not_start_is_refused_and_leaves_no_process(tmp_path, mode, timeout, fragment):
    with pytest.raises(InputError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        with _server(tmp_path, fake_python(tmp_path), mode, timeout) as s:
            s.wait_ready()
    pids = core_pids(tmp_path / "logs")
    assert len(pids) == 1 and gone(pids[0])


def test_a_port_taken_before_the_server_binds_it_is_refused(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(InputError, match=r"exited with code 1 before it was ready: .*Address already in use"):
            with _server(tmp_path, fake_python(tmp_path), "ok", port=port) as s:
                s.wait_ready()
        with pytest.raises(InputError, match=rf"--port {port}: the port is in use"):
            server.ensure_port_free(port)
    assert all(gone(pid) for pid in core_pids(tmp_path / "logs"))


def test_a_server_that_dies_mid_run_is_refused_in_one_line_and_leaves_no_process(tmp_path, monkeypatch, converted):
    monkeypatch.setenv("FAKE_VLLM", "die_after=3")
    child = converted
    out = tmp_path / "serve.json"
    found = cli("serve-bench", EMBEDDED, child, "--vllm-python", fake_python(tmp_path), *QUICK, "--out", out)
    assert_refused(
        found,
        "the server for austen-mha exited with code 1 during the run",
        "RuntimeError: the fake engine died",
        strict=False,  # the progress lines before it
    )
    assert not out.exists()
    pids = core_pids(tmp_path / "serve.json.logs")
    assert len(pids) == 2 and all(gone(pid) for pid in pids)


def test_ctrl_c_ends_every_server_and_exits_130(tmp_path, converted):
    child = converted
    logs = tmp_path / "logs"
    env = {**os.environ, "FAKE_VLLM": "hang"}
    command = [sys.executable, "-m", "mha2gqa", "serve-bench", str(EMBEDDED), str(child), *QUICK]
    command += ["--vllm-python", str(fake_python(tmp_path)), "--logs", str(logs)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(core_pids(logs)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    pids = core_pids(logs)
    assert len(pids) == 2, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Interrupted by SIGINT" in err and "Traceback" not in err
    assert all(gone(pid) for pid in pids)


def test_serve_bench_against_the_fake_writes_a_result_the_report_shows(tmp_path, converted):
    child = converted
    out = tmp_path / "serve.json"
    args = ["serve-bench", EMBEDDED, child, "--vllm-python", fake_python(tmp_path), *QUICK, "--out", out]
    found = cli(*args, "--concurrency", "1,2", "--repeats", "2", "--prompt-tokens", "16", "--output-tokens", "4")
    assert found.exit_code == 0, found.output
    data = json.loads(out.read_text())
    parent, converted = data["models"]
    assert (parent["kv"]["engine"]["tokens"], converted["kv"]["engine"]["tokens"]) == (87296, 349440)
    assert parent["kv"]["match"] and converted["kv"]["match"]
    assert data["comparison"][0]["formula_ratio"] == 4.0
    # the fake's "greedy" rule is not the model's: every prompt differs, and the result says where
    assert parent["greedy"]["equal"] == 0 and parent["greedy"]["prompts"][0]["first_difference"] is not None
    assert converted["greedy"]["follows_parent_mean"] == 4  # the same rule for both models
    assert [p["concurrency"] for p in parent["throughput"]] == [1, 2]
    assert len(parent["throughput"][1]["runs"]) == 2 and parent["throughput"][1]["requests"] == 4
    assert any("differs from transformers'" in w for w in data["warnings"])
    assert all(gone(pid) for pid in core_pids(tmp_path / "serve.json.logs"))

    report = cli("report", out, "--out", tmp_path / "report")
    assert report.exit_code == 0, report.output
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Serving (vLLM 0.0.0+fake" in text and "| child | 2 | 349,440 | 4.00x (4.00x) |" in text
    assert (tmp_path / "report" / "serving_throughput.png").stat().st_size > 1000


def test_the_gqa8_serving_bench_runs_at_its_smoke_size(tmp_path):
    """bench/serve_gqa8.py builds a random MHA model, converts it and serves both (here by the fake server)."""
    root = EMBEDDED.parents[2]
    command = [sys.executable, "bench/serve_gqa8.py", "--smoke", "--vllm-python", str(fake_python(tmp_path))]
    command += ["--tokenizer", str(EMBEDDED), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "gqa8.json")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout[done.stdout.index("\n[") + 1 :])  # the table: the line that opens with [
    assert [r["kv_heads"] for r in rows] == [8, 2] and rows[1]["ratios"]["kv_tokens"] == pytest.approx(4, rel=0.01)
    assert rows[0]["concurrency"] == 4 and rows[0]["output_tokens_per_s"] > 0
    assert json.loads((tmp_path / "gqa8.json").read_text())["settings"]["prompt_tokens"] == 248


def test_serve_bench_times_decode_alone_and_the_capacity_bound_point_after_the_servers_go_quiet(
    tmp_path, converted, monkeypatch
):
    """At a 6 MiB KV budget the parent (12,288 bytes a token) holds 4 blocks, one vLLM's null block: 3 requests of
    24 tokens; its 4x child 15: the capacity point runs 6 (auto: twice the parent's) and the fake's gauges show the
    parent running 3 of them, the child all 6. The decode point runs --decode-concurrency 2, which both fit."""
    monkeypatch.setenv("FAKE_VLLM_TOKEN_S", "0.1")  # each request in flight for 0.8 s: the sampler sees it
    out = tmp_path / "serve.json"
    args = ["serve-bench", EMBEDDED, child_ := converted, "--vllm-python", fake_python(tmp_path), *QUICK]
    args += ["--kv-cache-memory", "6MiB", "--concurrency", "1", "--decode-concurrency", "2", "--repeats", "1"]
    found = cli(*args, "--prompt-tokens", "16", "--output-tokens", "8", "--out", out)
    assert found.exit_code == 0, found.output
    data = json.loads(out.read_text())
    parent, child = data["models"]
    assert Path(child["path"]) == Path(child_).resolve()
    assert (parent["fits_requests"], child["fits_requests"]) == (3, 15)
    assert data["settle"]["settled"] and data["settle"]["cores"][-1] < 0.1
    assert data["settings"]["capacity_concurrency"] == 6 and data["settings"]["decode_concurrency"] == 2
    for m in (parent, child):
        decode = m["decode"]
        assert decode["concurrency"] == 2 and decode["requests"] == 4
        assert 50 < decode["tpot_ms"] < 1000 and 50 < decode["itl_ms"] < 1000  # the fake's 100 ms a token
        assert m["capacity"]["concurrency"] == 6 and m["capacity"]["output_tokens_per_s"] > 0
    assert parent["capacity"]["running_max"] == 3 and parent["capacity"]["waiting_max"] == 3
    assert child["capacity"]["running_max"] == 6 and child["capacity"]["waiting_max"] == 0
    row = data["comparison"][0]
    assert row["decode_tpot_speedup"] > 0 and row["capacity_throughput_ratio"] > 0
    assert not [w for w in data["warnings"] if "quiet" in w or "queue" in w], data["warnings"]
    assert (
        "decode-only at concurrency 2:" in found.stdout and "capacity-bound at concurrency 6 (fits 3)" in found.stdout
    )
