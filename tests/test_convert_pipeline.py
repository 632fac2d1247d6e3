"""prepare -> execute: every input read once, every mistake refused before the disk is touched, --dry-run
shows every stage, the model card's Reproduce command makes the same checkpoint byte for byte, and
refine's spill files get their room up front, inside DST's partial folder."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer

from mha2gqa.cli import main
from mha2gqa.convert.options import ConvertOptions, RefineOptions
from mha2gqa.convert.prepare import prepare
from mha2gqa.convert.run import convert

QUICK = RefineOptions(steps=3, lr=2e-3, tokens=512, batch_blocks=2)


def test_one_parent_load_and_one_tokenization(tmp_path, tiny_src, calibration_file, monkeypatch):
    """Calibration and refine share the parent and the calibration ids: each is made once per convert."""
    from mha2gqa.corpus import calibration
    from mha2gqa.files import loading

    counts, loaded = {"tokenize": 0}, []
    real_load, real_ids = loading.load_causal_lm, calibration.text_ids

    def load(*args, **kwargs):
        loaded.append(Path(args[0]).name)
        return real_load(*args, **kwargs)

    def ids(*args, **kwargs):
        counts["tokenize"] += 1
        return real_ids(*args, **kwargs)

    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "load_causal_lm", load)
    monkeypatch.setattr(calibration, "text_ids", ids)
    result = convert(
        tiny_src,
        tmp_path / "dst",
        2,
        method="calibrated",
        calibration=calibration_file,
        calibration_tokens=1024,
        refine=QUICK,
        progress=False,
    )
    assert result.refine["layers"] and result.layers  # both stages ran
    # The parent once, for the statistics, refine and the check; the converted model once, by the check.
    assert loaded[0] == tiny_src.name and loaded[1].startswith(".dst.partial") and len(loaded) == 2
    assert counts["tokenize"] == 1
    assert result.check["parent_cached"] is False
    loaded.clear()
    counts.update(tokenize=0)
    convert(tiny_src, tmp_path / "plain", 2, method="mean-norm", progress=False, check=False)  # nothing to read
    assert loaded == [] and counts["tokenize"] == 0
    checked = convert(tiny_src, tmp_path / "checked", 2, method="mean-norm", progress=False)
    assert (
        len(loaded) == 1 and loaded[0].startswith(".checked.partial") and checked.check["parent_cached"] is True
    )  # the parent's numbers came cached


def test_stats_travel_as_their_own_argument(tmp_path, tiny_src, calibration_file):
    """A sweep's statistics, gathered once, give the same checkpoint as calibrating inside convert."""
    from mha2gqa.architecture.layouts import attention_shape, layout_for, read_config
    from mha2gqa.convert.calibration import calibrate

    config = read_config(tiny_src)
    stats = calibrate(tiny_src, layout_for(config), attention_shape(config), calibration_file, 1024, tmp_path)
    with pytest.raises(TypeError, match="stats="):  # the options' calibration field holds data, not statistics
        convert(tiny_src, tmp_path / "wrong", 2, method="calibrated", calibration=stats, progress=False)
    for name, kwargs in (("inside", {"calibration": calibration_file}), ("given", {"stats": stats})):
        convert(tiny_src, tmp_path / name, 2, method="calibrated", calibration_tokens=1024, progress=False, **kwargs)
    inside, given = ((tmp_path / n / "model.safetensors").read_bytes() for n in ("inside", "given"))
    assert inside == given
    assert _card_command(tmp_path / "given") == _card_command(tmp_path / "inside")  # the card names the data


def test_dry_run_prints_every_stage_and_writes_nothing(tmp_path, tiny_src, calibration_file):
    args = ["convert", str(tiny_src), str(tmp_path / "dst"), "-g", "2", "--method", "calibrated"]
    args += ["--calibration", calibration_file, "--calibration-tokens", "1024", "--refine", "--refine-tokens", "512"]
    result = CliRunner().invoke(main, [*args, "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    stages = [line.split(":")[1].strip() for line in lines if line.startswith("stage ")]
    assert stages == ["calibrate", "merge", "refine", "refine (global)", "write", "check", "metadata"], lines
    refine = next(line for line in lines if line.startswith("stage 3: refine"))
    assert "up to 448 fit and 64 held-out tokens" in refine  # 512 tokens: 8 blocks of 64, 1 held out
    # priced as the run would be: a run this short is not worth a probe, and says so (a long one: test_estimates.py)
    assert re.fullmatch(
        r"time: about .*not scaled to this one: a probe would cost more than 2% of a run this short; .*", lines[-2]
    )
    global_stage = next(line for line in lines if line.startswith("stage 4: refine"))
    assert "up to 64 Adam steps (lr 0.0002" in global_stage and "checked every 10 steps" in global_stage
    # 64 held-out block tokens + 2 held-out openings of 8, x a vocabulary of 128 x 4 B
    assert "the parent's logits on the 80 held-out tokens kept between checks: 40.00 KiB" in global_stage
    small = ["--refine-memory", "1KiB", "--dry-run"]
    tight = next(line for line in CliRunner().invoke(main, [*args, *small]).output.splitlines() if "stage 4" in line)
    assert "are over --refine-memory, so they are computed again at each check" in tight
    off = CliRunner().invoke(main, [*args, "--refine-global-steps", "0", "--dry-run"]).output.splitlines()
    assert [line.split(":")[1].strip() for line in off if line.startswith("stage ")] == [
        "calibrate", "merge", "refine", "write", "check", "metadata"
    ]  # fmt: skip
    assert "up to 1,024 tokens" in next(line for line in lines if line.startswith("stage 1: calibrate"))
    estimates = next(line for line in lines if line.startswith("estimates:"))
    assert "written to DST" in estimates and "peak memory about" in estimates
    assert list(tmp_path.iterdir()) == []
    plan = prepare(tiny_src, ConvertOptions(2, calibration=calibration_file, calibration_tokens=1024, refine=QUICK))
    assert plan.refine_budget.blocks == 8 and plan.peak_memory > 0 and plan.bytes_written > plan.tensors.bytes_out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--calibration-tokens", "0", "--method", "calibrated"], "--calibration-tokens 0 must be at least 1"),
        (["--refine", "--refine-lr", "inf"], "--refine-lr inf must be a finite positive number"),
        (["--refine", "--refine-lr", "nan"], "--refine-lr nan must be a finite positive number"),
        (["--refine", "--refine-steps", "-2"], "--refine-steps -2 must be 0 or more"),
        (["--method", "calibrated", "--grouping", "similarity", "--calibration-tokens", "0"], "must be at least 1"),
        (["--refine", "--calibration-tokens", "100"], "at least 2 calibration blocks of 64 tokens"),
        (["--method", "nope"], "'nope' is not one of"),
        (["--dtype", "int8"], "--dtype 'int8' is unknown"),
        (["--max-shard-size", "big"], "--max-shard-size 'big' is not a size"),
        (["--calibration-memory", "0"], "--calibration-memory '0' must be positive"),
    ],
)
def test_mistakes_are_refused_before_anything_is_created(tmp_path, tiny_src, calibration_file, flags, message):
    """Listing DST's parent: no DST, no lock, no partial folder, no statistics."""
    parent = tmp_path / "out"
    parent.mkdir()
    args = ["convert", str(tiny_src), str(parent / "dst"), "-g", "2", "--calibration", calibration_file, *flags]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.output.count("Error:") == 1 and message in result.output, result.output
    assert list(parent.iterdir()) == []


def _card_command(model_dir: Path) -> list[str]:
    card = (model_dir / "README.md").read_text()
    (line,) = [line for line in card.splitlines() if line.startswith("mha2gqa convert ")]
    return shlex.split(line, comments=True)


def _checkpoint_files(model_dir: Path) -> dict[str, bytes]:
    """Everything but the record, the card and convert.yaml (they name dates, folders and the options themselves)."""
    made = ("mha2gqa.json", "README.md", "convert.yaml")
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.name not in made}


# One conversion per flag of the table that changes the output, with that flag's field at a value other than
# its default (and what it needs to take effect): the card's command, run again, gives the same bytes.
CAL = dict(calibration="CAL", calibration_tokens=1024)
REFINE = dict(method="calibrated", **CAL)
NON_DEFAULT = {  # flag: (convert keywords, RefineOptions keywords or None)
    "--groups": (dict(groups=1), None),
    "--method": (dict(method="first"), None),
    "--seed": (dict(method="random", seed=3), None),
    "--dtype": (dict(method="mean-norm", dtype="bfloat16"), None),
    "--max-shard-size": (dict(max_shard_size="40KB"), None),
    "--calibration": (dict(method="calibrated", calibration="CAL"), None),
    "--calibration-tokens": (dict(REFINE, calibration_tokens=768), None),
    "--calibration-memory": (dict(REFINE, calibration_memory="100KiB"), None),
    "--grouping": (dict(grouping="similarity", **CAL), None),
    "--keep-retrieval-heads": (dict(keep_retrieval_heads=True), None),
    "--retrieval-weight": (dict(keep_retrieval_heads=True, retrieval_weight=2.0), None),
    "--refine": (REFINE, {}),
    "--refine-steps": (REFINE, dict(steps=2)),
    "--refine-lr": (REFINE, dict(lr=3e-3)),
    "--refine-memory": (REFINE, dict(memory=1)),
    "--refine-tokens": (REFINE, dict(tokens=384)),
    "--refine-global-steps": (REFINE, dict(global_steps=3)),
    "--refine-global-lr": (REFINE, dict(global_steps=3, global_lr=1e-3)),
    "--refine-global-precision": (REFINE, dict(global_steps=3, global_precision="bfloat16")),
    "--refine-batch-blocks": (REFINE, dict(batch_blocks=3)),
    "--refine-opening-weight": (REFINE, dict(opening_weight=1.0)),
    "--refine-solve-output": (REFINE, dict(solve_output=False)),
    "--refine-seed": (REFINE, dict(seed=7)),
}


def test_every_flag_that_changes_the_output_has_a_reproduce_case():
    from mha2gqa.convert.options import CONVERT_FLAGS

    # the per-layer flags have their own planner and card: their reproduce case is in tests/test_nemotron_nas.py
    per_layer = ("--kv-heads-per-layer", "--kv-budget")
    assert list(NON_DEFAULT) == [
        flag.flag for flag in CONVERT_FLAGS if flag.changes_output and flag.flag not in per_layer
    ]


# the retrieval questions need a context longer than tiny_src's 64 tokens (their shortest: 148 with its tokenizer)
LONG_CONTEXT = ("--keep-retrieval-heads", "--retrieval-weight")


@pytest.fixture(scope="module")
def long_src(tmp_path_factory):
    from tiny_models import make_tiny_tokenizer, save_tiny_model

    src = tmp_path_factory.mktemp("long") / "llama"
    save_tiny_model(src, "llama", max_position_embeddings=512)
    make_tiny_tokenizer(src)
    return src


@pytest.mark.parametrize("flag", list(NON_DEFAULT))
def test_the_cards_reproduce_command_makes_the_same_checkpoint(tmp_path, request, calibration_file, flag):
    tiny_src = request.getfixturevalue("long_src" if flag in LONG_CONTEXT else "tiny_src")
    kwargs, refine = NON_DEFAULT[flag]
    kwargs = {key: calibration_file if value == "CAL" else value for key, value in kwargs.items()}
    groups = kwargs.pop("groups", 2)
    if refine is not None:  # quick settings, the case's field on top
        kwargs["refine"] = RefineOptions(**{**QUICK.__dict__, "global_steps": 0, **refine})
    convert(tiny_src, tmp_path / "made", groups, progress=False, **kwargs)
    words = _card_command(tmp_path / "made")
    assert words[:4] == ["mha2gqa", "convert", str(tiny_src), "OUT"], words
    assert flag in words or f"--no-{flag[2:]}" in words, words
    result = CliRunner().invoke(main, [*[str(tmp_path / "again") if w == "OUT" else w for w in words[1:]], "--quiet"])
    assert result.exit_code == 0, result.output
    assert _checkpoint_files(tmp_path / "again") == _checkpoint_files(tmp_path / "made")
    assert _card_command(tmp_path / "again") == words  # and it records the same command


def test_a_plain_merge_command_leaves_out_the_calibration_it_does_not_need(tmp_path, tiny_src, calibration_file):
    convert(tiny_src, tmp_path / "made", 2, calibration=calibration_file, calibration_tokens=512, progress=False)
    words = _card_command(tmp_path / "made")
    assert words == ["mha2gqa", "convert", str(tiny_src), "OUT", "--groups", "2", "--method", "mean"]


def test_the_embedded_corpus_is_named_in_the_card_not_listed(tmp_path, tiny_src):
    """--calibration austen is written as `austen` (it was a Python list repr no shell could pass back)."""
    result = CliRunner().invoke(
        main,
        ["convert", str(tiny_src), str(tmp_path / "a"), "-g", "2", "--method", "calibrated"]
        + ["--calibration", "austen", "--calibration-tokens", "256", "--quiet"],
    )
    assert result.exit_code == 0, result.output
    words = _card_command(tmp_path / "a")
    assert words[words.index("--calibration") + 1] == "austen" and words.count("--calibration") == 1
    again = [str(tmp_path / "b") if w == "OUT" else w for w in words[1:]]
    assert CliRunner().invoke(main, [*again, "--quiet"]).exit_code == 0
    assert _checkpoint_files(tmp_path / "b") == _checkpoint_files(tmp_path / "a")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (root only: the full-disk cases need a real filesystem that fills)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_spill_files_reserve_their_room(small_tmpfs):
    """Buffers bigger than the disk: ENOSPC naming the file at reservation, not a SIGBUS when written."""
    import errno

    import torch

    from mha2gqa.convert.refine import ActivationBuffers

    with pytest.raises(OSError) as caught:
        ActivationBuffers(64, 64, 64, memory=1, device=torch.device("cpu"), spill_dir=small_tmpfs)
    assert caught.value.errno == errno.ENOSPC and str(small_tmpfs) in caught.value.filename
    assert list(small_tmpfs.iterdir()) == []  # the reserved files are gone
    buffers = ActivationBuffers(2, 64, 64, memory=1, device=torch.device("cpu"), spill_dir=small_tmpfs)
    buffers["targets"].fill_(1.0)  # fits: written through the mapping
    assert buffers.spill_dir.parent == small_tmpfs and buffers["targets"].sum() == 2 * 64 * 64
    buffers.close()
    assert list(small_tmpfs.iterdir()) == []


def test_refine_on_a_full_disk_is_one_error_and_a_full_tmpdir_is_not_used(tmp_path, tiny_src, small_tmpfs, monkeypatch):
    long_text = tmp_path / "long.txt"
    long_text.write_text(SAMPLE_TEXT * 80)
    calibration_file = str(long_text)
    spill = RefineOptions(steps=1, memory=1, tokens=4096)  # memory 1 byte: the buffers spill
    monkeypatch.setenv("TMPDIR", str(small_tmpfs))
    monkeypatch.setattr("tempfile.tempdir", None)
    with open(small_tmpfs / "filler", "wb") as f:  # $TMPDIR full
        f.write(b"\0" * (2 << 20))
    kwargs = dict(method="mean", calibration=calibration_file, calibration_tokens=4096, refine=spill, progress=False)
    result = convert(tiny_src, tmp_path / "dst", 2, **kwargs)
    assert result.refine["spilled_to_disk"] and sorted(p.name for p in small_tmpfs.iterdir()) == ["filler"]
    (small_tmpfs / "filler").unlink()
    monkeypatch.delenv("TMPDIR")
    monkeypatch.setattr("tempfile.tempdir", None)
    # DST on the small disk: the checkpoint fits, the spill files (4 x 64 blocks x 64 x 64 float32: 4 MiB) do not.
    flags = ["--method", "mean", "--calibration", calibration_file, "--calibration-tokens", "4096", "--refine"]
    flags += ["--refine-memory", "1", "--refine-steps", "1", "--refine-tokens", "4096", "--quiet"]
    source_bytes = {p.name: p.read_bytes() for p in tiny_src.iterdir()}
    outcome = CliRunner().invoke(main, ["convert", str(tiny_src), str(small_tmpfs / "dst"), "-g", "2", *flags])
    assert outcome.exit_code == 2, outcome.output
    assert outcome.output.count("Error:") == 1 and len(outcome.output.strip().splitlines()) == 1, outcome.output
    assert list(small_tmpfs.iterdir()) == []
    assert {p.name: p.read_bytes() for p in tiny_src.iterdir()} == source_bytes


@pytest.mark.parametrize("groups", ["8", "3", "0"])
def test_demo_checks_groups_through_prepare_and_creates_nothing(tmp_path, groups):
    """`demo --groups 8` left an empty folder and listed 8 as valid; its --help said "1, 2 or 4"."""
    result = CliRunner().invoke(main, ["demo", "--groups", groups, "--out", str(tmp_path / "demo")])
    assert result.exit_code == 2, result.output
    assert result.output.count("Error:") == 1 and "(valid: 1, 2, 4)" in result.output, result.output
    assert list(tmp_path.iterdir()) == []
    help_text = " ".join(CliRunner().invoke(main, ["demo", "--help"]).output.split())
    assert "8-head model (1, 2 or 4)" in help_text


def test_a_refit_that_goes_non_finite_is_kept_as_merged_and_said(tmp_path, tiny_src, calibration_file):
    """lr 1e30 is finite (so accepted) but blows every Adam step up: the layer stays merged, with a warning."""
    from mha2gqa.runtime.errors import WeightWarning

    wild = RefineOptions(steps=2, lr=1e30, tokens=512, solve_output=False)
    kwargs = dict(method="mean", calibration=calibration_file, calibration_tokens=1024, progress=False)
    with pytest.warns(WeightWarning, match="went non-finite .* kept as merged"):
        result = convert(tiny_src, tmp_path / "wild", 2, refine=wild, **kwargs)
    assert {row.get("kept_merged") for row in result.refine["layers"]} == {"non-finite"}
    convert(tiny_src, tmp_path / "merged", 2, **kwargs)
    assert _checkpoint_files(tmp_path / "wild") == _checkpoint_files(tmp_path / "merged")


def test_refine_of_an_unsupported_layout_is_refused_before_anything_is_created(tmp_path, calibration_file):
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=64)).save_pretrained(src)
    make_tiny_tokenizer(src)
    parent = tmp_path / "out"
    parent.mkdir()
    args = ["convert", str(src), str(parent / "dst"), "-g", "1", "--calibration", calibration_file, "--refine"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and result.output.count("Error:") == 1, result.output
    assert "--refine cannot refine model_type 'gpt2'" in result.output
    assert list(parent.iterdir()) == []
