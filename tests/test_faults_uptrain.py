"""Fault injection for `mha2gqa uptrain`: bad recipes, outputs that would overwrite a source,
checkpoints whose tensors do not match, divergence (finite and not), full and read-only disks,
damaged checkpoints and kill -9. Every case asserts the exit code, the one `Error:` line (no
traceback), what is (not) left behind, and that every source is byte-identical afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import (
    add_tensor,
    assert_refused,
    cli,
    drop_tensor,
    edit_weights,
    fill,
    pickle_only,
    remount_readonly,
    reshape_tensor,
    subprocess_error,
    tmpfs,
    tree_digest,
)
from safetensors.torch import load_file
from uptrain_helpers import corpus, metrics, recipe_file, tiny_model_dir

K_PROJ = "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny random model, the same model trained for 8 steps (clearly better than guessing, so
    divergence back to guessing can be seen), and the training text."""
    root = tmp_path_factory.mktemp("faults_uptrain")
    model = tiny_model_dir(root / "model")
    data = corpus(root / "train.jsonl")
    recipe = recipe_file(
        root / "pretrain.yaml",
        model=str(model),
        output_dir=str(root / "trained"),
        data={"train": str(data)},
        budget={"max_steps": 8},
    )
    assert cli("uptrain", "--recipe", recipe).exit_code == 0
    return {"model": model, "trained": root / "trained", "data": data, "root": root}


@pytest.fixture
def sources(src):
    """Digests of every source before the case; checked unchanged after it."""
    before = {k: tree_digest(src[k]) for k in ("model", "trained", "data")}
    yield
    assert {k: tree_digest(src[k]) for k in ("model", "trained", "data")} == before


def _recipe(tmp_path, src, **keys):
    keys.setdefault("model", str(src["model"]))
    keys.setdefault("output_dir", str(tmp_path / "out"))
    keys.setdefault("data", {"train": str(src["data"])})
    return recipe_file(tmp_path / "r.yaml", **keys)


def _uptrain(recipe, *overrides, resume=False):
    return cli("uptrain", "--recipe", recipe, *(["--resume"] if resume else []), *overrides)


def _steps_saved(out: Path) -> list[str]:
    return sorted(p.parent.name for p in (out / "checkpoints").glob("step-*/progress.json"))


# --- 1. an output_dir that would overwrite a source ------------------------------------------------


@pytest.mark.parametrize("where", ["equal", "inside", "contains", "symlink"])
def test_output_dir_over_the_model_is_refused(tmp_path, src, sources, where):
    model = tmp_path / "holder" / "model" if where == "contains" else src["model"]
    if where == "contains":  # output_dir holds the model: overwrite and the final save would reach it
        shutil.copytree(src["model"], model)
    before = tree_digest(model)
    out = {
        "equal": src["model"],
        "inside": src["model"] / "run",
        "contains": model.parent,
        "symlink": tmp_path / "link",
    }[where]
    if where == "symlink":
        out.symlink_to(src["model"], target_is_directory=True)
    result = _uptrain(_recipe(tmp_path, src, model=str(model), output_dir=str(out), overwrite=True))
    assert_refused(result, f"output_dir {out}", "choose an output_dir")
    assert not (src["model"] / "run").exists() and tree_digest(model) == before


def test_output_dir_equal_to_the_teacher_is_refused(tmp_path, src, sources):
    result = _uptrain(
        _recipe(tmp_path, src, output_dir=str(src["trained"]), overwrite=True, distill={"teacher": str(src["trained"])})
    )
    assert_refused(result, f"is distill.teacher={src['trained']}")


def test_overwrite_keeps_the_previous_final_model_until_a_new_one_is_complete(tmp_path, src, sources):
    out = tmp_path / "out"
    shutil.copytree(src["trained"], out)  # a finished run's output: weights, tokenizer, mha2gqa.json
    before = tree_digest(out)
    final_files = {k: v for k, v in before.items() if not k.startswith(("checkpoints", "metrics"))}
    result = _uptrain(
        _recipe(
            tmp_path,
            src,
            model=str(src["trained"]),
            overwrite=True,
            budget={"max_steps": 1},
            optim={"lr": 1e30, "warmup_steps": 0},
        )
    )
    assert_refused(result, "training diverged at step 1", code=1, strict=False)
    after = tree_digest(out)
    assert {k: after.get(k) for k in final_files} == final_files  # the old model is whole
    assert not (out / ".final.partial").exists()
    # A run that succeeds replaces it (and leaves no staging folder).
    ok = _uptrain(_recipe(tmp_path, src, model=str(src["trained"]), overwrite=True, budget={"max_steps": 2}))
    assert ok.exit_code == 0, ok.output
    assert tree_digest(out)["model.safetensors"] != final_files["model.safetensors"]
    assert not (out / ".final.partial").exists()


# --- 2. weights that do not match their config, pickles ---------------------------------------------


@pytest.mark.parametrize(
    "fault,edit,named",
    [
        ("missing", drop_tensor(K_PROJ), f"missing: {K_PROJ}"),
        ("unexpected", add_tensor("model.layers.0.extra.weight"), "unexpected: model.layers.0.extra.weight"),
        ("shape", reshape_tensor(K_PROJ), f"wrong shape: {K_PROJ} is [32, 64] not [64, 64]"),
    ],
)
def test_model_whose_tensors_do_not_match_is_refused(tmp_path, src, sources, fault, edit, named):
    bad = edit_weights(src["model"], tmp_path / fault, edit)
    before = tree_digest(bad)
    result = _uptrain(_recipe(tmp_path, src, model=str(bad)))
    assert_refused(result, f"model {bad} does not match its config.json", named)
    assert not (tmp_path / "out").exists() and tree_digest(bad) == before


def test_teacher_with_a_missing_tensor_is_refused(tmp_path, src, sources):
    bad = edit_weights(src["model"], tmp_path / "teacher", drop_tensor(K_PROJ))
    result = _uptrain(_recipe(tmp_path, src, distill={"teacher": str(bad)}))
    assert_refused(result, f"distill.teacher {bad} does not match", K_PROJ)
    assert not (tmp_path / "out").exists()


def test_pickle_only_model_is_refused_with_how_to_resave(tmp_path, src, sources):
    bad = pickle_only(src["model"], tmp_path / "pickled")
    result = _uptrain(_recipe(tmp_path, src, model=str(bad)))
    assert_refused(result, "only pickled weights (pytorch_model.bin)", "save_pretrained")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "config,says",
    [
        (b"\x00\xff\xfe", "config.json is not UTF-8 text"),
        (b"[1, 2]", "config.json is a JSON list, not an object"),
        (None, 'num_attention_heads="eight": it must be a positive integer'),
    ],
)
def test_a_malformed_config_json_is_one_line(tmp_path, src, sources, config, says):
    bad = tmp_path / "bad-config"
    shutil.copytree(src["model"], bad)
    good = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_bytes(config or json.dumps({**good, "num_attention_heads": "eight"}).encode())
    assert_refused(_uptrain(_recipe(tmp_path, src, model=str(bad))), f"model={bad}", says)
    assert not (tmp_path / "out").exists()


# --- 3. divergence --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,says",
    [
        ("optim.lr=.inf", "optim.lr: expected a finite number, got inf"),
        ("optim.lr=nan", "optim.lr: expected a finite number, got nan"),
        ("optim.eps=-1e-8", "optim.eps=-1e-08 must be positive"),
    ],
)
def test_non_finite_or_negative_hyper_parameters_are_refused(tmp_path, src, sources, override, says):
    result = _uptrain(_recipe(tmp_path, src), override)
    assert_refused(result, says)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lr,save_every,steps", [(1e30, 0, 1), (1e6, 1, 4)])
def test_a_destructive_update_saves_nothing_and_does_not_suggest_resume(tmp_path, src, sources, lr, save_every, steps):
    """lr=1e30 for one step used to exit 0 with a model at uniform perplexity; lr=1e6 used to
    checkpoint the poisoned weights as 'the last good checkpoint'."""
    result = _uptrain(
        _recipe(
            tmp_path,
            src,
            model=str(src["trained"]),
            save_every=save_every,
            budget={"max_steps": steps},
            optim={"lr": lr, "warmup_steps": 0},
        )
    )
    line = assert_refused(result, "training diverged at step 1", "no checkpoint was saved", code=1, strict=False)
    assert "--resume" not in line
    out = tmp_path / "out"
    assert _steps_saved(out) == [] and not (out / "model.safetensors").exists()


def test_divergence_after_the_last_checkpoint_writes_no_final_model(tmp_path, src, sources):
    recipe = _recipe(tmp_path, src, model=str(src["trained"]), budget={"max_steps": 4}, optim={"warmup_steps": 0})
    assert _uptrain(recipe, "exit_after_steps=2").exit_code == 0
    result = _uptrain(recipe, "optim.lr=1e30", resume=True)
    out = tmp_path / "out"
    assert_refused(
        result,
        "training diverged at step 4",  # step 3's update was destructive, step 4's loss NaN
        f"the last good checkpoint is {out / 'checkpoints' / 'step-00000002'}",
        "--resume",
        code=1,
        strict=False,
    )
    assert not (out / "model.safetensors").exists() and _steps_saved(out) == ["step-00000002"]
    # ... and that checkpoint really is good: resuming from it with the recipe's lr finishes.
    assert _uptrain(recipe, resume=True).exit_code == 0
    assert (out / "model.safetensors").is_file()


# --- one line instead of a traceback --------------------------------------------------------------


@pytest.mark.parametrize(
    "content,says",
    [
        (b"\xff\xfe\x00binary\x00\x9c", "is not UTF-8 text"),
        (b"- a\n- list\n", "holds a list, not a mapping of key: value"),
        (b"model: [unclosed\n", "is not valid YAML"),
    ],
)
def test_a_recipe_that_is_not_a_yaml_mapping_is_one_line(tmp_path, src, content, says):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content)
    assert_refused(_uptrain(recipe), f"recipe {recipe}", says)


def test_missing_tokenizer_is_one_line(tmp_path, src, sources):
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    result = _uptrain(_recipe(tmp_path, src, tokenizer=str(empty)))
    assert_refused(result, f"tokenizer {empty} could not be loaded", "set tokenizer=")
    assert not (tmp_path / "out").exists()


def test_seq_len_beyond_the_models_positions_is_refused(tmp_path, src, sources):
    result = _uptrain(_recipe(tmp_path, src, seq_len=512))
    assert_refused(result, "seq_len=512 exceeds the model's max_position_embeddings=256")
    assert not (tmp_path / "out").exists()


def test_read_only_output_filesystem_is_refused_before_training(tmp_path, src, sources):
    with tmpfs(tmp_path / "ro", "4m") as mount:
        remount_readonly(mount)
        result = _uptrain(_recipe(tmp_path, src, output_dir=str(mount / "out")))
        assert_refused(result, f"output_dir {mount / 'out'}", "not writable")
        assert list(mount.iterdir()) == []


def test_output_filesystem_without_room_is_refused_before_training(tmp_path, src, sources):
    with tmpfs(tmp_path / "small", "256k") as mount:
        result = _uptrain(_recipe(tmp_path, src, output_dir=str(mount / "out")))
        assert_refused(result, "MiB (a checkpoint and the final model) but its filesystem has")
        assert list(mount.iterdir()) == []


def test_disk_full_during_save_state_is_one_line_and_leaves_no_half_checkpoint(tmp_path, src, sources):
    # Room for the first checkpoints (the check before training passes), not for keep_last=9 of them.
    with tmpfs(tmp_path / "full", "3m") as mount:
        out = mount / "out"
        result = _uptrain(
            _recipe(
                tmp_path, src, output_dir=str(out), save_every=1, keep_last=9, eval_every=0, budget={"max_steps": 12}
            )
        )
        assert_refused(result, "no space left on the device", code=2, strict=False)
        folders = sorted(p.name for p in (out / "checkpoints").iterdir())
        assert folders and folders == _steps_saved(out)  # finished checkpoints only: resumable
        assert not (out / "model.safetensors").exists()


def test_disk_full_at_the_final_save_is_one_line_and_leaves_no_half_model(tmp_path, src, sources):
    params_bytes = sum(t.numel() * 4 for t in load_file(str(src["model"] / "model.safetensors")).values())
    with tmpfs(tmp_path / "full", "2m") as mount:
        out = mount / "out"
        out.mkdir()
        (out / "keep.txt").write_text("a file of the user's\n")
        fill(mount)
        # Leave room for the weights' bytes (the check before training passes) plus one page for
        # metrics.jsonl: the safetensors header, config and tokenizer then no longer fit.
        filler = mount / "filler"
        os.truncate(filler, filler.stat().st_size - params_bytes - 4096)
        result = _uptrain(_recipe(tmp_path, src, output_dir=str(out), overwrite=True, budget={"max_steps": 2}))
        assert_refused(result, "no space left on the device", strict=False)
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "metrics.jsonl"]


# --- damaged checkpoints and kill -9 ----------------------------------------------------------------


def _two_checkpoints(tmp_path, src):
    recipe = _recipe(
        tmp_path, src, model=str(src["trained"]), save_every=1, keep_last=3, eval_every=0, budget={"max_steps": 4}
    )
    assert _uptrain(recipe, "exit_after_steps=2").exit_code == 0
    out = tmp_path / "out"
    assert _steps_saved(out) == ["step-00000001", "step-00000002"]
    return recipe, out


def test_resume_falls_back_from_a_corrupt_newest_checkpoint(tmp_path, src, sources):
    recipe, out = _two_checkpoints(tmp_path, src)
    newest = out / "checkpoints" / "step-00000002"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a file cut short
    result = _uptrain(recipe, resume=True)
    assert result.exit_code == 0, result.output
    assert f"checkpoint {newest} could not be loaded" in result.output
    assert "resuming from" in result.output and "step-00000001 (step 1 of 4)" in result.output
    assert (out / "model.safetensors").is_file()
    assert [r["step"] for r in metrics(out)] == [0, 2, 4]  # step 2's line dropped and written again


def test_resume_with_only_damaged_checkpoints_is_one_line(tmp_path, src, sources):
    recipe, out = _two_checkpoints(tmp_path, src)
    (out / "checkpoints" / "step-00000002" / "progress.json").write_bytes(b"\x00garbage")  # unfinished now
    first = out / "checkpoints" / "step-00000001" / "model.safetensors"
    first.write_bytes(b"not safetensors")
    result = _uptrain(recipe, resume=True)
    assert_refused(result, "--resume: none of the 1 checkpoint under", "start over", strict=False)
    assert not (out / "model.safetensors").exists()


CLI = ("mha2gqa", "uptrain")
ACCELERATE_ENTRY = ("mha2gqa.uptrain",)  # what `accelerate launch -m mha2gqa.uptrain` runs on every rank


def _start(recipe: Path, log: Path, *args, command=CLI) -> subprocess.Popen:
    """A real `python -m mha2gqa uptrain` (stderr to a file: a full pipe would stall the child)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", *command, "--recipe", str(recipe), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _wait_until_saved(proc: subprocess.Popen, out: Path, step: int) -> None:
    """Until a checkpoint of `step` or later is complete. keep_last rotates older ones away, so on a fast
    machine the exact `step` folder may be gone before a poll sees it."""
    deadline = time.monotonic() + 240
    while not any(int(name.split("-")[1]) >= step for name in _steps_saved(out)):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
        time.sleep(0.05)


def test_sigterm_then_kill_9_during_training_then_resume_finishes(tmp_path, src, sources):
    recipe = _recipe(
        tmp_path,
        src,
        model=str(src["trained"]),
        save_every=1,
        keep_last=2,
        eval_every=0,
        log_every=1,
        budget={"max_steps": 40},
    )
    out, log = tmp_path / "out", tmp_path / "stderr.txt"
    # SIGTERM unwinds like Ctrl-C: exit 143, one line, no half-written checkpoint.
    proc = _start(recipe, log)
    _wait_until_saved(proc, out, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    stderr = log.read_text()
    assert "Interrupted by SIGTERM" in stderr and "Traceback" not in stderr
    folders = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert folders == _steps_saved(out) and not (out / ".final.partial").exists()
    # kill -9 of the resumed run: no cleanup can run (possibly inside save_state).
    proc = _start(recipe, log, "--resume")
    _wait_until_saved(proc, out, int(folders[-1].split("-")[1]) + 2)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    killed_at = int(_steps_saved(out)[-1].split("-")[1])
    assert killed_at < 40
    result = _uptrain(recipe, resume=True)
    assert result.exit_code == 0, result.output
    assert f"(step {killed_at} of 40)" in result.output
    steps = [r["step"] for r in metrics(out)]
    assert steps == sorted(set(steps)) and steps[-1] == 40
    assert load_file(str(out / "model.safetensors")) and not (out / ".final.partial").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == _steps_saved(out)  # kill -9 debris gone


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_the_accelerate_entry_point_unwinds_sigterm_and_sighup_like_ctrl_c(tmp_path, src, sources, signum):
    recipe = _recipe(tmp_path, src, save_every=1, keep_last=2, eval_every=0, log_every=1, budget={"max_steps": 10_000})
    out, log = tmp_path / "out", tmp_path / "stderr.txt"
    proc = _start(recipe, log, command=ACCELERATE_ENTRY)
    _wait_until_saved(proc, out, 2)
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == 128 + signum
    stderr = log.read_text()
    assert stderr.strip().splitlines()[-1] == f"Interrupted by {signal.Signals(signum).name}", stderr
    assert "Traceback" not in stderr
    # no half-written checkpoint, no partial final model
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == _steps_saved(out)
    assert not (out / ".final.partial").exists() and not (out / "model.safetensors").exists()


def test_the_accelerate_entry_point_reports_bad_input_in_one_line(tmp_path, src, sources):
    recipe = _recipe(tmp_path, src, output_dir=str(src["model"]), overwrite=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mha2gqa.uptrain", "--recipe", str(recipe)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert f"is model={src['model']} or lies inside it" in subprocess_error(proc)
    assert json.loads((src["model"] / "config.json").read_text())["model_type"] == "llama"
