"""Output folders and refusals: the newer commands (reproduce, demo, sweep, report) check all their input
before any work and follow one rule for their output folder; file modes follow the umask; option values are
checked by their own rule; the source's side files never sink a conversion; loops, bounds and the warm hub
cache answer in one line.

Every refusal asserts exit code 2, exactly one `Error:` line, nothing beside OUT/DST, $TMPDIR empty and
the sources byte-identical."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import cli, error_line, sweep_args, tree_digest
from tiny_models import save_tiny_inputs

import mha2gqa.demo.ablations as ablations
import mha2gqa.eval.run as eval_run
from mha2gqa.files import embedded
from mha2gqa.files.run_folder import MARKER, mark
from mha2gqa.files.writing import write_atomic

REPO = Path(__file__).resolve().parent.parent
SHAPE = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture
def no_grid(monkeypatch):
    """A reproduce that gets past its checks fails the test at once (the old code ran the grid)."""
    monkeypatch.setattr(ablations, "run_grid", lambda *a, **k: pytest.fail("the grid started"))
    monkeypatch.setattr("mha2gqa.demo.pipeline._run_stages", lambda *a, **k: pytest.fail("the demo started"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny 4-kv-head llama with a tokenizer, calibration and eval text (sweep's inputs)."""
    return save_tiny_inputs(tmp_path_factory.mktemp("round3"), **SHAPE)


def _beside(out: Path) -> list[str]:
    """What a run left at OUT's place: OUT itself and any `.OUT.*` entry beside it."""
    if not out.parent.is_dir():
        return []
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def refused(result, *words, out: Path, tmpdir: Path, left=()) -> str:
    """The whole promise: exit 2, one Error line naming `words`, nothing at OUT's place but `left`
    (what was there before), $TMPDIR empty."""
    line = error_line(result, 2)
    for word in words:
        assert word in line, (word, line)
    assert _beside(out) == sorted(left), _beside(out)
    assert list(tmpdir.iterdir()) == []
    return line


_sweep_args = sweep_args


# ----------------------------------------------------------- class 1: every check before any work
REPRODUCE_FAULTS = {
    "kv heads that do not divide": (["--kv-heads", "3"], ["--kv-heads 3", "divide", "valid: 1, 2, 4 or 8"]),
    "kv heads naming nothing": (["--kv-heads", ","], ["--kv-heads (nothing)"]),
    "kv heads not numbers": (["--kv-heads", "two"], ["--kv-heads 'two'", "whole numbers"]),
    "an unknown method": (["--methods", "mean,bogus"], ["--methods bogus", "mean, first or random"]),
    "methods naming nothing": (["--methods", ""], ["--methods (nothing)"]),
    "alphas without 0": (["--alphas", "0.05,0.1"], ["--alphas 0.05,0.1 must hold 0"]),
    "alphas all 0": (["--alphas", "0"], ["--alphas 0 must hold 0", "a budget above it"]),
    "alphas above 1": (["--alphas", "0,2"], ["--alphas 0,2", "fraction in [0, 1]"]),
    "alphas not finite": (["--alphas", "0,nan"], ["--alphas 0,nan", "fraction in [0, 1]"]),
    "eval blocks 0": (["--eval-blocks", "0"], ["--eval-blocks 0 must be at least 1"]),
}


@pytest.mark.parametrize("fault", REPRODUCE_FAULTS)
def test_reproduce_checks_every_flag_before_any_work(tmp_path, tmpdir_env, no_grid, fault):
    flags, words = REPRODUCE_FAULTS[fault]
    before = tree_digest(embedded.model_dir())
    out = tmp_path / "ablations"
    refused(cli("reproduce", "--out", out, *flags), *words, out=out, tmpdir=tmpdir_env)
    assert tree_digest(embedded.model_dir()) == before


def test_reproduce_and_demo_dry_runs_check_and_write_nothing(tmp_path, tmpdir_env, no_grid):
    out = tmp_path / "ablations"
    result = cli("reproduce", "--out", out, "--methods", "mean", "--kv-heads", "2", "--alphas", "0,0.05", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "2 uptraining runs" not in result.output and "1 uptraining runs (methods mean x kv heads 2)" in result.output
    result = cli("demo", "--quick", "--out", tmp_path / "demo", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "to 2 kv heads by mean-pooling" in result.output and "alpha=0.01" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["TMPDIR"] and list(tmpdir_env.iterdir()) == []
    refused(
        cli("demo", "--groups", "3", "--out", tmp_path / "demo", "--dry-run"),
        "3",
        out=tmp_path / "demo",
        tmpdir=tmpdir_env,
    )


def test_a_failed_reproduce_leaves_no_work_folder(tmp_path, tmpdir_env, monkeypatch):
    def fail(out, *args, **kwargs):
        (out / "work" / "parent").mkdir(parents=True)
        raise OSError(28, "No space left on device", str(out / "work" / "parent" / "x"))

    monkeypatch.setattr(ablations, "run_grid", fail)
    out = tmp_path / "ablations"
    result = cli("reproduce", "--out", out, "--methods", "mean", "--kv-heads", "2", "--alphas", "0,0.05")
    refused(result, f"{out}: no space left", out=out, tmpdir=tmpdir_env)


# ------------------------------------------------- class 2: a user's files are never overwritten
@pytest.mark.parametrize("command", ["reproduce", "demo"])
def test_a_users_file_in_out_is_never_replaced(tmp_path, tmpdir_env, no_grid, command):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "ablations.md").write_text("my notes")  # a name reproduce writes, in a folder that is no run
    (out / "notes.txt").write_text("mine")
    before = tree_digest(out)
    for force in ([], ["--force"]):
        refused(
            cli(command, "--out", out, *force),
            "holds files that are not a",
            "notes.txt",
            out=out,
            tmpdir=tmpdir_env,
            left=["mine"],
        )
        assert tree_digest(out) == before


def test_an_earlier_reproduce_run_needs_force(tmp_path, tmpdir_env, no_grid):
    out = tmp_path / "ablations"
    out.mkdir()
    (out / "ablations.json").write_text("{}")
    mark(out, "reproduce")  # what every run writes first: it is a run, not a user's file of that name
    refused(
        cli("reproduce", "--out", out),
        "holds an earlier reproduce run: pass --force",
        out=out,
        tmpdir=tmpdir_env,
        left=["ablations"],
    )
    assert (out / "ablations.json").read_text() == "{}"


def test_sweep_refuses_a_users_file_and_an_earlier_sweep_without_force(tiny, tmp_path, tmpdir_env):
    before = tree_digest(tiny)
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.md").write_text("my sweep notes")  # no sweep.json beside it: sweep used to replace it
    (out / "todo.txt").write_text("mine")
    refused(
        cli(*_sweep_args(tiny, out)),
        "holds files that are not a sweep run (todo.txt)",
        out=out,
        tmpdir=tmpdir_env,
        left=["out"],
    )
    (out / "todo.txt").unlink()
    line = refused(
        cli(*_sweep_args(tiny, out)),
        "holds sweep.md, which no sweep run wrote",
        out=out,
        tmpdir=tmpdir_env,
        left=["out"],
    )
    assert "--force" not in line  # never offered for a file mha2gqa did not write (issue 38)
    mark(out, "sweep")
    refused(
        cli(*_sweep_args(tiny, out)),
        "holds an earlier sweep run: pass --force",
        out=out,
        tmpdir=tmpdir_env,
        left=["out"],
    )
    assert (out / "sweep.md").read_text() == "my sweep notes" and tree_digest(tiny) == before


# -------------------------------------------- class 3: nothing left after a failure or a kill -9
def test_a_sweep_that_fails_before_its_first_candidate_leaves_no_out(tiny, tmp_path, tmpdir_env, monkeypatch):
    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device", str(next((tmp_path / "deep" / "out").glob(".sweep-*")) / "x"))

    monkeypatch.setattr(eval_run, "evaluate", full_disk)
    out = tmp_path / "deep" / "out"
    refused(cli(*_sweep_args(tiny, out)), f"{out}: no space left", out=out, tmpdir=tmpdir_env)
    assert not (tmp_path / "deep").exists()  # the parents it made go too


_KILLED_RUN = """
import os, signal, sys
from pathlib import Path
from mha2gqa.files.run_folder import run_folder, scratch_folder
out = Path(sys.argv[1])
with run_folder(out, "--out", "demo", {"report", "results", ".sweep-*"}, force=True) as folder:
    (out / "report").mkdir()
    (out / "report" / "report.md").write_text("half made")
    with scratch_folder(out, ".sweep-"):
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_run(out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN, str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.parametrize("earlier", [True, False])
def test_the_next_start_undoes_a_run_killed_with_sigkill(tmp_path, tmpdir_env, no_grid, earlier):
    out = tmp_path / "demo"
    if earlier:
        (out / "results").mkdir(parents=True)
        (out / "results" / "parent.json").write_text("earlier run")
        mark(out, "demo")
    before = tree_digest(out) if earlier else None
    _killed_run(out)
    assert any(name.startswith(".demo.") for name in _beside(out))  # the kill left its markers
    # The next start, even one that is refused, puts the earlier run back (or removes the half-made one).
    result = cli("demo", "--quick", "--out", out, "--dry-run")
    if earlier:
        refused(result, "holds an earlier demo run", out=out, tmpdir=tmpdir_env, left=["demo"])
        assert tree_digest(out) == before
    else:
        assert result.exit_code == 0, result.output
        assert _beside(out) == []


def test_scratch_of_a_killed_sweep_is_removed_by_the_next_start(tmp_path):
    from mha2gqa.files.run_folder import continued_folder, run_folder

    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text("{}")
    mark(out, "sweep")
    for pid in ("999999999", "999999998"):
        (out / f".sweep-{pid}").mkdir()  # dead PIDs' statistics, several MB in real runs
        (out / f".sweep-{pid}" / "stats.bin").write_bytes(b"\0" * 4096)
    with continued_folder(out, "--out", scratch=".sweep-"):  # sweep --resume
        assert sorted(p.name for p in out.iterdir()) == [MARKER, "sweep.json"]
    (out / ".sweep-999999999").mkdir()
    with run_folder(out, "--out", "sweep", {"sweep.json", ".sweep-*"}, force=True, scratch=".sweep-"):
        assert [p.name for p in out.iterdir()] == [MARKER]  # the earlier sweep is aside, its scratch with it
    assert _beside(out) == ["sweep"] and [p.name for p in out.iterdir()] == [MARKER]


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(tmp_path, tmpdir_env, no_grid):
    from mha2gqa.files.run_folder import run_folder

    out = tmp_path / "ablations"
    with run_folder(out, "--out", "reproduce", ablations.RUN_ENTRIES, force=False):
        result = cli("reproduce", "--out", tmp_path / "ablations", "--force", "--methods", "mean", "--kv-heads", "2")
        line = error_line(result)
        assert f"is being written by another mha2gqa run (PID {os.getpid()}" in line
    assert _beside(out) == ["ablations"] and list(tmpdir_env.iterdir()) == []


# --------------------------------------------------------------- class 4: modes follow the umask
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "new.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == mode


def test_a_replaced_file_keeps_its_mode(tmp_path):
    path = tmp_path / "card.md"
    path.write_text("old")
    path.chmod(0o640)
    write_atomic(path, "new")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.read_text() == "new"


def test_a_converted_models_card_and_provenance_are_readable_by_others(tiny, tmp_path):
    """A real umask of a real process: the CLI as a subprocess under umask 022."""
    dst = tmp_path / "gqa"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "mha2gqa", "convert", str(tiny / "src"), str(dst), "--groups", "2", "-q"],
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.umask(0o022),
    )
    assert proc.returncode == 0, proc.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in dst.iterdir()}
    assert modes["README.md"] == modes["mha2gqa.json"] == modes["config.json"] == 0o644, modes


# ------------------------------------------- class 6: every option value checked by its own rule
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--groups", ""], ["--groups '' names nothing"]),
        (["--groups", ","], ["--groups ',' names nothing"]),
        (["--groups", "0"], ["--groups 0", "at least 1"]),
        (["--groups", "a,b"], ["--groups 'a,b' must be comma-separated whole numbers"]),
        (["--methods", ""], ["--methods '' names nothing", "mean,calibrated"]),
        (["--methods", ", ,"], ["--methods ', ,' names nothing"]),
        (["--force", "--resume"], ["--force and --resume contradict"]),
        (["--resume"], ["--resume:", "holds no sweep.json"]),
    ],
)
def test_sweep_flags_are_refused_in_their_own_words(tiny, tmp_path, tmpdir_env, flags, words):
    out = tmp_path / "out"
    line = refused(cli(*_sweep_args(tiny, out, *flags)), *words, out=out, tmpdir=tmpdir_env)
    assert "hellaswag" not in line


def test_a_thread_count_past_any_machine_is_refused(tmp_path):
    line = error_line(cli("--threads", "99999999999", "inspect", tmp_path))
    assert "--threads '99999999999' is more than 4,096 threads" in line


def test_a_file_over_its_size_limit_is_told_its_own_fix(tmp_path, tmpdir_env):
    from mha2gqa.files.reading import MAX_JSON_BYTES, MAX_YAML_BYTES

    result = tmp_path / "result.json"
    with open(result, "wb") as f:  # one byte over the limit, sparse: refused from its size, never read
        f.write(b"{}")
        f.truncate(MAX_JSON_BYTES + 1)
    line = refused(
        cli("report", result, "--out", tmp_path / "report"),
        f"limit of {MAX_JSON_BYTES:,} bytes",
        out=tmp_path / "report",
        tmpdir=tmpdir_env,
    )
    assert "written by `mha2gqa eval`" in line and "model's own" not in line
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("a: 1\n" + "#" * (MAX_YAML_BYTES - 4))  # MAX_YAML_BYTES + 1 bytes
    assert recipe.stat().st_size == MAX_YAML_BYTES + 1
    line = error_line(cli("uptrain", "--recipe", recipe), strict=False)
    assert "for a recipe: a recipe is a few KB of YAML" in line and "model's own" not in line


@pytest.fixture(scope="module")
def parent_result(tiny):
    out = tiny / "parent.json"
    result = cli("eval", tiny / "src", "--data", tiny / "eval.txt", "--max-tokens", 100, "--out", out, "--quiet")
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "parent, candidates, words",
    [
        (None, [], ["the parent of the sweep has no eval result (no entry)"]),
        ("ok", [{"name": "kv2-mean", "result": None}], ["candidate 'kv2-mean' of the sweep has no eval result"]),
        ("ok", [{"name": "kv1-mean", "result": {"schema": "x"}}], ["(candidate 'kv1-mean' of the sweep)", "'x'"]),
        ("ok", [7], ["candidate #1 of the sweep has no eval result (a JSON int)"]),
    ],
)
def test_report_of_a_broken_sweep_names_the_bad_entry(parent_result, tmp_path, tmpdir_env, parent, candidates, words):
    from mha2gqa.sweep.schema import SWEEP_SCHEMA

    sweep_json = tmp_path / "sweep.json"
    parent = {"perplexity": 1.0, "result": parent_result} if parent else None
    sweep_json.write_text(json.dumps({"schema": SWEEP_SCHEMA, "parent": parent, "candidates": candidates}))
    out = tmp_path / "report"
    line = refused(cli("report", sweep_json, "--out", out), *words, out=out, tmpdir=tmpdir_env)
    assert "NoneType" not in line


# ------------------------------------------------------- sweep --resume (issue 30): finished rows kept
def test_sweep_resume_reuses_the_finished_candidates(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    evaluate, seen = eval_run.evaluate, []

    def interrupt_at_the_second_candidate(model_path, *args, **kwargs):
        seen.append(Path(model_path).name)
        if len(seen) == 3:  # the parent, candidate 1, then candidate 2
            raise KeyboardInterrupt
        return evaluate(model_path, *args, **kwargs)

    monkeypatch.setattr(eval_run, "evaluate", interrupt_at_the_second_candidate)
    assert cli(*_sweep_args(tiny, out)).exit_code == 130
    first = json.loads((out / "sweep.json").read_text())
    assert [r["name"] for r in first["candidates"]] == ["kv2-mean"]

    seen.clear()
    monkeypatch.setattr(
        eval_run, "evaluate", lambda path, *a, **k: seen.append(Path(path).name) or evaluate(path, *a, **k)
    )
    refused_line = error_line(cli(*_sweep_args(tiny, out, "--resume", "--seed", "1")))
    assert "--resume: --seed differs from the sweep" in refused_line and seen == []
    result = cli(*_sweep_args(tiny, out, "--resume"))
    assert result.exit_code == 0, result.output
    assert "resuming" in result.output and "1 of 4 candidates already finished" in result.output
    assert seen == ["kv2-calibrated", "kv1-mean", "kv1-calibrated"]  # not the parent, not kv2-mean again
    record = json.loads((out / "sweep.json").read_text())
    assert [r["name"] for r in record["candidates"]] == ["kv2-mean", "kv2-calibrated", "kv1-mean", "kv1-calibrated"]
    assert record["candidates"][0] == first["candidates"][0] and record["interrupted"] is False
    assert record["parent"] == first["parent"] and not list(out.glob(".sweep-*"))


# --------------------------------------------------- class 7: the source's side files never sink it
@pytest.fixture
def src(tiny, tmp_path, tmpdir_env):
    path = tmp_path / "src"
    shutil.copytree(tiny / "src", path)
    return path


def test_a_source_card_over_the_limit_is_kept_unread_with_a_warning(src, tmp_path, tmpdir_env):
    from mha2gqa.records.card import MAX_CARD_BYTES

    big = b"---\nlicense: mit\n---\n" + b"x" * MAX_CARD_BYTES  # 4 MiB + 20 bytes
    (src / "README.md").write_bytes(big)
    before = tree_digest(src)
    dst = tmp_path / "dst"
    result = cli("convert", src, dst, "--groups", "2", "-q")
    assert result.exit_code == 0, result.output
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("Warning: ")]
    assert len(warnings) == 1 and f"{src / 'README.md'} is {len(big):,} bytes" in warnings[0]
    assert ".partial-" not in result.stderr
    assert (dst / "SOURCE_README.md").read_bytes() == big and "license: mit" not in (dst / "README.md").read_text()
    assert tree_digest(src) == before and list(tmpdir_env.iterdir()) == []


def test_the_parents_own_provenance_log_and_results_are_not_carried(src, tmp_path):
    (src / "PROVENANCE.md").write_text("# A multi-head attention model\n")
    (src / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (src / "parent-eval.json").write_text(json.dumps({"schema": "mha2gqa.eval/1", "perplexity": 3.0}))
    (src / "special_tokens_map.json").write_text("{}")  # an ordinary side file: still copied
    dst = tmp_path / "dst"
    assert cli("convert", src, dst, "--groups", "2", "-q").exit_code == 0
    names = {p.name for p in dst.iterdir()}
    assert not names & {"PROVENANCE.md", "metrics.jsonl", "parent-eval.json"}
    assert "special_tokens_map.json" in names and "3.0" not in (dst / "README.md").read_text()


# -------------------------------------------------------------- class 9: loops and odd links
LOOPS = {"a link to itself": {"loop": "loop"}, "two links": {"a": "b", "b": "a"}, "config.json": {"config.json": "c"}}


@pytest.mark.parametrize("fault", LOOPS)
def test_a_symlink_loop_inside_src_is_one_eloop_line(src, tmp_path, tmpdir_env, fault):
    links = LOOPS[fault] | ({"c": "config.json"} if fault == "config.json" else {})
    for name, target in links.items():
        (src / name).unlink(missing_ok=True)
        (src / name).symlink_to(target)
    before = tree_digest(src)
    dst = tmp_path / "dst"
    line = refused(cli("convert", src, dst, "--groups", "2", "-q"), "symbolic links", out=dst, tmpdir=tmpdir_env)
    assert str(src) in line
    if fault == "config.json":  # inspect reads only the config and the weights
        refused(cli("inspect", src), "symbolic links", out=dst, tmpdir=tmpdir_env)
    assert tree_digest(src) == before


def test_a_dst_or_out_that_is_a_link_loop_is_one_line(src, tmp_path, tmpdir_env, no_grid):
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    line = error_line(cli("convert", src, loop, "--groups", "2", "-q"))
    assert "loop" in line
    line = error_line(cli("demo", "--out", loop, "--dry-run"))
    assert "is a symbolic link" in line


# ----------------------------------------------------- class 8: bounds answer in seconds, not minutes
def _llama_parameters(layers: int, h: int = 64, inter: int = 128, vocab: int = 1000) -> int:
    """A llama with as many kv heads as heads and untied embeddings, counted by hand."""
    return 2 * vocab * h + h + layers * (4 * h * h + 3 * h * inter + 2 * h)


@pytest.mark.parametrize("layers", [30, 10_000])  # 10,000: the stated ceiling (layouts.CEILINGS)
def test_inspect_of_a_bare_config_at_the_layer_ceiling_answers_in_seconds(tmp_path, layers):
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128)
    config |= dict(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=layers, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("inspect took over 60 s (432 s at 10,000 layers)"))
    signal.alarm(60)
    try:
        result = cli("inspect", tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert result.exit_code == 0, result.output
    expected = _llama_parameters(layers)
    assert f"{layers} layers" in result.output and f"{expected / 1e6:.2f}M parameters" in result.output, result.output


# ----------------------------------------------------- class 5: offline with a warm hub cache works
def _hub_cache(model: Path, cache: Path, repo_id: str = "someorg/tiny-llama") -> Path:
    """`model` laid out as huggingface_hub caches a download: blobs named by their sha256, a snapshot of
    relative links to them, and refs/main naming the snapshot."""
    import hashlib

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for file in sorted(p for p in model.iterdir() if p.is_file()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / digest)
        (repo / "snapshots" / commit / file.name).symlink_to(f"../../blobs/{digest}")
    return repo


def test_a_hub_id_in_the_warm_cache_converts_offline(tiny, tmp_path):
    """A real subprocess, offline, with HF_HUB_CACHE pointing at the cache: as on a cluster."""
    cache = tmp_path / "hub"
    repo = _hub_cache(tiny / "src", cache)
    before = tree_digest(repo)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    dst = tmp_path / "gqa"
    command = [sys.executable, "-m", "mha2gqa", "convert", "someorg/tiny-llama", str(dst), "--groups", "2", "-q"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (dst / "model.safetensors").is_file() and "someorg/tiny-llama" in (dst / "README.md").read_text()
    proc = subprocess.run(
        [*command[:4], "someorg/absent", str(tmp_path / "x"), "--groups", "2"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "hub cache" in proc.stderr and "holds no snapshot of it" in proc.stderr
    assert tree_digest(repo) == before and not (tmp_path / "x").exists()


def test_eval_and_uptrain_checks_take_a_hub_id_from_the_warm_cache(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from mha2gqa.files.sources import model_ref_problem, resolve_model_dir

    repo = _hub_cache(tiny / "src", tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_ref_problem("someorg/tiny-llama", "model=") is None  # the recipe's check (uptrain)
    assert resolve_model_dir("someorg/tiny-llama").parent == repo / "snapshots"
    out = tmp_path / "result.json"
    result = cli(
        "eval", "someorg/tiny-llama", "--data", tiny / "eval.txt", "--max-tokens", 100, "--out", out, "--quiet"
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["model"]["kv_heads"] == 4


def test_a_killed_reports_staging_is_removed_by_the_next_report(parent_result, tmp_path):
    result = tmp_path / "parent.json"
    result.write_text(json.dumps(parent_result))
    dead = tmp_path / ".report.partial-999999999"  # what a kill -9 of a report leaves
    dead.mkdir()
    (dead / "report.md").write_text("half")
    outcome = cli("report", result, "--out", tmp_path / "report")
    assert outcome.exit_code == 0, outcome.output
    assert not dead.exists() and (tmp_path / "report" / "report.md").is_file()


def test_sweep_dry_run_plans_every_candidate_and_writes_nothing(tiny, tmp_path, tmpdir_env):
    out = tmp_path / "out"
    result = cli(*_sweep_args(tiny, out, "--dry-run"))
    assert result.exit_code == 0, result.output
    assert "would sweep 4 candidates" in result.output and "kv1-calibrated" in result.output
    assert _beside(out) == [] and list(tmpdir_env.iterdir()) == []
    refused(cli(*_sweep_args(tiny, out, "--dry-run", "--groups", "3")), "--groups 3", out=out, tmpdir=tmpdir_env)
