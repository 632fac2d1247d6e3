"""Safetensors checkpoints on disk: a lazy sharded reader, a streaming sharded writer, and an atomic
output directory.

Only the file format is used here (8-byte little-endian header length, a JSON header, raw bytes), so a
tensor that passes through unchanged is copied byte for byte without entering Python, and a tensor that
is transformed is read alone into memory it owns. Memory stays flat whatever the model size.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.errors import InputError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
_COPY_CHUNK = 64 << 20  # bytes per copy_file_range call: bounded kernel work per step


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: [start, end) are absolute offsets in `file`."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a .safetensors file and the offset where its data begins."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise InputError(f"{path} is not a safetensors file (too short): re-save the checkpoint")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, 100 << 20):
            raise InputError(f"{path} has a corrupt safetensors header (length {length}): re-save the checkpoint")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"{path} has a corrupt safetensors header ({err}): re-save the checkpoint") from err
    return header, 8 + length


def _tensor_infos(path: Path) -> list[TensorInfo]:
    header, data_start = read_header(path)
    size = path.stat().st_size
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = entry["dtype"]
        if dtype not in DTYPES:
            raise InputError(f"{path}: tensor {name} has dtype {dtype}, which mha2gqa cannot read")
        numel = 1
        for dim in entry["shape"]:
            numel *= dim
        if end - begin != numel * DTYPES[dtype].itemsize or data_start + end > size:
            raise InputError(f"{path}: tensor {name} has inconsistent offsets: the file is truncated or corrupt")
        infos.append(TensorInfo(name, dtype, tuple(entry["shape"]), path, data_start + begin, data_start + end))
    return sorted(infos, key=lambda info: info.start)  # file order: sequential reads


class SafetensorsCheckpoint:
    """All tensors of a model directory (one file or an indexed set of shards), read lazily."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self._weight_files():
            for info in _tensor_infos(path):
                self.tensors[info.name] = info

    def _weight_files(self) -> list[Path]:
        index = self.model_dir / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [self.model_dir / name for name in dict.fromkeys(weight_map.values())]
            missing = [str(f.name) for f in files if not f.is_file()]
            if missing:
                raise InputError(f"{index} names missing shards {missing}: download the full checkpoint")
            return files
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise InputError(
                f"{self.model_dir} holds no .safetensors weights: mha2gqa never loads pickled .bin/.pt files; "
                "convert them once with transformers (from_pretrained(SRC).save_pretrained(NEW_DIR)) and pass NEW_DIR"
            )
        return files

    def load(self, name: str) -> torch.Tensor:
        """One tensor, in memory that it owns (no mmap, no pickle)."""
        info = self.tensors[name]
        buffer = bytearray(info.nbytes)
        with open(info.file, "rb", buffering=0) as f:
            f.seek(info.start)
            view = memoryview(buffer)
            while view:
                view = view[f.readinto(view):]
        if not buffer:
            return torch.empty(info.shape, dtype=DTYPES[info.dtype])
        return torch.frombuffer(buffer, dtype=DTYPES[info.dtype]).reshape(info.shape)


@dataclass(frozen=True)
class OutputTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * DTYPES[self.dtype].itemsize


def assign_shards(tensors: list[OutputTensor], max_shard_bytes: int) -> list[list[OutputTensor]]:
    """Greedy, in write order: a new shard starts when the next tensor would overflow the current one."""
    shards: list[list[OutputTensor]] = [[]]
    used = 0
    for tensor in tensors:
        if shards[-1] and used + tensor.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(tensor)
        used += tensor.nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class ShardedWriter:
    """Writes tensors in a fixed order straight into their shards: each shard's header is known up front
    (every output name, dtype and shape comes from the plan), so no tensor is held back in memory."""

    def __init__(self, out_dir: Path, tensors: list[OutputTensor], max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        self.shards = assign_shards(tensors, max_shard_bytes)
        self.file_names = shard_file_names(len(self.shards))
        self._pending = [(i, t) for i, shard in enumerate(self.shards) for t in shard]
        self._position = 0
        self._shard_index = -1
        self._file = None

    def _next(self, name: str, nbytes: int) -> None:
        if self._position >= len(self._pending):
            raise RuntimeError(f"writer got {name} after the last planned tensor")
        shard_index, expected = self._pending[self._position]
        if expected.name != name or expected.nbytes != nbytes:
            raise RuntimeError(f"writer expected {expected.name} ({expected.nbytes} B), got {name} ({nbytes} B)")
        self._position += 1
        if shard_index != self._shard_index:
            self._open_shard(shard_index)

    def _open_shard(self, index: int) -> None:
        if self._file is not None:
            self._file.close()
        self._shard_index = index
        self._file = open(self.out_dir / self.file_names[index], "wb", buffering=0)
        self._file.write(_header_bytes(self.shards[index]))

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        self._next(name, tensor.numel() * tensor.element_size())
        if tensor.numel():
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            self._file.write(memoryview(data))

    def copy_bytes(self, name: str, source: TensorInfo) -> None:
        """Copy a tensor unchanged, file to file, inside the kernel where the platform allows."""
        self._next(name, source.nbytes)
        with open(source.file, "rb", buffering=0) as src:
            offset, remaining = source.start, source.nbytes
            while remaining:
                copied = _copy_range(src, self._file, offset, min(remaining, _COPY_CHUNK))
                offset += copied
                remaining -= copied

    def close(self) -> None:
        if self._position != len(self._pending):
            raise RuntimeError(f"writer closed after {self._position} of {len(self._pending)} tensors")
        if self._file is not None:
            self._file.close()
        if len(self.shards) > 1:
            weight_map = {t.name: self.file_names[i] for i, t in self._pending}
            total = sum(t.nbytes for _, t in self._pending)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _header_bytes(tensors: list[OutputTensor]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data must start 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _copy_range(src, dst, offset: int, count: int) -> int:
    if hasattr(os, "copy_file_range"):
        try:
            copied = os.copy_file_range(src.fileno(), dst.fileno(), count, offset)
            if copied > 0:
                return copied
        except OSError:  # e.g. across some filesystems: fall back to a user-space copy
            pass
    src.seek(offset)
    chunk = src.read(count)
    dst.write(chunk)
    return len(chunk)


@contextmanager
def atomic_directory(dst: Path):
    """Yield a temporary directory beside `dst`; on success it becomes `dst` (replacing an old one),
    on any failure it vanishes. An interrupted run never leaves a half-written `dst`."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old)
    else:
        os.rename(tmp, dst)
