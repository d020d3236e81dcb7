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


def _expect(name: str, what: str) -> typer.models.OptionInfo:
    return typer.Option(f"--expect-{name}", help=f"Expected {what}.", show_default=False)


@app.command()
def probe(
    source: Annotated[str, typer.Option("--from", help="Namespace (or /proc/PID/ns/net) the "
                                        "probes leave from.", show_default=False)],
    destination: Annotated[str, typer.Option("--to", help="Namespace of the receiver.",
                                             show_default=False)],
    address: Annotated[str, typer.Option("--to-address", help="The receiver's IPv4 address, "
                                         "inside --to.", show_default=False)],
    count: Annotated[int, typer.Option(min=1, help="Probes in the timed train.")] = 5000,
    interval: Annotated[str, typer.Option(help="Spacing of the probes, e.g. 400us.")] = "400us",
    size: Annotated[int, typer.Option(min=32, help="UDP payload bytes of a probe.")] = 128,
    rate_duration: Annotated[
        str | None,
        typer.Option(help="Length of the bulk train that measures the rate (0: none). "
                     "Default: 1s when a rate is expected, else none."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the end of a train.")] = 5.0,
    expect_profile: Annotated[
        typer.FileText | None,
        typer.Option(help="YAML mapping of a link profile (docs/profiles.md); --expect-* "
                     "flags override its fields.", show_default=False),
    ] = None,
    expect_delay: Annotated[str | None, _expect("delay", "delay, e.g. 20ms")] = None,
    expect_jitter: Annotated[str | None, _expect("jitter", "jitter, e.g. 5ms")] = None,
    expect_distribution: Annotated[
        str | None, _expect("distribution", "delay distribution (uniform, normal, ...)")
    ] = None,
    expect_loss: Annotated[str | None, _expect("loss", "random loss, e.g. 10%")] = None,
    expect_duplicate: Annotated[str | None, _expect("duplicate", "duplication")] = None,
    expect_corrupt: Annotated[str | None, _expect("corrupt", "corruption")] = None,
    expect_reorder: Annotated[str | None, _expect("reorder", "reordering")] = None,
    expect_rate: Annotated[str | None, _expect("rate", "rate, e.g. 10mbit")] = None,
) -> None:
    """Measure a link with probe trains: loss and its bursts, one-way delay, jitter, reordering,
    duplication, corruption and rate, beside what was expected. Exit code 1 if a check fails."""
    import yaml
    from rich.console import Console
    from rich.table import Table

    from netem.probe import ProbeError, compare, offered_load
    from netem.probe import probe as run_probe
    from netem.profile import LinkProfile, ProfileError
    from netem.units import parse_time

    flags = {
        "delay": expect_delay, "jitter": expect_jitter, "distribution": expect_distribution,
        "loss": expect_loss, "duplicate": expect_duplicate, "corrupt": expect_corrupt,
        "reorder": expect_reorder, "rate": expect_rate,
    }
    flags = {name: value for name, value in flags.items() if value is not None}
    try:
        spec = yaml.safe_load(expect_profile) if expect_profile else None
        if spec is not None and not isinstance(spec, dict):
            raise typer.BadParameter("expected a YAML mapping of profile fields",
                                     param_hint="--expect-profile")
        expected = LinkProfile.parse(spec, **flags) if spec or flags else None
        spacing = parse_time(interval)
        bulk = parse_time(rate_duration) if rate_duration is not None else (
            1.0 if expected is not None and expected.rate else 0.0
        )
    except (ProfileError, ValueError, yaml.YAMLError) as exc:
        typer.echo(f"testbed probe: {exc}", err=True)
        raise typer.Exit(2) from None
    offered = offered_load(expected) if expected is not None else None
    try:
        result = run_probe(source, destination, address, count=count, interval=spacing,
                           size=size, rate_duration=bulk, offered_rate=offered, timeout=timeout)
    except ProbeError as exc:
        typer.echo(f"testbed probe: {exc}", err=True)
        raise typer.Exit(2) from None
    checks = compare(expected or LinkProfile(), result)
    table = Table(title=f"probe {source} -> {destination} ({address})")
    columns = ("quantity", "configured", "measured", "tolerance", "result")
    for column in columns if expected is not None else ("quantity", "measured"):
        table.add_column(column)
    verdicts = {True: "[green]pass[/green]", False: "[red]FAIL[/red]"}
    notes: list[str] = []  # why a quantity was not checked, as footnotes
    for check in checks:
        measured = check.show(check.measured)
        if expected is None:
            table.add_row(check.quantity, measured)
            continue
        if check.passed is None:
            notes += [check.note] if check.note not in notes else []
            verdict = f"[dim]not checked ({notes.index(check.note) + 1})[/dim]"
        else:
            verdict = verdicts[check.passed]
        tolerance = "-" if check.passed is None else f"± {check.show(check.tolerance)}"
        table.add_row(check.quantity, check.show(check.configured), measured, tolerance, verdict)
    console = Console()
    console.print(table)
    for number, note in enumerate(notes, start=1):
        console.print(f"({number}) {note}", style="dim")
    p = result.delay_percentiles
    console.print(
        f"{result.sent} probes of {result.size} bytes every {result.interval * 1e6:.0f} us; "
        f"{result.received} arrived ({result.arrivals} with duplicates), {result.corrupt} "
        f"damaged, {result.malformed} malformed; loss bursts: max {result.loss_burst_max}; "
        f"delay p50/p90/p99 {p[50] * 1e3:.3f}/{p[90] * 1e3:.3f}/{p[99] * 1e3:.3f} ms"
        + (f"; rate over {result.rate_frames} frames of {result.rate_frame_bytes} bytes, "
           f"{result.rate_offered / 1e6:.1f} Mbit/s offered" if result.rate is not None else "")
        + ("" if result.ended else "; no end-of-train marker arrived (receiver timed out)")
    )
    if expected is not None and any(check.passed is False for check in checks):
        raise typer.Exit(1)


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
