"""Click options that name a path: a file (a folder there is refused by click) or a folder (a file there
is refused), so each command's path options are declared by what they name, in one way."""

from __future__ import annotations

import click


def file_option(flag: str, help: str, **kwargs):
    """click.option(flag) whose value is a path to a file; `kwargs` as click.option's (required, multiple)."""
    return click.option(flag, type=click.Path(dir_okay=False), help=help, **kwargs)


def folder_option(flag: str, help: str, **kwargs):
    """click.option(flag) whose value is a path to a folder; `kwargs` as click.option's."""
    return click.option(flag, type=click.Path(file_okay=False), help=help, **kwargs)
