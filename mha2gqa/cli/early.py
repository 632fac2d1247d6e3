"""Checks a command runs on its flags before it imports torch: a mistyped path or value is refused in a
fraction of a second, not after torch's start-up (13-69 s for a missing `eval --data` on a busy 2-core
machine). Only what is known without torch or a model is checked here; the command's own checks (eval/run.py,
the recipe's, convert's `prepare`) still run and say the same things for Python callers."""

from __future__ import annotations

from pathlib import Path

from mha2gqa.architecture.dtypes import dtype_name
from mha2gqa.corpus import textdata
from mha2gqa.corpus.probe import parse_domains
from mha2gqa.eval.schema import validate_writable
from mha2gqa.files.reading import did_you_mean
from mha2gqa.files.sources import looks_local, model_ref_problem, require_safetensors
from mha2gqa.runtime.errors import InputError

# eval flags with a least value; the messages are eval/run.py's and scoring/perplexity.py's
_EVAL_LEAST = (
    ("--batch-size", "batch_size", 1),
    ("--max-tokens", "max_tokens", 2),
    ("--kv-batch", "kv_batch", 1),
    ("--kv-tokens", "kv_tokens", 1),
    ("--context", "context", 2),
    ("--new-tokens", "new_tokens", 1),
    ("--repeats", "repeats", 1),
    ("--lm-eval-limit", "lm_eval_limit", 1),
)


def validate_model(name: str, what: str = "") -> None:
    """A model directory with safetensors weights, or a hub id the hub may be asked for."""
    problem = model_ref_problem(str(name), what)
    if problem:
        raise InputError(problem)
    if Path(name).expanduser().is_dir():
        require_safetensors(Path(name).expanduser(), what.strip() or "model")


def validate_out(out: str | None, force: bool, flag: str = "--out") -> None:
    """A result file may go to `out`: not a folder, not an existing file unless --force, writable."""
    if out is None:
        return
    path = Path(out)
    if path.is_dir():
        raise InputError(f"{flag} {out} is a directory: pass a file path such as {path / 'results.json'}")
    if path.exists() and not force:
        raise InputError(f"{flag} {out} exists: pass --force to replace it, or choose a new path")
    validate_writable(path, flag)


def validate_eval(model: str, options: dict, out: str | None, force: bool) -> dict:
    """`eval`'s flags as far as they can be checked without torch; returns `options` with --dtype in its
    one name (bf16 -> bfloat16)."""
    validate_model(model)
    if options.get("reference"):
        validate_model(options["reference"], "--reference ")
    tokenizer = options.get("tokenizer")
    if tokenizer and not Path(tokenizer).expanduser().is_dir() and looks_local(tokenizer):
        raise InputError(
            f"--tokenizer {tokenizer}: no such directory ({looks_local(tokenizer)}){did_you_mean(tokenizer)}"
        )
    for path in (parse_domains(options.get("data")) or {}).values():  # each named text (default: the probe set)
        textdata.resolve("--data", path)
    for flag, key, least in _EVAL_LEAST:
        if isinstance(options.get(key), int) and options[key] < least:  # --batch-size auto is checked by eval
            raise InputError(f"{flag} {options[key]} must be at least {least}")
    stride, context = options.get("stride"), options.get("context")
    if stride is not None and (stride < 1 or (context is not None and stride > context)):
        raise InputError(f"--stride {stride} must be between 1 and --context {context or 'the window'}")
    for flag, key in (("--speed-batches", "speed_batches"), ("--speed-contexts", "speed_contexts")):
        values = options.get(key)
        if values is not None and (not values or min(values) < 1):
            raise InputError(f"{flag} {','.join(map(str, values))}: every value must be a positive integer")
    validate_out(out, force)
    if options.get("attention_png"):
        validate_writable(Path(options["attention_png"]), "--attention-png")
    return {**options, "dtype": dtype_name(options.get("dtype"), keep=("auto",))}
