"""Fault injection for `mha2gqa eval`, `report` and `demo`: checkpoints whose tensors do not match
their config (model and --reference), pickles, destinations that are read-only or full, binary and
malformed data, results and metrics of the wrong shape. Every case asserts the exit code, the one
`Error:` line (no traceback), that nothing is left behind and that every input is byte-identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fault_helpers import (
    add_tensor,
    assert_refused,
    cli,
    drop_tensor,
    edit_weights,
    fill,
    pickle_only,
    remount_readonly,
    reshape_tensor,
    tmpfs,
    tree_digest,
)
from tiny_models import SAMPLE_TEXT
from uptrain_helpers import tiny_model_dir

K_PROJ = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny model, a text, one real result file and a metrics.jsonl."""
    root = tmp_path_factory.mktemp("faults_eval")
    model = tiny_model_dir(root / "model")
    text = root / "heldout.txt"
    text.write_text(SAMPLE_TEXT * 8)
    result = root / "result.json"
    ran = cli("eval", model, "--data", text, "--speed", "off", "--quiet", "--out", result)
    assert ran.exit_code == 0, ran.output
    metrics = root / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in range(5)))
    return {"model": model, "text": text, "result": result, "metrics": metrics, "root": root}


@pytest.fixture
def sources(src):
    before = {k: tree_digest(src[k]) for k in ("model", "text", "result", "metrics")}
    yield
    assert {k: tree_digest(src[k]) for k in ("model", "text", "result", "metrics")} == before


def _eval(model, *args):
    return cli("eval", model, "--speed", "off", "--quiet", *args)


# --- eval: weights that do not match, pickles ---------------------------------------------------


@pytest.mark.parametrize(
    "fault,edit,named",
    [
        ("missing", drop_tensor(K_PROJ), f"missing: {K_PROJ}"),
        ("unexpected", add_tensor("model.layers.1.extra.weight"), "unexpected: model.layers.1.extra.weight"),
        ("shape", reshape_tensor(K_PROJ), f"wrong shape: {K_PROJ} is [32, 64] not [64, 64]"),
    ],
)
def test_eval_refuses_a_model_whose_tensors_do_not_match(tmp_path, src, sources, fault, edit, named):
    """These used to load with fresh random tensors: exit 0, a plausible perplexity, no warning."""
    bad = edit_weights(src["model"], tmp_path / fault, edit)
    before = tree_digest(bad)
    out = tmp_path / "r.json"
    assert_refused(
        _eval(bad, "--data", src["text"], "--out", out), f"model {bad} does not match its config.json", named
    )
    assert not out.exists() and tree_digest(bad) == before


def test_eval_refuses_a_reference_with_a_missing_tensor(tmp_path, src, sources):
    bad = edit_weights(src["model"], tmp_path / "ref", drop_tensor(K_PROJ))
    out = tmp_path / "r.json"
    result = _eval(src["model"], "--data", src["text"], "--reference", bad, "--out", out)
    assert_refused(result, f"--reference {bad} does not match", K_PROJ)
    assert not out.exists()


@pytest.mark.parametrize("which", ["model", "--reference"])
def test_eval_refuses_pickle_only_weights_before_loading_anything(tmp_path, src, sources, which):
    pickled = pickle_only(src["model"], tmp_path / "pickled")
    model, ref = (pickled, src["model"]) if which == "model" else (src["model"], pickled)
    result = _eval(model, "--data", src["text"], "--reference", ref)
    assert_refused(result, f"{which} {pickled} has only pickled weights", "save_pretrained")
    assert "Loading weights" not in result.stderr  # refused before any weights were read


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda c: b"\x00\xff\xfe", "config.json is not UTF-8 text"),
        (lambda c: b'["llama"]', "config.json is a JSON list, not an object"),
        (
            lambda c: json.dumps({**c, "num_key_value_heads": 0}).encode(),
            "num_key_value_heads=0: it must be a positive integer",
        ),
        (lambda c: json.dumps({**c, "model_type": "frobnicator"}).encode(), "could not be read by transformers"),
    ],
)
def test_eval_refuses_a_malformed_config_json_in_one_line(tmp_path, src, sources, edit, says):
    bad = tmp_path / "bad-config"
    shutil.copytree(src["model"], bad)
    (bad / "config.json").write_bytes(edit(json.loads((bad / "config.json").read_text())))
    out = tmp_path / "r.json"
    assert_refused(_eval(bad, "--data", src["text"], "--out", out), f"{bad / 'config.json'}", says)
    assert not out.exists()


# --- eval: destinations and data ----------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--out", "--attention-png"])
def test_eval_refuses_a_read_only_destination_before_measuring(tmp_path, src, sources, flag):
    with tmpfs(tmp_path / "ro", "1m") as mount:
        remount_readonly(mount)
        target = mount / "results" / ("r.json" if flag == "--out" else "maps.png")
        extra = ["--attention-maps", "It is a truth", "--out", tmp_path / "r.json"] if flag != "--out" else []
        result = _eval(src["model"], "--data", src["text"], flag, target, *extra)
        assert_refused(result, f"{flag} {target}: cannot write in {mount}", "Read-only file system")
        assert "Loading weights" not in result.stderr and list(mount.iterdir()) == []
    assert not (tmp_path / "r.json").exists()


def test_eval_refuses_a_full_destination_before_measuring(tmp_path, src, sources):
    with tmpfs(tmp_path / "full", "256k") as mount:
        fill(mount)
        out = mount / "r.json"
        result = _eval(src["model"], "--data", src["text"], "--out", out)
        assert_refused(result, f"--out {out}: cannot write in {mount}", "No space left on device")
        assert "Loading weights" not in result.stderr  # refused before the model loads; no wall-time bound
        assert sorted(p.name for p in mount.iterdir()) == ["filler"]


@pytest.mark.parametrize(
    "content,says",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x9c", "not UTF-8 text"),
    ],
)
def test_eval_refuses_binary_data_in_one_line(tmp_path, src, sources, content, says):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    out = tmp_path / "r.json"
    assert_refused(_eval(src["model"], "--data", data, "--out", out), f"--data {data}", says)
    assert not out.exists() and data.read_bytes() == content


# --- report: results and metrics of the wrong shape -------------------------------------------------


def _report(tmp_path, *inputs, metrics=()):
    out = tmp_path / "report"
    args = ["report", *inputs, "--out", out]
    for m in metrics:
        args += ["--metrics", m]
    return cli(*args), out


def _edited_result(tmp_path, src, edit) -> Path:
    result = json.loads(src["result"].read_text())
    edit(result)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(result))
    return path


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda r: r["model"].__setitem__("kv_heads", "two"), 'model.kv_heads is "two", must be a whole number'),
        (lambda r: r.__setitem__("perplexity", "low"), 'perplexity is "low", must be an object or null'),
        (lambda r: r["perplexity"].__setitem__("perplexity", [1]), "perplexity.perplexity is [1], must be a number"),
        (lambda r: r.__setitem__("speed", {"points": ["fast"]}), "speed is"),
        (lambda r: r.__setitem__("warnings", "none"), 'warnings is "none", must be a list of text'),
        (lambda r: r.__setitem__("role", 3), "role is 3, must be parent, converted or uptrained"),
        (lambda r: r.pop("kv_cache"), "lacks kv_cache"),
    ],
)
def test_report_refuses_results_of_the_wrong_types(tmp_path, src, sources, edit, says):
    bad = _edited_result(tmp_path, src, edit)
    result, out = _report(tmp_path, src["result"], bad)
    assert_refused(result, str(bad), says)
    assert not out.exists()


@pytest.mark.parametrize(
    "content,says",
    [
        (b"[1, 2, 3]", "has schema 'list'"),
        (b"\xff\xd8\xff\xe0 binary", "is not UTF-8 text"),
        (b'{"schema": "mha2gqa.eval/1", "label": ', "is not valid JSON"),
    ],
)
def test_report_refuses_result_files_that_are_not_results(tmp_path, src, sources, content, says):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    result, out = _report(tmp_path, src["result"], bad)
    assert_refused(result, str(bad), says)
    assert not out.exists()


@pytest.mark.parametrize(
    "content,says",
    [
        (b"\x00\x01\x02\xff\xfe garbage", "is not UTF-8 text"),
        (b"[1, 2]\n3\n", "line 1 is not an object with a numeric 'step'"),
        (b'{"step": "one", "loss": 1}\n', "line 1 is not an object with a numeric 'step'"),
        (b'{"step": 1, "lr": 0.1}\n', "has no numeric loss or ppl keys"),
        (b"not json at all\n", "line 1 is not valid JSON"),
    ],
)
def test_report_refuses_a_garbage_metrics_file(tmp_path, src, sources, content, says):
    bad = tmp_path / "metrics.jsonl"
    bad.write_bytes(content)
    result, out = _report(tmp_path, src["result"], metrics=[bad])
    assert_refused(result, f"--metrics {bad}", says)
    assert not out.exists()


def test_report_refuses_a_read_only_out_before_writing(tmp_path, src, sources):
    with tmpfs(tmp_path / "ro", "1m") as mount:
        remount_readonly(mount)
        result = cli("report", src["result"], "--out", mount / "report", "--metrics", src["metrics"])
        assert_refused(result, f"--out {mount / 'report' / 'report.json'}: cannot write in {mount}")
        assert list(mount.iterdir()) == []


def test_report_writes_when_inputs_are_good(tmp_path, src, sources):
    """The control: the same inputs with nothing wrong make a report."""
    result, out = _report(tmp_path, src["result"], src["result"], metrics=[src["metrics"]])
    assert result.exit_code == 0, result.output
    assert {"report.md", "report.html", "report.json", "training_curve.png"} <= {p.name for p in out.iterdir()}


# --- demo ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,says",
    [
        (["--groups", "3"], "--groups 3 must divide num_key_value_heads=8 (valid: 1, 2, 4)"),
        (
            ["--groups", "8"],
            "--groups 8 equals the source's num_key_value_heads=8: nothing to convert (valid: 1, 2, 4)",
        ),
        (["--groups", "0"], "--groups 0 must divide"),
        (["--alpha", "2"], "--alpha 2.0 must be in (0, 1]"),
    ],
)
def test_demo_refuses_bad_flags_before_creating_anything(tmp_path, args, says):
    out = tmp_path / "demo"
    assert_refused(cli("demo", "--out", out, *args), says)
    assert not out.exists()


def test_demo_refuses_an_out_that_is_a_file(tmp_path):
    out = tmp_path / "demo"
    out.write_text("mine\n")
    assert_refused(cli("demo", "--out", out), f"--out {out} is a file")
    assert out.read_text() == "mine\n"
