"""The one way mha2gqa reads files it did not write: bounded, and only regular files.

Every JSON document (safetensors headers, config.json, the shard index, mha2gqa.json, eval results)
and every YAML document (recipes, `key=value` overrides, a source card's front matter) goes through
here, so a hostile file meets the same limits wherever it is read:
- JSON: at most MAX_JSON_DEPTH levels of nesting (the decoder recurses; thousands of levels were a
  RecursionError), a size cap per kind of file, UTF-8 only, integers of at most 64 digits.
- YAML: at most MAX_YAML_DEPTH levels, and MAX_YAML_NODES nodes once aliases are expanded (a
  "billion laughs" document of a few hundred bytes expands to 10^9 nodes; its aliases share objects
  until something walks them).
- Files: a regular file (a FIFO would block, /dev/zero never ends), opened without blocking, read to
  its stat size (a short read is a file that changed, never an end); a file of a model directory must
  resolve inside it (a README.md linked to /etc/passwd is refused), see `inside`.
Each breach is one InputError line naming the file and the limit.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import re
import stat
from pathlib import Path

from mha2gqa.runtime.errors import InputError, first_line

MAX_JSON_DEPTH = 64  # real configs, indexes, results and provenance nest under 10 levels
MAX_JSON_BYTES = 64 << 20  # config.json, indexes, mha2gqa.json, results: real ones are under 10 MB
MAX_YAML_DEPTH = 64
MAX_YAML_BYTES = 1 << 20  # recipes and card front matter are a few KB
MAX_YAML_NODES = 100_000  # after alias expansion
# Big enough for every integer real files hold: safetensors offsets are u64 (20 digits), and transformers writes
# "no limit" as int(1e30) (31 digits: model_max_length in most hub tokenizer_config.json files). Small enough that
# parsing stays linear (Python's int() is quadratic in thousands of digits).
_INT_DIGITS = 64

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def file_kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def resolve(path: str | os.PathLike) -> Path:
    """Path.resolve(), with a symbolic link loop reported as the OSError ELOOP naming `path` (one line
    for the user, like every ELOOP from open()): Python before 3.13 raises a RuntimeError there."""
    try:
        return Path(path).resolve()
    except RuntimeError as err:
        if "Symlink loop" not in str(err):
            raise
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.fspath(path)) from None


def inside(path: Path, root: Path) -> Path:
    """`path` (named inside model directory `root`) if what it resolves to is inside `root`, else
    InputError. A hub cache snapshot's files are links into the repo's blobs/ folder: those count as
    inside. Links within `root` are fine; only leaving it is refused."""
    path, root = Path(path), Path(root)
    real = resolve(path)
    if not real.exists():
        return path  # a dangling link: opening it says "no such file"
    allowed = [resolve(root)]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--")):
        allowed.append(resolve(root.parent.parent / "blobs"))
    if not any(real == top or top in real.parents for top in allowed):
        raise InputError(
            f"{path} is a link to {real}, outside the model directory {root}: mha2gqa reads only files "
            "inside it; put the file itself there instead of the link"
        )
    return path


def open_regular(path: str | os.PathLike, root: Path | None = None):
    """`path` opened for reading (binary, unbuffered) if it is a regular file (and, with `root`,
    inside that model directory). Opened with O_NONBLOCK, so a FIFO is refused, never waited on."""
    path = Path(path)
    if root is not None:
        inside(path, root)
    _require_regular(path, os.stat(path).st_mode)  # first: a socket cannot even be opened
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _require_regular(path, os.fstat(fd).st_mode)  # again: what was opened, if it was swapped meanwhile
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)


def _require_regular(path: Path, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    raise InputError(
        f"{path} is {file_kind(mode)}, not a regular file: mha2gqa reads only regular files; put the file itself there"
    )


def validate_regular(path: str | os.PathLike, root: Path | None = None) -> int:
    """The rule of open_regular without keeping the file open; returns its size."""
    with open_regular(path, root) as f:
        return os.fstat(f.fileno()).st_size


def read_exactly(f, count: int, path, what: str = "") -> bytes:
    """`count` bytes from `f`; fewer is a file cut short or changing under us, never an end."""
    data = f.read(count)
    if len(data) != count:
        raise short_read(path, what)
    return data


def short_read(path, what: str = "") -> InputError:
    where = f" {what}" if what else ""
    return InputError(
        f"{path} ended before{where or ' its stated size'}: the file is truncated or changed while "
        "being read; copy it again (from a stable source) and retry"
    )


_TOO_LARGE_FIX = "check that it is the file you meant (real ones are far smaller)"


def read_bytes(
    path: str | os.PathLike, limit: int, root: Path | None = None, kind: str = "file", fix: str = _TOO_LARGE_FIX
) -> bytes:
    """The whole of a regular file of at most `limit` bytes; `fix` ends the message of one over it (the
    caller's words for that kind of file: a result, a recipe, a model's config)."""
    with open_regular(path, root) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise too_large(path, size, limit, kind, fix)
        return read_exactly(f, size, path)


def too_large(path, size: int, limit: int, kind: str, fix: str = _TOO_LARGE_FIX) -> InputError:
    return InputError(f"{path} is {size:,} bytes, over mha2gqa's limit of {limit:,} bytes for {kind}: {fix}")


def read_json(path: str | os.PathLike, fix: str, limit: int = MAX_JSON_BYTES, root: Path | None = None):
    """A JSON file, bounded (see the module docstring). `fix` ends each message: what the user does."""
    return parse_json(read_bytes(path, limit, root, "a JSON file", fix), path, fix)


def parse_json(raw: bytes | str, where, fix: str):
    """JSON text (bytes must be UTF-8), refused in one line when it is not JSON, too deep, or holds
    an integer of more than 64 digits."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"{where} is not UTF-8 text ({err.reason} at byte {err.start}): {fix}") from None
    if _depth_exceeds(raw, MAX_JSON_DEPTH):
        raise InputError(f"{where} nests JSON deeper than {MAX_JSON_DEPTH} levels: {fix}")
    try:
        return json.loads(raw, parse_int=_bounded_int)
    except json.JSONDecodeError as err:
        raise InputError(f"{where} is not valid JSON ({err.msg} at line {err.lineno}): {fix}") from None
    except _HugeInt as err:
        raise InputError(f"{where} holds an integer of {err.args[0]} digits, over {_INT_DIGITS}: {fix}") from None


def parse_json_lines(raw: bytes, where, fix: str) -> list[tuple[int, object]]:
    """(line number, value) of every non-blank line of JSON-lines text, each line bounded as parse_json."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{where} is not UTF-8 text ({err.reason} at byte {err.start}): {fix}") from None
    return [
        (n, parse_json(line, f"{where} line {n}", fix)) for n, line in enumerate(text.splitlines(), 1) if line.strip()
    ]


class _HugeInt(ValueError):
    pass


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > _INT_DIGITS:
        raise _HugeInt(digits)
    return int(text)


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_PAIR = re.compile(r"[\[{][\]}]")


def _depth_exceeds(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than `limit`: innermost pairs are removed one
    level per pass (regex, C speed), so the cost is at most `limit` passes over the brackets."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    for _ in range(limit):
        if not brackets:
            return False
        brackets, removed = _PAIR.subn("", brackets)
        if not removed:
            return False  # unbalanced: the decoder says where
    return bool(_PAIR.search(brackets))


def parse_yaml(text: str, where, fix: str, limit: int = MAX_YAML_BYTES):
    """YAML text as Python objects (yaml.safe_load's types), bounded in size, depth and expanded
    nodes. Raises YamlLimit (an InputError) at a bound and yaml.YAMLError for malformed text."""
    import yaml

    if len(text) > limit:
        raise YamlLimit(f"{where} is {len(text):,} characters of YAML, over mha2gqa's limit of {limit:,}: {fix}")
    loader = _bounded_loader(yaml)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        nodes = _expanded_nodes(node, yaml)
        if nodes > MAX_YAML_NODES:
            raise YamlLimit(
                f"{where} expands to more than {MAX_YAML_NODES:,} YAML nodes once its aliases (*name) are "
                f"resolved: {fix}"
            )
        return loader.construct_document(node)
    except _TooDeep:
        raise YamlLimit(f"{where} nests YAML deeper than {MAX_YAML_DEPTH} levels: {fix}") from None
    finally:
        loader.dispose()


MAX_SIBLINGS = 2000  # a folder listed for a "did you mean": beyond this many entries, none is offered


def near_miss(path) -> Path | None:
    """An existing path one typo away from a missing `path` (runs/smoll -> runs/smol): the first part of it
    that does not exist, replaced by the closest name in its folder, when the whole path then exists;
    None otherwise (nothing close, or `path` exists)."""
    path = Path(path).expanduser()
    parts = path.parts
    for depth in range(1, len(parts) + 1):
        here = Path(*parts[:depth])
        if os.path.lexists(here):
            continue
        folder = here.parent
        try:
            names = [entry.name for _, entry in zip(range(MAX_SIBLINGS + 1), os.scandir(folder))]
        except OSError:
            return None
        if len(names) > MAX_SIBLINGS:
            return None
        for close in difflib.get_close_matches(here.name, names, n=3, cutoff=0.75):
            found = Path(folder, close, *parts[depth:])
            if os.path.lexists(found):
                return found
        return None
    return None


def did_you_mean(path, words: str = " (did you mean {}?)") -> str:
    """`words` with the near_miss of a missing `path` in it (' (did you mean runs/smol?)'), else '': every "no
    such file" message that names a local path ends with it, as a mistyped flag or recipe key gets one."""
    found = near_miss(path)
    if found is None:
        return ""
    written = Path(str(path)).expanduser()
    return words.format(found if written.is_absolute() or str(path).startswith("~") else os.path.relpath(found))


def read_yaml_mapping(path, where: str, kind: str, limit: int, size_fix: str, fix: str) -> dict:
    """A YAML file that must hold one mapping (a recipe, a convert config), {} when empty. Refused in one
    line naming `where` (e.g. "recipe PATH"): missing, over `limit` bytes (`size_fix`), not UTF-8,
    malformed (where PyYAML stopped), or not a mapping; `fix` ends each line."""
    import yaml

    if not os.path.lexists(path):
        raise InputError(f"{where}: no such file{did_you_mean(path)} ({fix})")
    try:
        text = read_bytes(Path(path), limit, kind=kind, fix=size_fix).decode("utf-8")
        raw = parse_yaml(text, where, fix)
    except UnicodeDecodeError as err:
        raise InputError(f"{where} is not UTF-8 text (byte {err.start}): {fix}") from None
    except yaml.YAMLError as err:
        raise InputError(f"{where} is not valid YAML{_yaml_error_where(err)}: {fix}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InputError(f"{where} holds a {type(raw).__name__}, not a mapping of key: value: {fix}")
    return raw


def _yaml_error_where(err) -> str:
    """Where PyYAML stopped, and what it was inside (an unclosed [ is found only at the end of the file)."""
    mark, context = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
    text = f" at line {mark.line + 1}" if mark is not None else ""
    text += f" ({getattr(err, 'problem', None) or first_line(err)}"
    if getattr(err, "context", None) and context is not None:
        text += f", {err.context} from line {context.line + 1}"
    return text + ")"


class YamlLimit(InputError):
    """A YAML document over one of parse_yaml's bounds."""


class _TooDeep(Exception):
    pass


def _bounded_loader(yaml):
    class BoundedLoader(yaml.SafeLoader):
        """SafeLoader whose composer (recursive) stops at MAX_YAML_DEPTH."""

        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            try:
                if self.depth > MAX_YAML_DEPTH:
                    raise _TooDeep
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return BoundedLoader


def _expanded_nodes(root, yaml) -> int:
    """Nodes of the document with every alias expanded, counted without expanding (each shared node
    once, iteratively); a cycle (`&a [*a]`) counts as unbounded."""
    sizes: dict[int, int | None] = {}  # None: being counted (seen again: a cycle)
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        if done:
            sizes[key] = min(1 + sum(sizes[id(child)] for child in children), MAX_YAML_NODES + 1)
            continue
        if key in sizes:
            if sizes[key] is None:
                return MAX_YAML_NODES + 1
            continue
        sizes[key] = None
        stack.append((node, True))
        for child in children:
            if sizes.get(id(child), 0) is None:
                return MAX_YAML_NODES + 1
            if id(child) not in sizes:
                stack.append((child, False))
    return sizes[id(root)]
