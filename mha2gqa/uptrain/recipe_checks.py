"""Value and cross-key rules of a recipe. Each rule appends one message naming the key, the rule
and the fix; nothing raises here so that the user sees every problem at once."""

from __future__ import annotations

import re
from pathlib import Path

from mha2gqa.errors import InputError
from mha2gqa.layouts import read_config
from mha2gqa.sources import hub_offline
from mha2gqa.textdata import resolve
from mha2gqa.uptrain import lora
from mha2gqa.uptrain.recipe import Recipe

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def check(r: Recipe, problems: list[str], check_files: bool = True) -> None:
    _check_numbers(r, problems)
    _check_budget(r, problems)
    _check_sources(r, problems, check_files)
    lora.check(r, problems)


def _need(problems: list[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


def _check_numbers(r: Recipe, p: list[str]) -> None:
    for key, value in [("seq_len", r.seq_len - 1), ("micro_batch_size", r.micro_batch_size),
                       ("grad_accum", r.grad_accum), ("log_every", r.log_every), ("keep_last", r.keep_last),
                       ("data.eval_blocks", r.data.eval_blocks), ("data.shuffle_buffer", r.data.shuffle_buffer)]:
        _need(p, value >= 1, f"{key} must be at least {2 if key == 'seq_len' else 1}")
    for key, value in [("eval_every", r.eval_every), ("save_every", r.save_every),
                       ("optim.warmup_steps", r.optim.warmup_steps), ("optim.weight_decay", r.optim.weight_decay),
                       ("optim.grad_clip", r.optim.grad_clip)]:
        _need(p, value >= 0, f"{key}={value} must be 0 or more")
    _need(p, r.exit_after_steps is None or r.exit_after_steps >= 1, "exit_after_steps must be at least 1 (or unset)")
    _need(p, r.optim.lr > 0, f"optim.lr={r.optim.lr} must be positive (e.g. 1e-4)")
    _need(p, 0 <= r.optim.min_lr_ratio <= 1, f"optim.min_lr_ratio={r.optim.min_lr_ratio} must be in [0, 1]")
    _need(p, r.optim.eps > 0, f"optim.eps={r.optim.eps} must be positive")
    _need(p, all(0 <= b < 1 for b in r.optim.betas), f"optim.betas={list(r.optim.betas)} must each be in [0, 1)")
    _need(p, 0 <= r.distill.kl_weight <= 1, f"distill.kl_weight={r.distill.kl_weight} must be in [0, 1]")
    _need(p, r.distill.temperature > 0, f"distill.temperature={r.distill.temperature} must be positive")


def _check_budget(r: Recipe, p: list[str]) -> None:
    b = r.budget
    chosen = [k for k in ("max_steps", "tokens", "alpha") if getattr(b, k) is not None]
    if len(chosen) != 1:
        got = ", ".join(f"budget.{k}" for k in chosen) or "none"
        p.append(f"set exactly one of budget.max_steps, budget.tokens, budget.alpha (got {got})")
    for key in ("max_steps", "tokens", "alpha", "pretrain_tokens"):
        value = getattr(b, key)
        _need(p, value is None or value > 0, f"budget.{key}={value} must be positive")
    _need(p, b.alpha is None or b.pretrain_tokens is not None,
          "budget.alpha needs budget.pretrain_tokens (the tokens the source model was pretrained on)")


def _check_sources(r: Recipe, p: list[str], check_files: bool) -> None:
    if (r.model is None) == (r.init_from_config is None):
        p.append("set exactly one of model (to uptrain) and init_from_config (to train from scratch)")
    _need(p, bool(r.output_dir), "output_dir is required (where checkpoints and the final model go)")
    if r.output_dir and Path(r.output_dir).expanduser().is_file():
        p.append(f"output_dir={r.output_dir} is a file: choose a directory")
    if check_files:
        for key, value in [("model", r.model), ("tokenizer", r.tokenizer), ("distill.teacher", r.distill.teacher)]:
            if value is not None:
                _check_model_ref(key, value, p)
        if r.init_from_config is not None:
            _check_config_ref(r.init_from_config, p)
    if r.init_from_config and r.init_from_config.endswith(".json") and r.tokenizer is None:
        p.append("tokenizer is required with init_from_config=<file>.json (a config file carries no tokenizer)")
    resolve("data.train", r.data.train, p, check_files, one_format=True)
    if r.data.eval is not None:
        resolve("data.eval", r.data.eval, p, check_files, one_format=True)


def _check_model_ref(key: str, value: str, p: list[str]) -> None:
    path = Path(value).expanduser()
    if path.is_dir():
        if key == "tokenizer":
            return
        if not (path / "config.json").is_file():
            p.append(f"{key}={value} has no config.json: pass a HF model dir")
            return
        try:  # a binary or list config.json, or string head counts, fail here and not in transformers
            read_config(path)
        except InputError as err:
            p.append(f"{key}={value}: {err}")
    elif path.exists():
        p.append(f"{key}={value} is a file: pass a model directory or a hub id like org/name")
    elif not _HUB_ID.match(value):
        p.append(f"{key}={value}: no such directory, and not a hub id like org/name")
    elif hub_offline():
        p.append(f"{key}={value} is not a local directory and the hub is offline (HF_HUB_OFFLINE=1)")


def _check_config_ref(value: str, p: list[str]) -> None:
    path = Path(value).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return
    if path.is_dir():
        p.append(f"init_from_config={value} holds no config.json")
    elif value.endswith(".json") or not _HUB_ID.match(value):
        p.append(f"init_from_config={value}: no such file")
    elif hub_offline():
        p.append(f"init_from_config={value} is not local and the hub is offline (HF_HUB_OFFLINE=1)")
