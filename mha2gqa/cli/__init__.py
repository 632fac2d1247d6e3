"""The `mha2gqa` command line: one click group, one module per command family."""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager, suppress

import click

from mha2gqa.runtime.errors import WeightWarning, exit_report, one_line, signals_as_interrupts
from mha2gqa.runtime.progress import close_open_bars, write_line
from mha2gqa.version import __version__


class _OneLineError(click.ClickException):
    """A user mistake: `Error: <message>` on stderr, exit code 2, no traceback."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(one_line(message))


@contextmanager
def _one_line_warnings():
    """Every warning on a line of its own, above any progress bar (progress.write_line): WeightWarnings (about
    the user's weights) as `Warning: <message>`, each line once per command (a check that several stages repeat
    says it once), other warnings in Python's usual form."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", WeightWarning)
        shown = set()

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, WeightWarning):
                if str(message) not in shown:
                    shown.add(str(message))
                    write_line(f"Warning: {message}")
            else:
                write_line(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"))

        warnings.showwarning = show
        yield


class _Group(click.Group):
    """The one place where faults become what the user sees: InputError and OSErrors of the user's
    files or machine -> one `Error:` line, exit 2; Ctrl-C, SIGTERM, SIGHUP -> cleanups run (they
    unwind as KeyboardInterrupt), one line, exit 128 + the signal number; anything else is our bug
    and keeps its traceback."""

    def format_commands(self, ctx, formatter):
        """Each command with its whole summary (its short_help, else its help's first sentence),
        wrapped, not cut mid-sentence to fit one line as click's default does."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx):
        for stream in (sys.stdout, sys.stderr):  # a path that is not UTF-8 prints as \xNN, not a traceback
            with suppress(AttributeError, ValueError):
                stream.reconfigure(errors="backslashreplace")
        try:
            with signals_as_interrupts(), _one_line_warnings():
                return super().invoke(ctx)
        except click.UsageError as err:  # a subcommand's bad flag: one line too, with where to look
            where = err.ctx.command_path if err.ctx else "mha2gqa"
            raise _OneLineError(f"{err.format_message()} (see '{where} --help')") from None
        except (Exception, KeyboardInterrupt) as err:
            close_open_bars()  # the error line (or a bug's traceback) goes below the bars, not onto one
            report = exit_report(err)
            if report is None:
                raise
            click.echo(report[0], err=True)
            raise click.exceptions.Exit(report[1]) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mha2gqa")
@click.option(
    "--threads",
    metavar="N",
    default=None,
    help="CPU threads for torch (also MHA2GQA_THREADS=N). Default: 1 for demo, reproduce, and eval and "
    "uptrain of a local model under 1 GiB (faster on small models, above all on a busy machine); torch's "
    "one per core otherwise; OMP_NUM_THREADS, when set, is kept.",
)
def main(threads):
    """Convert multi-head attention (MHA) checkpoints to grouped-query (GQA) or multi-query (MQA)
    attention, uptrain them briefly, and measure what was lost and what was saved."""
    from mha2gqa.runtime import threads as thread_count

    if threads is not None:
        os.environ[thread_count.ENV] = str(thread_count.parse(threads, "--threads"))
    thread_count.apply()


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

    from mha2gqa.cli import sweep_cmd  # mha2gqa sweep

    main.add_command(sweep_cmd.sweep)

    from mha2gqa.cli import serve_cmd  # mha2gqa serve-bench

    main.add_command(serve_cmd.serve_bench)


_register()
