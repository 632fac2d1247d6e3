"""serve-bench reads nothing unchecked (issue 55, item 2): what vLLM's Python prints, the numbers a server logs,
the bodies it answers, the options' values and the models it is given are each read by one checked reader, and
anything else is refused in one line, exit 2, with every server it started stopped."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from fault_helpers import assert_refused, cli
from serving_helpers import EMBEDDED, QUICK, convert_child, core_pids, fake_python, gone

from mha2gqa.runtime.errors import InputError
from mha2gqa.serving import client, engine, kvlog
from mha2gqa.serving.options import ServeOptions


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return convert_child(tmp_path_factory.mktemp("child") / "child")


def _python_printing(folder, text: str):
    """An executable that answers any arguments by printing `text` and exiting 0 (a wrapper, an alias)."""
    script = folder / "python"
    script.write_text(f"#!/bin/sh\nprintf '%s' '{text}'\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    "printed, fragment",
    [
        ("", "printed nothing where vLLM's probe prints its release"),
        ("Welcome to my shell", "is not valid JSON"),
        ("{}", "answered vLLM's probe with '{}', not an object of version, distribution"),
        ("[1, 2]", "answered vLLM's probe with '[1, 2]', not an object"),
        ('{"version": 3, "distribution": "vllm", "plugins": []}', "a version of 3, not vLLM's"),
        ('{"version": "0.3", "distribution": ["vllm"], "plugins": []}', "a distribution of ['vllm'], not vLLM's"),
        ('"0.32.0"', "not an object of version, distribution, plugins"),
        ('{"version": "0.3", "distribution": "vllm"}', "not an object of version, distribution, plugins"),
        ('{"version": "0.3", "distribution": "vllm", "plugins": [1]}', "a plugins of [1], not vLLM's"),
    ],
)
def test_a_vllm_python_that_prints_anything_but_the_probe_is_refused(tmp_path, printed, fragment):
    python = _python_printing(tmp_path, printed)
    with pytest.raises(InputError, match=f"^--vllm-python {python}.*{re.escape(fragment)}"):
        engine.find_engine(str(python), {})
    with pytest.raises(InputError, match=f"^MHA2GQA_VLLM_PYTHON {python}"):
        engine.find_engine(None, {engine.ENV: str(python)})


def test_the_cli_refuses_a_garbled_vllm_python_in_one_line(tmp_path, converted, monkeypatch):
    monkeypatch.setenv(engine.ENV, str(_python_printing(tmp_path, "[]")))
    found = cli("serve-bench", EMBEDDED, converted, *QUICK)
    assert_refused(found, f"MHA2GQA_VLLM_PYTHON {tmp_path / 'python'} answered vLLM's probe with '[]'")


@pytest.mark.parametrize(
    "log, fragment",
    [
        ("CPU KV cache size: 1,2,,3 tokens", "the KV cache size in its log '1,2,,3' is not a whole number"),
        ("CPU KV cache size: , tokens", "',' is not a whole number"),
        ("CPU KV cache size: 1e5 tokens", "'1e5' is not a whole number"),
        ("CPU KV cache size: " + "9" * 5000 + " tokens", "is not a whole number"),
        ("Maximum concurrency for 512 tokens per request: 1.2.3x", "'1.2.3' is not a decimal number"),
        ("Maximum concurrency for 5x2 tokens per request: 3.0x", "context in its log's concurrency line '5x2'"),
    ],
)
def test_a_log_number_that_is_none_is_refused_by_the_one_reader(log, fragment):
    with pytest.raises(kvlog.Unreadable, match=re.escape(fragment)):
        kvlog.engine_kv(log, None)


def test_a_metrics_count_that_is_none_is_refused_by_the_same_reader():
    with pytest.raises(kvlog.Unreadable, match="/metrics' block_size 'sixteen' is not a whole number"):
        kvlog.engine_kv("", 'vllm:cache_config_info{block_size="sixteen"} 1.0\n')
    with pytest.raises(kvlog.Unreadable, match="block_size '0' is not a block size"):
        kvlog.engine_kv("", 'vllm:cache_config_info{block_size="0"} 1.0\n')


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"<!DOCTYPE html><html>Welcome</html>", "a completion was an HTML page"),
        (b"", "a completion was an empty body, not JSON"),
        (b"[1, 2]", "a completion was '[1, 2]', without choices"),
        (b'{"choices": []}', "without choices"),
        (b'{"choices": [{"token_ids": ["a"]}]}', "not token ids"),
        (b'{"choices": [{"token_ids": [1, -2]}]}', "not token ids"),
        (b'{"choices": [{"token_ids": [1, 2, 3, 4, 5]}]}', "not a list of at most 4 token ids"),
        (b'{"choices": [{"token_ids": [true]}]}', "not token ids"),
    ],
)
def test_a_completion_that_is_none_is_refused_by_the_one_reader(body, fragment):
    with pytest.raises(client.ServerGarbled, match=re.escape(fragment)):
        client.read_completion(body, 4)


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("data: <html>", "a streamed chunk was an HTML page"),
        ('data: {"choices": {}}', "without choices"),
        ('data: {"choices": [], "usage": {"completion_tokens": "4"}}', "not 0 to 4 tokens"),
        ('data: {"choices": [], "usage": {"completion_tokens": 99}}', "not 0 to 4 tokens"),
        ('data: {"choices": [], "usage": [1]}', "not 0 to 4 tokens"),
    ],
)
def test_a_streamed_chunk_that_is_none_is_refused_by_the_one_reader(line, fragment):
    with pytest.raises(client.ServerGarbled, match=re.escape(fragment)):
        client.read_chunk(line, 4)


@pytest.mark.parametrize(
    "mode, fragments",
    [
        ("html", ["answered with something that is no OpenAI-compatible completion", "an HTML page"]),
        ("bad_log", ["wrote a KV number serve-bench cannot read", "'1,2,,3' is not a whole number"]),
        ("not_found", ["refused a request (HTTP 404: an HTML page", "is --vllm-python vLLM's"]),
    ],
)
def test_a_server_answering_garbage_is_refused_and_every_server_stops(
    tmp_path, monkeypatch, converted, mode, fragments
):
    monkeypatch.setenv("FAKE_VLLM", mode)
    out = tmp_path / "serve.json"
    found = cli("serve-bench", EMBEDDED, converted, "--vllm-python", fake_python(tmp_path), *QUICK, "--out", out)
    assert_refused(found, *fragments, strict=False)  # the progress lines before it
    assert not out.exists()
    pids = core_pids(tmp_path / "serve.json.logs")
    assert len(pids) == 2 and all(gone(pid) for pid in pids)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0])
def test_a_startup_timeout_that_is_no_time_is_refused(value):
    with pytest.raises(InputError, match=r"--startup-timeout \S+ must be a positive finite number of seconds"):
        ServeOptions(startup_timeout=value).validate()


@pytest.mark.parametrize("budget", ["5000TiB", "999999TiB", "9" * 400 + "GiB"])
def test_a_kv_cache_memory_beyond_the_machines_memory_is_refused(budget):
    with pytest.raises(InputError, match=r"--kv-cache-memory .*(more than this machine's memory|beyond any size)"):
        ServeOptions(kv_cache_memory=budget).validate()


def test_the_cli_refuses_nan_and_an_absurd_budget_in_one_line(converted):
    assert_refused(cli("serve-bench", EMBEDDED, converted, "--startup-timeout", "nan"), "--startup-timeout nan")
    assert_refused(
        cli("serve-bench", EMBEDDED, converted, "--kv-cache-memory", "100000TiB"), "more than this machine's memory"
    )


def _parent_again(tmp_path, how: str):
    if how == "link":
        (tmp_path / "link").symlink_to(EMBEDDED)
        return tmp_path / "link"
    if how == "dot":
        return EMBEDDED / "."
    return EMBEDDED


@pytest.mark.parametrize("how", ["same", "link", "dot"])
def test_the_parent_given_as_its_own_child_is_refused(tmp_path, converted, how):
    child = _parent_again(tmp_path, how)
    found = cli("serve-bench", EMBEDDED, converted, child, "--vllm-python", fake_python(tmp_path))
    assert_refused(found, f"CHILD {child} is the same folder as PARENT ({EMBEDDED})")


def _with_tokenizer(tmp_path, converted, edit):
    """A copy of the converted child whose tokenizer.json is `edit`ed (its vocab_size unchanged)."""
    child = tmp_path / "other-tokenizer"
    shutil.copytree(converted, child)
    data = json.loads((child / "tokenizer.json").read_text())
    edit(data)
    (child / "tokenizer.json").write_text(json.dumps(data))
    return child


def _swap_two_ids(data):
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]


def test_a_child_whose_tokenizer_numbers_tokens_differently_is_refused(tmp_path, converted):
    child = _with_tokenizer(tmp_path, converted, _swap_two_ids)
    vocab_size = json.loads((child / "config.json").read_text())["vocab_size"]
    assert vocab_size == json.loads((EMBEDDED / "config.json").read_text())["vocab_size"]
    found = cli("serve-bench", EMBEDDED, child, "--vllm-python", fake_python(tmp_path))
    assert_refused(found, f"CHILD {child}: its tokenizer.json numbers tokens differently from its parent's")
    (child / "tokenizer.json").unlink()
    assert_refused(cli("serve-bench", EMBEDDED, child), "has no tokenizer files, its parent has tokenizer.json")


def test_a_child_whose_tokenizer_is_the_parents_saved_again_is_accepted(tmp_path, converted):
    """The same tokenizer in other bytes (indented otherwise, padding set) is the same tokenizer."""
    child = _with_tokenizer(tmp_path, converted, lambda data: data.update(padding={"strategy": "BatchLongest"}))
    assert (child / "tokenizer.json").read_bytes() != (EMBEDDED / "tokenizer.json").read_bytes()
    python = _python_printing(tmp_path, '{"version": "9.9", "distribution": "vllm", "plugins": []}')
    from mha2gqa.serving.bench import prepare

    plan = prepare(str(EMBEDDED), [str(child)], None, ServeOptions(vllm_python=str(python), context=256))
    assert [m.label for m in plan.models] == ["austen-mha", "other-tokenizer"] and plan.engine.version == "9.9"


@pytest.mark.parametrize("value", [None, "4096", 0, True])
def test_a_child_config_without_a_whole_vocab_size_is_refused(tmp_path, converted, value):
    child = tmp_path / "child"
    shutil.copytree(converted, child)
    config = json.loads((child / "config.json").read_text())
    config.pop("vocab_size") if value is None else config.update(vocab_size=value)
    (child / "config.json").write_text(json.dumps(config))
    assert_refused(cli("serve-bench", EMBEDDED, child), f"config.json has vocab_size={value!r}: a served model needs")


def test_vllm_on_path_whose_script_runs_env_python_is_found(tmp_path):
    """pip's `#!/usr/bin/env python` line names `env`, not a Python: the Python env would find is the one."""
    python = fake_python(tmp_path)
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "vllm"
    script.write_text("#!/usr/bin/env python\nimport sys\n")
    script.chmod(0o755)
    found = engine.find_engine(None, {"PATH": f"{tmp_path / 'bin'}:{tmp_path}"})
    assert (found.python, found.found_by, found.version) == (str(python), "vllm on PATH", "0.0.0+fake")


@pytest.mark.parametrize("named", ["float64", "int8", ["bfloat16"]])
def test_a_parent_dtype_the_servers_do_not_take_is_refused_under_dtype_auto(tmp_path, converted, named):
    parent = tmp_path / "parent"
    shutil.copytree(EMBEDDED, parent)
    config = json.loads((parent / "config.json").read_text())
    config.update(dtype=named)
    (parent / "config.json").write_text(json.dumps(config))
    found = cli("serve-bench", parent, converted, "--vllm-python", fake_python(tmp_path))
    assert_refused(
        found, f"--dtype auto: {parent}/config.json names dtype", "pass --dtype (float32, bfloat16, float16)"
    )


@pytest.fixture(scope="module")
def per_layer_child(tmp_path_factory):
    """The embedded parent with kv heads 8,1,4,1,2,8 (a Nemotron-NAS checkpoint), once for the module."""
    dst = tmp_path_factory.mktemp("nas") / "per-layer"
    assert cli("convert", EMBEDDED, dst, "--kv-heads-per-layer", "8,1,4,1,2,8", "-q").exit_code == 0
    return dst


@pytest.mark.parametrize(
    "plugins, allowed, fragment",
    [
        ([], None, "which vLLM serves through mha2gqa's plugin (mha2gqa_nemotron_nas), and --vllm-python"),
        (["other"], None, "has no such plugin: install mha2gqa into that environment"),
        (["mha2gqa_nemotron_nas"], "other", "VLLM_PLUGINS='other' leaves mha2gqa_nemotron_nas out"),
    ],
)
def test_a_per_layer_child_needs_mha2gqas_plugin_beside_vllm(
    tmp_path, per_layer_child, monkeypatch, plugins, allowed, fragment
):
    """Without the plugin vLLM stops in its config check minutes later; serve-bench refuses before any start."""
    from mha2gqa.serving.bench import prepare

    probe = json.dumps({"version": "9.9", "distribution": "vllm", "plugins": plugins})
    options = ServeOptions(vllm_python=str(_python_printing(tmp_path, probe)), context=256)
    if allowed is not None:
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
    else:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with pytest.raises(InputError, match=f"^CHILD {per_layer_child} has per-layer kv heads.*{re.escape(fragment)}"):
        prepare(str(EMBEDDED), [str(per_layer_child)], None, options)


def test_a_per_layer_child_with_the_plugin_is_planned_with_its_summed_kv(tmp_path, per_layer_child, monkeypatch):
    from mha2gqa.serving.bench import prepare

    monkeypatch.setenv("VLLM_PLUGINS", "mha2gqa_nemotron_nas,other")
    probe = json.dumps({"version": "9.9", "distribution": "vllm", "plugins": ["mha2gqa_nemotron_nas"]})
    options = ServeOptions(vllm_python=str(_python_printing(tmp_path, probe)), context=256)
    plan = prepare(str(EMBEDDED), [str(per_layer_child)], None, options)
    parent, child = (m.shape.kv_bytes_per_token(dtype_bytes=4) for m in plan.models)
    assert (parent, child) == (2 * 6 * 8 * 32 * 4, 2 * 24 * 32 * 4)  # 24 kv heads over the layers, not 6 x 8
    assert plan.engine.plugins == ("mha2gqa_nemotron_nas",)


def _parent_weights_again(tmp_path, how: str):
    """A folder of its own whose weights are the parent's: hard links to them, or a byte-identical copy (its
    config.json and tokenizer copied too, so nothing else tells it apart)."""
    child = tmp_path / f"parent-{how}"
    child.mkdir()
    for path in EMBEDDED.iterdir():
        if path.is_file():
            if how == "hardlink" and path.suffix == ".safetensors":
                (child / path.name).hardlink_to(path)
            else:
                shutil.copyfile(path, child / path.name)
    return child


@pytest.mark.parametrize("how", ["hardlink", "copy"])
def test_a_child_whose_weights_are_the_parents_is_refused(tmp_path, converted, how):
    child = _parent_weights_again(tmp_path, how)
    found = cli("serve-bench", EMBEDDED, converted, child, "--vllm-python", fake_python(tmp_path))
    assert_refused(found, f"CHILD {child} holds PARENT's weights", "serve-bench compares a parent with its conversions")
