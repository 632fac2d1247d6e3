"""`evaluate` and `mha2gqa eval` end to end on tiny models: result contents, roles, files, errors."""

import importlib.util
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_model

from mha2gqa.cli import main
from mha2gqa.eval import evaluate
from mha2gqa.eval.schema import SCHEMA, load_result
from mha2gqa.report import write_report

QUICK = dict(context=32, stride=16, speed_preset="off", progress=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    tok = make_tiny_tokenizer()
    dirs = {}
    conversion = {"groups": 2, "source": str(root / "parent")}  # the lineage the report pairs recovery by
    for name, kv, provenance in (
        ("parent", 8, None),
        ("gqa", 2, {"conversion": conversion}),
        ("gqa-up", 2, {"conversion": conversion, "uptrain": {"steps": 1}}),
    ):
        dirs[name] = root / name
        save_tiny_model(dirs[name], "llama", num_key_value_heads=kv, seed=len(name))
        tok.save_pretrained(dirs[name])
        if provenance:
            (dirs[name] / "mha2gqa.json").write_text(json.dumps(provenance))
    (root / "text.txt").write_text(SAMPLE_TEXT * 2)
    dirs["text"] = root / "text.txt"
    return dirs


def test_evaluate_with_reference_writes_a_complete_result(models, tmp_path):
    out = tmp_path / "gqa.json"
    r = evaluate(
        models["gqa"], models["text"], reference=models["parent"], out=out, attention_text="It is a truth", **QUICK
    )
    assert load_result(out) == json.loads(json.dumps(r))  # what was returned is what was written
    assert (r["schema"], r["label"], r["role"]) == (SCHEMA, "gqa", "converted")
    assert (
        r["model"]["kv_heads"] == 2
        and r["model"]["heads"] == 8
        and r["model"]["provenance"] == {"conversion": {"groups": 2, "source": str(models["parent"])}}
    )
    assert r["model"]["params"] > 0 and r["model"]["dtype"] == "float32"
    assert r["data"]["tokens"] > 100 and len(r["data"]["ids_sha256"]) == 64
    assert r["perplexity"]["tokens_scored"] == r["data"]["tokens"] - 1
    assert r["agreement"]["tokens"] == r["perplexity"]["tokens_scored"]
    assert 0.0 < r["agreement"]["kl_mean"] and 0.0 <= r["agreement"]["top1_agreement"] <= 1.0
    assert r["kv_cache"]["match"] and r["kv_cache"]["measured_bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    assert r["speed"] is None and r["warnings"] == []
    assert r["attention_maps"]["png"] == str(tmp_path / "gqa.attention.png")
    assert (tmp_path / "gqa.attention.png").read_bytes()[:4] == b"\x89PNG"
    assert r["env"]["versions"]["torch"] and r["env"]["seed"] == 0


@pytest.mark.parametrize(
    "name,role_flag,role",
    [("parent", None, "parent"), ("gqa-up", None, "uptrained"), ("gqa-up", "converted", "converted")],
)
def test_role_comes_from_the_flag_or_the_provenance_file(models, name, role_flag, role):
    r = evaluate(models[name], role=role_flag, label="x", **QUICK)
    assert (r["role"], r["label"], r["perplexity"]) == (role, "x", None)


def test_a_model_without_a_conversion_record_is_a_parent(models, tmp_path):
    """A model trained from scratch by `mha2gqa uptrain` (like the embedded default) records only its
    training: it is a parent, not an uptrained child."""
    model = tmp_path / "pretrained"
    save_tiny_model(model, "llama")
    make_tiny_tokenizer(model)
    (model / "mha2gqa.json").write_text('{"uptrain": {"source": {"model": null}}}')
    assert evaluate(model, **QUICK)["role"] == "parent"
    assert evaluate(model, role="uptrained", **QUICK)["role"] == "uptrained"


def test_decode_speed_grid(models):
    import resource

    import psutil

    before = psutil.Process().memory_info().rss
    r = evaluate(
        models["gqa"],
        speed_preset="cpu",
        speed_batches=(1, 3),
        speed_contexts=(8,),
        new_tokens=2,
        repeats=2,
        progress=False,
    )
    lifetime_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    points = r["speed"]["points"]
    assert [(p["batch"], p["context"], p["new_tokens"]) for p in points] == [(1, 8, 2), (3, 8, 2)]
    for p in points:
        # At least --repeats timed runs, more while the point took under the preset's second, at most 30.
        assert 2 <= p["repeats"] == len(p["decode_s"]) <= 30
        assert p["tokens_per_s"] == pytest.approx(p["batch"] * 2 / p["decode_s_median"])
        low, high = p["tokens_per_s_iqr"]
        slowest, fastest = p["tokens_per_s_range"]
        assert slowest <= low <= p["tokens_per_s"] <= high <= fastest
        assert fastest == pytest.approx(p["batch"] * 2 / min(p["decode_s"]))
        # the process's RSS while decoding: most of what it held before, about at most its lifetime peak (the
        # kernel updates that high-water mark lazily, so a fresh sample may pass it by a page or two)
        assert 0.8 * before <= p["peak_memory_bytes"] <= 1.05 * lifetime_peak and p["peak_memory_kind"] == "cpu_rss"


PEAK_PROBE = """
import json, time
import psutil, torch
from mha2gqa.eval.memory import PeakMemory

size = 256 * 2**20
with PeakMemory(torch.device("cpu")) as mem:
    start = psutil.Process().memory_info().rss
    buffer = torch.ones(size // 4, dtype=torch.float32)  # touched, so resident
    # Hold it until the sampler thread has run (a busy machine can starve it for a while; the wait ends
    # as soon as it has), at most 120 s.
    deadline = time.monotonic() + 120
    while mem.peak_bytes - start < 0.9 * size and time.monotonic() < deadline:
        time.sleep(0.01)
    del buffer  # freed before the region ends: only the sampler can have seen it
    end = psutil.Process().memory_info().rss
print(json.dumps({"size": size, "start": start, "end": end, "peak": mem.peak_bytes}))
"""


def test_peak_memory_catches_a_transient_allocation_on_cpu():
    # A fresh interpreter: in a long-lived one (the suite) the allocator reuses pages that are already
    # resident, so a new buffer need not raise the RSS at all and there would be nothing to catch.
    done = subprocess.run([sys.executable, "-c", PEAK_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout.strip().splitlines()[-1])
    assert m["peak"] - m["start"] >= 0.9 * m["size"]
    assert m["peak"] - m["end"] >= 0.5 * m["size"]  # the peak is not just the RSS at exit


@pytest.mark.parametrize(
    "args,message",
    [
        (["--stride", "64", "--context", "32"], "--stride 64 must be between 1 and --context 32"),
        (["--context", "512"], "--context 512 exceeds the model's max_position_embeddings=256"),
        (["--speed-contexts", "250"], "exceeds the model's max_position_embeddings=256"),
        (["--speed-batches", "1,0"], "--speed-batches 1,0: every value must be a positive integer"),
        (["--speed-batches", "1,x"], "'1,x' is not a comma-separated list of integers"),
        (["--data", "no/such/dir/"], "not a local file or folder, and the hub is offline"),
        (["--attention-maps", "hello"], "--attention-maps needs --out or --attention-png"),
        (["--data", "a=one.txt", "--data", "a=two.txt"], "two texts are named 'a'"),
        (["--lm-eval-tasks", "hellaswag", "HIDE_LM_EVAL"], "pip install 'mha2gqa[lmeval]'"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2_and_writes_nothing(models, tmp_path, monkeypatch, args, message):
    if "HIDE_LM_EVAL" in args:  # CI installs lm_eval: hide it to see the message a user without it gets
        args = [a for a in args if a != "HIDE_LM_EVAL"]
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *rest: None if name == "lm_eval" else find_spec(name, *rest)
        )
    out = tmp_path / "r.json"
    args = [a.replace("PARENT", str(models["parent"])) for a in args]
    if "--attention-maps" not in args:
        args += ["--out", str(out)]
    result = CliRunner().invoke(main, ["eval", str(models["gqa"]), "-q", *args])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0]
    assert not out.exists()


def test_cli_as_a_subprocess_then_report_on_three_real_results(models, tmp_path):
    paths = []
    for name in ("parent", "gqa", "gqa-up"):
        paths.append(tmp_path / f"{name}.json")
        cmd = [
            sys.executable,
            "-c",
            "from mha2gqa.cli import main; main()",
            "eval",
            str(models[name]),
            "--data",
            str(models["text"]),
            "--context",
            "32",
            "--speed",
            "off",
            "-q",
            "--out",
            str(paths[-1]),
        ]
        if name != "parent":
            cmd += ["--reference", str(models["parent"])]
        if name == "gqa":  # the subprocess run; the others in-process keep the test quick
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            assert "KV cache 256 B/token measured, 256 B by formula: match" in done.stdout
        else:
            assert CliRunner().invoke(main, cmd[3:]).exit_code == 0
    written = write_report(paths, tmp_path / "report")
    rows = json.loads(written["json"].read_text())["rows"]
    ppl = [load_result(p)["perplexity"]["perplexity"] for p in paths]
    assert [r["role"] for r in rows] == ["parent", "converted", "uptrained"]
    assert rows[2]["recovery"] == pytest.approx((ppl[1] - ppl[2]) / (ppl[1] - ppl[0]))
    assert rows[1]["kv_saving"] == 4.0


def test_the_terminal_summary_gives_decode_speed_its_spread():
    from mha2gqa.cli.eval_cmd import summary

    point = {"context": 32, "peak_memory_bytes": 2**20, "peak_memory_kind": "cpu_rss"}
    result = {
        "label": "x",
        "role": "parent",
        "model": {"kv_heads": 2, "heads": 8},
        "perplexity": None,
        "agreement": None,
        "kv_cache": {"measured_bytes_per_token": 256, "formula_bytes_per_token": 256, "match": True},
        "speed": {
            "points": [
                {**point, "batch": 4, "tokens_per_s": 640.0, "tokens_per_s_iqr": [320.0, 711.1], "repeats": 5},
                {**point, "batch": 1, "tokens_per_s": 64.0},  # written before the spread was kept
            ]
        },
        "attention_maps": None,
        "lm_eval": None,
    }
    lines = summary(result).splitlines()
    assert "  decode B=4 T=32: 640.0 tok/s (IQR 320.0-711.1, 5 runs), peak 1.00 MiB (cpu_rss)" in lines
    assert "  decode B=1 T=32: 64.0 tok/s, peak 1.00 MiB (cpu_rss)" in lines
