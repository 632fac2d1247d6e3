"""Long runs say their time and peak memory before they start, correct the rest as they go, and say what they took
(mha2gqa/estimates/): the rates a bench re-makes, the probe that scales them to the machine, each command's
stages as work, the clock, and the bench's fit. The rates used here are a file of the tests' own (round numbers),
so that each assertion can be worked out by hand."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from mha2gqa import estimates
from mha2gqa.convert.options import ConvertOptions, RefineOptions
from mha2gqa.convert.prepare import Stage, prepare
from mha2gqa.estimates import clock as clock_module
from mha2gqa.estimates import rates
from mha2gqa.estimates.clock import Clock
from mha2gqa.files import embedded

ROOT = Path(__file__).resolve().parents[1]
SMALL, LARGE = rates.SMALL, rates.LARGE
LONG = 1000.0  # seconds of priced work: a run long enough for every probe's full rounds

RATES = {
    "kinds": {
        "torch_start": {"fixed": [2.0, 2.0], "per": {}},
        "eval_load": {"fixed": [1.0, 1.0], "per": {"bytes": [1e-8, 1e-8]}},
        "eval_quality": {"fixed": [0.0, 0.0], "per": {"forward": [1e-9, 1e-10]}},
        "eval_tally": {"fixed": [0.0, 0.0], "per": {"tally": [1e-8, 1e-8]}},
        "eval_kv": {"fixed": [0.5, 0.5], "per": {}},
        "check": {"fixed": [0.5, 0.5], "per": {"forward": [1e-9, 1e-10], "cold_start": [4.0, 4.0]}},
        "calibrate": {"fixed": [1.0, 1.0], "per": {"tokens": [4e-10, 4e-11]}},
        "only_small": {"fixed": [3.0, None], "per": {}},
        "refine": {"fixed": [0.0, 0.0], "per": {"steps": [1e-9, 1e-9]}},
        "refine_global": {"fixed": [0.0, 0.0], "per": {"steps": [1e-9, 1e-9], "checks": [1e-9, 1e-9]}},
    },
    "probe_s": {"torch": 0.25, "numpy": 0.5, "torch_fine": 0.1},
    "measured": {"cores": 2, "load": 0.4, "date": "2026-12-03"},
}


@pytest.fixture
def fixed_rates(tmp_path, monkeypatch):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(RATES))
    monkeypatch.setattr(rates, "RATES_FILE", path)
    return rates.load()


def test_a_part_costs_its_fixed_seconds_plus_its_work_at_the_rate_of_its_model_size(fixed_rates):
    assert fixed_rates.seconds("eval_load", SMALL, {"bytes": 1e8}) == pytest.approx(2.0)
    assert fixed_rates.seconds("eval_quality", SMALL, {"forward": 1e9}) == pytest.approx(1.0)
    assert fixed_rates.seconds("eval_tally", SMALL, {"tally": 1e8}) == pytest.approx(1.0)
    assert fixed_rates.seconds("eval_load", SMALL, {"bytes": 1e8}, fixed=False) == pytest.approx(1.0)  # paid once
    assert fixed_rates.seconds("eval_quality", LARGE, {"forward": 1e9}) == pytest.approx(0.1)
    # halfway on log(parameters): the geometric mean of the two rates; beyond them, the nearer one's
    middle = int((SMALL * LARGE) ** 0.5)
    assert fixed_rates.seconds("eval_quality", middle, {"forward": 1e9}) == pytest.approx(1e9 * (1e-9 * 1e-10) ** 0.5)
    assert fixed_rates.seconds("eval_quality", 100 * LARGE, {"forward": 1e9}) == pytest.approx(0.1)
    assert fixed_rates.seconds("only_small", LARGE, {}) == 3.0  # measured on one model only
    assert fixed_rates.seconds("not_measured", SMALL, {"x": 5}) == 0.0  # a kind the bench did not measure


def test_the_probe_scales_every_rate_to_this_machine(fixed_rates, monkeypatch):
    monkeypatch.setitem(rates.PROBES, "numpy", lambda: 1.5)
    machine = rates.this_machine("numpy", False, LONG)
    assert machine.factor == pytest.approx(3.0) and machine.probe_s == 1.5
    assert "x3 for this machine now (a numpy probe: 1500 ms here)" in machine.words()
    assert rates.this_machine(None, False, LONG).factor == 1.0


def test_refine_is_scaled_by_the_probe_of_small_products_the_rest_by_the_torch_probe(fixed_rates, monkeypatch):
    monkeypatch.setitem(rates.PROBES, "torch", lambda: 0.5)  # x2 of the rates file's 0.25
    monkeypatch.setitem(rates.PROBES, "torch_fine", lambda: 0.4)  # x4 of its 0.1
    machine = rates.this_machine("torch", True, LONG)
    assert (machine.factor, machine.fine_factor) == pytest.approx((2.0, 4.0))
    assert "x2, x4 for small products for this machine now" in machine.words()
    stage = estimates.StageCost(
        "refine",
        (estimates.Part("refine", SMALL, {"steps": 1e9}), estimates.Part("eval_quality", SMALL, {"forward": 1e9})),
    )
    assert estimates.Estimate((stage,), machine).seconds() == pytest.approx(1.0 * 4 + 1.0 * 2)
    monkeypatch.setitem(rates.PROBES, "torch_fine", lambda: pytest.fail("a run without refine probed small products"))
    assert rates.this_machine("torch", False, LONG).fine_factor is None
    assert estimates.Estimate((stage,), rates.this_machine("torch", False, LONG)).seconds() == pytest.approx(4.0)


def test_the_probe_sums_its_rounds_by_whether_a_round_can_dodge_a_busy_machine(fixed_rates, monkeypatch):
    rounds = iter([9.0, 9.0, 0.3, 0.1, 0.5, 0.4, 0.2, 0.7, 0.9, 0.35, 0.45, 0.8, 0.6])  # 2 warm-ups, then 11 rounds
    monkeypatch.setitem(rates.PROBES, "torch", lambda: next(rounds))
    monkeypatch.setattr(rates, "_torch_threads", lambda: 1)
    assert rates.probe_seconds("torch") == pytest.approx(
        (0.1 * 0.45) ** 0.5
    )  # a lucky round on a busy machine is not the speed
    rounds = iter([9.0, 9.0, 0.3, 0.1, 0.5, 0.4, 0.2, 0.7, 0.9, 0.35, 0.45, 0.8, 0.6])
    monkeypatch.setattr(rates, "_torch_threads", lambda: 2)
    assert rates.probe_seconds("torch") == pytest.approx(0.1)
    rounds = iter([9.0, 9.0, 0.3, 0.1, 0.5, 0.4, 0.2, 0.7, 0.9, 0.35, 0.45, 0.8, 0.6])
    monkeypatch.setitem(rates.PROBES, "torch_fine", lambda: next(rounds))
    assert rates.probe_seconds("torch_fine") == pytest.approx(0.45)  # small products dodge on any count


def _estimate(factor: float = 1.0) -> estimates.Estimate:
    stages = (
        estimates.StageCost("start", (estimates.Part("torch_start", SMALL),)),  # 2 s
        estimates.StageCost("load", (estimates.Part("eval_load", SMALL, {"bytes": 1e8}),)),  # 2 s
        estimates.StageCost("quality: prose", (estimates.Part("eval_quality", SMALL, {"forward": 16e9}),)),  # 16 s
    )
    return estimates.Estimate(stages, rates.Machine(factor, 0.5, "torch"), 3 << 30)


def test_the_estimate_line_says_time_memory_each_share_and_the_scaling(fixed_rates):
    line = _estimate(2.0).line()
    assert line.startswith("estimate: about 40 s, peak memory about 3.0 GiB (start 10%, load 10%, quality: prose 80%; ")
    assert "rates measured on 2 cores at load 0.4, 2026-12-03, x2 for this machine now" in line


class FakeTime:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def time(self) -> float:
        return self.now


def test_the_clock_says_the_estimate_corrects_the_rest_and_says_what_it_took(fixed_rates, monkeypatch, tmp_path):
    fake = FakeTime()
    monkeypatch.setattr(clock_module, "time", fake)
    records = []
    monkeypatch.setattr(clock_module, "_OBSERVERS", [records.append])
    lines = []
    clock = Clock(echo=lines.append, started=1000.0)
    clock.begin(lambda: _estimate())  # 20 s: start 2, load 2, quality 16
    fake.now += 4.0
    clock.stage("load")  # 4 s for 2 estimated (a tenth of the run): 2x, so the 18 s left are 36 s
    assert lines[1] == "1 stage in 4 s: about 35 s left (corrected from how the run went so far)"
    fake.now += 8.0
    clock.stage("quality: prose")  # 12 s for 4 estimated: 3x, so the 16 s left are 48 s, not the 28 s said
    assert lines[2] == "2 stages in 12 s: about 50 s left (corrected from how the run went so far)"
    clock.partial(0.05)  # under a tenth: nothing
    fake.now += 6.0
    clock.partial(0.25)  # 6 s for a quarter of 16: 1.5x, so 18 s left
    assert lines[3] == "quality: prose: 25% in 6 s: about 20 s left (corrected from how the run went so far)"
    clock.partial(0.5)  # once a stage
    assert len(lines) == 4
    fake.now += 18.0
    assert clock.finish() == pytest.approx(36.0)
    assert lines[0].startswith("estimate: about 20 s") and lines[-1] == "took 36 s (estimated about 20 s)"
    (record,) = records
    assert [(s["name"], s["seconds"]) for s in record["stages"]] == [("start", 4), ("load", 8), ("quality: prose", 24)]
    assert record["stages"][2]["parts"] == [{"kind": "eval_quality", "parameters": SMALL, "work": {"forward": 16e9}}]
    assert record["estimate_s"] == pytest.approx(20.0) and record["took_s"] == pytest.approx(36.0)
    peaks = [s["peak_rss_bytes"] for s in record["stages"]]  # where the run's memory peaked, stage by stage
    assert peaks == sorted(peaks) and peaks[0] > 50 << 20  # this test's process: python, torch, pytest


def test_a_library_call_pays_for_no_estimate():
    from mha2gqa.estimates.clock import NO_CLOCK

    NO_CLOCK.begin(lambda: pytest.fail("the estimate was made"))
    NO_CLOCK.stage("x")
    assert NO_CLOCK.finish() == 0.0


def test_every_stage_of_a_refining_conversion_is_costed_and_a_stage_may_cost_itself(fixed_rates):
    options = ConvertOptions(2, calibration="austen", calibration_tokens=4096, refine=RefineOptions(steps=2))
    plan = prepare(embedded.model_dir(), options)
    names = [s.name for s in plan.priced()]
    assert names == ["start", "load", "calibrate", "refine", "refine (global)", "write", "check", "metadata"]
    calibrate = next(s for s in plan.priced() if s.name == "calibrate")
    params = plan.parameters
    assert calibrate.seconds() == pytest.approx(1.0 + 4096 * params * plan.calibration_passes * 4e-10)
    plan.stages.append(Stage("later", "a stage its planner costs", parts=(estimates.Part("eval_kv", params),)))
    assert [s for s in plan.priced() if s.name == "later"][0].seconds() == 0.5
    mean = prepare(embedded.model_dir(), ConvertOptions(2))  # numpy: no torch until the check imports it
    assert [s.name for s in mean.priced()] == ["start", "merge", "check", "metadata"]


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "auto"])
def test_a_global_stage_in_bfloat16_is_priced_at_its_measured_speedup_and_its_checks_are_not(
    fixed_rates, monkeypatch, precision
):
    from mha2gqa.convert import run as convert_run
    from mha2gqa.runtime import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2"}))  # bfloat16 emulated: auto is float32
    monkeypatch.setattr(machine, "torch_device", lambda: "cpu")
    monkeypatch.setattr(rates, "this_machine", lambda kind, fine, priced_s: rates.STORED)
    options = dict(calibration="austen", calibration_tokens=4096)
    plan = prepare(
        embedded.model_dir(), ConvertOptions(2, **options, refine=RefineOptions(steps=2, global_precision=precision))
    )
    baseline = prepare(
        embedded.model_dir(), ConvertOptions(2, **options, refine=RefineOptions(steps=2, global_precision="float32"))
    )
    (stage,) = [s for s in convert_run.estimate(plan).stages if s.name == "refine (global)"]
    (float32,) = [s for s in baseline.priced() if s.name == "refine (global)"]
    speedup = 1.3  # the embedded model is SMALL: (1.3, 1.6)'s first
    assert stage.parts[0].work["checks"] == float32.parts[0].work["checks"] > 0
    expected = float32.parts[0].work["steps"] / (speedup if precision == "bfloat16" else 1)
    assert stage.parts[0].work["steps"] == pytest.approx(expected)


def test_the_bf16_speedup_is_interpolated_between_the_two_measured_models():
    from mha2gqa.estimates.costs import BF16_GLOBAL_STEP_SPEEDUP

    assert rates.between(BF16_GLOBAL_STEP_SPEEDUP, SMALL) == pytest.approx(1.3)
    assert rates.between(BF16_GLOBAL_STEP_SPEEDUP, LARGE) == pytest.approx(1.6)
    assert 1.3 < rates.between(BF16_GLOBAL_STEP_SPEEDUP, 30_000_000) < 1.6


def _bench():
    spec = importlib.util.spec_from_file_location("estimate_rates", ROOT / "bench" / "estimate_rates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_fits_fixed_seconds_and_rates_and_a_kind_inside_a_mixed_stage():
    bench = _bench()

    def stage(seconds, *parts):
        return {"seconds": seconds, "parts": [{"kind": k, "parameters": p, "work": w} for k, p, w in parts]}

    records = [{"stages": [stage(3 + 2e-9 * n, ("eval_quality", SMALL, {"forward": n}))]} for n in (1e9, 3e9, 5e9)] + [
        # a training stage: its steps (unknown) and its evals (eval_quality, fitted above)
        {
            "stages": [
                stage(
                    1 + 5e-9 * t + 3 + 2e-9 * 1e9,
                    ("train", SMALL, {"tokens": t}),
                    ("eval_quality", SMALL, {"forward": 1e9}),
                )
            ]
        }  # fmt: skip
        for t in (1e9, 2e9)
    ]
    fitted = bench.fit(records)
    quality, train = fitted["eval_quality"][str(SMALL)], fitted["train"][str(SMALL)]
    assert quality["fixed"] == pytest.approx(3.0) and quality["per"]["forward"] == pytest.approx(2e-9)
    # the evals' 3 + 2 s taken out first: 1 s fixed, 5e-9 a token
    assert train["per"]["tokens"] == pytest.approx(5e-9) and train["fixed"] == pytest.approx(1.0)
    written = bench.rates_file(fitted, SMALL, None, {"torch": 0.2, "numpy": 0.3}, {"cores": 2})
    assert written["kinds"]["eval_quality"]["per"]["forward"] == [pytest.approx(2e-9), None]  # one model measured


def test_a_term_that_never_varies_folds_into_the_fixed_part():
    bench = _bench()
    found = bench.least_squares([({"bytes": 100.0, "tokens": 1.0}, 3.0), ({"bytes": 100.0, "tokens": 3.0}, 7.0)])
    assert found["fixed"] == pytest.approx(1.0) and found["per"] == {"tokens": pytest.approx(2.0)}


def test_the_demo_says_its_time_before_it_starts(tmp_path, monkeypatch, fixed_rates):
    from mha2gqa.demo import pipeline

    lines = []
    monkeypatch.setattr(pipeline, "_run_stages", lambda *args: lines.append("stages ran") or {})
    pipeline.run_demo(tmp_path / "demo", quick=True, echo=lines.append, progress=False)
    assert lines[0].startswith("estimate: about ") and lines[1] == "stages ran" and lines[2].startswith("took ")
    for stage in ("convert", "evaluate parent", "evaluate converted", "uptrain", "evaluate uptrained", "report"):
        assert f" {stage} " in lines[0], stage


def test_durations_are_rounded_as_an_estimate_deserves_and_measured_ones_are_not():
    assert [estimates.duration(s) for s in (3, 42, 200, 6540, 7200)] == [
        "about 5 s",
        "about 40 s",
        "about 3 min",
        "about 1 h 50 min",
        "about 2 h",
    ]
    assert [estimates.took(s) for s in (42.4, 185, 3725)] == ["42 s", "3 min 5 s", "1 h 2 min"]


def test_the_held_out_novels_tokens_are_guessed_from_its_size():
    from mha2gqa.demo.timing import HELDOUT_TOKENS

    assert 0.7 * HELDOUT_TOKENS < estimates.text_tokens(str(embedded.heldout_path())) < 1.4 * HELDOUT_TOKENS


def test_convert_checks_work_is_a_stage_of_its_estimate_and_a_cached_parent_halves_its_forwards(
    fixed_rates, tmp_path, monkeypatch
):
    # convert's quality check (convert/check.py) is costed by its planner: a part of kind "check" (with a cold
    # start on the numpy path), counted before the metadata; the parent's forwards only when the cache lacks them
    tokens, vocab = 1024, 4096
    cold = estimates.check_parts(tokens, SMALL, vocab)
    work = {"forward": 2 * tokens * SMALL, "tally": tokens * vocab, "cold_start": 0}
    assert [(p.kind, p.work) for p in cold] == [("check", work)]
    warm = estimates.check_parts(tokens, SMALL, vocab, torch_start=True, parent_cached=True)
    assert [(p.kind, p.work) for p in warm] == [("check", {**work, "forward": tokens * SMALL, "cold_start": 1})]
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    plan = prepare(embedded.model_dir(), ConvertOptions(groups=2))  # numpy executor: the check starts torch
    check = next(stage for stage in plan.priced() if stage.name == "check")
    assert [p.kind for p in check.parts] == ["check"] and check.parts[0].work["cold_start"] == 1
    assert plan.check.skip is None
    forward = plan.check.tokens * len(plan.check.domains) * plan.parameters
    assert check.parts[0].work["forward"] == 2 * forward  # an empty cache: the parent is scored too
    assert check.seconds() == pytest.approx(plan.check.seconds)
    from mha2gqa.files.cache import model_key

    (tmp_path / "cache" / "check").mkdir(parents=True)
    (tmp_path / "cache" / "check" / f"{model_key(embedded.model_dir())}-settings.safetensors").write_bytes(b"")
    cached = prepare(embedded.model_dir(), ConvertOptions(groups=2))
    assert cached.check.parts[0].work["forward"] == forward and cached.check.seconds < plan.check.seconds
    unchecked = prepare(embedded.model_dir(), ConvertOptions(groups=2, check=False))
    assert "check" not in [stage.name for stage in unchecked.priced()]


def test_a_warm_evaluation_pays_no_fixed_seconds_and_a_reference_adds_the_vocabulary_tally(fixed_rates):
    # a demo's or a sweep's later evaluations run in the process that paid each kind's fixed seconds already
    work = estimates.EvalWork(SMALL, SMALL, 4096, 8 * SMALL, {"text": (1000, 990)}, 0)
    cold = sum(stage.seconds() for stage in estimates.eval_stages(work, start=False))
    warm = sum(stage.seconds() for stage in estimates.eval_stages(work, start=False, warm=True))
    assert cold - warm == pytest.approx(1.0 + 0.5)  # eval_load's and eval_kv's fixed seconds in RATES
    quality = next(s for s in estimates.eval_stages(work) if s.name == "quality: text")
    assert [(p.kind, p.work) for p in quality.parts] == [
        ("eval_quality", {"forward": 1000 * 2 * SMALL}),
        ("eval_tally", {"tally": 990 * 4096}),
    ]
    alone = estimates.EvalWork(SMALL, None, 4096, 4 * SMALL, {"text": (1000, 990)}, 0)
    assert [p.kind for s in estimates.eval_stages(alone) if s.name == "quality: text" for p in s.parts] == [
        "eval_quality"
    ]


def test_a_checked_conversion_probes_torch_which_its_check_runs_on(fixed_rates, monkeypatch):
    from mha2gqa.convert import run as convert_run

    probed = []
    monkeypatch.setattr(rates, "this_machine", lambda kind, fine, priced_s: probed.append(kind) or rates.STORED)
    for check in (True, False):
        convert_run.estimate(prepare(embedded.model_dir(), ConvertOptions(groups=2, check=check)))
    assert probed == ["torch", "numpy"]  # mean merges with numpy: only the unchecked run is torch-free


def test_sampling_is_costed_by_its_batched_forwards_and_the_tokens_they_draw(tmp_path):
    """A batch of 16 sequences costs about one sequence's forwards (SmolLM2's default 36 sequences were costed as
    36 sequential ones: 15 min said, 3.5 min taken), and a chat template splits the batches in two."""
    from mha2gqa.corpus.sampling import forward_work, has_chat_template
    from mha2gqa.estimates.costs import sample_part

    assert forward_work(18_432, 512, chat=True) == (4 * 512, 36 * 512)  # 18 + 18 sequences: 16 + 2, twice
    assert forward_work(18_432, 512, chat=False) == (3 * 512, 36 * 512)  # 36: 16 + 16 + 4
    assert forward_work(256, 512, chat=True) == (512, 512)  # one sequence, whole
    assert forward_work(36_864, 512, chat=True, batch=64) == (2 * 512, 72 * 512)  # each kind in one batch
    part = sample_part(1000, 18_432, 512, chat=True)
    assert part.kind == "sample" and part.work == {"steps": 2048 * 1000, "tokens": 18_432 * 1000}
    assert not has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert not has_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(tmp_path)


@pytest.mark.parametrize(
    "layers, kv_heads, head_dim, batch",
    [(30, 3, 64, 64), (32, 32, 128, 16), (24, 8, 128, 21), (2, 2, 16, 64)],  # SmolLM2, Llama-2-7B, between, tiny
)
def test_convert_samples_as_many_sequences_at_once_as_their_kv_cache_allows(layers, kv_heads, head_dim, batch):
    """Up to 64 sequences at once while their float32 KV cache at 512 tokens stays within 2 GiB, never fewer than
    the recipe's 16: SmolLM2 (23.6 MB a sequence) draws its 36 of each kind in one batch, a 7B model (268 MB) in 16s;
    the plan's memory counts the batch it draws."""
    from mha2gqa.architecture.layouts import attention_shape
    from mha2gqa.corpus.sampling import batch_for, cache_bytes

    heads = kv_heads * 3
    config = {"model_type": "llama", "num_hidden_layers": layers, "num_attention_heads": heads, "vocab_size": 1000}
    config |= {"num_key_value_heads": kv_heads, "hidden_size": heads * head_dim, "max_position_embeddings": 2048}
    assert batch_for(config, 512) == batch
    per_sequence = 2 * layers * kv_heads * head_dim * 512 * 4
    assert cache_bytes(config, attention_shape(config), 512, batch) == batch * (per_sequence + 4 * 1000 * 4)


# ---- when a run probes (issue 59: a 1-second probe said that a 2-second conversion takes about 5 s) ----


def test_a_short_plain_conversion_starts_no_probe(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from mha2gqa.cli import main

    for kind in list(rates.PROBES):
        monkeypatch.setitem(rates.PROBES, kind, lambda: pytest.fail("a short conversion probed the machine"))
    args = ["convert", str(embedded.model_dir()), str(tmp_path / "out"), "-g", "2", "--no-check"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "not scaled to this one: a probe would cost more than 2% of a run this short)" in result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_long_refine_still_gets_its_machine_scaled_estimate_from_a_probe_of_a_small_share(monkeypatch):
    from mha2gqa.convert import run as convert_run

    stored, calls = rates.load().probe_s, []

    def probe(kind: str, factor: float):
        return lambda: calls.append(kind) or stored[kind] * factor

    monkeypatch.setitem(rates.PROBES, "torch", probe("torch", 2.0))
    monkeypatch.setitem(rates.PROBES, "torch_fine", probe("torch_fine", 3.0))
    monkeypatch.setattr(rates, "_torch_threads", lambda: 2)
    plan = prepare(embedded.model_dir(), ConvertOptions(2, refine=RefineOptions()))
    priced = plan.at_rates().seconds()
    assert priced > rates.PROBE_AFTER_S  # the default refine of the embedded model: minutes
    scaled = convert_run.estimate(plan)
    assert (scaled.machine.factor, scaled.machine.fine_factor) == pytest.approx((2.0, 3.0))
    assert "x2, x3 for small products for this machine now" in scaled.line()
    assert scaled.seconds() > 2 * priced * 0.99
    probe_cost = sum(stored[kind] for kind in calls)  # on the measuring machine: the share is of its price
    assert 0 < probe_cost <= rates.PROBE_SHARE * priced


@pytest.mark.parametrize("kinds", [["numpy"], ["torch"], ["torch", "torch_fine"]])
def test_the_probe_costs_at_most_a_fixed_small_share_of_the_priced_work(kinds):
    per_round = sum(rates.load().probe_s[kind] for kind in kinds)
    assert rates.probe_rounds(rates.PROBE_AFTER_S - 0.1, kinds) == 0
    assert rates.probe_rounds(3600.0, kinds) == rates.PROBE_ROUNDS
    for priced in (10.0, 12.0, 15.0, 20.0, 23.0, 30.0, 45.0, 60.0, 120.0, 600.0):
        rounds = rates.probe_rounds(priced, kinds)
        assert rounds == 0 or rounds >= rates.MIN_PROBE_ROUNDS
        assert (rounds + rates.PROBE_WARMUP) * per_round <= rates.PROBE_SHARE * priced or rounds == 0


def test_one_place_decides_whether_a_command_probes():
    """Every command's estimate meets the machine through estimates.for_this_machine: no module outside
    mha2gqa/estimates/ calls the probe or builds a machine factor itself."""
    package = ROOT / "mha2gqa"
    callers = [
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if "estimates" not in path.parts and re.search(r"\b(this_machine|probe_seconds)\(", path.read_text())
    ]
    assert callers == []


def test_a_commands_start_is_read_to_a_tick_not_a_second_early(monkeypatch):
    """The "start" stage is timed from the process's start. psutil's create_time adds the start to /proc/stat's boot
    time in whole seconds, so it read up to a second early (0.47 s here), which every "start" carried; the start
    from /proc/self/stat and the time since boot is exact to a tick, never before psutil's, and in the past."""
    import sys
    import time

    psutil = pytest.importorskip("psutil")
    started = clock_module._linux_start()
    if started is None:
        pytest.skip("not Linux: psutil's create_time stands")
    assert -0.02 <= started - psutil.Process().create_time() < 1.02
    assert started <= time.time()
    monkeypatch.setattr(sys, "argv", ["/usr/bin/mha2gqa", "convert"])  # run as the command: its start is the run's
    assert clock_module.process_started() == pytest.approx(started, abs=0.02)
