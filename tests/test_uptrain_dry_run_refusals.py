"""`uptrain --dry-run` refuses what the run refuses before its first write (issue 55, item 3): a teacher of another
vocabulary, an output_dir that cannot take the run, an output_dir holding another run. Both call the same
functions (uptrain/preflight.py), so the dry run's line is the run's line, word for word."""

from __future__ import annotations

import pytest
from fault_helpers import assert_refused, cli, remount_readonly, tmpfs
from uptrain_helpers import corpus, recipe_file, tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dry_refusals")
    return {
        "model": tiny_model_dir(root / "model", seed=1),
        "teacher": tiny_model_dir(root / "teacher"),
        "wide_teacher": tiny_model_dir(root / "wide_teacher", vocab_size=256),
        "train": corpus(root / "train.jsonl"),
    }


def _both(tmp_path, tiny, **keys):
    """The dry run's and the run's results for one recipe."""
    base = {"model": str(tiny["model"]), "output_dir": str(tmp_path / "out"), "data": {"train": str(tiny["train"])}}
    path = recipe_file(tmp_path / "r.yaml", **{**base, **keys})
    return cli("uptrain", "--recipe", path, "--dry-run"), cli("uptrain", "--recipe", path)


def test_a_teacher_of_another_vocabulary_is_refused_by_the_dry_run_as_by_the_run(tmp_path, tiny):
    dry, run = _both(tmp_path, tiny, distill={"teacher": str(tiny["wide_teacher"])})
    line = assert_refused(dry, "distill.teacher has vocab_size=256, the model 128: distil from the model's own parent")
    assert assert_refused(run, strict=False) == line
    assert not (tmp_path / "out").exists()


def test_an_output_dir_below_a_file_is_refused_by_the_dry_run_as_by_the_run(tmp_path, tiny):
    (tmp_path / "file").write_text("a file, not a folder")
    dry, run = _both(tmp_path, tiny, output_dir=str(tmp_path / "file" / "out"))
    line = assert_refused(dry, f"output_dir {tmp_path / 'file' / 'out'}: {tmp_path / 'file'} is a file")
    assert assert_refused(run, strict=False) == line


def test_an_output_dir_holding_another_run_is_refused_by_the_dry_run_as_by_the_run(tmp_path, tiny):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    dry, run = _both(tmp_path, tiny)
    line = assert_refused(dry, f"output_dir {tmp_path / 'out'} is not empty")
    assert assert_refused(run, strict=False) == line


def test_a_read_only_output_dir_is_refused_by_the_dry_run_as_by_the_run(tmp_path, tiny):
    with tmpfs(tmp_path / "ro", "4m") as mount:
        remount_readonly(mount)
        dry, run = _both(tmp_path, tiny, output_dir=str(mount / "out"))
        line = assert_refused(dry, f"output_dir {mount / 'out'}", "not writable")
        assert assert_refused(run, strict=False) == line


def test_an_output_dir_without_room_is_refused_by_the_dry_run(tmp_path, tiny):
    """The dry run's room is the run's formula (preflight.disk_needed) on the sizes the weight headers give."""
    with tmpfs(tmp_path / "small", "64k") as mount:
        dry, run = _both(tmp_path, tiny, output_dir=str(mount / "out"))
        line = assert_refused(dry, "MiB (a checkpoint and the final model) but its filesystem has")
        assert assert_refused(run, strict=False) == line


@pytest.mark.parametrize("how", ["same", "hardlink", "copy"])
def test_a_teacher_that_is_the_model_itself_is_refused_by_the_dry_run_as_by_the_run(tmp_path, tiny, how):
    """The same folder, a folder of hard links to its weights, or a byte-identical copy: KL to itself is no
    teacher's signal."""
    import shutil

    teacher = tiny["model"]
    if how != "same":
        teacher = tmp_path / f"teacher-{how}"
        teacher.mkdir()
        for path in tiny["model"].iterdir():
            if path.suffix == ".safetensors" and how == "hardlink":
                (teacher / path.name).hardlink_to(path)
            elif path.is_file():
                shutil.copyfile(path, teacher / path.name)
    dry, run = _both(tmp_path, tiny, distill={"teacher": str(teacher)})
    line = assert_refused(dry, f"distill.teacher {teacher} is the model itself", "name the model's parent")
    assert assert_refused(run, strict=False) == line
    assert not (tmp_path / "out").exists()
