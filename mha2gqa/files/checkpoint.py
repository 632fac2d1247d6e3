"""Safetensors checkpoints on disk: a lazy sharded reader, a streaming sharded writer, and an atomic
output directory.

Only the file format is used here (8-byte little-endian header length, a JSON header, raw bytes), so a
tensor that passes through unchanged is copied byte for byte without entering Python, and a tensor that
is transformed is read alone into memory it owns. Memory stays flat whatever the model size.
"""

from __future__ import annotations

import functools
import os
import shutil
import struct
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mha2gqa.files import jsontext
from mha2gqa.files.reading import open_regular, parse_json, read_exactly, read_json, short_read
from mha2gqa.files.writing import beside, claim, make_parents, remove_dead, swap_in, validate_room
from mha2gqa.runtime.errors import InputError, is_user_fault, user_file_error

if TYPE_CHECKING:  # annotations only: reading headers must not import torch
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Bytes per element of every safetensors dtype code we read. Headers need only this; the torch dtypes
# (DTYPES) are made on first use, so reading a checkpoint's shapes (`inspect`) never imports torch.
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # what --dtype casts


@functools.cache
def torch_dtypes() -> dict:
    """safetensors dtype code -> torch dtype."""
    import torch

    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }


def __getattr__(name: str):
    """DTYPES (code -> torch dtype), made when first imported."""
    if name == "DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
_COPY_CHUNK = 64 << 20  # bytes per copy_file_range call: bounded kernel work per step
# copy_file_range on ext4 (a 0.4 GB shard, page cache warm) took 0.10 s when source and destination sat
# at the same offset within a page and 0.24 s otherwise; shard headers are padded to match (_page_phase).
_PAGE = 4096


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


def read_header(path: Path, root: Path | None = None) -> tuple[dict, int]:
    """The JSON header of a .safetensors file (a JSON object) and the offset where its data begins.
    The file must be a regular file (inside model directory `root` when given)."""
    fix = "re-save the checkpoint"
    with open_regular(path, root) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise InputError(f"{path} is not a safetensors file (too short): {fix}")
        (length,) = struct.unpack("<Q", read_exactly(f, 8, path))
        if length > size - 8:
            raise InputError(
                f"{path} has a corrupt safetensors header (length {length:,} > the file's {size - 8:,} bytes): {fix}"
            )
        if length > MAX_HEADER_BYTES:
            raise InputError(
                f"{path} has a safetensors header of {length:,} bytes, over the format's limit of "
                f"{MAX_HEADER_BYTES:,} (the safetensors library refuses it too): {fix}"
            )
        header = parse_json(read_exactly(f, length, path, "its header"), f"{path}'s safetensors header", fix)
    if not isinstance(header, dict):
        raise InputError(
            f"{path} has a safetensors header that is a JSON {type(header).__name__}, not an object: {fix}"
        )
    return header, 8 + length


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_infos(path: Path, root: Path | None = None) -> list[TensorInfo]:
    """Every tensor's place in `path`, checked as the safetensors library checks it: known dtype,
    shape and offsets of non-negative integers, byte count matching the shape, and ranges that tile
    the data exactly (no overlap, no gap, nothing missing or left over)."""
    header, data_start = read_header(path, root)
    data_size = path.stat().st_size - data_start

    def corrupt(name: str, what: str) -> InputError:
        return InputError(f"{path}: tensor {name!r} {what}: the file is corrupt; re-save the checkpoint")

    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise corrupt(name, f"has a header entry that is a JSON {type(entry).__name__}, not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise InputError(
                f"{path}: tensor {name!r} has dtype {dtype!r}, which mha2gqa cannot read "
                f"(readable: {', '.join(ITEMSIZE)})"
            )
        if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
            raise corrupt(name, f"has shape {shape!r} (must be a list of non-negative integers)")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(map(_is_count, offsets))
            or offsets[0] > offsets[1]
        ):
            raise corrupt(name, f"has data_offsets {offsets!r} (must be [begin, end], 0 <= begin <= end)")
        numel = 1
        for dim in shape:
            numel *= dim
        begin, end = offsets
        if end - begin != numel * ITEMSIZE[dtype]:
            raise corrupt(name, f"has {end - begin} bytes for shape {shape} of {dtype}")
        infos.append(TensorInfo(name, dtype, tuple(shape), path, data_start + begin, data_start + end))
    infos.sort(key=lambda info: (info.start, info.end))  # file order: sequential reads
    expected = data_start
    for info in infos:
        if info.start != expected:
            what = "overlaps the tensor before it" if info.start < expected else "leaves a gap before it"
            raise corrupt(info.name, f"has a byte range that {what}")
        expected = info.end
    if expected - data_start != data_size:
        raise InputError(
            f"{path} holds {data_size} data bytes but its header describes {expected - data_start}: "
            "the file is truncated or corrupt; download or re-save it"
        )
    return infos


def _index_shards(index: Path) -> dict[str, str]:
    """The weight_map of a shard index, checked: a JSON object whose every value names a file inside
    the model directory. Names are checked as written (relative, no `..`), not after resolving links,
    so a hub cache's snapshot links to its blobs stay readable while `../../x` or `/etc/x` are refused."""
    found = read_json(index, "download or re-save the checkpoint", root=index.parent)
    if not isinstance(found, dict):
        raise InputError(f"{index} is not a JSON object with a weight_map: download or re-save the checkpoint")
    weight_map = found.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(
            f"{index} has no weight_map object (tensor name -> shard file): download or re-save the checkpoint"
        )
    for name, shard in weight_map.items():
        parts = Path(shard).parts if isinstance(shard, str) else ()
        if not parts or Path(shard).is_absolute() or ".." in parts or "\0" in shard:
            raise InputError(
                f"{index} maps {name!r} to {shard!r}, which is not a file inside {index.parent}: "
                "shard names must be relative paths within the model directory; fix the index"
            )
    return weight_map


class SafetensorsCheckpoint:
    """All tensors of a model directory (one file or an indexed set of shards), read lazily."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self._weight_files():
            for info in _tensor_infos(path, self.model_dir):
                self.tensors[info.name] = info

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}

    def _weight_files(self) -> list[Path]:
        index = self.model_dir / INDEX_NAME
        if os.path.lexists(index):  # a FIFO or a link out of SRC is refused by the reader, not skipped
            files = [self.model_dir / name for name in dict.fromkeys(_index_shards(index).values())]
            missing = [str(f.name) for f in files if not f.exists()]
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

    def read_bytes(self, name: str) -> bytearray:
        """One tensor's raw bytes, in memory that it owns (no mmap, no pickle)."""
        buffer = bytearray(self.tensors[name].nbytes)
        self.read_into(name, buffer)
        return buffer

    def read_into(self, name: str, buffer) -> None:
        """One tensor's raw bytes into `buffer` (writable, exactly its size): a caller may reuse one."""
        info = self.tensors[name]
        with open(info.file, "rb", buffering=0) as f:
            f.seek(info.start)
            view = memoryview(buffer).cast("B")
            while view:
                count = f.readinto(view)
                if not count:
                    raise short_read(info.file, f"tensor {name!r}")
                view = view[count:]

    def load(self, name: str) -> torch.Tensor:
        """One tensor as torch, in memory that it owns."""
        info, buffer = self.tensors[name], self.read_bytes(name)
        import torch

        dtype = torch_dtypes()[info.dtype]
        if not buffer:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(info.shape)


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
        return numel * ITEMSIZE[self.dtype]


def assign_shards(
    tensors: list[OutputTensor], max_shard_bytes: int, copied_from: dict[str, TensorInfo] | None = None
) -> list[list[OutputTensor]]:
    """Greedy, in write order: a new shard starts when the next tensor would overflow the current one, or
    when it is copied from another source file than the copies already in it (copied_from: output name ->
    source tensor). Within one shard every tensor's place is fixed by the header's length, so only the
    copies of one source file can all keep their offset within a page, and copy_file_range moved
    misaligned bytes at 0.6x the speed of aligned ones (ext4, page cache warm)."""
    copied_from = copied_from or {}
    shards: list[list[OutputTensor]] = [[]]
    used, origin = 0, None
    for tensor in tensors:
        source = copied_from.get(tensor.name)
        other_file = source is not None and origin is not None and source.file != origin
        if shards[-1] and (used + tensor.nbytes > max_shard_bytes or other_file):
            shards.append([])
            used, origin = 0, None
        shards[-1].append(tensor)
        used += tensor.nbytes
        origin = source.file if source is not None else origin
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class ShardedWriter:
    """Writes tensors in a fixed order straight into their shards: each shard's header is known up front
    (every output name, dtype and shape comes from the plan), so no tensor is held back in memory."""

    def __init__(
        self,
        out_dir: Path,
        tensors: list[OutputTensor],
        max_shard_bytes: int,
        copied_from: dict[str, TensorInfo] | None = None,
    ):
        """copied_from: the source tensor of each output that copy_bytes will copy (Plan.copies): shards hold
        the copies of one source file each, and each shard's header is padded so that those bytes land at
        their source's offset within a page."""
        self.out_dir = Path(out_dir)
        self._copied_from = copied_from or {}
        self.shards = assign_shards(tensors, max_shard_bytes, self._copied_from)
        self.file_names = shard_file_names(len(self.shards))
        self._pending = [(i, t) for i, shard in enumerate(self.shards) for t in shard]
        self._position = 0
        self._shard_index = -1
        self._file = None
        self._run: tuple[Path, int, int] | None = None  # source bytes [start, end) of file still to copy

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
            self._copy_run()
            self._file.close()
        self._shard_index = index
        self._file = open(self.out_dir / self.file_names[index], "wb", buffering=0)
        self._file.write(_header_bytes(self.shards[index], self._page_phase(self.shards[index])))

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor's bytes, from any device (refine on a GPU hands over CUDA tensors)."""
        self.write_array(name, tensor.detach().cpu().contiguous().reshape(-1).view(torch_dtypes()["U8"]).numpy())

    def write_array(self, name: str, array) -> None:
        """A numpy array's bytes, in C order (the torch-free executor writes these directly)."""
        self._next(name, array.nbytes)
        self._copy_run()
        if array.nbytes:
            self._file.write(memoryview(array.reshape(-1) if array.flags.c_contiguous else array.copy().reshape(-1)))

    def copy_bytes(self, name: str, source: TensorInfo) -> None:
        """Copy a tensor unchanged, file to file, inside the kernel where the platform allows. Tensors that
        lie back to back in one source file go in one copy (made before anything else is written): on ext4
        (Linux 6.18) a copy_file_range of a few KB, such as a norm's weight, left every later copy into that
        file at 0.7x the speed per CPU second."""
        self._next(name, source.nbytes)
        run = self._run
        if run is not None and run[0] == source.file and run[2] == source.start:
            self._run = (run[0], run[1], source.end)
        else:
            self._copy_run()
            self._run = (source.file, source.start, source.end)

    def _copy_run(self) -> None:
        if self._run is None:
            return
        path, offset, end = self._run
        self._run = None
        with open(path, "rb", buffering=0) as src:
            while offset < end:
                copied = _copy_range(src, self._file, offset, min(end - offset, _COPY_CHUNK))
                if not copied:  # the source shrank since its header was read: never an end, never a spin
                    raise short_read(path, "the tensors its header lists")
                offset += copied

    def _page_phase(self, shard: list[OutputTensor]) -> int | None:
        """Where in a page this shard's data should start so that most copied bytes keep their source's
        offset within a page (by bytes; None when nothing is copied)."""
        votes: dict[int, int] = {}
        position = 0
        for tensor in shard:
            source = self._copied_from.get(tensor.name)
            start = source.start if source is not None else None
            if start is not None and (start - position) % 8 == 0:
                phase = (start - position) % _PAGE
                votes[phase] = votes.get(phase, 0) + tensor.nbytes
            position += tensor.nbytes
        return max(votes, key=votes.get) if votes else None

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, kind, error, trace) -> None:
        """The block's end closes the writer; any failure in it (a refused cast, a short read, Ctrl-C) discards
        it instead, so no shard is left open, and the failure goes on."""
        if kind is None:
            self.close()
        else:
            self.discard()

    def discard(self) -> None:
        """After a failure: close the open shard, copy nothing more (the caller removes the partial directory)."""
        self._run = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._position != len(self._pending):
            raise RuntimeError(f"writer closed after {self._position} of {len(self._pending)} tensors")
        if self._file is not None:
            self._copy_run()
            self._file.close()
        if len(self.shards) > 1:
            weight_map = {t.name: self.file_names[i] for i, t in self._pending}
            total = sum(t.nbytes for _, t in self._pending)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out_dir / INDEX_NAME).write_text(jsontext.dumps(index, indent=2) + "\n")


def _header_bytes(tensors: list[OutputTensor], data_phase: int | None = None) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = jsontext.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data must start 8-byte aligned
    if data_phase is not None:  # and at data_phase within a page: JSON allows trailing spaces
        raw += b" " * ((data_phase - 8 - len(raw)) % _PAGE)
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


def validate_destination(dst: Path, replace: bool) -> None:
    """Refuse a DST that cannot be replaced safely: no name of its own ('.', '..', '/'), a symbolic
    link (the swap would replace the link, not what it points to), a file, or a non-empty directory
    without `replace`."""
    if dst.name in ("", ".", ".."):
        raise InputError(
            f"DST {str(dst)!r} names the current, a parent or the root directory: pass a new "
            "directory path, e.g. ./model-gqa"
        )
    if dst.is_symlink():
        raise InputError(
            f"DST {dst} is a symbolic link (to {os.readlink(dst)}): pass the directory it points to, or remove the link"
        )
    if dst.exists() and not dst.is_dir():
        raise InputError(f"DST {dst} is a file: choose a directory path")
    if dst.is_dir() and any(dst.iterdir()) and not replace:
        raise InputError(f"DST {dst} exists and is not empty: choose a new path or pass --force to replace it")


@contextmanager
def atomic_directory(dst: Path, replace: bool = False, needed_bytes: int = 0):
    """Yield a temporary directory `.DST.partial-PID` beside `dst`; on success it becomes `dst`, on
    any failure (an exception, Ctrl-C, or SIGTERM/SIGHUP under errors.signals_as_interrupts) it
    vanishes, with any parent directories this call created. Before yielding, checked in this order:
    - claim: an exclusive lock on `.DST.lock` (flock, released by the kernel if the process dies), so
      a second run writing the same `dst` is refused rather than silently replacing the first;
    - `dst` itself (validate_destination), now that no other run can change it;
    - debris: partial directories of killed runs (kill -9, power loss) whose PID is gone are removed;
    - room: the filesystem must be writable and hold `needed_bytes` more.
    With `replace`, an existing `dst` is swapped with renameat2(RENAME_EXCHANGE) where the platform has
    it, so at every instant `dst` is the old or the new directory, never missing."""
    dst = Path(dst)
    validate_destination(dst, replace)
    created = make_parents(dst.parent, f"DST {dst}")
    try:
        with claim(dst, f"DST {dst}"):
            validate_destination(dst, replace)
            remove_dead(dst.parent, f"{beside(dst)}.partial-")
            validate_room(dst.parent, needed_bytes, f"DST {dst}")
            tmp = dst.parent / f"{beside(dst)}.partial-{os.getpid()}"
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                yield tmp
                swap_in(tmp, dst, replace)
            except BaseException as err:
                shutil.rmtree(tmp, ignore_errors=True)
                if is_user_fault(err) and (err.filename is None or str(tmp) in os.fsdecode(err.filename)):
                    # a full or read-only disk under DST: name DST, not the temporary file that is gone
                    raise user_file_error(OSError(err.errno, err.strerror), dst) from err
                raise
    except BaseException:
        for parent in reversed(created):
            with suppress(OSError):
                parent.rmdir()
        raise
