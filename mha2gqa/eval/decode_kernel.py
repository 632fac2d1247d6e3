"""The grouped decode step's fused CPU kernel (decode_kernel.c): built once per machine, loaded with ctypes.

A one-token step on CPU reads each cached kv head once for its whole group and does its softmax in between,
in one loop nest per (sequence, kv head) (the C file says how). PyTorch's own kernels for this shape read K/V
at about a third of a streaming read on one core; this one is what eval's grouped path runs on CPU in
bfloat16 and float32 when it builds (decode_path.kernel_on), and the decode benchmark times it beside them.

The C file has no torch headers: the system C compiler builds it once (about 10 s of one core), for this machine's
CPU (-march=native), into ~/.cache/mha2gqa/kernels/ (MHA2GQA_KERNEL_DIR overrides), named by a hash of the
source, the compiler and the flags, so a changed source or machine builds anew. No compiler, or a failed
build: `available()` is False, `why_not()` says why, and the step runs PyTorch's kernels as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_kernel.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-shared", "-std=c11"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_DIM = 256  # the C side's limit on the head size


class _Args(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("bias", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("batch", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("group", ctypes.c_int64),
        ("tokens", ctypes.c_int64), ("dim", ctypes.c_int64),
        ("q_strides", ctypes.c_int64 * 3), ("k_strides", ctypes.c_int64 * 3), ("v_strides", ctypes.c_int64 * 3),
        ("bias_strides", ctypes.c_int64 * 4), ("out_strides", ctypes.c_int64 * 3),
        ("scale", ctypes.c_float), ("bf16", ctypes.c_int),
    ]  # fmt: skip


_STATE: dict = {}  # "lib" once loaded, or "error": why it could not be


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build_dir() -> Path:
    return Path(os.environ.get("MHA2GQA_KERNEL_DIR") or Path.home() / ".cache" / "mha2gqa" / "kernels")


def _cpu_flags() -> str:
    """This CPU's feature flags (-march=native builds for them: a home shared with another CPU builds anew)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = (SOURCE.read_text(), version, " ".join(FLAGS), platform.machine(), _cpu_flags())
    key = hashlib.sha256("\n".join(parts).encode())
    return _build_dir() / f"decode_kernel-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile to a file beside `target`, then rename: a concurrent or interrupted build never leaves half a
    library under the name that is loaded."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(done.stderr or done.stdout).strip()[-300:]}")
        os.replace(built, target)


def _load():
    if "lib" in _STATE or "error" in _STATE:
        return _STATE.get("lib")
    compiler = _compiler()
    try:
        if compiler is None:
            raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
        target = _library_path(compiler)
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
        lib.decode_attend.argtypes = [ctypes.POINTER(_Args), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.decode_attend.restype = ctypes.c_int
        _STATE["lib"] = lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        _STATE["error"] = str(error)
    return _STATE.get("lib")


def available() -> bool:
    """Whether the kernel is built (or builds now) and loads on this machine."""
    return _load() is not None


def why_not() -> str | None:
    """Why the kernel is not available (None when it is)."""
    _load()
    return _STATE.get("error")


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel runs this step: CPU tensors of one dtype it has, rows contiguous, a head size it takes."""
    tensors = (query, key, value)
    return (
        all(t.device.type == "cpu" and t.dtype == query.dtype and t.stride(-1) == 1 for t in tensors)
        and query.dtype in DTYPES
        and 1 <= query.shape[-1] <= MAX_DIM
        and available()
    )


def _bias(attn_mask: torch.Tensor | None, shape: tuple) -> torch.Tensor | None:
    """The mask as an additive float32 bias broadcast to (B, Hkv, G, T), rows contiguous."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=torch.float32).masked_fill_(attn_mask.logical_not(), float("-inf"))
    else:
        bias = attn_mask.to(torch.float32)
    if bias.stride(-1) != 1:
        bias = bias.contiguous()
    return bias.expand(shape)


def fused_attention(query, key, value, attn_mask=None, scale=None) -> torch.Tensor:
    """SDPA's result for a few query rows per kv head (`takes` must hold): query (B, Hkv, G, D), key/value
    (B, Hkv, T, D) as cached; returns (B, Hkv, G, D) in the query's dtype. Rows whose every position is masked
    give zeros. The (sequence, kv head) items are split over torch's thread count (ctypes lets go of the GIL)."""
    batch, kv_heads, group, dim = query.shape
    tokens = key.shape[2]
    out = torch.empty(batch, kv_heads, group, dim, dtype=query.dtype)
    bias = _bias(attn_mask, (batch, kv_heads, group, tokens))
    args = _Args(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), bias.data_ptr() if bias is not None else None,
        out.data_ptr(), batch, kv_heads, group, tokens, dim,
        (ctypes.c_int64 * 3)(*query.stride()[:3]), (ctypes.c_int64 * 3)(*key.stride()[:3]),
        (ctypes.c_int64 * 3)(*value.stride()[:3]),
        (ctypes.c_int64 * 4)(*(bias.stride() if bias is not None else (0, 0, 0, 0))),
        (ctypes.c_int64 * 3)(*out.stride()[:3]),
        dim**-0.5 if scale is None else scale, DTYPES[query.dtype],
    )  # fmt: skip
    items = batch * kv_heads
    workers = max(1, min(torch.get_num_threads(), items))
    bounds = [items * i // workers for i in range(workers + 1)]
    scratch = torch.empty(workers, group * tokens, dtype=torch.float32)
    lib = _load()

    def run(i: int) -> int:
        return lib.decode_attend(ctypes.byref(args), bounds[i], bounds[i + 1], scratch[i].data_ptr())

    if workers == 1:
        codes = [run(0)]
    else:
        codes = list(_pool(workers).map(run, range(workers)))
    if any(codes):
        raise ValueError(f"the decode kernel does not take head size {dim}")
    return out


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _pool(workers: int) -> ThreadPoolExecutor:
    """A thread pool per worker count, kept for the process (a step is too short to start threads in); keyed by
    the process id too, since a forked child inherits the dict but not the pool's threads."""
    key = (os.getpid(), workers)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(workers, thread_name_prefix="decode-kernel")
    return _POOLS[key]
