"""The `testbed` command line: one typer app, one command (or sub-app) per concern."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Network fault-injection testbed for distributed training.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def main() -> None:
    """Network fault-injection testbed for distributed training."""


@app.command()
def clean() -> None:
    """Remove what a killed run left: its namespaces (with veths, ifbs, nft tables) and processes.

    Only names with the testbed's prefix are touched.
    """
    from rich.console import Console

    from netem.lab import remove_namespaces

    removed = remove_namespaces()
    listing = f": {', '.join(removed)}" if removed else ""
    Console().print(f"removed {len(removed)} namespace(s){listing}")
