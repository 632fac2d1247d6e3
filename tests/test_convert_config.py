"""`convert --config FILE`: the options as YAML (the flags' keys), checked by the flags' own types with their
messages, a flag on the command line over the file, SRC/DST in the file or on the command line; every conversion
writes DST/convert.yaml, and a conversion made from it is byte-identical to the one that wrote it."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_convert_pipeline import NON_DEFAULT, QUICK, _card_command, _checkpoint_files

from mha2gqa.cli import main
from mha2gqa.cli.convert_cmd import convert as convert_command
from mha2gqa.convert.config_file import CONFIG_NAME, MAX_CONFIG_BYTES, render, values
from mha2gqa.convert.options import RefineOptions, flag_words, options_from_flags
from mha2gqa.convert.run import convert


def _config_line(model_dir: Path) -> list[str]:
    """The card's `mha2gqa convert --config convert.yaml SRC OUT` (a comment beside the command line)."""
    card = (model_dir / "README.md").read_text()
    (line,) = [line for line in card.splitlines() if "mha2gqa convert --config" in line]
    return shlex.split(line[line.index("mha2gqa convert") :])


CASES = {  # groups, convert keywords ("CAL": the calibration file)
    "mean": (2, {}),
    "calibrated-refine": (
        1,
        dict(
            method="calibrated",
            calibration=["CAL:0.5", "austen:0.5"],
            calibration_tokens=768,
            seed=3,
            refine=RefineOptions(**{**QUICK.__dict__, "steps": 2, "global_steps": 2, "solve_output": False}),
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_conversion_from_the_written_config_is_byte_identical(tmp_path, tiny_src, calibration_file, case):
    groups, kwargs = CASES[case]
    if "calibration" in kwargs:
        kwargs = {**kwargs, "calibration": [c.replace("CAL", calibration_file) for c in kwargs["calibration"]]}
    made, again = tmp_path / "made", tmp_path / "again"
    convert(tiny_src, made, groups, progress=False, **kwargs)
    text = (made / CONFIG_NAME).read_text()
    assert text.startswith(f"# mha2gqa convert --config {CONFIG_NAME} DST\n"), text
    written = yaml.safe_load(text)
    assert written["source"] == str(tiny_src) and written["groups"] == groups
    words = _config_line(made)
    assert words == ["mha2gqa", "convert", "--config", CONFIG_NAME, str(tiny_src), "OUT"]
    card = (made / "README.md").read_text()  # the card shows the file, folded under its name
    block = card.split("<summary>convert.yaml</summary>", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == written
    run = [str(made / CONFIG_NAME) if w == CONFIG_NAME else str(again) if w == "OUT" else w for w in words[1:]]
    result = CliRunner().invoke(main, [*run, "--quiet"])
    assert result.exit_code == 0, result.output
    files = _checkpoint_files(made)
    assert "model.safetensors" in files and _checkpoint_files(again) == files
    assert (again / CONFIG_NAME).read_text() == text
    assert _card_command(again) == _card_command(made)


@pytest.mark.parametrize("flag", list(NON_DEFAULT))
def test_every_option_that_changes_the_output_survives_the_file(tmp_path, calibration_file, flag):
    """Each flag at a value other than its default: written to the file, read back through click, the same
    command line (without converting: the case above runs two conversions)."""
    from mha2gqa.convert.options import ConvertOptions

    kwargs, refine = NON_DEFAULT[flag]
    kwargs = {key: calibration_file if value == "CAL" else value for key, value in kwargs.items()}
    if refine is not None:
        kwargs["refine"] = RefineOptions(**{**QUICK.__dict__, **refine})
    options = ConvertOptions(**{"groups": 2, **kwargs})
    path = tmp_path / CONFIG_NAME
    path.write_text(render({"source": "SRC", **values(options)}))
    ctx = convert_command.make_context("convert", ["--config", str(path)])
    assert flag_words(options_from_flags(ctx.params)) == flag_words(options)


def test_a_flag_overrides_the_file_and_one_path_is_dst(tmp_path, tiny_src):
    path = tmp_path / "c.yaml"
    path.write_text(f"source: {tiny_src}\ngroups: 1\nmethod: first\ncalibration: [austen]\ndry_run: true\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", "--config", str(path), str(out)])
    assert result.exit_code == 0, result.output
    assert f"would write {out}: " in result.output and "kv heads 8 -> 1 by first" in result.output
    result = CliRunner().invoke(main, ["convert", "--config", str(path), str(out), "-g", "4", "--method", "mean"])
    assert "kv heads 8 -> 4 by mean" in result.output, result.output
    assert not out.exists()  # dry_run: true in the file
    result = CliRunner().invoke(main, ["convert", "--config", str(path), str(out), "--no-dry-run", "--quiet"])
    assert result.exit_code == 0 and (out / "model.safetensors").is_file(), result.output
    assert yaml.safe_load((out / CONFIG_NAME).read_text())["method"] == "first"


def test_source_and_destination_may_both_come_from_the_file(tmp_path, tiny_src):
    out = tmp_path / "out"
    path = tmp_path / "c.yaml"
    path.write_text(f"source: {tiny_src}\ndestination: {out}\ngroups: 2\nquiet: true\n")
    result = CliRunner().invoke(main, ["convert", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file()
    other = tmp_path / "other"
    result = CliRunner().invoke(main, ["convert", "--config", str(path), str(tiny_src), str(other)])
    assert result.exit_code == 0 and (other / "model.safetensors").is_file(), result.output


BAD = [  # file text, the one line's words
    ("groups: 2\nrefine-steps: 3\n", "unknown key 'refine-steps' (did you mean refine_steps?)"),
    ("groups: 2\ncalibraton: austen\n", "unknown key 'calibraton' (did you mean calibration?)"),
    ("groups: two\n", "Invalid value for '--groups' / '-g': 'two' is not a valid integer (groups: in --config"),
    ("groups: 2.5\n", "'2.5' is not a valid integer (groups: in --config"),
    ("groups: 2\nmethod: nope\n", "Invalid value for '--method': 'nope' is not one of"),
    ("groups: 2\nrefine: maybe\n", "refine: 'maybe' is not true or false (--refine is a switch)"),
    ("groups: 2\nseed: false\n", "Invalid value for '--seed': 'false' is not a valid integer (seed: in --config"),
    ("groups: [2, 4]\n", "groups: --groups takes one value, not a list"),
    ("groups:\n", "groups: has no value"),
    ("groups: 2\nsource: [a, b]\n", "source: must be one path or hub id"),
    ("- groups: 2\n", "holds a list, not a mapping"),
    (
        "groups: 2\nmethod: [mean\n",
        "is not valid YAML at line 3 (expected ',' or ']', but got '<stream end>', while "
        "parsing a flow sequence from line 2)",
    ),
    ("groups: 2\n  method: mean\n", "is not valid YAML at line 2"),
    (None, "no such file"),
    ("#" * (MAX_CONFIG_BYTES + 1), f"over mha2gqa's limit of {MAX_CONFIG_BYTES:,} bytes for a convert config"),
    ("groups: 2\nrefine: true\nrefine_steps: -2\n", "--refine-steps -2 must be 0 or more"),
]


@pytest.mark.parametrize("text, words", BAD)
def test_a_bad_config_is_one_line_exit_2_and_nothing_written(tmp_path, tiny_src, text, words):
    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    out = tmp_path / "out"
    before = sorted(tmp_path.iterdir())
    result = CliRunner().invoke(main, ["convert", "--config", str(path), str(tiny_src), str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.count("Error:") == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert words in result.output, result.output
    assert sorted(tmp_path.iterdir()) == before


def test_a_path_missing_from_both_is_named(tmp_path, tiny_src):
    path = tmp_path / "c.yaml"
    path.write_text("groups: 2\n")
    result = CliRunner().invoke(main, ["convert", "--config", str(path)])
    assert result.exit_code == 2 and "convert needs SRC" in result.output and "source: in --config" in result.output
    path.write_text(f"source: {tiny_src}\ndestination: {tmp_path / 'x'}\ngroups: 2\n")
    result = CliRunner().invoke(main, ["convert", "--config", str(path), str(tmp_path / "y")])
    assert result.exit_code == 2 and "names both source and destination" in result.output, result.output


def test_a_bad_config_is_refused_before_torch_is_imported(tmp_path, tiny_src):
    path = tmp_path / "c.yaml"
    path.write_text("groups: 2\nrefine_stpes: 3\n")
    code = (
        "import sys\nfrom mha2gqa.cli import main\n"
        f"try:\n    main(['convert', '--config', {str(path)!r}, {str(tiny_src)!r}, {str(tmp_path / 'o')!r}])\n"
        "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "exit 2 False", done.stdout + done.stderr
    assert "did you mean refine_steps?" in done.stderr


def test_the_docs_example_reads_as_written(tmp_path):
    """docs/convert.md's worked example is a config this parser takes, with the values it shows."""
    docs = (Path(__file__).parent.parent / "docs" / "convert.md").read_text()
    example = docs.split("## A config file", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / CONFIG_NAME
    path.write_text(example)
    ctx = convert_command.make_context("convert", ["--config", str(path), "out"])
    options = options_from_flags(ctx.params)
    assert (options.groups, options.method.value, options.calibration) == (
        1,
        "calibrated",
        ["parent:0.5", "austen:0.5"],
    )
    assert (options.refine.steps, options.refine.global_steps, options.calibration_tokens) == (40, 0, 73728)
