"""lm-evaluation-harness for real: the offline Persuasion tasks on a tiny model and on the embedded
default, through `mha2gqa eval`, with every number checked against lm-eval called directly."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer
from uptrain_helpers import tiny_model_dir

from mha2gqa.cli import main
from mha2gqa.eval import evaluate
from mha2gqa.eval.lmeval import BOOTSTRAP_ITERS, OFFLINE_TASKS, TASKS_DIR, perplexity_intervals
from mha2gqa.files import embedded
from mha2gqa.report import write_report
from mha2gqa.runtime.errors import InputError

pytest.importorskip("lm_eval")  # the [lmeval] extra; .ci/run installs it, so CI runs every test here

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 3


def direct_harness(model_dir: Path, tasks, limit: int) -> dict:
    """lm-eval on its own, the way its docs show: HFLM around a loaded model, simple_evaluate."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    wrapped = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(model_dir), batch_size=1)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return lm_eval.simple_evaluate(
        model=wrapped, tasks=list(tasks), limit=limit, task_manager=manager, bootstrap_iters=BOOTSTRAP_ITERS
    )["results"]


def assert_same_numbers(ours: dict, theirs: dict) -> None:
    assert set(ours["tasks"]) == set(theirs) == set(OFFLINE_TASKS)
    for task, raw in theirs.items():
        metrics = ours["tasks"][task]["metrics"]
        expected = {"persuasion_cloze": {"acc", "perplexity"}, "persuasion_next_sentence": {"acc", "acc_norm"}}[task]
        assert set(metrics) == expected
        for name, found in metrics.items():
            assert found["value"] == raw[f"{name},none"], (task, name)  # the very number, not a near one
            assert found["stderr"] == raw[f"{name}_stderr,none"], (task, name)
        assert ours["tasks"][task]["samples"] == LIMIT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("lmeval") / "tiny")


def test_shipped_task_data_is_what_the_script_makes():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_lmeval_tasks.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    cloze = [json.loads(line) for line in (TASKS_DIR / "persuasion_cloze.jsonl").read_text().splitlines()]
    choice = [json.loads(line) for line in (TASKS_DIR / "persuasion_next_sentence.jsonl").read_text().splitlines()]
    assert len(cloze) == 355 and len(choice) == 500
    for row in cloze:  # LAMBADA's form: the target is the last space-separated word, seen earlier
        context, _, last = row["text"].rpartition(" ")
        assert last.isalpha() and last.lower() in context.lower()
    assert all(len(r["choices"]) == 4 and r["choices"][r["gold"]] not in r["context"] for r in choice)
    assert {r["gold"] for r in choice} == {0, 1, 2, 3}


def test_tiny_model_numbers_equal_the_harness_called_directly(tiny, tmp_path):
    result = evaluate(
        tiny,
        lm_eval_tasks=list(OFFLINE_TASKS),
        lm_eval_limit=LIMIT,
        speed_preset=None,
        out=tmp_path / "tiny.json",
        progress=False,
    )
    section = result["lm_eval"]
    assert section["harness"].startswith("lm-eval 0.4") and section["limit"] == LIMIT
    assert_same_numbers(section, direct_harness(tiny, OFFLINE_TASKS, LIMIT))
    assert json.loads((tmp_path / "tiny.json").read_text())["lm_eval"] == section
    # The perplexity's interval is centred (on its log scale) on the harness's own value.
    cloze = section["tasks"]["persuasion_cloze"]["metrics"]["perplexity"]
    low, high = cloze["interval_95"]
    assert low < cloze["value"] < high and math.sqrt(low * high) == pytest.approx(cloze["value"])


def test_perplexity_interval_is_the_mean_nlls_not_a_bootstrap_of_its_exp(monkeypatch):
    import lm_eval.api.metrics as harness

    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # the harness's bootstrap, in this process

    ll = [-2.0, -3.0, -20.0, -2.5, -4.0, -1.5, -18.0, -3.5]  # two very unlikely target words
    samples = [{"doc_id": i, "filter": "none", "perplexity": v, "acc": 0} for i, v in enumerate(ll)]
    config = {
        "metric_list": [{"metric": "perplexity", "aggregation": "perplexity"}, {"metric": "acc", "aggregation": "mean"}]
    }
    low, high = perplexity_intervals(config, samples)["perplexity"]
    nll, se = -statistics.fmean(ll), statistics.stdev(ll) / math.sqrt(len(ll))
    assert (low, high) == pytest.approx((math.exp(nll - 1.96 * se), math.exp(nll + 1.96 * se)))
    value = harness.perplexity(ll)
    assert low < value < high
    # What the harness reports instead: a bootstrapped stderr as large as the value itself, whose ± would
    # reach below zero.
    stderr = harness.bootstrap_stderr(harness.perplexity, ll, iters=1000)
    assert stderr > 0.5 * value and value - stderr < low
    assert set(perplexity_intervals(config, samples)) == {"perplexity"}  # acc is a mean: its stderr stands


def test_embedded_default_through_the_cli_equals_the_harness_and_reaches_the_report(tiny, tmp_path):
    out = tmp_path / "embedded.json"
    run = CliRunner().invoke(
        main,
        [
            "eval",
            str(embedded.model_dir()),
            "--lm-eval-tasks",
            "mha2gqa_offline",
            "--lm-eval-limit",
            str(LIMIT),
            "--speed",
            "off",
            "--quiet",
            "--out",
            str(out),
        ],
    )
    assert run.exit_code == 0, run.output
    assert f"persuasion_cloze ({LIMIT} examples): perplexity " in run.output
    ours = json.loads(out.read_text())["lm_eval"]
    assert_same_numbers(ours, direct_harness(embedded.model_dir(), OFFLINE_TASKS, LIMIT))

    # The report gains one column per task metric and its change vs the baseline.
    other = evaluate(
        tiny,
        lm_eval_tasks=["persuasion_next_sentence"],
        lm_eval_limit=LIMIT,
        speed_preset=None,
        label="tiny",
        out=tmp_path / "tiny.json",
        progress=False,
    )
    written = write_report([out, tmp_path / "tiny.json"], tmp_path / "report")
    table = written["markdown"].read_text()
    header = next(line for line in table.splitlines() if line.startswith("| model | persuasion"))  # lm-eval's table
    for column in (
        "persuasion_cloze perplexity",
        "persuasion_cloze acc",
        "persuasion_next_sentence acc_norm",
        "Δ acc_norm",
    ):
        assert column in header
    base = ours["tasks"]["persuasion_next_sentence"]["metrics"]["acc"]["value"]
    mine = other["lm_eval"]["tasks"]["persuasion_next_sentence"]["metrics"]["acc"]["value"]
    lm_eval_table = table.split("## lm-evaluation-harness tasks")[1]  # after the main and per-domain tables
    row = next(line for line in lm_eval_table.splitlines() if line.startswith("| tiny |"))  # its lm-eval row
    assert f"{100 * (mine - base):+.1f} pt" in row
    report = json.loads(written["json"].read_text())
    assert report["rows"][1]["lm_eval:persuasion_cloze:acc"] is None  # the tiny run had no cloze


def test_unknown_task_is_refused_before_loading(tiny):
    with pytest.raises(InputError, match="not_a_task: not an lm-eval task"):
        evaluate(tiny, lm_eval_tasks=["not_a_task"], speed_preset=None, progress=False)
    with pytest.raises(InputError, match="--lm-eval-limit 0 must be at least 1"):
        evaluate(tiny, lm_eval_tasks=["persuasion_cloze"], lm_eval_limit=0, speed_preset=None, progress=False)


def _hub_task_index(tmp_path):
    """A TaskManager over two tasks that read hub datasets (as hellaswag does), a group and a tag of them,
    and one task on local json files: the data check sees exactly the two hub repos."""
    from lm_eval.tasks import TaskManager

    common = "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{text}}'\ndoc_to_target: ' x'\n"
    (tmp_path / "a.yaml").write_text(f"task: hub_a\ntag: [both_hub]\ndataset_path: someorg/data-a\n{common}")
    (tmp_path / "b.yaml").write_text(f"task: hub_b\ntag: [both_hub]\ndataset_path: data-b\ndataset_name: cfg\n{common}")
    (tmp_path / "c.yaml").write_text(
        f"task: local_c\ndataset_path: json\ndataset_kwargs:\n  data_files: x.jsonl\n{common}"
    )
    (tmp_path / "g.yaml").write_text("group: hub_group\ntask: [hub_a, local_c]\n")
    return TaskManager(include_path=str(tmp_path), include_defaults=False)


def test_hub_datasets_of_tasks_groups_and_tags(tmp_path):
    from mha2gqa.eval.lmeval import hub_datasets

    manager = _hub_task_index(tmp_path)
    assert hub_datasets(manager, ["hub_group"]) == {"someorg/data-a": "hub_a"}
    assert set(hub_datasets(manager, ["both_hub", "local_c"])) == {"someorg/data-a", "data-b"}


def test_uncached_task_data_offline_is_one_line_before_the_run(tmp_path, monkeypatch):
    from mha2gqa.eval.lmeval import validate_task_data

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError) as err:
        validate_task_data(_hub_task_index(tmp_path), ["both_hub"])
    assert str(err.value).startswith(
        "--lm-eval-tasks: the data of hub_a (someorg/data-a), hub_b (data-b) is not in the local cache"
    )


def test_unreachable_hub_for_task_data_is_one_bounded_try(tmp_path, monkeypatch):
    import huggingface_hub

    from mha2gqa.eval.lmeval import validate_task_data
    from mha2gqa.files.sources import HUB_TIMEOUT_S

    asked = []

    def unreachable(self, repo, timeout=None, **kwargs):
        asked.append((repo, timeout))
        raise ConnectionError("no route")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(InputError, match=r"hub_a: its data someorg/data-a is not cached here and the hub did not"):
        validate_task_data(_hub_task_index(tmp_path), ["hub_group"])
    assert asked == [("someorg/data-a", HUB_TIMEOUT_S)]


def test_hellaswag_offline_is_refused_in_one_line_before_loading(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        main,
        ["eval", str(tiny), "--data", str(embedded.heldout_path())]
        + ["--lm-eval-tasks", "hellaswag", "--out", str(out)],
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "Error: --lm-eval-tasks: the data of hellaswag (Rowan/hellaswag) is not in the local cache and the hub is "
        "offline (HF_HUB_OFFLINE=1): run once online to cache it, or use an offline task "
        "(persuasion_cloze, persuasion_next_sentence)"
    ]
    assert not out.exists()
