"""What convert chooses from the machine is decided once, by the plan, from facts that do not move (the CPU's flags,
the device), and recorded as the explicit value (mha2gqa.json, the card's Reproduce line, convert.yaml); execution
asks the machine nothing (convert/decide.py, mha2gqa/runtime/machine.py; issues 54 and 55)."""

from __future__ import annotations

import json

import pytest
import yaml

from mha2gqa.convert.options import ConvertOptions, GlobalPrecision, RefineOptions
from mha2gqa.convert.prepare import prepare
from mha2gqa.convert.run import execute, plan_conversion
from mha2gqa.estimates import rates
from mha2gqa.files import embedded
from mha2gqa.runtime import machine

REFINE = dict(calibration="austen", calibration_tokens=4096, check=False, progress=False)
EPYC = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})  # the AMD EPYC of issue 55: its probe read 2.2-2.35x
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"})
NO_BF16 = frozenset({"fpu", "avx2", "fma"})


def refine_options(**refine) -> ConvertOptions:
    return ConvertOptions(2, **REFINE, refine=RefineOptions(steps=1, global_steps=2, **refine))


def on_cpu(monkeypatch, flags, speedup: float | None = None) -> None:
    """This machine as a CPU with `flags` (None: unreadable) whose bfloat16 probe reads `speedup` (None: fails)."""
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    monkeypatch.setattr(machine, "torch_device", lambda: "cpu")
    probe = (lambda: speedup) if speedup is not None else (lambda: pytest.fail("the CPU's flags decide: no probe"))
    monkeypatch.setattr(machine, "bf16_speedup", probe)


@pytest.mark.parametrize(
    ("flags", "expected"), [(EPYC, "bfloat16"), (SAPPHIRE_RAPIDS, "bfloat16"), (NO_BF16, "float32")]
)
def test_auto_is_decided_from_the_cpus_flags_and_the_plan_holds_the_value(monkeypatch, flags, expected):
    on_cpu(monkeypatch, flags)
    plan = prepare(embedded.model_dir(), refine_options())
    assert plan.options.refine.global_precision == GlobalPrecision(expected)
    assert plan.decided.device == "cpu"
    assert plan.decided.why["--refine-global-precision"].startswith(f"auto -> {expected}: this CPU ")
    assert f"--refine-global-precision {expected}" in plan.command()
    assert plan.config_values()["refine_global_precision"] == expected
    assert f"in {expected}" in next(s.detail for s in plan.stages if s.name == "refine (global)")


@pytest.mark.parametrize("reading", [1.9, 1.99, 2.0, 2.01, 2.2, 2.35, 2.9])
def test_a_probe_near_the_threshold_flips_nothing(monkeypatch, reading):
    """The EPYC's probe read 2.2-2.35x against a 2.0x threshold: wherever it reads now, its flags decide, and where
    no flags can be read the probe needs a margin (3x) that a busy moment near 2x does not cross."""
    on_cpu(monkeypatch, EPYC, speedup=reading)
    assert prepare(embedded.model_dir(), refine_options()).options.refine.global_precision == GlobalPrecision.BFLOAT16
    on_cpu(monkeypatch, None, speedup=reading)
    assert prepare(embedded.model_dir(), refine_options()).options.refine.global_precision == GlobalPrecision.FLOAT32
    on_cpu(monkeypatch, None, speedup=6.8)  # AMX-class, far past the margin
    assert prepare(embedded.model_dir(), refine_options()).options.refine.global_precision == GlobalPrecision.BFLOAT16


def test_an_explicit_precision_and_a_gpu_need_no_question_of_the_cpu(monkeypatch):
    monkeypatch.setattr(machine, "cpu_flags", lambda: pytest.fail("an explicit precision asks the CPU nothing"))
    monkeypatch.setattr(machine, "torch_device", lambda: "cpu")
    plan = prepare(embedded.model_dir(), refine_options(global_precision="float32"))
    assert plan.options.refine.global_precision == GlobalPrecision.FLOAT32
    assert "--refine-global-precision" not in plan.decided.why
    monkeypatch.setattr(machine, "torch_device", lambda: "cuda")
    plan = prepare(embedded.model_dir(), refine_options())
    assert (plan.decided.device, plan.options.refine.global_precision) == ("cuda", GlobalPrecision.FLOAT32)


def test_a_plain_merge_decides_nothing_and_asks_no_device(monkeypatch):
    monkeypatch.setattr(machine, "torch_device", lambda: pytest.fail("a merge that loads no parent needs no device"))
    plan = prepare(embedded.model_dir(), ConvertOptions(2, check=False))
    assert (plan.decided.device, plan.decided.why) == (None, {})


def test_execution_carries_the_decision_out_asking_the_machine_nothing(monkeypatch, tmp_path):
    """Planned on an EPYC, executed with every question of the machine failing: the record, the card's Reproduce
    line and convert.yaml say bfloat16 explicitly, and a replay of the recorded command plans the same value on a
    machine whose CPU has no bfloat16 at all."""
    on_cpu(monkeypatch, EPYC)
    plan = plan_conversion(embedded.model_dir(), tmp_path / "out", refine_options())

    def asked(*args, **kwargs):
        raise AssertionError("execution asked the machine")

    for name in ("cpu_flags", "bf16_speedup", "torch_device", "native_bf16", "bf16_pays_on_cpu"):
        monkeypatch.setattr(machine, name, asked)
    monkeypatch.setattr(rates, "probe_seconds", asked)
    execute(plan, tmp_path / "out")
    record = json.loads((tmp_path / "out" / "mha2gqa.json").read_text())["lineage"][-1]
    assert "--refine-global-precision bfloat16" in record["command"]
    assert record["refine"]["options"]["global_precision"] == "bfloat16"
    assert record["refine"]["global"]["precision"] == "bfloat16 autocast"
    assert record["device"] == "cpu" and record["decided"]["--refine-global-precision"].startswith("auto -> bfloat16")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "--refine-global-precision bfloat16" in card and "# and the CPU: this ran on it" in card
    assert yaml.safe_load((tmp_path / "out" / "convert.yaml").read_text())["refine_global_precision"] == "bfloat16"
    on_cpu(monkeypatch, NO_BF16)
    replay = refine_options(global_precision=record["refine"]["options"]["global_precision"])
    assert prepare(embedded.model_dir(), replay).command() == plan.command()


def test_a_sweeps_estimate_prices_the_precision_its_plans_decided_and_asks_the_machine_nothing(monkeypatch):
    from mha2gqa.sweep.timing import sweep_stages

    on_cpu(monkeypatch, EPYC)
    in_bf16 = prepare(embedded.model_dir(), refine_options())
    on_cpu(monkeypatch, NO_BF16)
    in_float32 = prepare(embedded.model_dir(), refine_options())
    for name in ("cpu_flags", "bf16_speedup", "torch_device"):
        monkeypatch.setattr(machine, name, lambda: pytest.fail("the sweep's estimate asked the machine"))

    def global_seconds(plan) -> float:
        (candidate,) = [s for s in sweep_stages({"c": plan}, [], None, 4096) if s.name == "candidate c"]
        return sum(part.seconds() for part in candidate.parts if part.kind == "refine_global")

    assert 0 < global_seconds(in_bf16) < global_seconds(in_float32)
