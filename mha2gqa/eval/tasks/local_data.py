"""Loader for the offline tasks in this folder (lm-eval calls it through `custom_dataset`).

lm-eval hands `dataset_kwargs.data_files` to `datasets.load_dataset` as written, so a relative
path would be read from the user's working directory. Resolving it here, against this file's
folder, lets the YAMLs work from anywhere: through `mha2gqa eval --lm-eval-tasks` and through
`lm_eval --include_path <this folder>`.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(data_file: str, **_metadata):
    """The task's .jsonl (beside this file) as a DatasetDict with one "test" split."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(HERE / data_file)})
