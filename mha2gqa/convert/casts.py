"""The one rule for `--dtype` casts, shared by both executors (fast.py's numpy, run.py's torch): a cast
may round, but it may not turn finite values into inf (1e6 in float16) or a whole nonzero tensor into
zeros. Either is refused naming the tensor, its largest |value| and the fix.

The check costs one min/max pass over each cast tensor (no temporary arrays): the cast itself reads
and writes every value anyway.
"""

from __future__ import annotations

from mha2gqa.runtime.errors import InputError

# code -> (smallest |x| that rounds to inf, largest |x| that rounds to zero), round-to-nearest-even.
LIMITS = {
    "F16": (65520.0, 2.0**-25),
    "BF16": (3.3961775292304611e38, 2.0**-134),
    "F32": (3.4028235677973366e38, 2.0**-150),
}
NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
FIX = {"F16": "use --dtype bfloat16 (float32's range) or leave --dtype out"}


def validate_cast(name: str, low: float, high: float, source: str, target: str) -> None:
    """Refuse casting tensor `name` (finite values in [low, high], stored as `source`) to `target`."""
    if target not in LIMITS or source == target:
        return
    overflow, underflow = LIMITS[target]
    largest = max(abs(low), abs(high))
    fix = FIX.get(target, "leave --dtype out")
    if largest >= overflow:
        raise InputError(
            f"--dtype {NAMES[target]}: tensor {name} holds values up to |{largest:.4g}|, beyond {NAMES[target]}'s "
            f"range (max {_largest(target):.6g}), so the cast would write inf: {fix}"
        )
    if 0 < largest <= underflow:
        raise InputError(
            f"--dtype {NAMES[target]}: every value of tensor {name} is at most |{largest:.3g}|, below "
            f"{NAMES[target]}'s smallest ({underflow * 2:.3g}), so the cast would write all zeros: {fix}"
        )


def _largest(code: str) -> float:
    return {"F16": 65504.0, "BF16": 3.3895313892515355e38, "F32": 3.4028234663852886e38}[code]


def numpy_range(array) -> tuple[float, float]:
    """(min, max) of an array's finite values (fp16/fp32 arrays; 0, 0 when it has none)."""
    import numpy as np

    if not array.size:
        return 0.0, 0.0
    low, high = float(array.min()), float(array.max())
    if np.isfinite(low) and np.isfinite(high):
        return low, high
    finite = array[np.isfinite(array)]  # rare: the tensor already holds inf/NaN (warned about elsewhere)
    return (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)


def torch_range(tensor) -> tuple[float, float]:
    """(min, max) of a float tensor's finite values, in one pass."""
    import torch

    if not tensor.numel() or not tensor.is_floating_point():
        return 0.0, 0.0
    low, high = (float(v) for v in torch.aminmax(tensor))
    if torch.isfinite(torch.tensor([low, high])).all():
        return low, high
    finite = tensor[torch.isfinite(tensor)]
    return (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 0.0)
