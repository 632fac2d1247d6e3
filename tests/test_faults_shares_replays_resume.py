"""Faults in shares, names, replays and --resume (issue 38): a bad value is named as what it is (a share, a domain name), a
conversion replays from anywhere, `--resume` trusts only what it checks, a dry run answers as the run
would, a reserved name never hides a user's file, and an empty part of a mix is refused before torch.

Every refusal asserts exit code 2, exactly one `Error:` line, nothing written where the run would write,
$TMPDIR empty and the sources byte-identical; each case takes seconds."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml
from fault_helpers import cli, error_line, tree_digest
from tiny_models import SAMPLE_TEXT, save_tiny_inputs
from uptrain_helpers import corpus, recipe_file

import mha2gqa
from mha2gqa.convert.config_file import CONFIG_NAME
from mha2gqa.corpus.mix import parse_spec
from mha2gqa.corpus.probe import parse_domains

REPO = Path(mha2gqa.__file__).resolve().parent.parent  # the tree under test (its docs too)
SHAPE = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4)
SHARE_RULE = "a share is a positive number or percentage, e.g. 0.5 or 50%"
NAME_RULE = "a domain name starts with a letter, then letters, digits, _ or -, at most 40 characters"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny 4-kv-head llama with a tokenizer (64-token context), calibration, eval and training text."""
    root = tmp_path_factory.mktemp("round4")
    save_tiny_inputs(root, max_position_embeddings=64, **SHAPE)
    (root / "notes:v2.txt").write_text(SAMPLE_TEXT * 4)  # a file whose own name holds a colon
    corpus(root / "train.jsonl", docs=40)
    return root


@pytest.fixture
def sources(tiny):
    """The fixture's digest before the case; the case's end checks it unchanged."""
    before = tree_digest(tiny)
    yield tiny
    assert tree_digest(tiny) == before


def _beside(out: Path) -> list[str]:
    """What a run left at OUT's place: OUT itself and any `.OUT.*` entry beside it."""
    if not out.parent.is_dir():
        return []
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def refused(result, *words, out: Path, tmpdir: Path, left=(), started: float | None = None) -> str:
    """The whole promise: exit 2, one Error line naming `words`, nothing at OUT's place but `left`, $TMPDIR
    empty, and (given `started`) in seconds."""
    line = error_line(result, 2, strict=False)
    for word in words:
        assert word in line, (word, line)
    assert _beside(out) == sorted(left), _beside(out)
    assert list(tmpdir.iterdir()) == []
    if started is not None:
        assert time.perf_counter() - started < 20, "a refusal must come in seconds"
    return line


# --------------------------------------------------- class 1: a share that is not a number is a bad share
BAD_SHARES = ["-0.5", "", "nan", "NaN", "inf", "-inf", "+inf%", "1e-400", "1e999", "0", "0.0%", "half", "50%%", "1/2"]


def _share_words(share: str) -> list[str]:
    return [SHARE_RULE, "the share after the colon is empty" if not share else f"{share!r} is not a share"]


def _convert_args(tiny: Path, dst: Path, *calibration: str) -> list:
    flags = [word for entry in calibration for word in ("--calibration", entry)]
    return ["convert", tiny / "src", dst, "--groups", "2", "--method", "calibrated", *flags, "--quiet"]


@pytest.mark.parametrize("share", BAD_SHARES)
def test_convert_calls_a_bad_share_a_bad_share(sources, tmp_path, tmpdir_env, share):
    dst = tmp_path / "dst"
    started = time.perf_counter()
    result = cli(*_convert_args(sources, dst, f"{sources / 'cal.txt'}:{share}", "austen:0.5"))
    line = refused(result, *_share_words(share), out=dst, tmpdir=tmpdir_env, started=started)
    assert "no share while others do" not in line and "hub is offline" not in line
    assert "read whole when it exists" in line  # how to reach a path that holds a colon


@pytest.mark.parametrize("share", ["-1", "nan", "", "zero"])
def test_a_bad_share_of_a_lone_existing_file_or_a_reserved_name_is_a_bad_share(sources, tmp_path, tmpdir_env, share):
    for entry in (f"{sources / 'cal.txt'}:{share}", f"parent:{share}", f"austen:{share}"):
        dst = tmp_path / "dst"
        refused(cli(*_convert_args(sources, dst, entry)), *_share_words(share), out=dst, tmpdir=tmpdir_env)


@pytest.mark.parametrize("share", ["-0.25", "", ".nan", "abc", "1e-500"])
def test_convert_config_reads_shares_by_the_same_rule(sources, tmp_path, tmpdir_env, share):
    """A list entry and a {entry: share} mapping in --config; YAML's own numbers (-0.25, .nan, 1e-500 -> 0)
    and strings alike."""
    cal = str(sources / "cal.txt")
    for calibration in (f"[{cal}:{share}, austen:0.5]", f"{{{cal}: {share or 'null'}, austen: 0.5}}"):
        config = tmp_path / "c.yaml"
        config.write_text(f"source: {sources / 'src'}\ngroups: 2\nmethod: calibrated\ncalibration: {calibration}\n")
        dst = tmp_path / "dst"
        line = refused(cli("convert", "--config", config, dst, "--quiet"), SHARE_RULE, out=dst, tmpdir=tmpdir_env)
        assert "is not a share" in line or "is empty" in line, line


@pytest.mark.parametrize("share", ["-3", "", "inf", "1e-330%", "a lot"])
def test_uptrain_data_train_reads_shares_by_the_same_rule(sources, tmp_path, tmpdir_env, share):
    out = tmp_path / "out"
    recipe = recipe_file(
        tmp_path / "r.yaml",
        model=str(sources / "src"),
        output_dir=str(out),
        distill={"teacher": str(sources / "src")},
        data={"train": [f"{sources / 'train.jsonl'}:{share}", "parent:0.5"]},
    )
    started = time.perf_counter()
    refused(cli("uptrain", "--recipe", recipe), *_share_words(share), out=out, tmpdir=tmpdir_env, started=started)


@pytest.mark.parametrize(
    "override, words",
    [
        ("data.train=[TRAIN:,parent:0.5]", "the share after the colon is empty"),  # YAML: [{TRAIN: null}, ...]
        ("data.train=[TRAIN: -1, parent: 0.5]", "'-1' is not a share"),
        ("data.train={TRAIN: .inf, parent: 1}", "'inf' is not a share"),
        ("data.train=[TRAIN:1e-999,parent:1]", "'1e-999' is not a share"),
    ],
)
def test_uptrain_overrides_read_shares_in_every_form_yaml_gives(sources, tmp_path, tmpdir_env, override, words):
    out = tmp_path / "out"
    recipe = recipe_file(
        tmp_path / "r.yaml", model=str(sources / "src"), output_dir=str(out), distill={"teacher": str(sources / "src")}
    )
    result = cli("uptrain", "--recipe", recipe, override.replace("TRAIN", str(sources / "train.jsonl")))
    line = refused(result, words, SHARE_RULE, out=out, tmpdir=tmpdir_env)
    assert line.count(";") == 1 and "is empty: give" not in line  # one problem, not a second one about it


def test_a_mix_in_yamls_mapping_forms_is_the_notation(sources, tmp_path):
    from mha2gqa.uptrain.recipe_load import load_recipe

    train = str(sources / "train.jsonl")
    recipe = recipe_file(
        tmp_path / "r.yaml", model=str(sources / "src"), output_dir="o", distill={"teacher": str(sources / "src")}
    )
    for override in (f"data.train=[{train}: 0.5, parent: 50%]", f"data.train={{{train}: 0.5, parent: 0.5}}"):
        assert load_recipe(recipe, [override]).data.train == [f"{train}:0.5", "parent:0.5"]
    config = tmp_path / "c.yaml"
    config.write_text(
        f"source: {sources / 'src'}\ngroups: 2\nmethod: calibrated\ncalibration: [{train}: 1, austen: 3]\n"
    )
    result = cli("convert", "--config", config, tmp_path / "dst", "--dry-run")
    assert result.exit_code == 0 and "train.jsonl 25%, austen 75%" in result.output, result.output


@pytest.mark.parametrize("share", ["-0.5", "", "NAN", "0%"])
def test_sweep_calibration_reads_shares_by_the_same_rule(sources, tmp_path, tmpdir_env, share):
    out = tmp_path / "out"
    args = ["sweep", sources / "src", "--data", sources / "eval.txt", "--out", out, "--quiet"]
    calibration = ["--calibration", f"{sources / 'cal.txt'}:{share}", "--calibration", "austen:0.5"]
    refused(cli(*args, *calibration), *_share_words(share), out=out, tmpdir=tmpdir_env)


def test_a_path_that_holds_a_colon_stays_reachable(sources, tmp_path):
    odd = str(sources / "notes:v2.txt")
    assert parse_spec(odd) == [(odd, None)]  # an existing path is read whole
    assert parse_spec([f"{odd}:0.5", "austen:50%"]) == [(odd, 0.5), ("austen", 0.5)]  # a share after one more colon
    assert parse_spec(["cal.txt:1e-1", "parent:.5", "x:+2"]) == [("cal.txt", 0.1), ("parent", 0.5), ("x", 2.0)]
    for calibration in ([odd], [f"{odd}:0.5", "austen:0.5"]):
        result = cli(*_convert_args(sources, tmp_path / "dst", *calibration), "--dry-run")
        assert result.exit_code == 0, result.output
        assert "notes:v2.txt" in result.output and not (tmp_path / "dst").exists()


def test_a_name_with_a_colon_that_is_no_share_is_left_to_the_readers():
    """A hub dataset's name may hold a colon: what follows it is no number, and nothing before it exists."""
    assert parse_spec("someorg/data:v2") == [("someorg/data:v2", None)]


# --------------------------------------------- class 2: a domain name breaks its rule in the rule's words
BAD_NAMES = ["9lives", "x" * 41, "my text", "", "naïve", "a.b", "-x", "_x", "prose!"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_eval_refuses_a_bad_domain_name_as_a_bad_name(sources, tmp_path, tmpdir_env, name):
    out = tmp_path / "r.json"
    started = time.perf_counter()
    result = cli("eval", sources / "src", "--data", f"{name}={sources / 'eval.txt'}", "--out", out)
    line = refused(result, NAME_RULE, out=out, tmpdir=tmpdir_env, started=started)
    assert ("is empty" in line) if not name else (f"{name!r} is not a domain name" in line), line
    assert "no such file" not in line


def test_sweep_takes_the_same_rule(sources, tmp_path, tmpdir_env):
    out = tmp_path / "out"
    result = cli("sweep", sources / "src", "--data", f"2024={sources / 'eval.txt'}", "--out", out, "--quiet")
    refused(result, "'2024' is not a domain name", NAME_RULE, out=out, tmpdir=tmpdir_env)
    result = cli("sweep", sources / "src", "--data", "prose=", "--out", out, "--quiet")
    refused(result, "--data prose=: names no text after '='", out=out, tmpdir=tmpdir_env)


def test_a_path_that_holds_an_equals_sign_is_a_path(tmp_path):
    with contextlib.chdir(tmp_path):
        Path("k=v.txt").write_text("text")
        Path("dir").mkdir()
        assert parse_domains(["k=v.txt"]) == {"data": "k=v.txt"}  # an existing path wins
        assert parse_domains(["./9=missing.txt"]) == {"data": "./9=missing.txt"}  # ./ forces a path
        assert parse_domains(["dir/a=b.txt"]) == {"data": "dir/a=b.txt"}  # so does any / before the =
        assert parse_domains(["k=v.txt", "prose=k=v.txt"]) == {"data": "k=v.txt", "prose": "k=v.txt"}
        name = "a" + "b_-9" * 9 + "xyz"  # 40 characters: the longest name
        assert parse_domains([f"{name}=k.txt"]) == {name: "k.txt"}


def test_eval_reads_a_file_whose_name_holds_an_equals_sign(sources, tmp_path):
    (tmp_path / "split=test.txt").write_text(SAMPLE_TEXT)
    out = tmp_path / "r.json"
    args = ["eval", sources / "src", "--data", "split=test.txt", "--data", "prose=./split=test.txt"]
    result = cli(*args, "--speed", "off", "--max-tokens", "64", "--out", out, "--quiet", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    domains = json.loads(out.read_text())["domains"]
    assert sorted(domains) == ["data", "prose"]


def test_the_domain_name_rule_is_in_the_help_and_the_docs():
    help_text = " ".join(cli("eval", "--help").output.split())
    assert "NAME starts with a letter, then letters, digits, _ or -, at most 40 characters" in help_text
    docs = " ".join((REPO / "docs" / "eval.md").read_text().split())
    assert "starts with a letter, then letters, digits, `_` or `-`, at most 40 characters" in docs
    assert "`./a=b.txt`" in docs


# ----------------------------------------------------------- class 3: a conversion replays from anywhere
def _checkpoint_files(model_dir: Path) -> dict[str, bytes]:
    made = ("mha2gqa.json", "README.md", "convert.yaml")
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.name not in made}


def test_convert_yaml_replays_from_dst_and_from_anywhere(sources, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(sources / "src", work / "model")
    shutil.copyfile(sources / "cal.txt", work / "text.txt")
    first = ["--groups", "2", "--method", "calibrated", "--calibration-tokens", "256", "--quiet"]
    result = cli(
        "convert", "model", "made", "--calibration", "text.txt:0.7", "--calibration", "austen:0.3", *first, cwd=work
    )
    assert result.exit_code == 0, result.output
    text = (work / "made" / CONFIG_NAME).read_text()
    written = yaml.safe_load(text)
    assert written["source"] == str(work / "model")
    assert written["calibration"] == [f"{work / 'text.txt'}:0.7", "austen:0.3"]
    command = text.splitlines()[0].removeprefix("# ").split()  # mha2gqa convert --config convert.yaml DST
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd, config, out in (
        (work / "made", CONFIG_NAME, tmp_path / "again"),  # the file's own comment, from DST
        (elsewhere, work / "made" / CONFIG_NAME, "again"),  # from any other folder
    ):
        result = cli(*command[1:3], config, out, "--quiet", cwd=cwd)
        assert result.exit_code == 0, result.output
        again = cwd / out
        assert _checkpoint_files(again) == _checkpoint_files(work / "made")
        assert (again / CONFIG_NAME).read_text() == text  # the replay records the same file, byte for byte


def test_a_hub_id_and_reserved_names_stay_as_they_are(tmp_path):
    from mha2gqa.convert.config_file import anywhere

    with contextlib.chdir(tmp_path):
        Path("local.txt").write_text("text")
        config = {"source": "someorg/tiny-llama", "groups": 1, "calibration": ["parent:0.5", "local.txt:0.5"]}
        assert anywhere(config) == {**config, "calibration": ["parent:0.5", f"{tmp_path / 'local.txt'}:0.5"]}
        assert anywhere({"source": "someorg/tiny-llama", "calibration": ["wikitext"]})["calibration"] == ["wikitext"]
        assert anywhere({"source": "someorg/tiny-llama", "calibration": None})["calibration"] is None


# ------------------------------------------------ class 6: a name the tool reserves never hides a user's file
def _warnings(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("Warning: ")]


@pytest.fixture
def shadowed(tmp_path):
    """A working folder holding folders `parent` and `austen` and a file `probe` of the user's."""
    for name in ("parent", "austen"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text(SAMPLE_TEXT)
    (tmp_path / "probe").write_text(SAMPLE_TEXT)
    return tmp_path


def test_a_reserved_name_that_shadows_a_path_is_said_once(sources, shadowed):
    args = ["--method", "calibrated", "--dry-run"]
    result = cli(*_convert_args(sources, shadowed / "dst", "parent:0.5", "austen:0.5"), *args, cwd=shadowed)
    assert result.exit_code == 0, result.output
    assert _warnings(result) == [
        "Warning: --calibration parent means text sampled from the model (a name mha2gqa reserves), not ./parent "
        "in the working folder: to read that folder, write ./parent",
        "Warning: --calibration austen means the embedded Austen novels (a name mha2gqa reserves), not ./austen "
        "in the working folder: to read that folder, write ./austen",
    ]
    result = cli(*_convert_args(sources, shadowed / "dst", "./parent:0.5", "./austen:0.5"), *args, cwd=shadowed)
    assert result.exit_code == 0 and _warnings(result) == [], result.output
    assert "./parent" in result.output and "./austen" in result.output  # the user's text is what is read


def test_sweep_says_each_shadowed_name_once(sources, shadowed):
    """Each candidate's plan reads the calibration again: the warning is still one line per name."""
    args = ["sweep", sources / "src", "--out", shadowed / "out", "--calibration", "parent:0.5"]
    result = cli(*args, "--calibration", "austen:0.5", "--data", "probe", "--dry-run", "--quiet", cwd=shadowed)
    assert result.exit_code == 0, result.output
    found = _warnings(result)
    assert len(found) == 3 and len(set(found)) == 3, found
    assert any("--data probe means the probe set" in w and "write ./probe" in w for w in found), found
    assert not (shadowed / "out").exists()


def test_uptrain_data_train_says_it_too(shadowed):
    with contextlib.chdir(shadowed), pytest.warns(UserWarning, match="data.train parent means text sampled"):
        parse_spec(["parent:0.5", "./parent:0.5"], "data.train")
    with contextlib.chdir(shadowed.parent), warnings_as_errors():
        parse_spec(["parent:0.5", "austen:0.5"], "data.train")  # no such path there: not a word


def test_uptrain_data_train_says_it_for_retrieval_too(tmp_path):
    """`retrieval` is reserved in data.train (the copy-task prompts): a ./retrieval there is named, not read."""
    from mha2gqa.uptrain.data_spec import data_parts

    (tmp_path / "retrieval").write_text("a file a user happens to have\n")
    (tmp_path / "notes.txt").write_text("Some text to copy from. " * 40)
    spec = ["notes.txt:0.75", "retrieval:0.25"]
    with contextlib.chdir(tmp_path), pytest.warns(UserWarning, match=r"data.train retrieval means the copy-task"):
        parts = data_parts("data.train", spec, [], validate_files=True, field="text")
    assert [part.name for part in parts] == ["notes.txt", "retrieval"] and parts[1].text is None
    with contextlib.chdir(tmp_path), warnings_as_errors():  # in a calibration mix it is a file's name
        parse_spec(["notes.txt:0.5", "retrieval:0.5"], "--calibration")


@contextlib.contextmanager
def warnings_as_errors():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


@pytest.mark.parametrize(
    "command, files",
    [
        ("reproduce", {"ablations.md": "my own notes"}),
        ("reproduce", {"ablations.json": "{}", "quality_vs_kv.png": "mine"}),
        ("demo", {"report/report.md": "mine"}),
    ],
)
def test_files_mha2gqa_did_not_write_are_never_offered_to_force(tmp_path, tmpdir_env, command, files):
    out = tmp_path / "mine"
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = tree_digest(out)
    for force in ([], ["--force"]):
        result = cli(command, "--out", out, *force, "--dry-run")
        line = refused(result, f"which no {command} run wrote", out=out, tmpdir=tmpdir_env, left=["mine"])
        assert "--force" not in line and "earlier" not in line, line
        assert tree_digest(out) == before


# ----------------------------------------------- class 7: an empty part of a mix is refused before torch
_BEFORE_TORCH = """
import sys
from mha2gqa.cli import main
for recipe in sys.argv[1:]:
    try:
        main(["uptrain", "--recipe", recipe])
    except SystemExit as e:
        print("exit", e.code)
print("torch", "torch" in sys.modules)
"""


def test_an_empty_part_of_data_is_refused_before_torch(sources, tmp_path, tmpdir_env):
    import subprocess
    import sys

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": "  "}\n{"text": "\\n"}\n')
    (tmp_path / "hollow").mkdir()
    (tmp_path / "hollow" / "a.txt").write_text("\n\n")
    train = str(sources / "train.jsonl")
    cases = {  # data: the empty part named in the line
        "empty": ({"train": [f"{tmp_path / 'empty.txt'}:0.5", f"{train}:0.5"]}, "empty.txt holds no text"),
        "blank": ({"train": [f"{tmp_path / 'blank.jsonl'}:1", "parent:1"]}, "blank.jsonl holds no text"),
        "folder": ({"train": [f"{tmp_path / 'hollow'}:25%", f"{train}:75%"]}, "a.txt holds no text"),
        "plain": ({"train": [str(tmp_path / "empty.txt")]}, "empty.txt holds no text"),
        "eval": ({"train": [train], "eval": [str(tmp_path / "empty.txt")]}, "data.eval"),
    }
    recipes = []
    for name, (data, _) in cases.items():
        recipes.append(
            recipe_file(
                tmp_path / f"{name}.yaml",
                model=str(sources / "src"),
                output_dir=str(tmp_path / f"out-{name}"),
                distill={"teacher": str(sources / "src")},
                data=data,
            )
        )
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _BEFORE_TORCH, *map(str, recipes)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(mha2gqa.__file__).parent.parent)},  # the package under test
    )
    assert time.perf_counter() - started < 60
    assert done.stdout.split() == ["exit", "2"] * len(cases) + ["torch", "False"], done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == len(cases), done.stderr
    for line, (_, words) in zip(errors, cases.values()):
        assert words in line and "holds no text" in line, line
    assert not any((tmp_path / f"out-{name}").exists() for name in cases)
    assert list(tmpdir_env.iterdir()) == []


# ------------------------------------------------------ class 5: a dry run answers as the run would
def _both(src: Path, dst: Path, *flags) -> tuple[str, str]:
    """The error lines of `convert --dry-run` and of the real run to `dst`, each asserted one line, exit 2."""
    lines = []
    for dry in (["--dry-run"], []):
        result = cli("convert", src, dst, "--groups", "2", *flags, *dry, "--quiet")
        lines.append(error_line(result, 2, strict=False))
        assert not dst.exists()
    return lines[0], lines[1]


def test_a_dry_run_to_a_read_only_filesystem_is_refused_as_the_run_is(sources, tmp_path, tmpdir_env):
    from fault_helpers import remount_readonly, tmpfs

    with tmpfs(tmp_path / "ro", "1m") as mount:
        remount_readonly(mount)
        dry, real = _both(sources / "src", mount / "dst")
        assert dry == real and "is not writable" in dry, (dry, real)
        dry, real = _both(sources / "src", mount / "deep" / "dst")  # parents the run would make: not made
        assert dry == real and "is not writable" in dry
    assert list(tmpdir_env.iterdir()) == []


def test_a_dry_run_to_a_filesystem_too_small_is_refused_as_the_run_is(sources, tmp_path, tmpdir_env):
    from fault_helpers import tmpfs

    with tmpfs(tmp_path / "small", "16k") as mount:
        dry, real = _both(sources / "src", mount / "dst")
        assert dry == real and "MiB free" in dry and "needs" in dry, (dry, real)
        assert sorted(p.name for p in mount.iterdir()) == []  # no lock file, no partial folder
    assert list(tmpdir_env.iterdir()) == []


def test_a_dry_run_names_the_run_that_holds_dst_and_says_what_it_checked(sources, tmp_path):
    from mha2gqa.files.writing import claim

    dst = tmp_path / "new" / "dst"
    result = cli("convert", sources / "src", dst, "--groups", "2", "--dry-run", "--quiet")
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("checked: ")]
    assert f"{tmp_path} is writable and has" in line and "free for the" in line and "the run writes" in line
    assert not (tmp_path / "new").exists()  # the parents the run would make are not made by a dry run
    dst.parent.mkdir()
    with claim(dst, f"DST {dst}"):
        result = cli("convert", sources / "src", dst, "--groups", "2", "--dry-run", "--quiet")
        assert f"is being written by another mha2gqa run (PID {os.getpid()}" in error_line(result, 2, strict=False)
    assert sorted(p.name for p in dst.parent.iterdir()) == []


# -------------------------------- class 4: --resume trusts only what it can check; class 8: a refused one
@pytest.fixture(scope="module")
def interrupted(tiny, tmp_path_factory):
    """A sweep of kv2-mean and kv1-mean stopped by Ctrl-C at the second candidate: kv2-mean finished."""
    import mha2gqa.eval.run as eval_run

    out = tmp_path_factory.mktemp("interrupted") / "out"
    evaluate, seen = eval_run.evaluate, []

    def stop_at_the_second_candidate(path, *args, **kwargs):
        seen.append(Path(path).name)
        if len(seen) == 3:  # the parent, kv2-mean, then kv1-mean
            raise KeyboardInterrupt
        return evaluate(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eval_run, "evaluate", stop_at_the_second_candidate)
        assert cli(*_resume_args(tiny, out)).exit_code == 130
    assert [r["name"] for r in json.loads((out / "sweep.json").read_text())["candidates"]] == ["kv2-mean"]
    return out


def _resume_args(tiny: Path, out: Path, *extra) -> list:
    from fault_helpers import sweep_args

    return sweep_args(tiny, out, "--methods", "mean", *extra)


@pytest.fixture
def resumable(interrupted, tmp_path, monkeypatch):
    """A copy of the interrupted sweep, and the names evaluate is called with from now on."""
    import mha2gqa.eval.run as eval_run

    out = tmp_path / "out"
    shutil.copytree(interrupted, out)
    evaluate, seen = eval_run.evaluate, []
    monkeypatch.setattr(
        eval_run, "evaluate", lambda path, *a, **k: seen.append(Path(path).name) or evaluate(path, *a, **k)
    )
    return out, seen


def _edit(out: Path, edit) -> None:
    """sweep.json edited by hand and written back as Python's json writes it (NaN as a bare NaN)."""
    record = json.loads((out / "sweep.json").read_text())
    edit(record)
    (out / "sweep.json").write_text(json.dumps(record, indent=2))


def _set(path: str, value):
    def edit(record):
        *parents, leaf = path.split(".")
        node = record
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[leaf] = value

    return edit


EDITS = {  # what was edited, and the words of the line that says the row is run again
    "a NaN perplexity": (_set("candidates.0.perplexity", math.nan), "perplexity is not a finite number"),
    "an infinite KL": (_set("candidates.0.kl_mean", -math.inf), "kl_mean is not a finite number"),
    "a NaN inside a domain": (_set("candidates.0.domains.eval.ratio", math.nan), "domains.eval.ratio is not a finite"),
    "the kv-head count": (_set("candidates.0.groups", 1), "its groups 1 and method 'mean' do not give its name"),
    "a finite perplexity": (_set("candidates.0.perplexity", 1.5), "its perplexity is not what its eval result gives"),
    "a domain's ratio": (_set("candidates.0.domains.eval.ratio", 0.5), "its domains is not what its eval result"),
    "the result's kv heads": (_set("candidates.0.result.model.kv_heads", 4), "its result measured 4 kv heads"),
    "no result": (_set("candidates.0.result", None), "it holds no eval result"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_resume_runs_again_a_finished_row_that_does_not_hold(tiny, resumable, edit):
    out, seen = resumable
    change, words = EDITS[edit]
    _edit(out, change)
    result = cli(*_resume_args(tiny, out, "--resume"))
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.output.splitlines() if "does not hold" in ln]
    assert "candidate 'kv2-mean'" in line and words in line and "running it again" in line, line
    assert seen == ["kv2-mean", "kv1-mean"]  # the parent held: measured once, not again
    record = _strict_json(out / "sweep.json")
    assert [r["name"] for r in record["candidates"]] == ["kv2-mean", "kv1-mean"]
    assert record["candidates"][0]["groups"] == 2 and math.isfinite(record["candidates"][0]["perplexity"])


def test_resume_measures_everything_again_when_the_parent_does_not_hold(tiny, resumable):
    out, seen = resumable
    _edit(out, _set("parent.perplexity", math.nan))
    result = cli(*_resume_args(tiny, out, "--resume"))
    assert result.exit_code == 0, result.output
    assert "the parent's entry in sweep.json does not hold (perplexity is not a finite number)" in result.output
    assert seen == ["src", "kv2-mean", "kv1-mean"]
    assert math.isfinite(_strict_json(out / "sweep.json")["parent"]["perplexity"])


def test_resume_keeps_a_row_that_holds(tiny, resumable):
    """The control: nothing edited, nothing run again (this held before issue 38 too)."""
    out, seen = resumable
    result = cli(*_resume_args(tiny, out, "--resume"))
    assert result.exit_code == 0 and "does not hold" not in result.output, result.output
    assert seen == ["kv1-mean"]


def _strict_json(path: Path):
    def refuse(word):
        raise ValueError(f"{path} holds {word}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _state(root: Path) -> dict:
    """Every entry under root (hidden ones too): a file by its sha256, a folder as such."""
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(root.rglob("*"))
    }


REFUSED_RESUMES = {
    "a changed seed": (["--seed", "7"], "--resume: --seed differs"),
    "a changed calibration": (["--calibration", "austen"], "--resume: --calibration differs"),
    "force too": (["--force"], "--force and --resume contradict each other"),
    "no kv-head count": (["--groups", "3"], "--groups 3 leaves no kv-head count to try"),
}


@pytest.mark.parametrize("case", REFUSED_RESUMES)
def test_a_refused_resume_leaves_the_state_it_found(tiny, resumable, case):
    """Debris of killed runs (a dead PID's scratch in OUT, a dead run's old copy beside it) is removed only by
    a resume that starts; a refused one, or a --dry-run, changes nothing."""
    out, seen = resumable
    (out / ".sweep-999999999").mkdir()
    (out / ".sweep-999999999" / "stats.bin").write_bytes(b"\0" * 64)
    (out.parent / ".out.old-999999999").mkdir()
    before = _state(out.parent)
    flags, words = REFUSED_RESUMES[case]
    assert words in error_line(cli(*_resume_args(tiny, out, "--resume", *flags)), 2, strict=False)
    assert _state(out.parent) == before and seen == []
    assert cli(*_resume_args(tiny, out, "--resume", "--dry-run")).exit_code == 0
    assert _state(out.parent) == before and seen == []
    assert cli(*_resume_args(tiny, out, "--resume")).exit_code == 0  # a resume that starts: the debris goes
    assert not (out / ".sweep-999999999").exists() and not (out.parent / ".out.old-999999999").exists()


def test_guarantees_say_what_resume_removes_and_when():
    text = " ".join((REPO / "docs" / "guarantees.md").read_text().split())
    assert "A refused `--resume` changes nothing" in text
    assert (
        "removes a dead PID's `.sweep-PID` scratch and `.OUT.old-PID` leftovers only once every check has passed"
        in text
    )
