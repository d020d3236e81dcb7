"""The `testbed` command line: one typer app, one command (or sub-app) per concern."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

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

    Only names with the testbed's prefixes are touched: labs (`tb…-h…`, `tb…-sw`), capability
    probes (`tbcap-…`) and the work directories of guests that are no longer running.
    """
    from pyroute2 import netns
    from rich.console import Console

    from netem.capabilities import NETNS_PREFIX
    from netem.lab import remove_namespaces
    from testbed.sandbox import remove_stale_workdirs

    removed = remove_namespaces(orphans_only=True)
    for name in netns.listnetns():
        if name.startswith(NETNS_PREFIX):
            netns.remove(name)
            removed.append(name)
    stale = remove_stale_workdirs()
    listing = f": {', '.join(removed)}" if removed else ""
    console = Console()
    console.print(f"removed {len(removed)} namespace(s){listing}")
    console.print(
        f"removed {len(stale)} stale guest work director{'y' if len(stale) == 1 else 'ies'}"
    )


@app.command()
def doctor() -> None:
    """What this host can do (found by trying it) and what follows for shaping and placement."""
    from rich.console import Console
    from rich.table import Table

    from netem.capabilities import CONSEQUENCES, detect

    capabilities = detect()
    table = Table(title="testbed doctor")
    for column in ("capability", "here", "found", "what follows"):
        table.add_column(column)
    for name, available in capabilities.items():
        answer = "[green]yes[/green]" if available else "[red]no[/red]"
        found = capabilities.details.get(name, "")
        table.add_row(name, answer, found, CONSEQUENCES[name][0 if available else 1])
    Console().print(table)


sandbox_app = typer.Typer(
    help="A User-Mode Linux guest whose kernel has netem, for hosts whose kernel has none.",
    no_args_is_help=True,
)
app.add_typer(sandbox_app, name="sandbox")
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@sandbox_app.command("prepare")
def sandbox_prepare(
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only warnings and errors.")
    ] = False,
) -> None:
    """Fetch, patch and verify the UML kernel once; later calls return at once from the cache."""
    from testbed import sandbox

    kernel = _sandbox_call(lambda: sandbox.prepare(quiet=quiet))
    if not quiet:
        typer.echo(sandbox.describe(kernel))


@sandbox_app.command("run", context_settings=PASS_THROUGH)
def sandbox_run(
    command: Annotated[list[str], typer.Argument(help="The command to run, after --.")],
    timeout: Annotated[float, typer.Option(help="Kill the guest after so many seconds.")] = 1800,
    mem: Annotated[str, typer.Option(help="Guest memory, e.g. 512M or 2G.")] = "1G",
) -> None:
    """Run a command as root in a fresh guest, here in this directory; exit with its code."""
    from testbed import sandbox

    result = _sandbox_call(lambda: sandbox.run(command, timeout=timeout, mem=mem))
    raise typer.Exit(result.returncode)


@sandbox_app.command("pytest", context_settings=PASS_THROUGH)
def sandbox_pytest(ctx: typer.Context) -> None:
    """Run `python -m pytest ARGS` where netem exists: directly if this kernel has it, else in
    a guest."""
    import subprocess
    import sys

    from netem.capabilities import netem_available
    from testbed import sandbox

    argv = [sys.executable, "-m", "pytest", *ctx.args]
    if netem_available():
        typer.echo("testbed sandbox: this kernel has netem: running pytest on the host", err=True)
        raise typer.Exit(subprocess.run(argv).returncode)
    kernel = _sandbox_call(sandbox.prepare)
    typer.echo(
        f"testbed sandbox: this kernel has no netem: running pytest in a guest "
        f"({sandbox.describe(kernel)})",
        err=True,
    )
    result = _sandbox_call(lambda: sandbox.run(argv, kernel=kernel))
    raise typer.Exit(result.returncode)


_T = TypeVar("_T")


def _sandbox_call(call: Callable[[], _T]) -> _T:
    """Turn the sandbox's errors into a message and an exit code (124 on timeout, like
    `timeout`), not a traceback."""
    import signal
    import sys

    from testbed.sandbox import GuestTimeout, SandboxError

    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the guest and its files go too.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return call()
    except GuestTimeout as exc:
        typer.echo(f"testbed sandbox: {exc}", err=True)
        raise typer.Exit(124) from None
    except (SandboxError, ValueError) as exc:  # ValueError: a bad argument, e.g. --mem
        typer.echo(f"testbed sandbox: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
