"""A recipe file -> a checked Recipe: YAML, `key=value` overrides, typed values, then the value and
cross-key rules. Every problem is collected and reported together, each naming the key the user
typed, the rule and the fix.

This is the one place a recipe is checked. What needs more than the recipe is checked where it
first exists: the tokenizer's EOS and the packed data in data.py (and there the data files of a
recipe loaded with validate_files=False); the model's vocabulary and positions, the trainable set, the
teacher, and output_dir (against the sources and --resume, room on its disk) in loop.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import shlex
import types
import typing
from pathlib import Path

import yaml

from mha2gqa.architecture.layouts import read_config
from mha2gqa.corpus.mix import PARENT, as_words
from mha2gqa.files.embedded import CORPUS_NAME
from mha2gqa.files.reading import MAX_YAML_BYTES, YamlLimit, did_you_mean, near_miss, parse_yaml, read_yaml_mapping
from mha2gqa.files.sources import hub_offline, is_hub_id, looks_local, model_ref_problem
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.limits import BOUNDS, count_problems
from mha2gqa.runtime.units import counted
from mha2gqa.uptrain.data_spec import data_parts, validate_rules
from mha2gqa.uptrain.recipe import BudgetConfig, LoraConfig, Recipe, all_keys, group_keys


def load_recipe(path, overrides=(), validate_files: bool = True) -> Recipe:
    """Read a YAML recipe, apply `key=value` overrides, check it; raise InputError listing every problem.

    validate_files=False skips the checks that local model/data paths exist (to check a shipped recipe
    for a machine that has its files); data.py then checks the data files when it reads them."""
    raw = _read_yaml(path)
    problems: list[str] = []
    _apply_overrides(raw, list(overrides), problems)
    recipe = _build(Recipe, raw, "", problems)
    _validate_numbers(recipe, problems)
    _validate_budget(recipe, problems, overridden={item.partition("=")[0].strip() for item in overrides})
    _validate_sources(recipe, problems, validate_files, made_first(path))
    _validate_data(recipe, problems, validate_files)
    _validate_lora(recipe, problems)
    if problems:
        raise InputError(f"recipe {path} has {counted(len(problems), 'problem')}: " + "; ".join(problems))
    return recipe


SHIPPED = Path(__file__).resolve().parent / "recipes"  # recipes inside the package, named without a path


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.yaml"))


def recipe_path(recipe) -> Path:
    """`--recipe`'s file: the path given, or a shipped recipe's name (distill-parent-cpu, or with .yaml); an
    existing path wins. A bare name that is neither is refused here: with the shipped name it is one typo from
    (did you mean ...?), else with the shipped names; a local file one typo away is left to the reader's own
    did-you-mean."""
    path = Path(recipe).expanduser()
    if os.path.lexists(path) or path.name != str(recipe):
        return path
    stem = path.name.removesuffix(".yaml")
    if (SHIPPED / f"{stem}.yaml").is_file():
        return SHIPPED / f"{stem}.yaml"
    if near_miss(path) is not None:
        return path
    shipped = shipped_recipes()
    close = difflib.get_close_matches(stem.lower(), shipped, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"shipped: {', '.join(shipped)}"
    raise InputError(
        f"recipe {recipe}: no such file, nor a recipe shipped in the package ({hint}); a recipe of your own is a "
        "path to its YAML (see recipes/*.yaml)"
    )


def _read_yaml(path) -> dict:
    path = recipe_path(path)
    size_fix = "a recipe is a few KB of YAML: pass the recipe itself (see recipes/*.yaml)"
    return read_yaml_mapping(path, f"recipe {path}", "a recipe", MAX_YAML_BYTES, size_fix, "see recipes/*.yaml")


def _apply_overrides(raw: dict, overrides: list[str], problems: list[str]) -> None:
    """`a.b=v` sets raw['a']['b'] = yaml(v); the schema check later catches unknown keys and bad values."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} is not key=value (e.g. optim.lr=1e-4)")
            continue
        try:
            value = parse_yaml(text, f"override {key}=", "give a plain value") if text else None
        except YamlLimit as err:
            problems.append(str(err))
            continue
        except yaml.YAMLError:
            value = text
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value


def _build(cls, raw: dict, prefix: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            problems.append(_unknown(prefix + str(key)))
    kwargs = {}
    for name in names & set(raw):
        hint, value, dotted = hints[name], raw[name], prefix + name
        if dataclasses.is_dataclass(hint):
            if isinstance(value, dict):
                kwargs[name] = _build(hint, value, dotted + ".", problems)
            elif value is not None:
                problems.append(f"{dotted} is a section: give its keys ({', '.join(all_keys(hint, dotted + '.'))})")
            continue
        try:
            if dotted in MIX_KEYS:  # a mix as YAML may read it ([a.txt: 0.5]), in the notation's words
                value = as_words(value, dotted)
            kwargs[name] = _coerce(value, hint)
        except InputError as err:
            problems.append(str(err))
        except (TypeError, ValueError) as err:
            problems.append(f"{dotted}: {err}")
    return cls(**kwargs)


# Names other tools give a key, by the leaf: `optim.learning_rate` means optim.lr, however close
# optim.min_lr_ratio is in spelling.
MIX_KEYS = ("data.train", "data.eval")  # written in the mix notation (corpus/mix.py)
_SYNONYMS = {"learning_rate": "lr", "batch_size": "micro_batch_size", "gradient_accumulation_steps": "grad_accum"}


def _unknown(key: str) -> str:
    section, _, leaf = key.rpartition(".")
    synonym = f"{section}.{_SYNONYMS[leaf]}" if section and leaf in _SYNONYMS else _SYNONYMS.get(leaf)
    if synonym in all_keys():
        return f"unknown key {key} (did you mean {synonym}?)"
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown key {key}{hint}"


def _coerce(value, hint):
    """Check `value` against a type hint, converting only lossless forms (1e-4 typed as text, 3.0 -> 3)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[X] and X | None
        if value is None:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        if value is False and "no" in args:  # YAML 1.1 reads a bare `no` as false
            value = "no"
        if value not in args:
            raise ValueError(f"expected one of {', '.join(args)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"expected a list of {len(args)} numbers like [0.9, 0.95], got {value!r}")
        return tuple(_coerce(v, a) for v, a in zip(value, args))
    if origin is list:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ValueError(f"expected a path/name or a list of them, got {value!r}")
        return list(items)
    return _scalar(value, hint)


def _scalar(value, hint):
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if hint in (int, float) and not isinstance(value, bool):
        if isinstance(value, str):
            try:
                value = float(value.replace("_", ""))
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
        if isinstance(value, (int, float)):
            if not math.isfinite(value):  # .inf passes `> 0` checks and turns every weight into NaN
                raise ValueError(f"expected a finite number, got {value!r}")
            if hint is float:
                return float(value)
            if float(value).is_integer():
                return int(value)
            raise ValueError(f"expected a whole number, got {value!r}")
    if hint is str and isinstance(value, str):
        return value
    raise ValueError(f"expected {'a number' if hint in (int, float) else 'text'}, got {value!r}")


# ---- the rules: each appends one message; nothing raises, so that the user sees every problem ----


def _need(problems: list[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


def _validate_numbers(r: Recipe, p: list[str]) -> None:
    for key, value in [
        ("seq_len", r.seq_len - 1),
        ("micro_batch_size", r.micro_batch_size),
        ("grad_accum", r.grad_accum),
        ("log_every", r.log_every),
        ("keep_last", r.keep_last),
        ("data.eval_blocks", r.data.eval_blocks),
        ("data.shuffle_buffer", r.data.shuffle_buffer),
    ]:
        _need(p, value >= 1, f"{key} must be at least {2 if key == 'seq_len' else 1}")
    for key, value in [
        ("eval_every", r.eval_every),
        ("save_every", r.save_every),
        ("optim.warmup_steps", r.optim.warmup_steps),
        ("optim.weight_decay", r.optim.weight_decay),
        ("optim.grad_clip", r.optim.grad_clip),
    ]:
        _need(p, value >= 0, f"{key}={value} must be 0 or more")
    _need(p, r.exit_after_steps is None or r.exit_after_steps >= 1, "exit_after_steps must be at least 1 (or unset)")
    # the most of each (limits.py); the least is the rules above, in their words
    p += count_problems("uptrain", {key: _key_value(r, key) for key in BOUNDS["uptrain"]}, joiner="=", least=False)
    _need(p, r.optim.lr > 0, f"optim.lr={r.optim.lr} must be positive (e.g. 1e-4)")
    _need(p, 0 <= r.optim.min_lr_ratio <= 1, f"optim.min_lr_ratio={r.optim.min_lr_ratio} must be in [0, 1]")
    _need(p, r.optim.eps > 0, f"optim.eps={r.optim.eps} must be positive")
    _need(p, all(0 <= b < 1 for b in r.optim.betas), f"optim.betas={list(r.optim.betas)} must each be in [0, 1)")
    _need(p, 0 <= r.distill.kl_weight <= 1, f"distill.kl_weight={r.distill.kl_weight} must be in [0, 1]")
    _need(p, r.distill.temperature > 0, f"distill.temperature={r.distill.temperature} must be positive")
    _need(p, r.distill.answer_weight > 0, f"distill.answer_weight={r.distill.answer_weight} must be positive")
    _need(
        p,
        r.distill.answer_weight == 1 or bool(r.distill.teacher),
        f"distill.answer_weight={r.distill.answer_weight} weighs the distillation loss, and distill.teacher is unset: "
        "set distill.teacher=<the MHA parent> or drop distill.answer_weight",
    )


def _key_value(recipe: Recipe, key: str):
    """The value of a dotted recipe key (data.eval_blocks)."""
    value = recipe
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _validate_budget(r: Recipe, p: list[str], overridden: set[str] = frozenset()) -> None:
    """`overridden`: the keys given as key=value. Overriding one budget on a recipe that sets another
    leaves both set; the message then names the one to unset (budget.alpha=null)."""
    b, kinds = r.budget, group_keys(BudgetConfig, "budget")
    chosen = [k for k in kinds if getattr(b, k) is not None]
    one_of = "set exactly one of " + ", ".join(f"budget.{k}" for k in kinds)
    if len(chosen) > 1:
        from_recipe = [f"budget.{k}" for k in chosen if f"budget.{k}" not in overridden]
        unset = from_recipe if 0 < len(from_recipe) < len(chosen) else [f"budget.{k}" for k in chosen[1:]]
        p.append(
            f"{one_of} (got {', '.join(f'budget.{k}' for k in chosen)}): unset the one(s) you do not want with "
            f"{' '.join(f'{key}=null' for key in unset)}"
        )
    elif not chosen:
        p.append(f"{one_of} (got none)")
    for key in (*kinds, "pretrain_tokens"):
        value = getattr(b, key)
        _need(p, value is None or value > 0, f"budget.{key}={value} must be positive")
    _need(
        p,
        b.alpha is None or b.pretrain_tokens is not None,
        "budget.alpha needs budget.pretrain_tokens (the tokens the source model was pretrained on)",
    )


def made_first(path) -> list[str]:
    """The commands a recipe's first line runs before its `mha2gqa uptrain` (`# mha2gqa convert SRC runs/x ... &&
    mha2gqa uptrain --recipe R`): what they make (runs/x) is a local path to make first, not a hub id."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096).decode("utf-8", "replace")
    except OSError:
        return []
    if not first.startswith("#"):
        return []
    commands = [c.strip() for c in first.lstrip("#").split("&&")]
    upto = next((i for i, c in enumerate(commands) if "uptrain --recipe" in c or "-m mha2gqa.uptrain" in c), 0)
    return commands[:upto]


def _made_by(value: str, commands: list[str]) -> str | None:
    """The first of `commands` that names `value` as one of its words, for a `value` that does not exist."""
    if Path(value).expanduser().exists():
        return None
    for command in commands:
        try:
            words = shlex.split(command)
        except ValueError:
            words = command.split()
        if value in words or value.rstrip("/") in words:
            return command
    return None


def _validate_sources(r: Recipe, p: list[str], validate_files: bool, first: list[str] = ()) -> None:
    if sum(getattr(r, key) is not None for key in group_keys(Recipe, "source")) != 1:
        p.append("set exactly one of model (to uptrain) and init_from_config (to train from scratch)")
    _need(p, bool(r.output_dir), "output_dir is required (where checkpoints and the final model go)")
    if r.output_dir and Path(r.output_dir).expanduser().is_file():
        p.append(f"output_dir={r.output_dir} is a file: choose a directory")
    if validate_files:
        for key, value in [("model", r.model), ("tokenizer", r.tokenizer), ("distill.teacher", r.distill.teacher)]:
            maker = None if value is None else _made_by(value, first)
            if maker:
                p.append(
                    f"{key}={value} does not exist yet: the recipe's first line makes it, run that first "
                    f"({maker}), or set {key}= to a model you have"
                )
            elif value is not None:
                _validate_model_ref(key, value, p)
        if r.init_from_config is not None:
            _validate_config_ref(r.init_from_config, p)
    if r.init_from_config and r.init_from_config.endswith(".json") and r.tokenizer is None:
        p.append("tokenizer is required with init_from_config=<file>.json (a config file carries no tokenizer)")


def _validate_model_ref(key: str, value: str, p: list[str]) -> None:
    path = Path(value).expanduser()
    if key == "tokenizer" and path.is_dir():
        return
    problem = model_ref_problem(value, f"{key}=")
    if problem:
        p.append(problem)
        return
    if path.is_dir():
        try:  # a binary or list config.json, or string head counts, fail here and not in transformers
            read_config(path)
        except InputError as err:
            p.append(f"{key}={value}: {err}")


def _validate_config_ref(value: str, p: list[str]) -> None:
    path = Path(value).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return
    if path.is_dir():
        p.append(f"init_from_config={value} holds no config.json")
    elif value.endswith(".json") or looks_local(value) or not is_hub_id(value):
        p.append(f"init_from_config={value}: no such file{did_you_mean(value)}")
    elif hub_offline():
        p.append(f"init_from_config={value} is not local and the hub is offline (HF_HUB_OFFLINE=1)")


def _validate_data(r: Recipe, p: list[str], validate_files: bool) -> None:
    """data.train and data.eval name text of one format each, `austen`, `parent` or a mix (data_spec).
    With the files checked, the parts found are kept on r.data for data.py, which reads exactly them
    rather than walking the folders again."""
    checked = {}
    for key, entries in (("data.train", r.data.train), ("data.eval", r.data.eval)):
        if any(problem.startswith(f"{key} ") or problem.startswith(f"{key}:") for problem in p):
            continue  # its value was refused already (not read as a list): 'is empty' would only add noise
        if entries is not None:
            checked[key] = (list(entries), data_parts(key, entries, p, validate_files, r.data.text_field))
    validate_rules(r, {key: parts for key, (_, parts) in checked.items()}, p)
    if validate_files:
        r.data.checked_sources = checked


def _validate_lora(recipe: Recipe, problems: list[str]) -> None:
    """The lora section is used by trainable=lora only, which needs peft (and QLoRA bitsandbytes and CUDA)."""
    lora, uses = recipe.lora, recipe.trainable == "lora"
    if not uses and lora != LoraConfig():
        problems.append(f"lora.* keys are set but trainable={recipe.trainable}: set trainable=lora or drop them")
        return
    if not uses:
        return
    if importlib.util.find_spec("peft") is None:
        problems.append("trainable=lora needs peft: pip install 'mha2gqa[lora]'")
    if lora.rank < 1:
        problems.append(f"lora.rank={lora.rank} must be at least 1 (e.g. 16)")
    if lora.alpha <= 0:
        problems.append(f"lora.alpha={lora.alpha} must be positive (e.g. twice lora.rank)")
    if not 0 <= lora.dropout < 1:
        problems.append(f"lora.dropout={lora.dropout} must be in [0, 1)")
    if lora.target_modules is not None and not lora.target_modules:
        problems.append("lora.target_modules is empty: list module names (e.g. [q_proj, v_proj]) or unset it")
    if lora.load_in_4bit and recipe.model is None:
        problems.append("lora.load_in_4bit=true needs model=<pretrained dir>: a 4-bit base is a trained one")
    if lora.load_in_4bit:
        import torch

        missing = [
            what
            for what, ok in (
                ("bitsandbytes", importlib.util.find_spec("bitsandbytes") is not None),
                ("a CUDA GPU", torch.cuda.is_available()),
            )
            if not ok
        ]
        if missing:
            problems.append(
                f"lora.load_in_4bit=true (QLoRA) needs {' and '.join(missing)}, absent here: "
                "set lora.load_in_4bit=false (plain LoRA holds the base as stored, e.g. bf16)"
            )


# ---- the recipe as a run records it ----


def recorded(recipe: Recipe) -> dict:
    """recipe.to_dict() with every local path made absolute (from the working directory the run started in),
    so that mha2gqa.json and the model card name the files a run read wherever they are read from. Hub ids
    and the names `austen` and `parent` stay as typed; so does a path that does not exist (yet)."""
    out = recipe.to_dict()
    for key in ("model", "tokenizer", "init_from_config", "output_dir"):
        out[key] = _absolute(out[key])
    out["distill"]["teacher"] = _absolute(out["distill"]["teacher"])
    for key in ("train", "eval"):
        if out["data"][key] is not None:
            out["data"][key] = [_absolute(entry) for entry in out["data"][key]]
    return out


def _absolute(value: str | None) -> str | None:
    """A local path (with a mix's `:share` kept as typed) made absolute; anything else unchanged."""
    if value is None or value in (PARENT, CORPUS_NAME):
        return value
    for name, share in ((value, ""), value.rpartition(":")[::2]):
        if name and Path(name).expanduser().exists():
            return os.path.abspath(Path(name).expanduser()) + (f":{share}" if share else "")
    return value
