"""A scenario run and what it recorded: `report` (its plots and page), `run` (here, or in a
User-Mode Linux guest where this kernel lacks netem), `capture` (what its links did to each
flow)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.live import Live

from testbed.cli.render import capture_notes, flows_table, live_table, summary_table
from testbed.cli.sandbox import Sandbox, call_sandbox, in_guest

if TYPE_CHECKING:
    from testbed.cluster.runner import ClusterRun, RunResult

commands = typer.Typer()
FORCE_TERMINAL = "TESTBED_FORCE_TERMINAL"  # set for a guest whose output a terminal shows
GUEST_MEM = "4G"  # a guest that runs whole scenarios (the host has far more; pages are lazy)
GUEST_TIMEOUT = 3600.0  # seconds a guest's run may take


@commands.command()
def report(
    run_dirs: Annotated[list[str], typer.Argument(
        metavar="RUN_DIR", help="Run directories; several are compared in one set of plots.",
        show_default=False)],
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="Where the plots and the page go. Default: the run directory (one "
        "run); `comparison/` beside the runs (several).", show_default=False)] = None,
) -> None:
    """Render a run's report (plots as PNG and index.html), or compare several runs (e.g. 0, 5
    and 10% loss) in one set of plots and comparison.html. Prints where the page is. Exit code 2
    if a path is not a run directory, 1 if its events are malformed."""
    from testbed.report import RunError, load_run
    from testbed.report.page import render_comparison, render_run

    try:
        runs = [load_run(path) for path in run_dirs]
        for run in runs:
            for warning in run.warnings:
                typer.echo(f"warning: {warning}", err=True)
        if len(runs) == 1:
            rendered = render_run(runs[0], out)
        else:
            common = Path(os.path.commonpath([run.path.resolve() for run in runs]))
            rendered = render_comparison(runs, Path(out) if out else common / "comparison")
    except RunError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(error.code) from None
    except OSError as error:
        typer.echo(f"error: {error.filename or ''}: {error.strerror or error}", err=True)
        raise typer.Exit(1) from None
    for name, reason in rendered.skipped.items():
        typer.echo(f"{name}.png not drawn: {reason}")
    typer.echo(f"report: {rendered.html}")


@commands.command()
def run(
    scenario: Annotated[str, typer.Argument(
        help="A scenario file, or the name of a shipped one (compose/scenarios/NAME.yaml).",
        show_default=False)],
    steps: Annotated[int | None, typer.Option(
        help="Override the job's steps (e.g. to shorten a run).", min=1)] = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="The run directory. Default: runs/NAME-TIME.",
        show_default=False)] = None,
    sandbox: Annotated[Sandbox, typer.Option(
        help="auto: run in a User-Mode Linux guest when the scenario needs netem and this "
        "kernel lacks it; uml: always; none: here (the fallback's clear error if it cannot).")
    ] = "auto",
    capture: Annotated[list[str] | None, typer.Option(
        "--capture", help="Capture this link too ('0->1', '0<->2', 'east->west', 'all'): what "
        "the sender put on the wire and what reached the receiver, as pcap files in "
        "RUN_DIR/capture, and a per-flow summary (docs/capture.md). Repeatable.",
        show_default=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="No live display: print the "
                                              "run's summary.json at the end (docs/cli.md).")
                           ] = False,
    report: Annotated[bool, typer.Option(
        help="Draw the report (plots and index.html) at the end; --no-report leaves it to "
        "`testbed report RUN_DIR`.")] = True,
) -> None:
    """Run a scenario end to end: its network, its workers, its fault timeline; a live display,
    a summary table, and the run directory with the report. Exit 1 if the run failed."""
    from testbed.scenario import ScenarioError, find_scenario, load_scenario

    path = find_scenario(scenario)
    try:
        loaded = load_scenario(path, steps=steps, files=True)
    except ScenarioError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from None
    try:
        loaded = loaded.with_capture(capture or [])
    except ValueError as error:
        typer.echo(f"--capture {error}", err=True)
        raise typer.Exit(2) from None
    if in_guest(sandbox, loaded):
        raise typer.Exit(_run_in_guest(path, loaded.name, steps, out, capture or [],
                                       json_output, report))
    _run_here(path, steps, out, capture or [], json_output, report)


def _run_in_guest(path: Path, name: str, steps: int | None, out: str | None,
                  capture: list[str], json_output: bool = False, report: bool = True) -> int:
    """The whole run inside a UML guest with a netem kernel; the run directory is shared (the
    guest's root is this host's). The report is drawn here, after the guest, on this host's
    CPUs: the guest has one, and drew it in 9 s."""
    from netem import sandbox
    from testbed.cluster.runner import safe_name

    if out is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        out = str(Path("runs") / f"{safe_name(name)}-{stamp}")
    kernel = call_sandbox(sandbox.prepare)
    typer.echo(f"this kernel has no netem: running in a User-Mode Linux guest "
               f"({sandbox.describe(kernel)})", err=json_output)
    argv = [sys.executable, "-m", "testbed.cli", "run", str(Path(path).resolve()), "--sandbox",
            "none", "--out", str(Path(out).resolve()), "--no-report"]
    if steps is not None:
        argv += ["--steps", str(steps)]
    for link in capture:
        argv += ["--capture", link]
    if json_output:
        argv.append("--json")
    env = dict(os.environ)
    if sys.stdout.isatty():  # the guest's output comes through a pipe: keep the live display
        env[FORCE_TERMINAL] = "1"
    result = call_sandbox(lambda: sandbox.run(argv, kernel=kernel, env=env, mem=GUEST_MEM,
                                              timeout=GUEST_TIMEOUT))
    from testbed.report.run import EVENTS

    if report and (Path(out) / EVENTS).exists():  # a run the guest began, however it ended
        from testbed.cluster.runner import render

        html = render(Path(out))
        if html is not None:
            typer.echo(f"report: {html}", err=json_output)
    return result.returncode


def _run_here(path: Path, steps: int | None, out: str | None, capture: list[str],
              json_output: bool = False, report: bool = True) -> None:
    """The run on this host, with a live table of its workers (none with --json: stdout is
    for the summary's JSON alone)."""
    from netem.plan import UnsupportedByKernel
    from testbed.cluster.runner import ClusterRun

    console = Console(force_terminal=True if os.environ.get(FORCE_TERMINAL) else None,
                      stderr=json_output)  # with --json, stdout is the summary's alone
    cluster = ClusterRun(path, steps=steps, run_dir=out, capture=capture, report=report)
    console.print(f"run directory: {cluster.run_dir}")
    try:
        with (contextlib.nullcontext(None) if json_output else
              Live(live_table(cluster), console=console, refresh_per_second=4)) as live:
            result = cluster.run(lambda workers: live and live.update(live_table(cluster)))
    except KeyboardInterrupt as interrupt:
        console.print(f"[yellow]interrupted: everything the run made is removed; what it "
                      f"wrote is in {cluster.run_dir}")
        raise typer.Exit(128 + getattr(interrupt, "signum", signal.SIGINT)) from None
    except UnsupportedByKernel as error:
        console.print(f"[red]{error}")
        raise typer.Exit(2) from None
    if json_output:
        typer.echo(json.dumps(result.summary, indent=2, default=str))
        raise typer.Exit(0 if result.success else 1)
    console.print(summary_table(cluster, result))
    if cluster.capture is not None and cluster.capture.flows is not None:
        _print_flows(console, cluster.capture.flows, rows=5)
        console.print(f"capture: {cluster.capture.directory} (pcap files for Wireshark; "
                      f"testbed capture {result.run_dir} shows every flow)")
    console.print(f"run directory: {result.run_dir}")
    if result.html is not None:
        console.print(f"report: {result.html}")
    if not result.success:
        console.print(f"[red]the run failed: {result.error}")
        for rank, lines in _command_tails(cluster, result).items():
            console.print(f"worker {rank}'s command, the last lines of its stderr:")
            console.print("\n".join(lines), markup=False, highlight=False)
        raise typer.Exit(1)
    console.print("[green]the run succeeded")


def _command_tails(cluster: ClusterRun, result: RunResult) -> dict[int, list[str]]:
    """The last lines of the stderr of each failed worker's command (a command job)."""
    if cluster.scenario.command is None:
        return {}
    tails = {}
    for w in result.workers:
        path = result.run_dir / "logs" / f"worker-{w.rank}.stderr"
        if w.status == "failed" and path.exists():
            tails[w.rank] = path.read_text(errors="replace").rstrip("\n").splitlines()[-10:]
    return tails


@commands.command("capture")
def capture_command(
    run_dir: Annotated[Path, typer.Argument(
        metavar="RUN_DIR", help="A run directory whose scenario captured links (or its "
        "capture/ directory).", show_default=False)],
    link: Annotated[list[str] | None, typer.Option(
        "--link", help="Only this captured link, e.g. 0->1. Repeatable.",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the whole analysis (what capture/flows.json holds).")] = False,
    write: Annotated[bool, typer.Option(
        "--write", help="Write capture/flows.json again from the pcap files.")] = False,
    rows: Annotated[int, typer.Option(
        min=1, help="Flows shown per link in the table (the largest first).")] = 10,
) -> None:
    """What each captured link did to each flow, from a run's pcap files: packets and bytes
    sent and received, lost, retransmitted, reordered, duplicated, delay (docs/capture.md).
    Exit 2 if RUN_DIR holds no capture or --link names a link not captured, 1 if a file
    cannot be read."""
    from netem.capture import MANIFEST, PcapError, analyse, load_manifest, write_flows

    if not run_dir.is_dir():
        typer.echo(f"RUN_DIR: {run_dir} is not a directory (a run directory, or its capture/)",
                   err=True)
        raise typer.Exit(2)
    directory = run_dir if (run_dir / MANIFEST).exists() else run_dir / "capture"
    try:
        manifest = load_manifest(directory)
    except FileNotFoundError:
        typer.echo(f"RUN_DIR: {run_dir} holds no capture (no {directory / MANIFEST}); capture "
                   "links with the scenario's capture section or testbed run --capture", err=True)
        raise typer.Exit(2) from None
    except ValueError as error:
        typer.echo(f"RUN_DIR: {error}", err=True)
        raise typer.Exit(2) from None
    captured = [entry["link"] for entry in manifest["links"]]
    unknown = [name for name in link or [] if name not in captured]
    if unknown:
        typer.echo(f"--link: {', '.join(unknown)} not captured; captured: "
                   f"{', '.join(captured) or 'none'}", err=True)
        raise typer.Exit(2)
    if write and link:
        typer.echo("--write: writes every link; leave out --link", err=True)
        raise typer.Exit(2)
    try:
        flows = analyse(directory, links=link or None)
        if write:
            write_flows(directory, flows)
    except (PcapError, OSError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(flows, indent=2))
        return
    console = Console()
    _print_flows(console, flows, rows=rows)
    console.print(f"pcap files: {directory} (open them in Wireshark); analysed in "
                  f"{flows['seconds']:.2f} s")


def _print_flows(console: Console, flows: dict, *, rows: int) -> None:
    """The captured links' largest flows, and what limits their counts."""
    console.print(flows_table(flows, rows=rows))
    for note in capture_notes(flows):
        console.print(note)
