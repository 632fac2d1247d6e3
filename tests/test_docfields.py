"""One source of truth for options: each `convert` / `eval` / `sweep` option's --help is its ConvertOptions /
EvalOptions / SweepOptions field's docstring (mha2gqa.runtime.docfields reads them from the source), every field has
one, and every option's default is its field's default."""

from dataclasses import MISSING, fields

import click
import pytest

from mha2gqa.cli.convert_cmd import convert
from mha2gqa.cli.eval_cmd import eval_command
from mha2gqa.cli.fields import field_default
from mha2gqa.cli.sweep_cmd import sweep
from mha2gqa.convert.options import (
    CONVERT_FLAGS,
    METHOD_SUMMARIES,
    ConvertOptions,
    GlobalPrecision,
    Grouping,
    Method,
    RefineOptions,
)
from mha2gqa.eval.options import DecodePath, EvalOptions, SpeedPreset
from mha2gqa.runtime.docfields import choice_docs, field_docs
from mha2gqa.runtime.units import parse_size
from mha2gqa.sweep.options import SweepOptions

# options that set no field of the command's options type, so keep a literal help
# --refine-* options set RefineOptions fields (ConvertOptions.refine): the flag table says which
REFINE_FIELDS = {flag.key: flag.name for flag in CONVERT_FLAGS if flag.owner is RefineOptions}
FOLLOWS = {flag.key: flag.default_from for flag in CONVERT_FLAGS if flag.default_from}  # unset: another flag's value
# --config: the flags' file; --plan-tensors: how --dry-run prints the plan, no option of the conversion
NOT_FIELDS = {"convert": {"quiet", "config", "plan_tensors", *REFINE_FIELDS}, "eval": {"quiet", "force"}}
# options that pick one of several: their help lists each choice after the field's docstring
CHOICES = {
    "method": METHOD_SUMMARIES,
    "grouping": choice_docs(Grouping),
    "speed_preset": choice_docs(SpeedPreset),
    "decode_path": choice_docs(DecodePath),
}
REFINE_CHOICES = {"global_precision": choice_docs(GlobalPrecision)}


def _with_choices(text: str, choices: dict | None) -> str:
    """A field's docstring as its option's help says it: on one line, then each choice and its doc."""
    text = " ".join(text.split())
    if choices:
        text += " " + "; ".join(f"{value}: {doc.rstrip('.')}" for value, doc in choices.items()) + "."
    return text


@pytest.mark.parametrize("command, cls", [(convert, ConvertOptions), (eval_command, EvalOptions)])
def test_each_options_help_is_its_fields_docstring(command, cls):
    docs, names = field_docs(cls), {f.name for f in fields(cls)}
    options = [p for p in command.params if isinstance(p, click.Option)]
    assert {p.name for p in options} - names == NOT_FIELDS[command.name]
    for option in options:
        if option.name in names:
            assert option.help == _with_choices(docs[option.name], CHOICES.get(option.name)), option.opts[0]


def test_every_convert_and_refine_field_has_one_flag_in_the_table():
    table = [(flag.owner, flag.name) for flag in CONVERT_FLAGS]
    assert len(table) == len(set(table))
    assert set(table) == {(cls, f.name) for cls in (ConvertOptions, RefineOptions) for f in fields(cls)}
    shown = ("config", "plan_tensors")  # how the command reads its flags and prints a plan: no conversion options
    flags = [p.name for p in convert.params if isinstance(p, click.Option) and p.name not in shown]
    assert flags == [f.key for f in CONVERT_FLAGS]


def test_refine_options_help_is_the_refine_fields_docstring():
    docs = field_docs(RefineOptions)
    helps = {p.name: p.help for p in convert.params if p.name in REFINE_FIELDS}
    expected = {
        option: _with_choices(docs[field], REFINE_CHOICES.get(field)) for option, field in REFINE_FIELDS.items()
    }
    assert {option: " ".join(text.split()) for option, text in helps.items()} == expected


@pytest.mark.parametrize("cls", [ConvertOptions, EvalOptions, RefineOptions])
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    assert [f.name for f in fields(cls)] == list(docs)
    assert all(len(text.split()) >= 2 for text in docs.values())


@pytest.mark.parametrize(
    "enum, summaries",
    [
        (Method, METHOD_SUMMARIES),
        (Grouping, choice_docs(Grouping)),
        (SpeedPreset, choice_docs(SpeedPreset)),
        (GlobalPrecision, choice_docs(GlobalPrecision)),
    ],
)
def test_every_choice_is_documented(enum, summaries):
    assert list(summaries) == [member.value for member in enum]


class Example:
    plain: int = 0
    """One line."""
    wrapped: str = ""
    """Two
    lines."""
    undocumented: int = 1
    MEMBER = "m"
    """a member."""

    class Nested:
        inner: int = 0
        """Inside."""


def test_docstrings_are_read_from_the_source_normalised():
    assert field_docs(Example) == {"plain": "One line.", "wrapped": "Two lines.", "MEMBER": "a member."}
    assert field_docs(Example.Nested) == {"inner": "Inside."}


def _as_field_value(option: click.Option, value, field_default):
    """What the command builds from the option's default `value`, as the field holds it."""
    if isinstance(field_default, tuple) and not option.multiple:  # comma-separated on the command line
        return tuple(value.split(","))
    if isinstance(field_default, int) and isinstance(value, str):  # a size flag: 4GiB
        return parse_size(value, option.opts[0])
    if option.multiple and isinstance(field_default, str) and isinstance(value, tuple) and len(value) == 1:
        return value[0]  # a repeatable flag whose field holds one value as itself
    return value


@pytest.mark.parametrize(
    "command, cls",
    [(convert, ConvertOptions), (eval_command, EvalOptions), (sweep, SweepOptions)],
    ids=["convert", "eval", "sweep"],
)
def test_each_options_default_is_its_fields_default(command, cls):
    names, ctx = {f.name for f in fields(cls)}, click.Context(command)
    covered = set()
    for option in (p for p in command.params if isinstance(p, click.Option)):
        default = option.get_default(ctx)
        if option.name in REFINE_FIELDS:
            owner, name = RefineOptions, REFINE_FIELDS[option.name]
        elif option.name in names:
            owner, name = cls, option.name
        elif option.name == "force" and cls is EvalOptions:  # eval's CLI rule, not an option of evaluate()
            assert default is False
            continue
        elif option.name == "config" and command is convert:  # a file of the other options, not an option itself
            assert not option.expose_value
            continue
        elif option.name == "plan_tensors" and command is convert:  # how --dry-run prints, no conversion option
            assert default is False
            continue
        else:
            assert option.name == "quiet", option.opts[0]  # sets progress, inverted
            assert default is False and field_default(cls, "progress") is True
            continue
        expected = field_default(owner, name)
        if option.name in FOLLOWS:  # --refine-seed: unset, it is --seed's value
            assert default is None and option.show_default == f"--{FOLLOWS[option.name]}", option.opts[0]
        elif expected is MISSING:
            assert option.required, option.opts[0]
        elif name == "refine":  # a flag that turns RefineOptions on: off means None
            assert default is False and expected is None
        else:
            assert _as_field_value(option, default, expected) == expected, option.opts[0]
            # a default that depends on another flag says so in words (Flag.default_words: --method's)
            words = {f.key: f.default_words for f in CONVERT_FLAGS}.get(option.name) if command is convert else None
            assert option.show_default == (words or (expected is not None and not option.is_flag)), option.opts[0]
        covered.add((owner, name))
    assert {name for owner, name in covered if owner is cls} == names - {"progress"}  # every field has its option
