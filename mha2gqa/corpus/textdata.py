"""The one reader of text corpora, for calibration (convert), perplexity (eval) and training (uptrain).

One set of formats: files and folders (sorted, recursively) of .txt/.text/.md (a file is one document),
.jsonl/.json (one document per record, from a text field) and .parquet (a text column), each optionally
.gz/.bz2/.xz/.zst-compressed; or one hub dataset name when online (HF_HUB_OFFLINE=1 is respected).
One set of errors: a binary or malformed file, a missing text field, an empty folder or an unknown
suffix is an InputError of one line naming the file, what is wrong and the fix.

Two ways to read the same sources: `iter_texts` yields plain strings (calibration and eval read each
file exactly, in order, with errors that name the file and line), and `load_documents` gives a
`datasets` Dataset (uptrain shuffles it, splits it between ranks and streams it). Hub datasets are
read through `datasets` in both.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.files.reading import did_you_mean, file_kind, near_miss, parse_json
from mha2gqa.files.sources import hub_offline
from mha2gqa.runtime.errors import InputError, first_line
from mha2gqa.runtime.quiet import without_datasets_bars

# File suffix -> format; the format is also the name of the `datasets` builder that reads it.
FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstandard"}
_SNIFF_CHARS = 1 << 16  # characters of each file checked before `datasets` reads it


@dataclass(frozen=True)
class TextSource:
    """Local files (in order) or one hub dataset; `key` is the flag or recipe key the user typed it as,
    named in every message."""

    key: str
    files: tuple[Path, ...] = ()
    hub: str | None = None
    folder: bool = False  # the files came from one folder (eval records that)

    @property
    def formats(self) -> set[str]:
        return {file_format(f) for f in self.files}


def file_format(path: Path) -> str | None:
    """'text', 'json' or 'parquet' from the suffix (a compression suffix after it is allowed), else None."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return FORMATS.get(suffixes[-1]) if suffixes else None


def _known() -> str:
    return "/".join(FORMATS) + " (optionally " + "/".join(COMPRESSIONS) + ")"


def _looks_local(entry: str) -> bool:
    """A missing path the user meant as a file (so 'no such file', not 'unknown hub dataset')."""
    return entry.startswith((".", "/", "~")) or file_format(Path(entry)) is not None


def resolve(
    key: str,
    entries: str | Sequence[str],
    problems: list[str] | None = None,
    validate_files: bool = True,
    one_format: bool = False,
) -> TextSource | None:
    """What `entries` (paths or one hub name) name, as a TextSource.

    With `problems`, each problem is appended (to be shown with others) and None may be returned;
    without, the first problems raise one InputError. validate_files=False accepts missing local paths
    (validating a recipe for another machine); one_format refuses a mix (one `datasets` builder)."""
    collected: list[str] = []
    source = _resolve(
        key, [entries] if isinstance(entries, (str, Path)) else list(entries), collected, validate_files, one_format
    )
    if problems is not None:
        problems.extend(collected)
        return source
    if collected:
        raise InputError("; ".join(collected))
    return source


def _resolve(key, entries, problems, validate_files, one_format) -> TextSource | None:
    if not entries:
        problems.append(f"{key} is empty: give a file, a folder or a hub dataset name")
        return None
    files: list[Path] = []
    for entry in map(str, entries):
        path = Path(entry).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and file_format(p))
            special = sorted(p for p in path.rglob("*") if p.exists() and not p.is_file() and not p.is_dir())
            if special:  # a FIFO named part.txt would block the read, and leaving it out would be silent
                problems.append(f"{key} {special[0]} is {_kind(special[0])}, not a regular file: remove it")
            if not found:
                problems.append(f"{key} {entry}: the folder holds no {_known()} files: add text files")
            files += found
        elif path.is_file():
            if file_format(path) is None:
                problems.append(f"{key} {entry}: unknown suffix (use {_known()})")
            elif file_format(path) == "parquet" and path.suffix.lower() in COMPRESSIONS:
                problems.append(f"{key} {entry}: parquet is compressed inside already: remove the {path.suffix}")
            files.append(path)
        elif path.exists():  # a FIFO, socket or device: reading one blocks or never ends
            problems.append(f"{key} {entry} is {_kind(path)}, not a regular file: pass a text file")
        elif not validate_files and _looks_local(entry):
            files.append(path)
        elif _looks_local(entry) or near_miss(entry):
            problems.append(f"{key} {entry}: no such file or folder{did_you_mean(entry)}")
        elif len(entries) > 1:
            problems.append(f"{key} {entry}: not a local path, and a hub dataset must be the only entry")
        elif validate_files and hub_offline():
            problems.append(
                f"{key} {entry}: not a local file or folder, and the hub is offline "
                "(HF_HUB_OFFLINE=1): pass local files"
            )
        else:
            return TextSource(key, hub=entry)
    formats = {file_format(f) for f in files} - {None}
    if one_format and len(formats) > 1:
        problems.append(f"{key} mixes formats ({', '.join(sorted(formats))}): use files of one format")
        return None
    folder = len(entries) == 1 and Path(str(entries[0])).expanduser().is_dir()
    return TextSource(key, files=tuple(files), folder=folder) if files else None


# ---- plain strings: calibration and eval ----


def iter_texts(
    source: TextSource,
    field: str = "text",
    *,
    field_key: str | None = None,
    piece_chars: int | None = None,
    end_with_blank_line: bool = False,
    hub_config: str | None = None,
    hub_split: str = "train",
) -> Iterator[str]:
    """The documents of `source` in order. piece_chars: a text file comes in pieces of about that many
    characters, cut at line ends (a huge file costs little memory). end_with_blank_line: newlines are
    added to each document's last piece until it ends in a blank line (a document boundary).
    field_key: the flag or key that names `field`, for messages."""
    if source.hub is not None:
        docs = _hub_texts(source, field, field_key, hub_config, hub_split)
        yield from (_end(d) if end_with_blank_line else d for d in docs)
        return
    for path in source.files:
        texts = _file_texts(source.key, path, field, field_key, piece_chars)
        if not end_with_blank_line:
            yield from texts
        elif file_format(path) != "text":  # every record is a document of its own
            yield from map(_end, texts)
        else:  # a text file is one document: only its last piece ends it
            previous = None
            for piece in texts:
                if previous is not None:
                    yield previous
                previous = piece
            if previous is not None:
                yield _end(previous)


def require_text(source: TextSource, field: str = "text", field_key: str | None = None) -> None:
    """Refuse local files that hold no text at all (empty, or only whitespace), reading no further than
    the first piece that has some: a calibration of 0 tokens is known before any model is loaded. A hub
    dataset is not read here (that would download it). field_key: the key that names `field`."""
    if source.hub is not None:
        return
    for piece in iter_texts(source, field, field_key=field_key, piece_chars=1 << 16):
        if piece.strip():
            return
    named = source.files[0] if len(source.files) == 1 else f"{len(source.files)} files"
    raise InputError(f"{source.key} {named} holds no text (empty or only whitespace): give a file with text in it")


def _end(text: str) -> str:
    trailing = len(text) - len(text.rstrip("\n"))
    return text + "\n" * max(0, 2 - trailing)


def _file_texts(key: str, path: Path, field: str, field_key: str | None, piece_chars: int | None) -> Iterator[str]:
    fmt = file_format(path)
    if fmt == "parquet":
        yield from _parquet_texts(key, path, field, field_key)
        return
    with _read_errors(key, path), _open_text(key, path) as f:
        if fmt == "json":
            yield from _json_texts(key, path, f, field, field_key)
        else:
            yield from _plain_texts(key, path, f, piece_chars)


@contextmanager
def _read_errors(key: str, path: Path):
    """Undecodable bytes and broken compressed streams, as one line naming the file."""
    try:
        yield
    except UnicodeDecodeError as err:
        raise InputError(f"{key} {path}: not UTF-8 text (a binary file?): convert it to UTF-8 or leave it out") from err
    except (EOFError, OSError, lzma.LZMAError) as err:  # gzip.BadGzipFile is an OSError
        codec = COMPRESSIONS.get(path.suffix.lower())
        if codec is None:
            raise InputError(
                f"{key} {path}: cannot be read ({type(err).__name__}: {getattr(err, 'strerror', None) or err}): "
                "check that it is a readable file"
            ) from err
        raise InputError(
            f"{key} {path}: ends in {path.suffix} but is not readable {codec} data "
            f"({type(err).__name__}): re-compress it or remove the suffix"
        ) from err


def _open_text(key: str, path: Path):
    """A text stream of the decompressed file: UTF-8, Python's universal newlines (as `datasets`)."""
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if suffix == ".bz2":
        return bz2.open(path, "rt", encoding="utf-8")
    if suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError as err:
            raise InputError(
                f"{key} {path}: reading .zst needs the zstandard package: pip install zstandard "
                "(or decompress the file)"
            ) from err
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8")
    return open(path, encoding="utf-8")


def _plain_texts(key: str, path: Path, f, piece_chars: int | None) -> Iterator[str]:
    if piece_chars is None:
        text = f.read()
        _refuse_nul(key, path, text)
        yield text
        return
    piece: list[str] = []
    size = 0
    for line in f:  # pieces end at line ends, so no word is cut in two
        _refuse_nul(key, path, line)
        piece.append(line)
        size += len(line)
        if size >= piece_chars:
            yield "".join(piece)
            piece, size = [], 0
    if piece:
        yield "".join(piece)


def _kind(path: Path) -> str:
    return file_kind(path.stat().st_mode)


def _refuse_nul(key: str, path: Path, text: str) -> None:
    if "\0" in text:
        raise InputError(f"{key} {path}: holds NUL bytes, so it is a binary file, not text: leave it out")


def _json_texts(key: str, path: Path, f, field: str, field_key: str | None) -> Iterator[str]:
    """JSON lines; or, for .json, one array of records (what `datasets`' json builder also reads)."""
    first = f.read(1)
    while first.isspace():
        first = f.read(1)
    if first == "[" and ".jsonl" not in [s.lower() for s in path.suffixes]:
        records = parse_json("[" + f.read(), f"{key} {path}", "fix or re-export it")
        for number, record in enumerate(records, 1):
            yield _record_text(key, f"{path} record {number}", record, field, field_key)
        return
    for number, line in enumerate(_prepend(first, f), 1):
        if not line.strip():
            continue
        record = parse_json(line, f"{key} {path}:{number}", f"each line must be one JSON object with a {field!r} field")
        yield _record_text(key, f"{path}:{number}", record, field, field_key)


def _prepend(first: str, f) -> Iterator[str]:
    rest = f.readline()
    yield first + rest
    yield from f


def _name_it(field: str, field_key: str | None) -> str:
    """The fix for a missing text field."""
    return f"set {field_key} to the one that holds the text" if field_key else f"give every record a {field!r} field"


def _record_text(key: str, where: str, record, field: str, field_key: str | None) -> str:
    if not isinstance(record, dict):
        raise InputError(f"{key} {where}: a {type(record).__name__}, not a JSON object with a {field!r} field")
    if field not in record:
        raise InputError(
            f"{key} {where}: has no {field!r} field (fields: {', '.join(record) or 'none'}): "
            + _name_it(field, field_key)
        )
    if not isinstance(record[field], str):
        raise InputError(f"{key} {where}: field {field!r} is a {type(record[field]).__name__}, not a string")
    return record[field]


def _parquet_texts(key: str, path: Path, field: str, field_key: str | None) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise InputError(
            f"{key} {path}: not a parquet file ({type(err).__name__}): re-export it or fix the suffix"
        ) from err
    columns = table.schema_arrow.names
    if field not in columns:
        raise InputError(
            f"{key} {path}: has no {field!r} column (columns: {', '.join(columns)}): " + _name_it(field, field_key)
        )
    for batch in table.iter_batches(columns=[field]):
        yield from (text or "" for text in batch.column(0).to_pylist())


def _hub_texts(source: TextSource, field: str, field_key: str | None, config: str | None, split: str) -> Iterator[str]:
    for row in _hub_dataset(source, config, split, streaming=True):
        if field not in row:
            raise InputError(
                f"{source.key} {source.hub}: has no {field!r} column (columns: {', '.join(row)}): "
                + _name_it(field, field_key)
            )
        yield row[field]


def _hub_dataset(source: TextSource, config: str | None, split: str, streaming: bool):
    if hub_offline():
        raise InputError(
            f"{source.key} {source.hub}: not a local file or folder, and the hub is offline "
            "(HF_HUB_OFFLINE=1): pass local files"
        )
    import datasets

    try:
        return datasets.load_dataset(source.hub, config, split=split, streaming=streaming)
    except Exception as err:  # missing dataset/config/split, network, auth: all the user's to fix
        first = first_line(err)
        raise InputError(
            f"{source.key} {source.hub} (config {config}, split {split}) could not be loaded "
            f"({type(err).__name__}: {first}): check the name, config and split, or pass local files"
        ) from err


# ---- datasets: uptrain ----


def load_documents(
    source: TextSource,
    field: str = "text",
    *,
    field_key: str = "text field",
    streaming: bool = False,
    sample_by: str = "document",
    hub_config: str | None = None,
    hub_split: str = "train",
):
    """A `datasets` Dataset (IterableDataset when streaming) with a `field` column. Local files are
    checked first (the head of each), so a bad file is one line naming it, not a DatasetGenerationError."""
    import datasets

    if source.hub is not None:
        ds = _hub_dataset(source, hub_config, hub_split, streaming)
    else:
        formats = source.formats
        if len(formats) != 1:
            raise InputError(f"{source.key} mixes formats ({', '.join(sorted(formats))}): use files of one format")
        fmt = formats.pop()
        for path in source.files:
            validate_file(source.key, path, field, field_key)
        kwargs = {"sample_by": sample_by} if fmt == "text" else {}
        try:
            with without_datasets_bars():  # "Generating train split" of local files: seconds, and ours say more
                ds = datasets.load_dataset(
                    fmt, data_files=[str(f) for f in source.files], split="train", streaming=streaming, **kwargs
                )
        except datasets.exceptions.DatasetGenerationError as err:
            raise InputError(
                f"{source.key}: `datasets` could not read the files ({_cause(err)}): "
                "check that each is valid text, jsonl or parquet"
            ) from err
    columns = ds.column_names
    if columns is not None and field not in columns:
        raise InputError(
            f"{field_key}={field!r} is not a column of the data in {source.key} (columns: {', '.join(columns)})"
        )
    return ds


def dataset_texts(ds, field: str, key: str, field_key: str = "text field") -> Iterator[str]:
    """The `field` of every row of a `datasets` dataset; a file that breaks mid-stream is one line."""
    import pyarrow as pa

    rows = iter(ds)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (UnicodeDecodeError, pa.ArrowException, ValueError) as err:
            raise InputError(
                f"{key}: a file could not be read while streaming ({type(err).__name__}: "
                f"{first_line(err)}): check that each file is valid"
            ) from err
        if field not in row:  # streams may not know their columns before the first row
            raise InputError(f"{field_key}={field!r} is not a column of the data in {key} (columns: {', '.join(row)})")
        yield row[field]


def validate_file(key: str, path: Path, field: str = "text", field_key: str | None = None) -> None:
    """Read the head of one file as `iter_texts` would; raises the same one-line errors."""
    if file_format(path) == "parquet":
        next(iter(_parquet_texts(key, path, field, field_key)), None)
        return
    with _read_errors(key, path), _open_text(key, path) as f:
        head = f.read(_SNIFF_CHARS)
        if file_format(path) != "json":
            _refuse_nul(key, path, head)
        elif not head.lstrip().startswith("["):  # JSON lines: check the complete ones
            lines = head.splitlines() if len(head) < _SNIFF_CHARS else head.splitlines()[:-1]
            for _ in _json_texts(key, path, io.StringIO("\n".join(lines)), field, field_key):
                pass


def _cause(err: BaseException) -> str:
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return f"{type(err).__name__}: {first_line(err)}"[:200]
