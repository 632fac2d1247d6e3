"""What the docs and the CLI say about themselves holds: links and named sections exist, one measured
duration for `demo --quick`, help texts whole, KV per sequence at the model's own context."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(page: Path) -> list[str]:
    in_code = False
    found = []
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.append(line.lstrip("#").strip())
    return found


def test_every_local_link_and_anchor_in_the_docs_exists():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in {_slug(h) for h in _headings(linked)}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such section)")
    assert broken == []


def test_sections_named_in_the_text_exist_where_they_are_said_to_be():
    """Prose like: the README section "Try it" (a section that moved leaves these behind)."""
    readme = _headings(ROOT / "README.md")
    missing = []
    for page in PAGES:
        for name in re.findall(r'README section "([^"]+)"', page.read_text().replace("\n", " ")):
            if not any(h.startswith(name) for h in readme):
                missing.append(f"{page.relative_to(ROOT)}: README section {name!r}")
    assert missing == []


def test_top_level_help_gives_each_command_a_whole_summary():
    from click.testing import CliRunner

    from mha2gqa.cli import main

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    commands = result.output.split("Commands:\n", 1)[1]
    summaries = re.split(r"\n  (?=\S)", "\n" + commands.rstrip())[1:]
    names = sorted(main.commands)
    assert [s.split()[0] for s in summaries] == names
    for summary in summaries:
        text = " ".join(summary.split()[1:])
        assert not text.endswith("...") and text.endswith("."), summary


def test_convert_method_is_a_choice_like_grouping_and_speed():
    import click

    from mha2gqa.cli import main
    from mha2gqa.convert.options import Method

    def option(command, name):
        return next(p for p in main.commands[command].params if p.name == name)

    assert isinstance(option("convert", "method").type, click.Choice)
    assert list(option("convert", "method").type.choices) == [m.value for m in Method]
    assert isinstance(option("convert", "grouping").type, click.Choice)
    assert isinstance(option("eval", "speed_preset").type, click.Choice)


_DURATION = re.compile(r"\b\d+(?:\.\d+)?\s*(?:s|sec|seconds?|min|minutes?)\b(?! per)|\babout (?:\w+ )?minutes?\b")


def test_demo_quick_has_one_measured_duration_with_its_load():
    """`demo --quick` was said to take 27 s, about 2 minutes and 2.8 minutes in three places: the README
    states the one measured time (with the load); the other pages and --help point to it (benchmarks.md
    compares thread counts side by side, each row with its load)."""
    from click.testing import CliRunner

    from mha2gqa.cli import main

    stated = []
    for page in PAGES:
        if page.name == "benchmarks.md":  # side-by-side measurements (threads), not the time to expect
            continue
        for paragraph in page.read_text().split("\n\n"):
            if "--quick" in paragraph and "demo" in paragraph and _DURATION.search(paragraph):
                stated.append((page.relative_to(ROOT).as_posix(), _DURATION.findall(paragraph)))
    assert [page for page, _ in stated] == ["README.md"], stated
    readme = next(p for p in (ROOT / "README.md").read_text().split("\n\n") if "--quick --out" in p)
    assert re.search(r"load(\s+average)?\s+\d", readme), readme
    help_text = CliRunner().invoke(main, ["demo", "--help"]).output
    assert not _DURATION.search(help_text.split("--quick", 1)[1].split("--alpha", 1)[0]), help_text


# ---- every file, flag and function a doc names exists ----
# The docs name things in code: `bench/refine.py`, `--refine-steps`, `checkpoint.assign_shards`, and command
# lines (in backticks, fenced blocks, or indented blocks). Each kind is checked against what the repo holds:
# files on disk, flags in the named command's own options (click's for mha2gqa, argparse's add_argument calls
# for a script), names in the modules' source (read with ast: nothing is imported).

_FILE = re.compile(r"(?<![\w$./:-])((?:[\w.{},*-]+/)+[\w.{},*-]*)")  # not after ':' (git show REV:path)
_DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
_FILE_SUFFIXES = {
    ".py",
    ".md",
    ".json",
    ".jsonl",
    ".yaml",
    ".yml",
    ".txt",
    ".gz",
    ".png",
    ".html",
    ".cfg",
    ".toml",
    ".log",
}
_FILE_SUFFIXES |= {".safetensors", ".bin", ".pt", ".csv", ".parquet", ".whl", ".sh", ".so", ".zst", ".bz2", ".xz"}


def _code(page: Path) -> tuple[list[str], list[str]]:
    """(inline code spans, command lines): a fenced or 4-space-indented block gives its lines (a trailing
    backslash joins the next), prose gives its `spans`."""
    spans, lines, fenced, pending = [], [], False, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or (line.startswith("    ") and not re.match(r"\s*([-*] |\|)", line)):  # not a list or table
            pending += line.strip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
            else:
                lines.append(pending)
                pending = ""
            continue
        spans += re.findall(r"`([^`\n]+)`", line)
    return spans, lines + [s for s in spans if _command(s)]


_WRAPPERS = {"nice", "time", "/usr/bin/time", "timeout", "sudo", "env"}


def _command(text: str) -> tuple[str, list[str]] | None:
    """('mha2gqa' or the script's path, its arguments) when `text` runs the package's CLI, a module of the repo
    (`python -m mha2gqa.uptrain`) or one of its scripts (`python bench/x.py`), through accelerate too; else None.
    Wrappers (nice -n 10, /usr/bin/time -v, VAR=1) are stepped over; the command ends at | && ; > or #."""
    line = re.split(r"\s+(?:\||&&|;|>|2>&1|#)(?:\s.*)?$", text.strip(), maxsplit=1)[0]
    try:
        words = shlex.split(line)
    except ValueError:  # an unbalanced quote in prose
        words = line.split()
    while words and (words[0] in _WRAPPERS or re.match(r"^[A-Z_]+=\S*$", words[0]) or words[0].startswith("-")):
        words = words[1:]
        if words and re.match(r"^(\d+|%.*)$", words[0]):  # nice -n 10, /usr/bin/time -f "%e s %M KiB"
            words = words[1:]
    if words[:1] == ["accelerate"] and "-m" in words:
        words = ["python", *words[words.index("-m") :]]
    if words[:1] == ["mha2gqa"]:
        return "mha2gqa", words[1:]
    if words[:1] not in (["python"], ["python3"]) or len(words) < 2:
        return None
    if words[1] == "-m" and len(words) > 2:
        if words[2] == "mha2gqa":
            return "mha2gqa", words[3:]
        module = ROOT / words[2].replace(".", "/")
        script = module / "__main__.py" if module.is_dir() else module.with_suffix(".py")
        return (script.relative_to(ROOT).as_posix(), words[3:]) if script.is_file() else None
    script = ROOT / words[1]
    return (words[1], words[2:]) if words[1].endswith(".py") and script.is_file() else None


def _ignored() -> list[str]:
    """The repo-root paths .gitignore names (/runs/, /bench/wheels/): outputs a doc may name before they exist."""
    return [line.strip("/") for line in (ROOT / ".gitignore").read_text().splitlines() if line.startswith("/")]


def _expand(path: str) -> list[str]:
    """Shell brace expansion, one level deep at a time: a/{b,c}.json -> a/b.json, a/c.json."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [
        x for part in match.group(1).split(",") for x in _expand(path[: match.start()] + part + path[match.end() :])
    ]


def _missing_path(path: str) -> bool:
    """A path whose first folder is a tracked top-level folder (bench/, docs/, mha2gqa/, ...) or one of the
    package's subpackages (convert/refine/hooks.py: mha2gqa/convert/refine/hooks.py) must exist; globs must match. Other
    paths are outputs or placeholders (runs/x, /tmp/dq, mha2gqa-demo/report/report.html)."""
    top = path.split("/")[0]
    roots = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} - set(_ignored())
    subpackages = {p.name for p in (ROOT / "mha2gqa").iterdir() if p.is_dir() and p.name != "__pycache__"}
    if any(path == i or path.startswith(i + "/") for i in _ignored()):
        return False
    base = ROOT if top in roots else ROOT / "mha2gqa" if top in subpackages else None
    if base is None:
        return False
    return not any(base.glob(p.rstrip("/")) if "*" in p else (base / p).exists() for p in _expand(path))


def test_every_repo_path_the_docs_name_exists():
    missing = []
    for page in PAGES:
        spans, lines = _code(page)
        for text in spans + lines:
            for path in _FILE.findall(text):
                path = path.rstrip(".,")
                if _missing_path(path):
                    missing.append(f"{page.relative_to(ROOT)}: {path} (in `{text[:80]}`)")
    assert missing == []


def _script_flags(script: str) -> set[str]:
    """The --flags a script's argparse parser takes: the option strings of its add_argument calls."""
    import ast

    tree = ast.parse((ROOT / script).read_text())
    return {"--help"} | {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--")
    }


def _cli_flags(words: list[str]) -> tuple[str, set[str]]:
    """(the mha2gqa command the words run, the --flags it takes): the top level's own before a command."""
    from mha2gqa.cli import main

    def flags(command) -> set[str]:
        return {"--help"} | {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}

    name = next((w for w in words if w in main.commands), None)
    return (name or "mha2gqa"), flags(main.commands[name]) if name else flags(main)


def _flags_in(words: list[str]) -> list[str]:
    """The --flags among a command's words (--x=1 -> --x; [--refine] -> --refine); --refine-* stays a pattern."""
    found = []
    for word in words:
        flag = re.match(r"^\[?(--[a-z][\w-]*\*?)", word)
        if flag:
            found.append(flag.group(1))
    return found


def _known(flag: str, allowed: set[str]) -> bool:
    return any(a.startswith(flag[:-1]) for a in allowed) if flag.endswith("*") else flag in allowed


def test_every_flag_of_a_command_line_in_the_docs_is_an_option_of_that_command():
    """`mha2gqa convert SRC DST --groups 2`, `python bench/refine.py --kv 1`: each --flag is one the command's
    --help lists (for mha2gqa: the command's, and the top level's before it)."""
    unknown = []
    for page in PAGES:
        for line in _code(page)[1]:
            found = _command(line)
            if found is None:
                continue
            program, words = found
            if program == "mha2gqa":
                name = next((w for w in words if not w.startswith("-")), None)
                head = words[: words.index(name)] if name in words else words
                _, top = _cli_flags([])
                command, allowed = _cli_flags(words)
                bad = [f for f in _flags_in(head) if not _known(f, top)]
                bad += [f for f in _flags_in(words[len(head) :]) if not _known(f, allowed)]
            else:
                command, allowed = program, _script_flags(program)
                bad = [f for f in _flags_in(words) if not _known(f, allowed)]
            unknown += [f"{page.relative_to(ROOT)}: {command} has no {f} (in `{line[:90]}`)" for f in bad]
    assert unknown == []


def test_every_flag_the_docs_name_alone_is_an_option_of_some_command():
    """A flag named alone in prose or a table (`--refine-steps`, `--refine-tokens 65536`): an option of some
    mha2gqa command or repo script. (Prose mixes commands in one paragraph, so "the command beside it" is not
    decidable there; a flag on a command line is checked against that command, above.)"""
    from mha2gqa.cli import main

    scripts = [p.relative_to(ROOT).as_posix() for d in ("bench", "scripts") for p in (ROOT / d).rglob("*.py")]
    everything = set().union(*(_cli_flags([name])[1] for name in main.commands), _cli_flags([])[1])
    everything |= set().union(*(_script_flags(s) for s in scripts + ["mha2gqa/uptrain/__main__.py"]))
    unknown = []
    for page in PAGES:
        for span in _code(page)[0]:
            if span.startswith("--") and not _command(span):
                flag = _flags_in(span.split()[:1])
                unknown += [f"{page.relative_to(ROOT)}: {f} (in `{span}`)" for f in flag if not _known(f, everything)]
    assert unknown == []


def _python_index() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """From the source, nothing imported: {module: the names it defines or imports} under its dotted name
    (mha2gqa.convert.run) and its last part (run, calibrated_merge), and {class: its members}."""
    import ast

    modules: dict[str, set[str]] = {}
    classes: dict[str, set[str]] = {}
    for folder in ("mha2gqa", "bench", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in node.names}
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                if isinstance(node, ast.ClassDef):
                    members = classes.setdefault(node.name, set())
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                            members.add(item.name)
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            members.add(item.target.id)
                        elif isinstance(item, ast.Assign):
                            members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            parts = path.relative_to(ROOT).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names |= {p.stem for p in path.parent.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()} if path.name == "__init__.py" else set()  # fmt: skip
            for key in {".".join(parts), parts[-1]}:
                modules.setdefault(key, set()).update(names)
    return modules, classes


def _recipe_sections() -> set[str]:
    from mha2gqa.uptrain.recipe import all_keys

    return {key.split(".")[0] for key in all_keys() if "." in key}


def test_every_function_module_and_recipe_key_the_docs_name_exists():
    """`mha2gqa.uptrain.load_recipe`, `checkpoint.assign_shards`, `ShardedWriter.copy_bytes`,
    `calibrated_merge.load_float32`, `embedded.pretrain_tokens()`: a dotted name whose head is one of the repo's
    modules or classes names something that module or class defines; one whose head is a recipe section
    (`lora.load_in_4bit`, `budget.max_steps=20`) is a recipe key. Other heads (torch., os.) are not ours."""
    from mha2gqa.uptrain.recipe import all_keys

    modules, classes = _python_index()
    keys, sections = set(all_keys()), _recipe_sections()
    missing = []
    for page in PAGES:
        for span in _code(page)[0]:
            key = re.match(r"^([a-z_]+(?:\.[a-z_0-9]+)+)(?:=|: )", span)
            dotted = _DOTTED.match(span)
            if key and key.group(1).split(".")[0] in sections:
                if key.group(1) not in keys:
                    missing.append(f"{page.relative_to(ROOT)}: recipe key {key.group(1)}")
                continue
            if not dotted or Path(dotted.group(1)).suffix in _FILE_SUFFIXES:
                continue
            name = dotted.group(1)
            parts = name.split(".")
            if parts[0] in sections and name in keys:
                continue
            problem = _unresolved(parts, modules, classes)
            if problem:
                missing.append(f"{page.relative_to(ROOT)}: `{span}`: {problem}")
    assert missing == []


def _unresolved(parts: list[str], modules: dict, classes: dict) -> str | None:
    """Why `parts` names nothing of ours, or None (it does, or its head is not ours)."""
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        if head in modules:
            name = parts[i]
            if name not in modules[head] and f"{head}.{name}" not in modules:
                return f"{head} has no {name}"
            if i + 1 < len(parts) and name in classes and parts[i + 1] not in classes[name]:
                return f"{name} has no {parts[i + 1]}"
            return None
    if parts[0] in classes and parts[1] not in classes[parts[0]]:
        return f"{parts[0]} has no {parts[1]}"
    return None


# ---- examples write outside the tree, or into ignored folders ----

RUNNABLE = re.compile(r"mha2gqa/data/|recipes/|\bausten\b")  # an example a reader runs as written, from the clone


def _ignored_folders() -> list[str]:
    """The folders .gitignore keeps out of the repository, anchored at its root (/runs/ -> runs/)."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return [line.strip("/") + "/" for line in lines if line.startswith("/") and line.endswith("/")]


def _written_paths(words: list[str]) -> list[str]:
    """Where an example command writes: convert's DST, --out, output_dir=."""
    found = [w.split("=", 1)[1] for w in words if w.startswith("output_dir=")]
    found += [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--out"]
    if words[:2] == ["mha2gqa", "convert"]:
        positional = [w for w in words[2:] if not w.startswith("-")][:2]
        found += positional[1:] if "--config" not in words else []
    return found


def _example_commands(page: Path):
    """(line, words) of every `mha2gqa ...` command in the page's code blocks and inline code."""
    lines, in_code = [], False
    for line in page.read_text().replace("\\\n", " ").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif in_code:
            lines.append(line.split(" #")[0].strip())
        else:
            lines += re.findall(r"`([^`]+)`", line)
    for line in lines:
        if "mha2gqa " not in line:
            continue
        try:
            words = shlex.split(line[line.index("mha2gqa ") :])
        except ValueError:
            continue
        yield line, words


def _placeholder(path: str) -> bool:
    """DST, OUT, W/demo, $VAR, ...: a name the reader replaces."""
    return bool(re.fullmatch(r"[A-Z]+(/.*)?|\$.*|\.\.\.", path))


def test_runnable_examples_write_outside_the_tree_or_into_ignored_folders():
    # docs/convert.md's example wrote out-gqa2/ into the clone, where git shows it as new.
    ignored, inside = _ignored_folders(), []
    for page in PAGES:
        for line, words in _example_commands(page):
            if not RUNNABLE.search(line):
                continue
            for path in _written_paths(words):
                outside = path.startswith(("/", "~")) or _placeholder(path)
                if not outside and not any(path.lstrip("./").startswith(folder) for folder in ignored):
                    inside.append(f"{page.relative_to(ROOT)}: {path} in `{line}`")
    assert inside == []


def test_the_example_check_finds_a_path_inside_the_tree():
    words = shlex.split("mha2gqa convert mha2gqa/data/austen-mha out-gqa2 --groups 2")
    assert _written_paths(words) == ["out-gqa2"]
    assert _written_paths(shlex.split("mha2gqa uptrain --recipe recipes/tiny-cpu.yaml output_dir=runs/x")) == ["runs/x"]
    assert "runs/" in _ignored_folders()
