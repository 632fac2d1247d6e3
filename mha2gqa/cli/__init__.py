"""The `mha2gqa` command line: one click group, one module per command family."""

from __future__ import annotations

import click

from mha2gqa import __version__
from mha2gqa.errors import InputError


class _OneLineError(click.ClickException):
    """A user mistake: `Error: <message>` on stderr, exit code 2, no traceback."""

    exit_code = 2


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as err:
            raise _OneLineError(str(err)) from None
        except click.UsageError as err:  # a subcommand's bad flag: one line too, with where to look
            where = err.ctx.command_path if err.ctx else "mha2gqa"
            raise _OneLineError(f"{err.format_message()} (see '{where} --help')") from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mha2gqa")
def main():
    """Convert multi-head attention (MHA) checkpoints to grouped-query (GQA) or multi-query (MQA)
    attention, uptrain them briefly, and measure what was lost and what was saved."""


def _register():
    from mha2gqa.cli import convert_cmd

    for command in (convert_cmd.convert, convert_cmd.inspect):
        main.add_command(command)

    from mha2gqa.cli import eval_cmd  # mha2gqa eval, mha2gqa report

    for command in (eval_cmd.eval_command, eval_cmd.report_command):
        main.add_command(command)

    from mha2gqa.cli import uptrain_cmd  # mha2gqa uptrain

    main.add_command(uptrain_cmd.uptrain)

    from mha2gqa.cli import demo_cmd  # mha2gqa demo, mha2gqa reproduce

    for command in (demo_cmd.demo, demo_cmd.reproduce):
        main.add_command(command)


_register()
