"""lm-evaluation-harness tasks on the model already loaded for the perplexity pass, folded into the result.

`pip install 'mha2gqa[lmeval]'`. Task names are lm-eval's: the offline suite shipped in
eval/tasks/ (OFFLINE_TASKS, built from held-out Persuasion, see docs/lmeval.md) or any hub task
(hellaswag, arc_easy, ...) when the machine is online.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import statistics
from pathlib import Path

from mha2gqa.files import jsontext
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.quiet import LM_EVAL_NOISE, without_datasets_bars, without_log_messages

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
OFFLINE_TASKS = ("persuasion_cloze", "persuasion_next_sentence")
# Perplexity's standard error is a bootstrap; lm-eval's default of 100,000 resamples takes longer
# than the task itself on a small model, and 1,000 give the same first significant digit.
BOOTSTRAP_ITERS = 1000


def validate_lm_eval_installed() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise InputError("--lm-eval-tasks needs lm-evaluation-harness: pip install 'mha2gqa[lmeval]'")


def task_manager(tasks: list[str]):
    """lm-eval's TaskManager over our offline tasks, plus its own catalogue when another name is asked
    for (indexing lm-eval's thousands of YAMLs takes seconds, so only then)."""
    from lm_eval.tasks import TaskManager

    needs_hub = any(t not in OFFLINE_TASKS and t != "mha2gqa_offline" for t in tasks)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=needs_hub)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        listed = ", ".join(OFFLINE_TASKS)
        raise InputError(
            f"--lm-eval-tasks {','.join(unknown)}: not an lm-eval task (offline ones: {listed}; "
            "hub tasks such as hellaswag need `lm_eval --tasks list` names)"
        )
    if needs_hub:
        validate_task_data(manager, [t for t in tasks if t not in OFFLINE_TASKS])
    return manager


def hub_datasets(manager, names: list[str]) -> dict[str, str]:
    """{hub dataset repo: the task that reads it} for `names` (tasks, groups and tags, expanded as lm-eval
    does), from the task YAMLs already indexed: nothing is downloaded. Tasks with a custom or local
    loader (json/csv/text files, our offline ones) read no hub dataset and are left out."""
    from lm_eval.tasks._index import Kind

    found: dict[str, str] = {}
    todo, seen = list(names), set()
    while todo:
        name = todo.pop(0)  # breadth first, in the order asked: the message lists tasks as typed
        entry = manager.task_index.get(name) if isinstance(name, str) else None
        if entry is None or name in seen:
            continue
        seen.add(name)
        cfg = entry.cfg or {}
        if entry.kind == Kind.TAG:
            todo += sorted(entry.tags)
        elif entry.kind == Kind.GROUP:
            children = cfg.get("task") or []
            todo += [c if isinstance(c, str) else c.get("task") for c in children]
        path = cfg.get("dataset_path")
        if entry.kind == Kind.TASK and path and not cfg.get("custom_dataset") and _is_hub_dataset(path):
            found.setdefault(path, name)
    return found


def _is_hub_dataset(path: str) -> bool:
    from mha2gqa.files.sources import is_hub_id

    return path not in _LOCAL_BUILDERS and not Path(path).expanduser().exists() and is_hub_id(path)


# datasets' packaged builders read local files named in dataset_kwargs, not a hub repo.
_LOCAL_BUILDERS = {"json", "csv", "text", "parquet", "arrow", "pandas", "webdataset", "imagefolder"}


def validate_task_data(manager, names: list[str]) -> None:
    """Before the run: every hub dataset the tasks read is in the local cache or, when online, answers one
    bounded request; otherwise one line naming the task, the dataset and the fix (not lm-eval's retries
    and traceback in the middle of an evaluation)."""
    from huggingface_hub import snapshot_download

    from mha2gqa.files.sources import HUB_TIMEOUT_S, hub_offline

    missing = {}
    for repo, task in hub_datasets(manager, names).items():
        try:
            snapshot_download(repo, repo_type="dataset", local_files_only=True)
            continue
        except Exception:  # not cached (LocalEntryNotFoundError and kin): ask the hub below, or say so
            pass
        if hub_offline() or _datasets_offline():
            missing[repo] = task
            continue
        from huggingface_hub import HfApi

        try:
            HfApi().dataset_info(repo, timeout=HUB_TIMEOUT_S)
        except Exception as err:  # unreachable, unknown or gated: all the user's to fix
            raise InputError(
                f"--lm-eval-tasks {task}: its data {repo} is not cached here and the hub did not answer "
                f"({type(err).__name__}, one try, {HUB_TIMEOUT_S} s timeout): check your network and HF_TOKEN, "
                f"or use an offline task ({', '.join(OFFLINE_TASKS)})"
            ) from None
    if missing:
        named = ", ".join(f"{task} ({repo})" for repo, task in missing.items())
        raise InputError(
            f"--lm-eval-tasks: the data of {named} is not in the local cache and the hub is offline "
            f"(HF_HUB_OFFLINE=1): run once online to cache it, or use an offline task ({', '.join(OFFLINE_TASKS)})"
        )


def _datasets_offline() -> bool:
    return os.environ.get("HF_DATASETS_OFFLINE", "0").upper() in {"1", "ON", "YES", "TRUE"}


@contextlib.contextmanager
def _in_process_bootstrap():
    """lm-eval bootstraps perplexity's stderr in a fork()ed multiprocessing pool unless DISABLE_MULTIPROC is
    set; forking a process that already runs torch's threads can deadlock (seen in the demo), and the
    in-process path draws the same seeded resamples, so the numbers are identical."""
    previous = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["DISABLE_MULTIPROC"]
        else:
            os.environ["DISABLE_MULTIPROC"] = previous


def run_lm_eval(
    model,
    tokenizer,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int | str = 1,
    manager=None,
    chat_template: bool = False,
    log_samples: Path | None = None,
) -> dict:
    """Run `tasks` on the loaded `model` (no second copy is loaded) and return the result's lm_eval
    section: harness version, settings, and per task the number of examples and every metric with
    its standard error and direction. chat_template: the prompts go through the tokenizer's chat
    template. log_samples: every example is written there as one JSON line."""
    validate_lm_eval_installed()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    manager = manager or task_manager(tasks)
    with without_log_messages(LM_EVAL_NOISE):  # we hand lm-eval our loaded model on purpose, in one process
        wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    # stdout: lm-eval prints "bootstrapping for stddev: perplexity" there (its results come back as data)
    with _in_process_bootstrap(), without_log_messages(LM_EVAL_NOISE), without_datasets_bars():
        with contextlib.redirect_stdout(io.StringIO()):
            out = lm_eval.simple_evaluate(
                model=wrapped,
                tasks=list(tasks),
                limit=limit,
                task_manager=manager,
                bootstrap_iters=BOOTSTRAP_ITERS,
                log_samples=True,  # the per-example log-likelihoods give perplexity an honest interval
                apply_chat_template=chat_template,
            )
    if log_samples is not None:
        write_samples(out["samples"], log_samples)
    return {
        "harness": f"lm-eval {lm_eval.__version__}",
        "limit": limit,
        "bootstrap_iters": BOOTSTRAP_ITERS,
        "chat_template": chat_template,
        "samples_log": str(log_samples) if log_samples is not None else None,
        "tasks": {
            task: fold_task(
                metrics,
                out["higher_is_better"].get(task, {}),
                out["n-samples"].get(task, {}).get("effective"),
                perplexity_intervals(out["configs"].get(task, {}), out["samples"].get(task, [])),
            )
            for task, metrics in out["results"].items()
        },
    }


def write_samples(samples: dict, path: Path) -> Path:
    """{task: [example, ...]} as JSON lines, each with its task: lm-eval's own per-example record (doc, the
    prompt arguments, responses, per-example metrics); values JSON has no type for are written as text."""
    from mha2gqa.files.writing import write_atomic

    lines = [
        jsontext.dumps({"task": task, **example}, default=str) for task, found in samples.items() for example in found
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, "".join(line + "\n" for line in lines))


def perplexity_intervals(config: dict, samples: list[dict]) -> dict[str, list[float]]:
    """{metric: [low, high]}, the 95% interval of each perplexity-aggregated metric, from its examples.

    lm-eval's stderr of a perplexity is a bootstrap of exp(mean nll): a few examples with a very
    unlikely target word (nll 15-20 nats) move a resample's mean by a nat or more, and exp() turns
    that into a right tail, so the "stderr" can be several times the value (8,081 ± 57,586 on 40
    cloze examples). The mean nll itself is an ordinary mean with an ordinary standard error; its
    interval, exponentiated, is the perplexity's, and stays on the multiplicative scale it lives on."""
    intervals = {}
    for entry in config.get("metric_list") or []:
        name = entry.get("metric")
        if entry.get("aggregation") != "perplexity" or not isinstance(name, str):
            continue
        ll = [s[name] for s in samples if s.get("filter", "none") == "none" and _is_number(s.get(name))]
        if len(ll) < 2:
            continue
        nll = -statistics.fmean(ll)
        half = 1.96 * statistics.stdev(ll) / math.sqrt(len(ll))
        intervals[name] = [math.exp(nll - half), math.exp(min(nll + half, 700.0))]
    return intervals


def fold_task(raw: dict, higher_is_better: dict, samples: int | None, intervals: dict | None = None) -> dict:
    """lm-eval's {"acc,none": 0.4, "acc_stderr,none": 0.02, "alias": ...} -> {"samples": n, "metrics":
    {"acc": {"value", "stderr", "higher_is_better"}}}, and "interval_95" for a perplexity with one in
    `intervals`. A filter other than "none" (e.g. gsm8k's strict-match) stays in the name:
    "exact_match (strict-match)"."""
    metrics = {}
    for key, value in raw.items():
        name, _, filter_name = key.partition(",")
        if not filter_name or name.endswith("_stderr") or not _is_number(value):
            continue
        stderr = raw.get(f"{name}_stderr,{filter_name}")
        label = name if filter_name == "none" else f"{name} ({filter_name})"
        metrics[label] = {
            "value": value,
            "stderr": stderr if _is_number(stderr) else None,
            "higher_is_better": higher_is_better.get(name),
        }
        if filter_name == "none" and name in (intervals or {}):
            metrics[label]["interval_95"] = intervals[name]
    return {"samples": samples, "metrics": metrics}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
