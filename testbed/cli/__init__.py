"""The `testbed` command line: one typer app, `app`, made of one module per command family.

Each family module holds a typer app of its own: the user's commands (`host`, `links`, `runs`,
`compose`) and the processes' entry points (`entry_points`) are merged into `app`, in the order
`testbed --help` lists them; `sandbox` and `scenario` are its sub-apps. What the commands show
is built in `render`. At module level only the standard library, typer and rich (which --help
loads anyway) are imported; netem and testbed, whose imports reach pydantic, pyroute2, numpy or
torch (up to seconds), are imported by the command that needs them, so that every command, and
--help, starts fast.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import signal
from typing import Annotated

import typer

from testbed.cli import compose, entry_points, host, links, runs, sandbox, scenario

app = typer.Typer(
    help="Network fault-injection testbed for distributed training.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
for family in (host, links, runs, compose, entry_points):
    app.add_typer(family.commands)
app.add_typer(sandbox.commands, name="sandbox")
app.add_typer(scenario.commands, name="scenario")


def _version(given: bool) -> None:
    if given:
        from importlib.metadata import version  # only --version needs it; it slows a start

        typer.echo(f"testbed {version('netem-testbed')}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Network fault-injection testbed for distributed training. Exit codes: 0 done, 1 what
    was run or checked failed, 2 bad input (naming the field), 130 Ctrl-C (docs/cli.md)."""
    # A command that seems stuck: `kill -USR1 PID` prints every thread's stack to stderr (when
    # stderr is a file: not under a test runner that captures it).
    with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
