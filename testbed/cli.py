"""The `testbed` command line: one typer app, one command (or sub-app) per concern."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Network fault-injection testbed for distributed training.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
