"""The plan's executor for the plain methods (mean, first) without torch: numpy on the safetensors bytes.

A plain conversion is I/O plus a mean over a few rows, and importing torch cost more than the whole
of it (5 s of a 15 s conversion of a 2 GB checkpoint). Where this executor runs, its output is
byte-identical to run.py's torch executor (tests/test_convert_fast.py checks every file):
- bfloat16 is held as its uint16 bit pattern; bf16 -> fp32 is a 16-bit shift, fp32 -> bf16 is
  round-to-nearest-even on the bits, fp32 -> fp16 numpy's (also nearest even); a tensor holding NaN is
  converted by torch itself (see _torch_cast: torch's NaN bits depend on where the NaN sits);
- mean sums fp32 slices in head order and divides by r in fp32, as methods.group_mean does;
- a pooled tensor goes to its source dtype, then to --dtype, the same two roundings as run.py.
It is used only where that holds (request_refusal and plan_refusal say why not otherwise): method mean
or first, contiguous groups, no calibration or refine, a layout of layouts.LAYOUTS, attention tensors in
F32/F16/BF16, and --dtype casts only between those. random draws from torch's generator and mean-norm
reduces in torch's summation order, so both stay on torch.
The checks before the plan (header validation, shapes) are prepare.py's, the destination, room and lock
run.py's, shared by both executors.
"""

from __future__ import annotations

import os
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mha2gqa.architecture.layouts import LAYOUTS
from mha2gqa.convert.casts import numpy_range, validate_cast
from mha2gqa.convert.options import ConvertOptions, Grouping, Method
from mha2gqa.convert.plan import Step, TensorPlan
from mha2gqa.convert.roles import KV_ROLES, pack, unpack
from mha2gqa.files.checkpoint import SafetensorsCheckpoint, ShardedWriter
from mha2gqa.runtime.errors import WeightWarning
from mha2gqa.runtime.progress import progress_bar

NUMPY_METHODS = (Method.MEAN, Method.FIRST)  # the methods this executor writes byte-identically
CODES = ("F32", "F16", "BF16")
# How each code is held: bfloat16 as its bits (numpy has no bfloat16).
_STORED = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_CODE_OF = {dtype: code for code, dtype in _STORED.items()}
# Set to 1 to convert with torch even where this executor applies (a check, or a way round a bug).
TORCH_ENV = "MHA2GQA_CONVERT_WITH_TORCH"


def request_refusal(options: ConvertOptions, config: dict, calibrated: bool | None = None) -> str | None:
    """Why the request itself needs torch, or None. calibrated: calibration data or statistics are given
    (default: options.calibration is set)."""
    if os.environ.get(TORCH_ENV, "0") not in ("", "0"):
        return f"{TORCH_ENV} is set"
    if options.method not in NUMPY_METHODS:
        return f"method {options.method} ({', '.join(NUMPY_METHODS)} run without torch)"
    if calibrated is None:
        calibrated = options.calibration is not None
    if calibrated or options.refine is not None or options.grouping != Grouping.CONTIGUOUS:
        return "calibration, refine or similarity grouping"
    if options.keep_retrieval_heads:
        return "--keep-retrieval-heads scores SRC's heads"
    if config.get("model_type") not in LAYOUTS:
        return f"model_type {config.get('model_type')!r} has no explicit layout (generic or retargeted)"
    return None


def plan_refusal(plan: TensorPlan, tensors: dict) -> str | None:
    """Why the plan's dtypes need torch, or None: every pooled tensor, and every cast, in F32/F16/BF16."""
    for step in plan.steps:
        if step.transpose:
            return f"{step.sources['tensor']} is transposed"
        if step.is_transform:
            other = next((name for name in step.sources.values() if tensors[name].dtype not in CODES), None)
            if other:
                return f"{other} is {tensors[other].dtype}"
        elif tensors[step.sources["tensor"]].dtype not in (step.outputs[0].dtype, *CODES):
            return f"{step.sources['tensor']} would be cast from {tensors[step.sources['tensor']].dtype}"
    return None


AHEAD = 2  # steps computed ahead of the writer: bounds memory at a few layers' pooled K/V


def write_tensors(
    checkpoint: SafetensorsCheckpoint, plan: TensorPlan, out_dir: Path, shard_bytes: int, progress: bool
) -> None:
    """Every step of the plan into DST's shards, in order: unchanged tensors copied inside the kernel by
    this thread while a worker thread reads and pools the next layers (both release the GIL), so the
    pooling hides behind the copying. Only this thread writes, and warnings are raised here, in order."""
    copies = plan.copies(checkpoint.tensors)
    bar = progress_bar(plan.bytes_out, "convert", progress, unit="B", unit_scale=True)
    to_compute = deque(step for step in plan.steps if step.outputs[0].name not in copies)
    worker, pending = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mha2gqa-pool"), deque()
    scratch = _Scratch()  # used by the one worker thread only
    with ShardedWriter(out_dir, plan.output_tensors(), shard_bytes, copies) as writer:
        try:
            for step in plan.steps:
                while to_compute and len(pending) < AHEAD:
                    pending.append(worker.submit(_compute, checkpoint, to_compute.popleft(), plan, scratch))
                if step.outputs[0].name in copies:
                    writer.copy_bytes(step.outputs[0].name, checkpoint.tensors[step.sources["tensor"]])
                else:
                    arrays, non_finite = pending.popleft().result()
                    for role, count in non_finite:
                        warn_non_finite(count, step.sources, role, step.layer)
                    for out, array in zip(step.outputs, arrays):
                        writer.write_array(out.name, array)
                bar.update(sum(out.nbytes for out in step.outputs))
        finally:  # the worker only reads and pools: it stops before the writer closes or is discarded
            worker.shutdown(wait=True, cancel_futures=True)  # on Ctrl-C: the running step finishes (under a second)
    bar.close()


def _load(checkpoint: SafetensorsCheckpoint, name: str, scratch: _Scratch | None = None, key: str = "") -> np.ndarray:
    """A stored tensor as an array: in memory of its own, or in scratch[key] (valid until its next use)."""
    info = checkpoint.tensors[name]
    if scratch is None:
        return np.frombuffer(checkpoint.read_bytes(name), dtype=_STORED[info.dtype]).reshape(info.shape)
    array = scratch.array(("read", key), info.shape, _STORED[info.dtype])
    checkpoint.read_into(name, array)
    return array


class _Scratch(dict):
    """The worker thread's reused buffers, by key: an array of tens of MB made afresh costs a page fault
    per 4 KiB every time (glibc maps and unmaps each one), which was most of the pooling's time."""

    def array(self, key, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if key not in self or self[key].nbytes < nbytes:
            self[key] = np.empty(nbytes, np.uint8)
        return self[key][:nbytes].view(dtype).reshape(shape)

    def holds(self, array: np.ndarray) -> bool:
        return any(np.may_share_memory(array, buffer) for buffer in self.values())


def _compute(checkpoint: SafetensorsCheckpoint, step: Step, plan: TensorPlan, scratch: _Scratch) -> tuple[list, list]:
    """A step's output arrays (in step.outputs order) and its kv roles' non-finite counts, (role, count)."""
    with np.errstate(all="ignore"):  # inf/NaN/overflow as torch gives them; the weights' are warned about by name
        if not step.is_transform:  # a cast (--dtype)
            out = step.outputs[0]
            return [cast(_load(checkpoint, step.sources["tensor"]), out.dtype, out.name)], []
        return _pool_layer(checkpoint, step, plan, scratch)


def _pool_layer(
    checkpoint: SafetensorsCheckpoint, step: Step, plan: TensorPlan, scratch: _Scratch
) -> tuple[list, list]:
    """One layer's attention tensors: read, pool the kv roles (one layer in memory at a time)."""
    shape, groups = plan.shape, plan.count(step.layer)
    roles = unpack({role: _load(checkpoint, name, scratch, role) for role, name in step.sources.items()}, shape)
    non_finite = []
    for role in KV_ROLES:
        if role in roles:
            source = roles[role]
            pooled = pool(source, shape.kv_heads, groups, plan.method, scratch)  # (G*hd, *rest) fp32
            if role in FINITE_SCANNED_ROLES and (plan.method == Method.FIRST or not np.isfinite(pooled).all()):
                non_finite.append((role, _non_finite(source)))
            roles[role] = cast(pooled, _CODE_OF[source.dtype])
            if scratch.holds(roles[role]):  # fp32 stays fp32: keep it past the next role's pooling
                roles[role] = roles[role].copy()
    names = {step.sources[role]: array for role, array in pack(roles, list(step.sources), groups).items()}
    outputs = [cast(names[out.name], out.dtype, out.name) for out in step.outputs]
    return [array.copy() if scratch.holds(array) else array for array in outputs], non_finite  # the writer's now


# The kv roles whose non-finite values are warned about (both executors): projections, not norms.
FINITE_SCANNED_ROLES = ("k.weight", "k.bias", "v.weight", "v.bias")


def pool(rows: np.ndarray, kv_heads: int, groups: int, method: str, scratch: _Scratch | None = None) -> np.ndarray:
    """(n_kv*hd, *rest) -> (G*hd, *rest) in fp32: methods.group_mean's order of operations (fp32 sum of
    slices in head order, then / r), or the first head of each group. With `scratch`, the result lives
    in it (valid until the next call)."""
    grouped = rows.reshape(groups, kv_heads // groups, -1, *rows.shape[1:])  # (G, r, hd, *rest)
    head_shape = (groups, *grouped.shape[2:])
    buffer = scratch.array if scratch is not None else (lambda key, shape, dtype: np.empty(shape, dtype))
    total = _into_float32(grouped[:, 0], buffer("total", head_shape, np.float32))  # never adds into the source
    if method == Method.MEAN:
        head = buffer("head", head_shape, np.float32)
        for j in range(1, grouped.shape[1]):
            total += _into_float32(grouped[:, j], head)
        total /= np.float32(grouped.shape[1])
    return total.reshape(-1, *rows.shape[1:])


def _into_float32(array: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`array` (any stored dtype) written exactly into the fp32 array `out`, in one pass."""
    if array.dtype == _STORED["BF16"]:
        np.left_shift(array, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, array)
    return out


def to_float32(array: np.ndarray) -> np.ndarray:
    """A new fp32 array; exact: fp16 and bf16 (its bits shifted up) are subsets of fp32."""
    return _into_float32(array, np.empty(array.shape, np.float32))


def cast(array: np.ndarray, code: str, name: str | None = None) -> np.ndarray:
    """A stored array (or an fp32 result) to `code`, as torch's .to() writes it: one rounding to nearest
    even, through fp32 (exact on the way up). With `name` (a tensor of the output), casts.validate_cast's
    rule applies: no overflow to inf, no whole tensor flushed to zero."""
    if _CODE_OF[array.dtype] == code:
        return array
    wide = array if array.dtype == _STORED["F32"] else to_float32(array)
    if name is not None:
        validate_cast(name, *numpy_range(wide), _CODE_OF[array.dtype], code)
    if code == "F32":
        return wide
    if np.isnan(wide).any():
        return _torch_cast(array, code)
    if code == "F16":
        return wide.astype(_STORED["F16"])
    bits = wide.view(np.uint32)  # bf16: round the low 16 bits to nearest even
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def _torch_cast(array: np.ndarray, code: str) -> np.ndarray:
    """NaN is the one value whose bits torch writes unevenly: its vectorised loop and its scalar tail
    (whose split depends on the tensor's length and the thread count) give bf16 0xFFFF or 0x7FC0 and drop
    or keep fp16 payloads. A tensor holding NaN is rare (and warned about), so torch converts it itself,
    the same tensor in the same shape as the torch executor converts: the bytes then match."""
    import torch

    from mha2gqa.files.checkpoint import torch_dtypes

    dtypes = torch_dtypes()
    as_int = {"BF16": torch.uint16, "F16": torch.float16, "F32": torch.float32}
    tensor = torch.from_numpy(np.ascontiguousarray(array)).view(dtypes[_CODE_OF[array.dtype]])
    return tensor.to(dtypes[code]).view(as_int[code]).numpy().view(_STORED[code])


def _non_finite(array: np.ndarray) -> int:
    if array.dtype == _STORED["BF16"]:  # exponent bits all ones: inf or NaN
        return int(np.count_nonzero((array & np.uint16(0x7F80)) == np.uint16(0x7F80)))
    return int(array.size - np.count_nonzero(np.isfinite(array)))


def warn_non_finite(count: int, sources: dict, role: str, layer: int) -> None:
    """Pooling spreads a NaN/inf in one kv head to its whole group: name the tensor, convert anyway."""
    if not count:
        return
    name = sources.get(role) or f"{sources.get('qkv.' + role.split('.')[1])} ({role[0]} rows)"
    warnings.warn(
        f"{name} has {count} non-finite values (NaN/inf): the merged kv heads of layer {layer} carry "
        "them; check the source checkpoint",
        WeightWarning,
        stacklevel=3,
    )
