"""What convert decides from the machine, decided once by prepare and carried by the plan (issue 54, 55).

The device the parent runs on (sample, calibrate, refine) and `--refine-global-precision auto` are chosen here,
from mha2gqa/runtime/machine.py's stable facts, and the plan holds the explicit values: its options say
`--refine-global-precision bfloat16` (or float32), never `auto`, so mha2gqa.json, the card's Reproduce line and
convert.yaml replay the same bytes on another machine, and execution (run.py, refine/global_stage.py, a sweep's
estimate) carries the choice out without asking the machine again. The thread count is the user's or torch's,
never the load's (cli/convert_cmd.py), and mha2gqa.json records it where it changes the bytes.

The rule for `auto` (docs/refine.md "The fit steps in bfloat16 where it pays"): float32 on a GPU (not measured
there); on a CPU, bfloat16 where the CPU has native bfloat16 products (amx_bf16, avx512_bf16, arm64 bf16), else
float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mha2gqa.convert.options import ConvertOptions, GlobalPrecision
from mha2gqa.runtime import machine


@dataclass(frozen=True)
class Decided:
    """The choices a plan made from the machine: `device`, where the parent runs (None: no stage loads it), and
    `why`: per choice (a flag, or "device"), its value and the reason, as mha2gqa.json records them."""

    device: str | None = None
    why: dict = field(default_factory=dict)


def decide(options: ConvertOptions, loads_parent: bool) -> tuple[ConvertOptions, Decided]:
    """`options` with every `auto` that depends on the machine replaced by its value, and what was decided.
    `loads_parent`: a stage runs the parent (sampling, calibration, refine); else nothing here applies."""
    if not loads_parent:
        return options, Decided()
    device = machine.torch_device()
    why = {"device": f"{device}: {'a CUDA GPU torch can use' if device == 'cuda' else 'no CUDA GPU torch can use'}"}
    refine = options.refine
    if refine is not None and refine.global_steps and refine.global_precision == GlobalPrecision.AUTO:
        precision, reason = auto_precision(device)
        why["--refine-global-precision"] = f"auto -> {precision.value}: {reason}"
        options = replace(options, refine=replace(refine, global_precision=precision))
    return options, Decided(device, why)


def auto_precision(device: str) -> tuple[GlobalPrecision, str]:
    """What `--refine-global-precision auto` means on `device`, and why (module docstring)."""
    if device != "cpu":
        return GlobalPrecision.FLOAT32, "a GPU runs the global stage in float32 under auto"
    pays, reason = machine.bf16_pays_on_cpu()
    return (GlobalPrecision.BFLOAT16 if pays else GlobalPrecision.FLOAT32), reason
