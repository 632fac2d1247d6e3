"""One source of truth for option docs: each `convert` / `eval` option's --help is its ConvertOptions /
EvalOptions field's docstring (mha2gqa.docfields reads them from the source), and every field has one."""

from dataclasses import fields

import click
import pytest

from mha2gqa.cli.convert_cmd import convert
from mha2gqa.cli.eval_cmd import eval_command
from mha2gqa.convert.options import METHOD_SUMMARIES, ConvertOptions, Grouping, Method, RefineOptions
from mha2gqa.docfields import choice_docs, field_docs
from mha2gqa.eval.options import EvalOptions, SpeedPreset

# options that set no field of the command's options type, so keep a literal help
# --refine-* options set RefineOptions fields (ConvertOptions.refine)
REFINE_FIELDS = {"refine_steps": "steps", "refine_lr": "lr", "refine_memory": "memory", "refine_tokens": "tokens"}
NOT_FIELDS = {"convert": {"quiet", *REFINE_FIELDS}, "eval": {"quiet"}}
# options that pick one of several: their help lists each choice after the field's docstring
CHOICES = {"method": METHOD_SUMMARIES, "grouping": choice_docs(Grouping), "speed_preset": choice_docs(SpeedPreset)}


@pytest.mark.parametrize("command, cls", [(convert, ConvertOptions), (eval_command, EvalOptions)])
def test_each_options_help_is_its_fields_docstring(command, cls):
    docs, names = field_docs(cls), {f.name for f in fields(cls)}
    options = [p for p in command.params if isinstance(p, click.Option)]
    assert {p.name for p in options} - names == NOT_FIELDS[command.name]
    for option in options:
        if option.name in names:
            expected = " ".join(docs[option.name].split())
            if option.name in CHOICES:
                listed = (f"{value}: {doc.rstrip('.')}" for value, doc in CHOICES[option.name].items())
                expected += " " + "; ".join(listed) + "."
            assert option.help == expected, option.opts[0]


def test_refine_options_help_is_the_refine_fields_docstring():
    docs = field_docs(RefineOptions)
    helps = {p.name: p.help for p in convert.params if p.name in REFINE_FIELDS}
    assert helps == {option: docs[field] for option, field in REFINE_FIELDS.items()}


@pytest.mark.parametrize("cls", [ConvertOptions, EvalOptions, RefineOptions])
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    assert [f.name for f in fields(cls)] == list(docs)
    assert all(len(text.split()) >= 2 for text in docs.values())


@pytest.mark.parametrize(
    "enum, summaries",
    [(Method, METHOD_SUMMARIES), (Grouping, choice_docs(Grouping)), (SpeedPreset, choice_docs(SpeedPreset))],
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
