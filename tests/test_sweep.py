"""`mha2gqa sweep`: its numbers are those of separate convert + eval runs, the calibration pass runs once,
bad input is refused before anything runs, and an interrupted sweep keeps its finished rows only."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import assert_refused, cli, sweep_args, tree_digest
from tiny_models import SAMPLE_TEXT, save_tiny_inputs

import mha2gqa.convert.calibration as calibration_module
import mha2gqa.eval.run as eval_run
from mha2gqa.convert.options import REFINE_TOKENS_PER_HIDDEN, RefineOptions
from mha2gqa.corpus import textdata
from mha2gqa.files.run_folder import MARKER
from mha2gqa.report.results import load_results
from mha2gqa.report.side_by_side import write_report
from mha2gqa.report.sweep_pages import write_pages
from mha2gqa.report.sweep_plots import pareto_front
from mha2gqa.sweep import SweepOptions, folder, sweep
from mha2gqa.sweep.next_step import pretrain_tokens
from mha2gqa.sweep.recommend import recommend

CAL_TOKENS, EVAL_TOKENS = 600, 300
# 4 kv heads: the default candidates are 2 and 1 kv heads x mean, calibrated
SHAPE = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_inputs(tmp_path_factory.mktemp("sweep"), **SHAPE)


_sweep_args = sweep_args


def counted_resolve(counts: dict, resolve):
    """textdata.resolve, counting the resolutions of the calibration text (not of the eval --data)."""

    def counted(key, *args, **kwargs):
        counts["resolved"] += key == "--calibration"
        return resolve(key, *args, **kwargs)

    return counted


@pytest.fixture(scope="module")
def swept(tiny, tmp_path_factory):
    """One kept sweep, with every calibration forward of the parent, every calibration pass, every resolution of
    the calibration text and every evaluate() call counted."""
    out = tmp_path_factory.mktemp("swept") / "s"
    counts = {"calibrate": 0, "forwards": 0, "evaluate": [], "resolved": 0}
    mp = pytest.MonkeyPatch()
    load, gather, evaluate = (
        calibration_module.load_source_model,
        calibration_module.gather,
        eval_run.evaluate,
    )
    mp.setattr(textdata, "resolve", counted_resolve(counts, textdata.resolve))

    def counted_load(model_dir, *args, **kwargs):
        model = load(model_dir, *args, **kwargs)
        if Path(model_dir) == tiny / "src":
            model.base_model.register_forward_hook(lambda *_: counts.__setitem__("forwards", counts["forwards"] + 1))
        return model

    def counted_gather(*args, **kwargs):
        counts["calibrate"] += 1
        return gather(*args, **kwargs)

    def counted_evaluate(model_path, *args, **kwargs):
        counts["evaluate"].append(Path(model_path).name)
        return evaluate(model_path, *args, **kwargs)

    mp.setattr(calibration_module, "load_source_model", counted_load)
    mp.setattr(calibration_module, "gather", counted_gather)
    mp.setattr(eval_run, "evaluate", counted_evaluate)
    try:
        result = cli(*_sweep_args(tiny, out, "--keep"))
    finally:
        mp.undo()
    assert result.exit_code == 0, (result.output, result.exception)
    return out, json.loads((out / "sweep.json").read_text()), counts, result


def test_sweep_runs_every_candidate_and_writes_its_pages(swept):
    out, record, _, result = swept
    assert [r["name"] for r in record["candidates"]] == ["kv2-mean", "kv2-calibrated", "kv1-mean", "kv1-calibrated"]
    assert record["interrupted"] is False and record["source"]["kv_heads"] == 4
    parent = record["parent"]
    assert parent["kv_bytes_per_token"] == 2 * 2 * 4 * 8 * 4  # 2 (K,V) x layers x kv heads x head_dim x fp32
    assert parent["kv_bytes_per_sequence"] == parent["kv_bytes_per_token"] * 256  # max_position_embeddings
    for row in record["candidates"]:
        assert row["kv_bytes_per_token"] == parent["kv_bytes_per_token"] * row["groups"] // 4
        assert row["kv_saving"] == 4 / row["groups"]
        assert row["convert_wall_s"] > 0 and row["convert_peak_rss_bytes"] > 1 << 20
        assert row["perplexity_change"] == pytest.approx(row["perplexity"] / parent["perplexity"] - 1)
        assert Path(row["model"]) == out / "models" / row["name"] and (Path(row["model"]) / "config.json").is_file()
    assert record["recommendation"]["line"] in result.output
    for name in ("sweep.md", "sweep.html", "sweep_quality_vs_kv.png"):
        assert (out / name).stat().st_size > 500
    md = (out / "sweep.md").read_text()
    assert "| kv1-calibrated | 1 | calibrated |" in md and "![quality_vs_kv](sweep_quality_vs_kv.png)" in md
    assert "data:image/png;base64," in (out / "sweep.html").read_text()
    assert not list(out.glob(".sweep-*")), "the work directory is removed"


def test_each_row_holds_the_checks_verdict_from_the_sweeps_own_evaluation(swept):
    """The check is not run again at each conversion: its verdict is read off the sweep's evaluation, the same
    rule (convert/check.py verdict) on the same per-domain ratios; resume keeps an older row without it."""
    from mha2gqa.convert.check import verdict
    from mha2gqa.sweep.trust import trusted

    out, record, _, _ = swept
    for row in record["candidates"]:
        ratios = {name: d["ratio"] for name, d in row["domains"].items()}
        assert ratios and row["check"] == verdict(ratios).kind
    assert "| Pareto | check |" in (out / "sweep.md").read_text()
    planned = [r["name"] for r in record["candidates"]]
    older = json.loads(json.dumps(record))
    for row in older["candidates"]:
        del row["check"]
    kept = trusted(older, planned, source_shape(record), record["context"], echo=pytest.fail)["candidates"]
    assert [r["check"] for r in kept] == [r["check"] for r in record["candidates"]]
    tampered = json.loads(json.dumps(record))
    tampered["candidates"][0]["check"] = "close" if record["candidates"][0]["check"] != "close" else "not usable"
    said = []
    assert (
        len(trusted(tampered, planned, source_shape(record), record["context"], echo=said.append)["candidates"])
        == len(planned) - 1
    )
    assert said == [
        f"sweep: candidate {planned[0]!r} in sweep.json does not hold (its check is not what its eval result gives): running it again"
    ]


def test_each_candidates_convert_command_is_its_cards_reproduce_line(swept):
    """The sweep's next-step command is the candidate's own dry-run plan: a plain mean merge names no
    calibration text (it shapes no weight), the calibrated one names the sweep's."""
    out, record, _, _ = swept
    for row in record["candidates"]:
        card = (Path(row["model"]) / "README.md").read_text()
        assert record["convert_commands"][row["name"]] in card.splitlines(), row["name"]
    assert "--calibration" not in record["convert_commands"]["kv2-mean"]
    assert "--calibration" in record["convert_commands"]["kv2-calibrated"]


def test_calibration_is_resolved_once_runs_once_and_the_parent_is_evaluated_once(swept):
    """Four candidates, each planned (a dry run) and converted: one resolution of the calibration text, made by
    the first plan, read by every other plan and by the calibration pass."""
    _, record, counts, _ = swept
    assert counts["resolved"] == 1
    assert counts["calibrate"] == 1
    # one pass over the calibration tokens: 600 tokens in blocks of 256 -> 2 full blocks (one batch) + a short one
    assert record["calibration"]["tokens"] == CAL_TOKENS and record["calibration"]["passes"] == 1
    assert counts["forwards"] == 2
    assert counts["evaluate"] == ["src", "kv2-mean", "kv2-calibrated", "kv1-mean", "kv1-calibrated"]


def test_numbers_equal_separate_convert_and_eval_runs(swept, tiny, tmp_path):
    out, record, _, _ = swept
    parent_json = tmp_path / "parent.json"
    common = ["--data", tiny / "eval.txt", "--max-tokens", EVAL_TOKENS, "--speed", "off", "--quiet"]
    assert cli("eval", tiny / "src", *common, "--out", parent_json).exit_code == 0
    parent = json.loads(parent_json.read_text())
    assert record["parent"]["perplexity"] == parent["perplexity"]["perplexity"]
    for row in record["candidates"]:
        dst = tmp_path / row["name"]
        made = cli(
            "convert", tiny / "src", dst, "--groups", row["groups"], "--method", row["method"],
            "--calibration", tiny / "cal.txt", "--calibration-tokens", CAL_TOKENS, "--quiet",
        )  # fmt: skip
        assert made.exit_code == 0, made.output
        assert (dst / "model.safetensors").read_bytes() == (
            out / "models" / row["name"] / "model.safetensors"
        ).read_bytes()
        result_json = tmp_path / f"{row['name']}.json"
        assert cli("eval", dst, *common, "--reference", tiny / "src", "--out", result_json).exit_code == 0
        alone = json.loads(result_json.read_text())
        assert row["perplexity"] == alone["perplexity"]["perplexity"]
        assert row["kl_mean"] == alone["agreement"]["kl_mean"]
        assert row["top1_agreement"] == alone["agreement"]["top1_agreement"]
        assert row["kv_bytes_per_token"] == alone["kv_cache"]["measured_bytes_per_token"]


def test_report_accepts_a_sweep_json_beside_eval_results(swept, tmp_path):
    out, record, _, _ = swept
    results = load_results(out / "sweep.json")
    assert [r["label"] for r in results] == ["parent"] + [r["name"] for r in record["candidates"]]
    written = write_report([out / "sweep.json"], tmp_path / "report")
    rows = json.loads(written["json"].read_text())["rows"]
    assert [r["kv_heads"] for r in rows] == [4, 2, 2, 1, 1]
    assert rows[3]["perplexity"] == record["candidates"][2]["perplexity"]


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--groups", "4,8"], ["--groups 4,8 leaves no kv-head count", "valid: 1, 2"]),
        (["--methods", "mean,bogus"], ["--methods 'bogus' is unknown", "calibrated"]),
        (["--tolerance", "0"], ["--tolerance 0 must be between 0 and 10"]),
        (["--tolerance", "10"], ["--tolerance 10 must be between 0 and 10"]),
        (["--tolerance", "-0.5"], ["--tolerance -0.5 must be between 0 and 10"]),
    ],
)
def test_bad_input_is_refused_in_one_line_before_anything_runs(tiny, tmp_path, extra, fragments):
    before = tree_digest(tiny)
    out = tmp_path / "out"
    assert_refused(cli(*_sweep_args(tiny, out, *extra)), *fragments)
    assert not out.exists() and tree_digest(tiny) == before


def test_a_missing_eval_text_and_too_little_room_are_refused_up_front(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = _sweep_args(tiny, out)
    args[args.index("--data") + 1] = tmp_path / "missing.txt"
    assert_refused(cli(*args), "missing.txt")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: type("U", (), {"free": 1000})())
    assert_refused(cli(*_sweep_args(tiny, out)), f"--out {out} needs", "MiB free")
    assert not out.exists()


def test_an_interrupted_sweep_keeps_its_finished_rows_and_no_temporary_model(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    seen = []
    evaluate = eval_run.evaluate

    def interrupt_at_the_second_candidate(model_path, *args, **kwargs):
        seen.append(Path(model_path))
        if len(seen) == 3:  # the parent, candidate 1, then candidate 2 (converted, on disk, under evaluation)
            assert (Path(model_path) / "model.safetensors").is_file()
            raise KeyboardInterrupt
        return evaluate(model_path, *args, **kwargs)

    monkeypatch.setattr(eval_run, "evaluate", interrupt_at_the_second_candidate)
    result = cli(*_sweep_args(tiny, out))
    assert result.exit_code == 130, result.output
    assert "keeps the 1 of 4 candidates that finished" in result.output
    record = json.loads((out / "sweep.json").read_text())
    assert record["interrupted"] is True and [r["name"] for r in record["candidates"]] == ["kv2-mean"]
    assert "Interrupted: 1 of 4" in (out / "sweep.md").read_text()
    assert not seen[2].exists() and not list(out.glob(".sweep-*")) and not (out / "models").exists()
    assert sorted(p.name for p in out.iterdir()) == [
        MARKER,
        "sweep.html",
        "sweep.json",
        "sweep.md",
        "sweep_quality_vs_kv.png",
    ]


def test_a_sweep_interrupted_before_any_candidate_leaves_nothing(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def interrupt(*_args, **_kwargs):
        assert any(out.glob(".sweep-*"))  # the work directory exists while the parent is evaluated
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_run, "evaluate", interrupt)
    result = cli(*_sweep_args(tiny, out))
    assert result.exit_code == 130 and "nothing written" in result.output
    assert not out.exists()


def test_refine_adds_the_per_layer_sensitivity_heat_map(tiny, tmp_path, monkeypatch):
    """With --refine each conversion reads its statistics' text again (refine's blocks): still the one
    resolution of the sweep."""
    out = tmp_path / "out"
    counts = {"resolved": 0}
    monkeypatch.setattr(textdata, "resolve", counted_resolve(counts, textdata.resolve))
    options = SweepOptions(
        calibration=str(tiny / "cal.txt"),
        data=str(tiny / "eval.txt"),
        out=str(out),
        groups=(1,),
        methods=("mean",),
        refine=RefineOptions(steps=3),  # a few Adam steps: the errors and the map are what is tested
        max_tokens=EVAL_TOKENS,
        calibration_tokens=CAL_TOKENS,
        progress=False,
    )
    record = sweep(tiny / "src", options, echo=lambda _: None, pages=write_pages)
    (row,) = record["candidates"]
    assert row["refine"]["options"]["steps"] == 3
    assert [layer["layer"] for layer in row["refine"]["layers"]] == [0, 1]
    assert (out / "sweep_layer_sensitivity.png").stat().st_size > 1000
    assert "![layer_sensitivity](sweep_layer_sensitivity.png)" in (out / "sweep.md").read_text()
    assert counts["resolved"] == 1


def _row(name, groups, method, ppl, kv):
    return {"name": name, "groups": groups, "method": method, "perplexity": ppl, "perplexity_change": ppl / 100 - 1,
            "kv_bytes_per_token": kv, "kv_saving": 1024 / kv, "model": None}  # fmt: skip


def test_recommendation_is_the_smallest_cache_within_tolerance_or_the_next_command():
    settings = {"methods": ["mean", "calibrated"], "tolerance": 0.05, "calibration": "austen",
                "calibration_tokens": 4096, "seed": 0, "refine": None, "data": "held.txt"}  # fmt: skip
    rows = [
        _row("kv4-mean", 4, "mean", 104, 512),
        _row("kv2-mean", 2, "mean", 110, 256),
        _row("kv4-calibrated", 4, "calibrated", 101, 512),
        _row("kv2-calibrated", 2, "calibrated", 104.9, 256),
    ]
    commands = {row["name"]: f"mha2gqa convert m OUT --groups {row['groups']} --method {row['method']}" for row in rows}
    commands["kv4-calibrated"] += " --calibration austen"
    record = {"settings": settings, "parent": {"perplexity": 100.0}, "candidates": rows,
              "source": {"path": "m", "pretrain_tokens": 123456}, "convert_commands": commands}  # fmt: skip
    found = recommend(record)
    assert found["per_method"] == {"mean": "kv4-mean", "calibrated": "kv2-calibrated"} and found["next"] is None
    record["settings"] = {**settings, "tolerance": 0.005}
    found = recommend(record)
    assert found["per_method"] == {"mean": None, "calibrated": None}
    assert found["next"].startswith(
        "mha2gqa convert m kv4-calibrated --groups 4 --method calibrated --calibration austen"
    )
    assert "mha2gqa uptrain --recipe" in found["next"] and "model=kv4-calibrated" in found["next"]
    assert found["line"] == f"{found['summary']}: {found['next']}" and "\n" not in found["line"]
    assert "budget.pretrain_tokens=123456" in found["next"]  # the model's own 5% budget, not the demo's
    assert "--recipe mha2gqa/demo/demo-uptrain.yaml" in found["next"]  # relative to the working folder
    record["settings"] = {**settings, "tolerance": 0.005, "calibration": "parent"}
    assert "data.train=[TRAIN_TEXT]" in recommend(record)["next"]  # samples are no uptrain data


def test_the_budget_base_is_the_models_own_pretraining_or_20_tokens_a_parameter(tmp_path):
    from mha2gqa.files import embedded

    assert pretrain_tokens(embedded.model_dir(), 6_000_000) == embedded.pretrain_tokens()
    (tmp_path / "m").mkdir()
    assert pretrain_tokens(tmp_path / "m", 135_000_000) == 2_700_000_000


def test_pareto_front_keeps_only_points_nothing_beats_on_both_axes():
    points = [(8, 10.0, "parent"), (4, 12.0, "a"), (4, 11.0, "b"), (2, 20.0, "c"), (2, 25.0, "d"), (1, 30.0, "e")]
    assert pareto_front(points) == ["parent", "b", "c", "e"]


@pytest.mark.slow
def test_a_real_sigint_during_the_second_candidate_keeps_the_first(tiny, tmp_path):
    out = tmp_path / "out"
    long_text = tmp_path / "long.txt"
    long_text.write_text(SAMPLE_TEXT.upper() * 400)  # each evaluation takes seconds: room to interrupt the second
    args = [str(a) for a in _sweep_args(tiny, out)[1:]]
    args[args.index("--data") + 1], args[args.index("--max-tokens") + 1] = str(long_text), "100000"
    command = [sys.executable, "-m", "mha2gqa", "sweep", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not (out / "sweep.json").exists():  # written once the first candidate has finished
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr
    assert "keeps the 1 of 4 candidates that finished" in stdout and "Traceback" not in stderr
    record = json.loads((out / "sweep.json").read_text())
    assert record["interrupted"] is True and [r["name"] for r in record["candidates"]] == ["kv2-mean"]
    assert not list(out.glob(".sweep-*")) and not list(out.glob("**/*.safetensors"))


@pytest.mark.parametrize("mlp_output", [False, True])
def test_resume_reads_a_sweep_json_written_while_refine_had_mlp_output(tiny, tmp_path, mlp_output):
    """sweep.json files from before --refine-mlp went to bench/ record "mlp_output" in their refine settings:
    false (what every sweep ran) changed nothing, so --resume continues them; true would be other settings."""
    from mha2gqa.architecture.layouts import read_config
    from mha2gqa.runtime.errors import InputError

    src, out = tiny / "src", tmp_path / "out"
    options = SweepOptions(out=str(out), refine=RefineOptions(), calibration=str(tiny / "cal.txt"), progress=False)
    record = folder.new_record(src, src, read_config(src), options, [])
    earlier = json.loads(json.dumps(record))
    earlier["settings"]["refine"]["mlp_output"] = mlp_output
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps(earlier))
    if mlp_output:
        with pytest.raises(InputError, match="--resume: --refine differs from the sweep"):
            folder.earlier_sweep(out, record)
    else:
        assert folder.earlier_sweep(out, record)["settings"]["refine"]["mlp_output"] is False


@pytest.mark.parametrize(
    "recorded_weight, weight_now, continues",
    [(None, 1.0, True), (None, 0.25, False), (0.25, 0.25, True), (1.0, 0.25, False)],
)
def test_resume_reads_a_sweep_json_written_before_the_opening_weight(
    tiny, tmp_path, recorded_weight, weight_now, continues
):
    """sweep.json files from before --refine-opening-weight lack it: they ran at weight 1 (the default until
    2026-12-04), so --resume continues them at weight 1 and refuses them at another weight, the default 0.25 too."""
    from mha2gqa.architecture.layouts import read_config
    from mha2gqa.runtime.errors import InputError

    src, out = tiny / "src", tmp_path / "out"
    options = SweepOptions(
        out=str(out), refine=RefineOptions(opening_weight=weight_now), calibration=str(tiny / "cal.txt"), progress=False
    )
    record = folder.new_record(src, src, read_config(src), options, [])
    earlier = json.loads(json.dumps(record))
    del earlier["settings"]["refine"]["opening_weight"]
    if recorded_weight is not None:
        earlier["settings"]["refine"]["opening_weight"] = recorded_weight
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps(earlier))
    if continues:
        assert folder.earlier_sweep(out, record)["schema"] == earlier["schema"]
    else:
        with pytest.raises(InputError, match="--resume: --refine differs from the sweep"):
            folder.earlier_sweep(out, record)


@pytest.mark.parametrize(
    "recorded, calibration_tokens, refine, continues",
    [
        (None, None, True, False),  # before the key: 64 x hidden, unset counts mean 128 x hidden now
        (None, 4096, True, False),  # --refine's tokens are still unset
        (None, 4096, False, True),  # every count given: the default does not matter
        (REFINE_TOKENS_PER_HIDDEN, None, True, True),
    ],
)
def test_resume_refuses_a_sweep_run_under_another_default_token_count(
    tiny, tmp_path, recorded, calibration_tokens, refine, continues
):
    """A sweep.json records what unset token counts meant (tokens_per_hidden); one from before the default
    doubled (2026-12-04) lacks it and ran at 64 x hidden: --resume continues it only where no count is unset."""
    from mha2gqa.architecture.layouts import read_config
    from mha2gqa.runtime.errors import InputError

    src, out = tiny / "src", tmp_path / "out"
    options = SweepOptions(
        out=str(out),
        refine=RefineOptions() if refine else None,
        calibration=str(tiny / "cal.txt"),
        calibration_tokens=calibration_tokens,
        progress=False,
    )
    record = folder.new_record(src, src, read_config(src), options, [])
    assert record["settings"]["tokens_per_hidden"] == REFINE_TOKENS_PER_HIDDEN == 128
    earlier = json.loads(json.dumps(record))
    del earlier["settings"]["tokens_per_hidden"]
    if recorded is not None:
        earlier["settings"]["tokens_per_hidden"] = recorded
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps(earlier))
    if continues:
        assert folder.earlier_sweep(out, record)["schema"] == earlier["schema"]
    else:
        with pytest.raises(InputError, match=r"meant 64 x hidden; they mean 128 x hidden now: start a new sweep"):
            folder.earlier_sweep(out, record)


def source_shape(record: dict):
    """The swept source's attention shape, as sweep --resume checks rows against it."""
    from pathlib import Path

    from mha2gqa.architecture.layouts import attention_shape, read_config

    return attention_shape(read_config(Path(record["source"]["resolved"])))
