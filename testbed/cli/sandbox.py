"""`testbed sandbox`: the User-Mode Linux guest with netem, and what `run` and `compose` share
about it: the `--sandbox` choice, whether a scenario needs the guest, and its errors as exits."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Literal, TypeVar

import typer

if TYPE_CHECKING:
    from testbed.scenario import Scenario

commands = typer.Typer(
    help="A User-Mode Linux guest whose kernel has netem, for hosts whose kernel has none.",
    no_args_is_help=True,
)
SANDBOX = "testbed sandbox"  # how the sandbox's messages start here
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}

Sandbox = Literal["auto", "uml", "none"]  # `--sandbox` of `run` and `compose --up`


@commands.command("prepare")
def sandbox_prepare(
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only warnings and errors.")
    ] = False,
) -> None:
    """Fetch, patch and verify the UML kernel once; later calls return at once from the cache."""
    from netem.sandbox.cli import prepare_command

    raise typer.Exit(prepare_command(quiet=quiet, prog=SANDBOX))


@commands.command("run", context_settings=PASS_THROUGH)
def sandbox_run(
    command: Annotated[list[str], typer.Argument(help="The command to run, after --.")],
    timeout: Annotated[float, typer.Option(help="Kill the guest after so many seconds.")] = 1800,
    mem: Annotated[str, typer.Option(help="Guest memory, e.g. 512M or 2G.")] = "1G",
) -> None:
    """Run a command as root in a fresh guest, here in this directory; exit with its code."""
    from netem.sandbox.cli import run_command

    raise typer.Exit(run_command(command, timeout=timeout, mem=mem, prog=SANDBOX))


@commands.command("pytest", context_settings=PASS_THROUGH)
def sandbox_pytest(ctx: typer.Context) -> None:
    """Run `python -m pytest ARGS` where netem exists: directly if this kernel has it, else in
    a guest."""
    from netem.sandbox.cli import pytest_command

    raise typer.Exit(pytest_command(ctx.args, prog=SANDBOX))


_T = TypeVar("_T")


def call_sandbox(call: Callable[[], _T]) -> _T:
    """`call()`, its sandbox errors a `testbed sandbox: ...` message and an exit code (124 on
    timeout), not a traceback."""
    from netem.sandbox.cli import guarded

    return guarded(call, prog=SANDBOX)


def in_guest(sandbox: Sandbox, scenario: Scenario) -> bool:
    """Whether `--sandbox` puts the scenario in the guest: always with uml, with auto when
    the scenario needs netem that this kernel lacks."""
    return sandbox == "uml" or (sandbox == "auto" and _needs_netem(scenario))


def _needs_netem(scenario: Scenario) -> bool:
    """Whether the scenario needs netem (delay, jitter, ...) that this kernel lacks."""
    from netem.capabilities import netem_available
    from netem.plan import UnsupportedByKernel
    from testbed.cluster.network import ClusterNetwork

    if netem_available():
        return False
    try:
        ClusterNetwork(scenario, backend="fallback").check()
    except UnsupportedByKernel:
        return True
    return False
