"""What a command may choose from the machine it runs on, read once, when it plans (never while it executes).

A choice made from the machine must not move with the moment: `--refine-global-precision auto` once timed a
probe against a 2.0x threshold, and on an AMD EPYC with AVX512-BF16 the probe reads 2.2-2.43x (five readings,
2 threads, load 0.3), so a busy moment could flip the same command to float32 and other bytes (issue 55). So:

- bfloat16 products: from the CPU's feature flags, which do not move. Native bfloat16 (x86 `amx_bf16`, Sapphire
  Rapids and later, whose products measured 5.7-6.8x float32's; x86 `avx512_bf16`, the EPYC above, 2.2-2.4x;
  arm64 `bf16`) -> bfloat16 pays; none of them -> bfloat16 is emulated, slower than float32. Only where the
  flags cannot be read (no /proc/cpuinfo: not Linux) a timed probe decides, with a margin: bfloat16 only at
  BF16_PROBE_MARGIN x or more, so a machine reading near 2x stays float32 on a busy moment and a quiet one.
- the device: a CUDA GPU when torch can use one, else the CPU; torch is imported for the question only where an
  NVIDIA driver is present, so a plan on a CPU machine stays torch-free.

The caller records what was decided as the explicit value (convert: mha2gqa.json, the card's Reproduce line and
convert.yaml), so a replay on another machine makes the same bytes.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})  # x86 AMX, x86 AVX512-BF16, arm64 FEAT_BF16
BF16_PROBE_MARGIN = 3.0  # flags unknown: bfloat16 only where its products time this much faster (not near 2x)
PROBE_SHAPE = (256, 576, 1536)  # rows x hidden x MLP width: SmolLM2's, the model the choice was measured on
PROBE_ROUNDS = 5


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags (x86 `flags`, arm64 `Features` of /proc/cpuinfo), or None where they cannot be
    read."""
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def native_bf16() -> bool | None:
    """Whether this CPU multiplies bfloat16 in hardware (None: its flags cannot be read)."""
    flags = cpu_flags()
    return None if flags is None else bool(flags & NATIVE_BF16_FLAGS)


def bf16_pays_on_cpu() -> tuple[bool, str]:
    """Whether bfloat16 products pay on this CPU, and why, in words: from its flags; where they cannot be read,
    from a timed probe with a margin (module docstring)."""
    native = native_bf16()
    if native is not None:
        found = sorted(cpu_flags() & NATIVE_BF16_FLAGS)
        return native, f"this CPU {'has ' + ', '.join(found) if native else 'has no native bfloat16 products'}"
    speedup = bf16_speedup()
    return (
        speedup >= BF16_PROBE_MARGIN,
        f"bfloat16 products timed {speedup:.2g}x float32's (bfloat16 from {BF16_PROBE_MARGIN:g}x)",
    )


@functools.cache
def bf16_speedup() -> float:
    """How many times faster this CPU multiplies in bfloat16 than in float32, with torch's current threads: the
    median of PROBE_ROUNDS timed products of PROBE_SHAPE each. Asked only where the CPU's flags are unknown."""
    import torch

    rows, inner, outer = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(rows, inner, generator=generator), torch.randn(inner, outer, generator=generator)
    return _median_seconds(left, right) / _median_seconds(left.bfloat16(), right.bfloat16())


def _median_seconds(left, right) -> float:
    left @ right  # the first call pays for the kernel's setup
    rounds = []
    for _ in range(PROBE_ROUNDS):
        started = time.perf_counter()
        for _ in range(4):
            left @ right
        rounds.append(time.perf_counter() - started)
    return statistics.median(rounds)


def cuda_visible() -> bool:
    """Whether a GPU may be there, asked without importing torch: an NVIDIA driver is present and
    CUDA_VISIBLE_DEVICES does not hide every device."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", None) not in ("", "-1") and NVIDIA_DRIVER.exists()


def torch_device() -> str:
    """Where torch work runs: "cuda" when torch can use a GPU, else "cpu". torch is imported only where an NVIDIA
    driver is present and CUDA_VISIBLE_DEVICES hides no device, so a CPU machine answers without it."""
    if not cuda_visible():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
