"""The `testbed` command line: one typer app, one command (or sub-app) per concern."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import typer

app = typer.Typer(
    help="Network fault-injection testbed for distributed training.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _version(given: bool) -> None:
    if given:
        from importlib.metadata import version

        typer.echo(f"testbed {version('netem-testbed')}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Network fault-injection testbed for distributed training. Exit codes: 0 done, 1 what
    was run or checked failed, 2 bad input (naming the field), 130 Ctrl-C (docs/cli.md)."""
    import contextlib
    import faulthandler
    import io
    import signal

    # A command that seems stuck: `kill -USR1 PID` prints every thread's stack to stderr (when
    # stderr is a file: not under a test runner that captures it).
    with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


@app.command()
def clean() -> None:
    """Remove what a killed run left: its namespaces (with veths, ifbs, nft tables) and processes,
    and the containers and networks of the testbed's Compose projects.

    Only names with the testbed's prefixes are touched: labs (`tb…-h…`, `tb…-sw`), capability
    probes (`tbcap-PID-…`), the work directories of guests, and the Docker Engines and mounted
    engine disks of `testbed compose --up` (`/run/tb-engine-…`, `/run/tb-disk-…`), each only once
    its owner is gone; Compose projects whose workers carry the `testbed.scenario` label, once
    none of them runs (a running one may be a live run: it is named, with the command that ends
    it).
    """
    from rich.console import Console

    from netem.capabilities import remove_orphan_probes
    from netem.lab import remove_namespaces
    from netem.sandbox import remove_stale_workdirs
    from testbed.compose import remove_projects
    from testbed.compose.engine import remove_stale

    removed = remove_namespaces(orphans_only=True) + remove_orphan_probes()
    stale = remove_stale_workdirs()
    engines = remove_stale()
    projects, running = remove_projects()
    listing = f": {', '.join(removed)}" if removed else ""
    console = Console()
    console.print(f"removed {len(removed)} namespace(s){listing}")
    console.print(
        f"removed {len(stale)} stale guest work director{'y' if len(stale) == 1 else 'ies'}"
    )
    console.print(f"removed {len(engines)} engine(s) and disk mount(s) of compose --up"
                  + (f": {', '.join(engines)}" if engines else ""))
    console.print(f"removed {len(projects)} Compose project(s)"
                  + (f": {', '.join(projects)}" if projects else ""))
    for project in running:
        console.print(f"left running: Compose project {project} (a live run? end it with "
                      f"`docker compose -p {project} down`)")


@app.command()
def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print the capabilities as JSON "
                                              "(docs/cli.md).")] = False,
    require: Annotated[str | None, typer.Option(
        help="Capabilities that must be here, comma-separated (e.g. netem,docker): exit 1 if "
        "one is missing.", show_default=False)] = None,
) -> None:
    """What this host can do (found by trying it) and what follows for shaping and placement."""
    import json

    from rich.console import Console
    from rich.table import Table

    from netem.capabilities import CONSEQUENCES, detect

    required = [name for name in (require or "").split(",") if name]
    unknown = [name for name in required if name not in CONSEQUENCES]
    if unknown:
        typer.echo(f"--require: unknown {', '.join(unknown)}; allowed: "
                   f"{', '.join(CONSEQUENCES)}", err=True)
        raise typer.Exit(2)
    capabilities = detect()
    missing = [name for name in required if not dict(capabilities.items())[name]]
    if json_output:
        typer.echo(json.dumps({
            "capabilities": {name: {"available": bool(available),
                                    "found": capabilities.details.get(name, ""),
                                    "consequence": CONSEQUENCES[name][0 if available else 1]}
                             for name, available in capabilities.items()},
            "missing": missing}, indent=2))
        raise typer.Exit(1 if missing else 0)
    table = Table(title="testbed doctor")
    for column in ("capability", "here", "found", "what follows"):
        table.add_column(column)
    for name, available in capabilities.items():
        answer = "[green]yes[/green]" if available else "[red]no[/red]"
        found = capabilities.details.get(name, "")
        table.add_row(name, answer, found, CONSEQUENCES[name][0 if available else 1])
    Console().print(table)
    if missing:
        typer.echo(f"required but missing: {', '.join(missing)}", err=True)
        raise typer.Exit(1)


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
    json_output: Annotated[bool, typer.Option("--json", help="Print the result and the checks "
                                              "as JSON (docs/cli.md).")] = False,
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
    failed = expected is not None and any(check.passed is False for check in checks)
    if json_output:
        import dataclasses
        import json

        typer.echo(json.dumps({
            "result": dataclasses.asdict(result),
            "checks": [dataclasses.asdict(check) for check in checks] if expected else [],
            "passed": not failed}, indent=2, default=str))
        raise typer.Exit(1 if failed else 0)
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
    if failed:
        raise typer.Exit(1)


def _set(name: str, what: str) -> typer.models.OptionInfo:
    return typer.Option(f"--{name}", help=what, show_default=False)


@app.command()
def shape(
    iface: Annotated[str, typer.Argument(help="The interface to shape.", show_default=False)],
    netns: Annotated[
        str | None, typer.Option(help="Its network namespace (a name, or a path such as "
                                 "/proc/PID/ns/net). Default: this one.", show_default=False)
    ] = None,
    direction: Annotated[
        Literal["egress", "ingress"],
        typer.Option(help="egress: traffic leaving IFACE (e.g. the switch port towards the "
                     "receiver); ingress: traffic arriving on IFACE (through an ifb)."),
    ] = "egress",
    source: Annotated[
        str | None,
        typer.Option("--from", help="Shape only the traffic from this IPv4 address or network "
                     "(a pairwise link); the rules of other sources stay. Default: the rule "
                     "for everyone else.", show_default=False),
    ] = None,
    backend: Annotated[
        Literal["auto", "netem", "fallback"],
        typer.Option(help="netem; fallback (nftables loss, htb rate) for kernels without it; "
                     "auto: netem if this kernel has it."),
    ] = "auto",
    delay: Annotated[str | None, _set("delay", "Delay, e.g. 20ms.")] = None,
    jitter: Annotated[str | None, _set("jitter", "Delay variation, e.g. 5ms.")] = None,
    distribution: Annotated[
        str | None, _set("distribution", "Of the jitter: uniform, normal, pareto, paretonormal.")
    ] = None,
    delay_correlation: Annotated[
        str | None, _set("delay-correlation", "Of successive delays, e.g. 25%.")
    ] = None,
    loss: Annotated[str | None, _set("loss", "Random loss, e.g. 5%.")] = None,
    loss_correlation: Annotated[
        str | None, _set("loss-correlation", "Of successive losses, e.g. 25%.")
    ] = None,
    ge_p: Annotated[str | None, _set("ge-p", "Gilbert-Elliott bursty loss: good->bad.")] = None,
    ge_r: Annotated[str | None, _set("ge-r", "Gilbert-Elliott: bad->good.")] = None,
    ge_1_h: Annotated[str | None, _set("ge-1-h", "Gilbert-Elliott: loss when bad.")] = None,
    ge_1_k: Annotated[str | None, _set("ge-1-k", "Gilbert-Elliott: loss when good.")] = None,
    duplicate: Annotated[str | None, _set("duplicate", "Duplication, e.g. 1%.")] = None,
    corrupt: Annotated[str | None, _set("corrupt", "Corruption (a flipped bit), e.g. 1%.")] = None,
    reorder: Annotated[str | None, _set("reorder", "Packets sent early (needs a delay).")] = None,
    gap: Annotated[int | None, _set("gap", "Reorder every GAP-th packet.")] = None,
    rate: Annotated[str | None, _set("rate", "Rate, e.g. 100mbit.")] = None,
    limit: Annotated[int | None, _set("limit", "Queue length in packets (1000).")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the equivalent tc/nft commands; needs no "
                           "root, touches nothing (the other sources' rules are not read).")
    ] = False,
    show_rules: Annotated[bool, typer.Option("--show", help="Print IFACE's rules.")] = False,
    clear_rules: Annotated[
        bool, typer.Option("--clear", help="Remove all shaping from IFACE.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Shape an interface with a link profile, per source (like tcconfig's tcset); --show reads
    it back from the kernel (tcshow), --clear removes it (tcdel). docs/shaping.md."""
    import json
    import os

    from pyroute2.netlink.exceptions import NetlinkError

    from netem.backend import (
        ShapingError,
        UnsupportedByKernel,
        change,
        clear,
        resolve_backend,
        show,
    )
    from netem.plan import build_plan, parse_source, render_commands, source_key
    from netem.profile import LinkProfile, ProfileError

    def fail(message: object, code: int) -> typer.Exit:
        typer.echo(f"testbed shape: {message}", err=True)
        return typer.Exit(code)

    fields = {
        "delay": delay, "jitter": jitter, "distribution": distribution,
        "delay_correlation": delay_correlation, "loss": loss, "loss_correlation": loss_correlation,
        "duplicate": duplicate, "corrupt": corrupt, "reorder": reorder, "gap": gap, "rate": rate,
        "limit": limit,
    }
    spec: dict[str, object] = {name: value for name, value in fields.items() if value is not None}
    ge = {"p": ge_p, "r": ge_r, "1-h": ge_1_h, "1-k": ge_1_k}
    if any(value is not None for value in ge.values()):
        spec["gilbert_elliott"] = {name: value for name, value in ge.items() if value is not None}
    if dry_run + show_rules + clear_rules > 1:
        raise fail("--dry-run, --show and --clear exclude one another", 2)
    if (show_rules or clear_rules) and (spec or source is not None):
        raise fail("--show and --clear take no profile and no --from", 2)
    try:
        profile = LinkProfile.parse(spec)
        key = None if source is None else source_key(parse_source(source))
        if dry_run:
            unprobed = backend == "auto" and os.geteuid() != 0
            if unprobed:
                typer.echo("testbed shape: not root, so the kernel was not probed: showing the "
                           "netem backend (--backend fallback shows the other)", err=True)
            chosen = "netem" if unprobed else resolve_backend(backend)
            plan = build_plan(iface, {key: profile}, direction=direction, backend=chosen)
    except UnsupportedByKernel as exc:
        hint = "\n(--backend netem --dry-run prints the netem commands)" if dry_run else ""
        raise fail(f"{exc}{hint}", 2) from None
    except (ProfileError, ValueError) as exc:
        raise fail(exc, 2) from None
    if dry_run:
        commands = render_commands(plan, netns)
        if as_json:
            typer.echo(json.dumps({"backend": plan.backend, "commands": commands}, indent=2))
        else:
            typer.echo("\n".join(commands))
        return
    if os.geteuid() != 0:
        raise fail("shaping needs root (CAP_NET_ADMIN); --dry-run prints the commands without", 1)
    try:
        if clear_rules:
            clear(iface, netns=netns)
            typer.echo(json.dumps({"iface": iface, "cleared": True}) if as_json
                       else f"{iface}: shaping removed")
            return
        if show_rules:
            _print_rules(iface, netns, show(iface, netns=netns), as_json=as_json)
            return
        rules = {**show(iface, netns=netns), key: profile}
        applied = change(iface, rules, netns=netns, direction=direction, backend=backend)
    except ProfileError as exc:
        raise fail(exc, 2) from None
    except (ShapingError, NetlinkError, OSError, ValueError) as exc:
        raise fail(exc, 1) from None
    _print_rules(iface, netns, applied.rules, as_json=as_json, applied={
        "backend": applied.backend, "direction": applied.direction, "device": applied.device,
        "in_place": applied.in_place, "offloads_disabled": applied.offloads_disabled,
    })


def _print_rules(
    iface: str, netns: str | None, rules: dict, *, as_json: bool, applied: dict | None = None
) -> None:
    """The rules of an interface as a table (or JSON), and how they were applied."""
    import json

    from rich.console import Console
    from rich.table import Table

    listing = [{"from": source, "profile": profile.to_spec()} for source, profile in rules.items()]
    if as_json:
        typer.echo(json.dumps({"iface": iface, "netns": netns, **(applied or {}),
                               "rules": listing}, indent=2))
        return
    console = Console()
    if not rules:
        console.print(f"{iface}: not shaped")
        return
    table = Table(title=f"{iface}" + (f" in {netns}" if netns else ""))
    for column in ("from", "profile"):
        table.add_column(column)
    for source, profile in rules.items():
        table.add_row(source or "everyone else", str(profile))
    console.print(table)
    if applied is not None:
        how = "changed in place" if applied["in_place"] else "built"
        offloads = ", ".join(applied["offloads_disabled"]) or "none"
        console.print(f"{applied['backend']} backend, {applied['direction']} (tree on "
                      f"{applied['device']}), {how}; offloads off on {iface}: {offloads}")


sandbox_app = typer.Typer(
    help="A User-Mode Linux guest whose kernel has netem, for hosts whose kernel has none.",
    no_args_is_help=True,
)
app.add_typer(sandbox_app, name="sandbox")
SANDBOX = "testbed sandbox"  # how the sandbox's messages start here
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}
GUEST_MEM = "4G"  # a guest that runs whole scenarios (the host has far more; pages are lazy)
GUEST_TIMEOUT = 3600.0  # seconds a guest's run may take


@sandbox_app.command("prepare")
def sandbox_prepare(
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only warnings and errors.")
    ] = False,
) -> None:
    """Fetch, patch and verify the UML kernel once; later calls return at once from the cache."""
    from netem.sandbox.cli import prepare_command

    raise typer.Exit(prepare_command(quiet=quiet, prog=SANDBOX))


@sandbox_app.command("run", context_settings=PASS_THROUGH)
def sandbox_run(
    command: Annotated[list[str], typer.Argument(help="The command to run, after --.")],
    timeout: Annotated[float, typer.Option(help="Kill the guest after so many seconds.")] = 1800,
    mem: Annotated[str, typer.Option(help="Guest memory, e.g. 512M or 2G.")] = "1G",
) -> None:
    """Run a command as root in a fresh guest, here in this directory; exit with its code."""
    from netem.sandbox.cli import run_command

    raise typer.Exit(run_command(command, timeout=timeout, mem=mem, prog=SANDBOX))


@sandbox_app.command("pytest", context_settings=PASS_THROUGH)
def sandbox_pytest(ctx: typer.Context) -> None:
    """Run `python -m pytest ARGS` where netem exists: directly if this kernel has it, else in
    a guest."""
    from netem.sandbox.cli import pytest_command

    raise typer.Exit(pytest_command(ctx.args, prog=SANDBOX))


_T = TypeVar("_T")


def _sandbox_call(call: Callable[[], _T]) -> _T:
    """`call()`, its sandbox errors a `testbed sandbox: ...` message and an exit code (124 on
    timeout), not a traceback."""
    from netem.sandbox.cli import guarded

    return guarded(call, prog=SANDBOX)


@app.command()
def demo() -> None:
    """The main job end to end: shape the links into one host of a 3-host lab per source, measure
    each with probe trains, on this kernel and then with full netem (in a UML guest if needed).
    Exit code 1 if a measured value misses its tolerance."""
    import time

    from rich.console import Console
    from rich.table import Table

    from testbed import demo as demonstration

    console = Console()
    started = time.monotonic()

    def say(line: str) -> None:
        console.log(line)
        status.update(f"[bold]{line}")

    with console.status("starting") as status:
        outcomes = _sandbox_call(lambda: demonstration.run(say))
    elapsed = time.monotonic() - started
    table = Table(title=f"testbed demo: configured vs measured ({elapsed:.0f} s)")
    for column in ("kernel", "link", "quantity", "configured", "measured", "tolerance", "result"):
        table.add_column(column)
    styles = {"pass": "[green]pass[/green]", "FAIL": "[red]FAIL[/red]"}
    for *cells, verdict in demonstration.summary_rows(outcomes):
        table.add_row(*cells, styles[verdict])
    console.print(table)
    failed = [f"{o.part}: {o.link}" for o in outcomes if not o.passed]
    if failed:
        console.print(f"[red]{len(failed)} link(s) missed a tolerance: {'; '.join(failed)}")
        raise typer.Exit(1)
    console.print(f"[green]all {len(outcomes)} links measured within tolerance")


@app.command()
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
    import os
    from pathlib import Path

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


scenario_app = typer.Typer(
    help="Scenario files: validate them, and the JSON Schema for editors (docs/scenarios.md).",
    no_args_is_help=True,
)
app.add_typer(scenario_app, name="scenario")


@scenario_app.command("schema")
def scenario_schema(
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="Write the schema to this file instead of printing it.",
        show_default=False)] = None,
) -> None:
    """Print (or write) the JSON Schema of scenario files, for editor completion and checks."""
    import json
    from pathlib import Path

    from testbed.scenario import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if out is None:
        typer.echo(text, nl=False)
    else:
        Path(out).write_text(text)
        typer.echo(f"schema: {out}")


@scenario_app.command("check")
def scenario_check(
    files: Annotated[list[str], typer.Argument(help="Scenario files (YAML).",
                                               show_default=False)],
    steps: Annotated[int | None, typer.Option(
        min=1, help="Check the scenario shortened to this many steps (as CI runs it).",
        show_default=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object per file "
                                              "in a list (docs/cli.md).")] = False,
) -> None:
    """Validate scenario files: one summary line per good file, every problem of a bad one
    (path, line, what is allowed). Exit code 2 if any file is bad (bad input)."""
    import json

    from testbed.scenario import ScenarioError, load_scenario

    results = []
    for name in files:
        try:
            scenario = load_scenario(Path(name), steps=steps)
        except ScenarioError as error:
            results.append({"file": name, "ok": False, "problems": [
                {"path": p.path, "line": p.line, "message": p.message} for p in error.problems]})
            if not json_output:
                typer.echo(str(error), err=True)
        else:
            results.append({"file": name, "ok": True, "name": scenario.name,
                            "summary": scenario.summary()})
            if not json_output:
                typer.echo(f"ok {name}: {scenario.summary()}")
    bad = sum(not result["ok"] for result in results)
    if json_output:
        typer.echo(json.dumps(results, indent=2))
    elif bad:
        typer.echo(f"{bad} of {len(files)} scenario file(s) invalid", err=True)
    if bad:
        raise typer.Exit(2)


@app.command()
def run(
    scenario: Annotated[str, typer.Argument(
        help="A scenario file, or the name of a shipped one (compose/scenarios/NAME.yaml).",
        show_default=False)],
    steps: Annotated[int | None, typer.Option(
        help="Override the job's steps (e.g. to shorten a run).", min=1)] = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="The run directory. Default: runs/NAME-TIME.",
        show_default=False)] = None,
    sandbox: Annotated[str, typer.Option(
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
) -> None:
    """Run a scenario end to end: its network, its workers, its fault timeline; a live display,
    a summary table, and the run directory with the report. Exit 1 if the run failed."""

    from testbed.scenario import ScenarioError, find_scenario, load_scenario

    if sandbox not in ("auto", "uml", "none"):
        typer.echo(f"--sandbox: expected auto, uml or none, got {sandbox!r}", err=True)
        raise typer.Exit(2)
    path = find_scenario(scenario)
    try:
        loaded = load_scenario(path, steps=steps)
    except ScenarioError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from None
    try:
        loaded = loaded.with_capture(capture or [])
    except ValueError as error:
        typer.echo(f"--capture {error}", err=True)
        raise typer.Exit(2) from None
    if sandbox == "uml" or (sandbox == "auto" and _needs_guest(loaded)):
        raise typer.Exit(_run_in_guest(path, loaded.name, steps, out, capture or [],
                                       json_output))
    _run_here(path, steps, out, capture or [], json_output)


@app.command("capture")
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
    import json

    from rich.console import Console

    from netem.capture import MANIFEST, PcapError, analyse, load_manifest, write_flows

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
    console.print(_flows_table(flows, rows=rows))
    for note in _capture_notes(flows):
        console.print(note)
    console.print(f"pcap files: {directory} (open them in Wireshark); analysed in "
                  f"{flows['seconds']:.2f} s")


@app.command()
def compose(
    scenario: Annotated[str, typer.Argument(
        help="A scenario file, or the name of a shipped one (compose/scenarios/NAME.yaml).",
        show_default=False)],
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="The project's directory. Default: build/compose/NAME.",
        show_default=False)] = None,
    steps: Annotated[int | None, typer.Option(
        help="Override the job's steps (e.g. to shorten a run).", min=1)] = None,
    subnet: Annotated[str | None, typer.Option(
        help="The workers' network (IPv4). Compose: its bridge (default 172.28.0.0/24); "
        "Swarm: its overlay (default: Swarm's choice).", show_default=False)] = None,
    swarm: Annotated[bool, typer.Option(
        "--swarm", help="Write a Docker Swarm stack instead (docker-stack.yaml, and "
        "docker-stack-monitoring.yaml for Prometheus and Grafana): the same workers on one "
        "machine or many (docs/multi-host.md).")] = False,
    place: Annotated[str, typer.Option(
        help="With --swarm. groups: each worker in a group of topology.groups on nodes "
        "labelled testbed.group.<group>=true; workers: each on nodes labelled "
        "testbed.worker.<rank>=true; none: anywhere.")] = "groups",
    runs: Annotated[Path | None, typer.Option(
        help="With --swarm: the run directory, an absolute path that every node has (a "
        "shared filesystem). Default: the stack's runs/ (one machine).",
        show_default=False)] = None,
    grafana: Annotated[bool, typer.Option(
        help="With --swarm: Grafana in the monitoring stack (leave it out where its image "
        "cannot be had).")] = True,
    up: Annotated[bool, typer.Option(
        "--up", help="Also run it, end to end, where netem exists: here, or in a User-Mode "
        "Linux guest with a Docker Engine of its own (see --sandbox); shows what the kernel "
        "has on every worker's links and one link measured on the wire.")] = False,
    sandbox: Annotated[str, typer.Option(
        help="With --up. auto: in the guest when the scenario needs netem and this kernel "
        "lacks it; uml: always; none: here (on this host's Docker Engine).")] = "auto",
    keep: Annotated[bool, typer.Option(
        help="With --up, here: leave the project up after the workers end (Prometheus, "
        "Grafana); `docker compose ... down` ends it.")] = False,
    json_output: Annotated[bool, typer.Option(
        "--json", help="With --up: print the run's report as one JSON document.")] = False,
) -> None:
    """Write a Docker Compose project for a scenario (workers; Prometheus and Grafana under the
    monitoring profile), or with `--swarm` a Docker Swarm stack; `--up` also runs a Compose
    project where netem exists (docs/compose.md, docs/multi-host.md)."""
    import ipaddress
    import json

    from testbed.compose import ComposeError, default_directory, write_project
    from testbed.compose.project import SUBNET
    from testbed.scenario import ScenarioError, find_scenario, load_scenario

    if sandbox not in ("auto", "uml", "none"):
        typer.echo(f"--sandbox: expected auto, uml or none, got {sandbox!r}", err=True)
        raise typer.Exit(2)
    if swarm and (up or keep):
        typer.echo("--up, --keep: for a Compose project; deploy a stack with the `docker stack "
                   "deploy` line --swarm prints", err=True)
        raise typer.Exit(2)
    path = find_scenario(scenario)
    try:
        if subnet is not None:
            try:
                ipaddress.ip_network(subnet)
            except ValueError as error:
                raise ValueError(f"--subnet: {error}") from None
        loaded = load_scenario(path, steps=steps)
        if swarm:
            _write_stack(path, loaded, out=out, steps=steps, place=place, runs=runs,
                         grafana=grafana, subnet=subnet)
            return
        directory = Path(out) if out else default_directory(loaded)
        written = write_project(path, directory, steps=steps, subnet=subnet or SUBNET)
    except (ScenarioError, ComposeError, ValueError) as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from None
    if loaded.capture.links:
        typer.echo("capture: not under Compose (testbed run captures links; in a container, "
                   "tcpdump on eth0 does)", err=True)
    say = (lambda line: typer.echo(line, err=True)) if json_output else typer.echo
    say(f"compose project: {written}")
    if loaded.authenticates("compose"):
        say(f"the run's key:   {written.parent / 'run.key'} (mode 600; a new one each time the "
            "project is written)")
    if not up:
        typer.echo(f"run it:          docker compose -f {written} --profile monitoring up "
                   "--build")
        typer.echo("then open        http://127.0.0.1:3000 (Grafana), http://127.0.0.1:9090 "
                   "(Prometheus); the run directory lands in " f"{written.parent / 'runs'}")
        return
    report = _compose_up(written, loaded, sandbox=sandbox, keep=keep, say=say,
                         json_output=json_output)
    if json_output:
        typer.echo(json.dumps(report, indent=2))
    else:
        _show_compose_report(report)
    if not report.get("success"):
        raise typer.Exit(1)


def _write_stack(path: Path, scenario, *, out: str | None, steps: int | None, place: str,
                 runs: Path | None, grafana: bool, subnet: str | None) -> None:
    """`testbed compose --swarm`: the stack files, and how to deploy them."""
    from typing import cast

    from testbed.compose.swarm import (
        PLACES,
        Place,
        default_directory,
        node_labels,
        stack_name,
        write_stack,
    )

    if place not in PLACES:
        raise ValueError(f"--place: expected one of {', '.join(PLACES)}, got {place!r}")
    placed = cast(Place, place)
    directory = Path(out) if out else default_directory(scenario)
    stack, monitoring = write_stack(path, directory, steps=steps, place=placed, runs=runs,
                                    grafana=grafana, subnet=subnet)
    typer.echo(f"stack:           {stack}")
    typer.echo(f"monitoring:      {monitoring}")
    if scenario.authenticates("compose"):
        typer.echo(f"the run's key:   {directory / 'run.key'} (a Swarm secret once deployed)")
    for label, ranks in node_labels(scenario, placed).items():
        typer.echo(f"label nodes:     docker node update --label-add {label}=true NODE   "
                   f"(workers {', '.join(map(str, ranks))})")
    typer.echo(f"deploy it:       docker stack deploy --resolve-image never -c {stack} "
               f"-c {monitoring} {stack_name(scenario)}")
    typer.echo(f"end it:          docker stack rm {stack_name(scenario)}")


def _compose_up(project, scenario, *, sandbox: str, keep: bool, say,
                json_output: bool) -> dict:
    """`testbed compose --up`: the project run here or in the guest; bad input exits 2."""
    import contextlib
    import sys

    from testbed.compose.engine import EngineError, docker
    from testbed.compose.up import UpError, run_in_guest, run_project

    guest = sandbox == "uml" or (sandbox == "auto" and _needs_guest(scenario))
    if guest and keep:
        typer.echo("--keep: only here (the guest's engine ends with the guest)", err=True)
        raise typer.Exit(2)
    try:
        if guest:
            say("this kernel has no netem: the project runs in a User-Mode Linux guest")
            # The guest's console is shown as it comes: on stderr when stdout is for the JSON.
            shown = contextlib.redirect_stdout(sys.stderr) if json_output else \
                contextlib.nullcontext()
            with shown:
                return _sandbox_call(lambda: run_in_guest(project, say=say))
        if docker({}, "info", check=False).returncode != 0:
            typer.echo("--up: no Docker Engine answers here (start dockerd, or run in the "
                       "guest with --sandbox uml)", err=True)
            raise typer.Exit(2)
        return run_project(project, {}, say=say, keep=keep)
    except (UpError, EngineError) as error:
        typer.echo(f"compose --up: {error}", err=True)
        raise typer.Exit(1) from None


def _show_compose_report(report: dict) -> None:
    for service, state in report.get("workers", {}).items():
        typer.echo(f"{service}: {state['state']}, exit code {state['exit_code']}")
    left = report.get("left", {})
    typer.echo(f"left behind: {sum(map(len, left.values()))} containers, networks, volumes"
               if left else "left up (--keep)")
    typer.echo(f"run directory: {report.get('run_dir', 'none')} "
               f"({'succeeded' if report.get('success') else 'FAILED'}, "
               f"{report.get('seconds', '?')} s, in the {report['where']})")


@app.command()
def dashboards(
    check: Annotated[bool, typer.Option(help="Write nothing; exit 1 if the committed JSON "
                                        "differs from testbed/dashboards.py.")] = False,
    out: Annotated[Path | None, typer.Option(help="Where to write (default: "
                                             "grafana/dashboards).")] = None,
) -> None:
    """Write the Grafana dashboards' JSON from testbed/dashboards.py (docs/grafana.md)."""
    from testbed import dashboards as generator

    raise typer.Exit(generator.write(out or generator.DASHBOARD_DIR, check=check))


@app.command("moshpit-peer", hidden=True)
def moshpit_peer(
    rank: Annotated[int, typer.Option(help="This peer's rank.")],
    world: Annotated[int, typer.Option(help="How many peers.")],
    store: Annotated[str, typer.Option(help="HOST:PORT of the TCPStore.")],
    serve_store: Annotated[bool, typer.Option(help="Host the store here.")] = False,
    listen: Annotated[str, typer.Option(help="This peer's address.")] = "127.0.0.1",
    group_size: Annotated[int, typer.Option(help="Peers per group.")] = 4,
    timeout: Annotated[float, typer.Option(help="Seconds a call may take.")] = 5.0,
    heartbeat: Annotated[float, typer.Option(help="Seconds between signs of life.")] = 1.0,
    steps: Annotated[int, typer.Option(help="All-reduces to run.")] = 10,
    numel: Annotated[int, typer.Option(help="Values per all-reduce.")] = 100_000,
    interval: Annotated[float, typer.Option(help="Seconds between steps.")] = 0.0,
) -> None:
    """One Moshpit peer all-reducing `demo_input` (anyone can recompute it), one JSON line per
    step: the demonstration and the multi-process test of docs/moshpit.md."""
    from testbed.collectives.moshpit import run_demo_peer

    host, _, port = store.rpartition(":")
    raise typer.Exit(run_demo_peer(
        rank, world, (host, int(port)), serve_store=serve_store, listen=listen,
        group_size=group_size, timeout=timeout, heartbeat=heartbeat, steps=steps,
        numel=numel, interval=interval))


# The processes a run starts itself are commands here too, each a thin wrapper around a function
# that takes the parsed values and returns the exit code: 0 done, 1 the training failed, 2 bad
# input (a spec, a scenario, a kernel that cannot shape the links), 143 ended by SIGTERM.


@app.command(hidden=True)
def worker(
    spec: Annotated[Path, typer.Argument(help="The worker's spec (WorkerSpec JSON), as the "
                                         "runner writes it into the run directory's logs/.")],
) -> None:
    """One worker of a namespace run (the runner starts it in the worker's namespace)."""
    from testbed.cluster.worker import run_worker

    raise typer.Exit(run_worker(spec))


@app.command()
def node(
    scenario: Annotated[Path, typer.Argument(help="The scenario file (in the container: "
                                             "/scenario/<name>.yaml).")],
    rank: Annotated[int, typer.Option(help="This worker's rank.")],
    hosts: Annotated[str, typer.Option(help="Every worker's address, by rank, comma-separated "
                                       "(on the project's network).")],
    runs: Annotated[Path, typer.Option(help="Where worker 0 creates the run directory (a "
                                       "volume every worker mounts).")] = Path("/runs"),
    steps: Annotated[int | None, typer.Option(help="Shorten the job to this many steps.")] = None,
    iface: Annotated[str, typer.Option(help="The interface whose ingress carries the links "
                                       "into this worker.")] = "eth0",
    base_dir: Annotated[Path | None, typer.Option(help="What the scenario's paths are relative "
                                                  "to (a command job's files, mounted).")] = None,
    key_file: Annotated[Path | None, typer.Option(help="The run's secret, where the scenario "
                                                  "authenticates (default: where `testbed "
                                                  "compose` mounts it, "
                                                  "/run/secrets/testbed-key).")] = None,
) -> None:
    """One worker of a Compose run, in its container: shapes its incoming links, runs the fault
    timeline's part that is its own, trains (docs/compose.md)."""
    from testbed.cluster.node import KEY_FILE, run_node

    raise typer.Exit(run_node(scenario, rank, hosts.split(","), runs, steps=steps, iface=iface,
                              base_dir=base_dir, key_file=key_file or KEY_FILE))


FORCE_TERMINAL = "TESTBED_FORCE_TERMINAL"  # set for a guest whose output a terminal shows


def _needs_guest(scenario) -> bool:
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


def _run_in_guest(path, name: str, steps: int | None, out: str | None,
                  capture: list[str], json_output: bool = False) -> int:
    """The whole run inside a UML guest with a netem kernel; the run directory is shared (the
    guest's root is this host's)."""
    import datetime
    import os
    import sys
    from pathlib import Path

    from netem import sandbox
    from testbed.cluster.runner import safe_name

    if out is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        out = str(Path("runs") / f"{safe_name(name)}-{stamp}")
    kernel = _sandbox_call(sandbox.prepare)
    typer.echo(f"this kernel has no netem: running in a User-Mode Linux guest "
               f"({sandbox.describe(kernel)})", err=json_output)
    argv = [sys.executable, "-m", "testbed.cli", "run", str(Path(path).resolve()), "--sandbox",
            "none", "--out", str(Path(out).resolve())]
    if steps is not None:
        argv += ["--steps", str(steps)]
    for link in capture:
        argv += ["--capture", link]
    if json_output:
        argv.append("--json")
    env = dict(os.environ)
    if sys.stdout.isatty():  # the guest's output comes through a pipe: keep the live display
        env[FORCE_TERMINAL] = "1"
    result = _sandbox_call(lambda: sandbox.run(argv, kernel=kernel, env=env, mem=GUEST_MEM,
                                               timeout=GUEST_TIMEOUT))
    return result.returncode


def _run_here(path, steps: int | None, out: str | None, capture: list[str],
              json_output: bool = False) -> None:
    import contextlib
    import json
    import os

    from rich.console import Console
    from rich.live import Live

    from netem.plan import UnsupportedByKernel
    from testbed.cluster.runner import ClusterRun

    console = Console(force_terminal=True if os.environ.get(FORCE_TERMINAL) else None,
                      stderr=json_output)  # with --json, stdout is the summary's alone
    cluster = ClusterRun(path, steps=steps, run_dir=out, capture=capture)
    console.print(f"run directory: {cluster.run_dir}")
    try:
        with (contextlib.nullcontext(None) if json_output else
              Live(_live_table(cluster), console=console, refresh_per_second=4)) as live:
            result = cluster.run(lambda workers: live and live.update(_live_table(cluster)))
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
    console.print(_summary_table(cluster, result))
    if cluster.capture is not None and cluster.capture.flows is not None:
        console.print(_flows_table(cluster.capture.flows, rows=5))
        for note in _capture_notes(cluster.capture.flows):
            console.print(note)
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


def _number(value: float | None, digits: int = 4) -> str:
    import math

    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else (
        f"{value:.{digits}g}")


def _live_table(cluster):
    """Each worker's state: a training job's step, loss, timing, coverage, losses and drift;
    a command job's status, how long it has run and its exit code."""
    import os
    import time

    from rich.table import Table

    scenario, workers = cluster.scenario, cluster.workers
    view = Table(title=f"{scenario.name}: {scenario.summary()}")
    if scenario.command is not None:
        columns = ("worker", "status", "running (s)", "exit code")
        rows = [(w.seconds if w.seconds is not None else
                 time.monotonic() - w.started if w.started is not None else None, w)
                for w in workers]
        cells = [[_number(seconds, 3), "-" if w.exit_code is None else str(w.exit_code)]
                 for seconds, w in rows]
    else:
        datagrams = scenario.collective.capabilities.datagrams  # lost ones are counted
        columns = ("worker", "status", "step", "loss", "step time (s)", "coverage",
                   *(["datagrams lost"] if datagrams else []), "drift")
        cells = [[f"{w.step + 1}/{scenario.job.steps}", _number(w.loss),
                  _number(w.step_seconds, 3), _number(w.coverage, 3),
                  *([f"{w.datagrams_lost:.0f}"] if datagrams else []), _number(w.drift, 3)]
                 for w in workers]
    for column in columns:
        view.add_column(column)
    if cluster.metrics_urls and not os.environ.get("TESTBED_IN_GUEST"):
        first, last = cluster.metrics_urls[0], cluster.metrics_urls[-1]
        view.caption = (f"/metrics of worker 0: {first}" if first == last else
                        f"/metrics of workers 0..{len(workers) - 1}: {first} .. {last}")
    for w, row in zip(workers, cells, strict=True):
        status = w.status + (f" (restarted {w.restarts}x)" if w.restarts else "")
        view.add_row(str(w.rank), status, *row)
    return view


def _summary_table(cluster, result):
    from rich.table import Table

    summary = Table(title=f"{cluster.scenario.name}: summary ({result.seconds:.1f} s)")
    if cluster.scenario.command is not None:
        for column in ("worker", "status", "exit code", "seconds", "restarts"):
            summary.add_column(column)
        for w in result.workers:
            summary.add_row(str(w.rank), w.status,
                            "-" if w.exit_code is None else str(w.exit_code),
                            _number(w.seconds, 3), str(w.restarts))
        return summary
    for column in ("worker", "status", "steps", "final loss", "evaluation"):
        summary.add_column(column)
    for w in result.workers:
        evaluation = ", ".join(f"{k} {v:.4g}" for k, v in sorted(w.evaluation.items()))
        summary.add_row(str(w.rank), w.status, str(w.step + 1), _number(w.loss),
                        evaluation or "-")
    return summary


def _flows_table(flows: dict, *, rows: int):
    """Per captured link, its largest flows: what was sent and received, lost, retransmitted,
    reordered, duplicated, and the median delay."""
    from rich.table import Table

    table = Table(title="capture: what crossed each link, per flow", caption="packets: recv "
                  "received, retx retransmitted, reord reordered, dup duplicated; p50: the "
                  "median one-way delay")
    for column in ("link", "flow", "sent", "recv", "lost", "retx", "reord", "dup", "p50 ms"):
        table.add_column(column, no_wrap=column == "flow")
    for link in flows["links"]:
        shown = link["flows"][:rows]
        for flow in shown:
            ends = (f"{flow['protocol']} {flow['sport']}>{flow['dport']}"
                    if flow["protocol"] != "other" else "other")
            delay = flow["delay_seconds"]
            table.add_row(link["link"], ends, f"{flow['sent_packets']}",
                          f"{flow['received_packets']}", f"{flow['lost']}",
                          f"{flow['retransmitted']}", f"{flow['reordered']}",
                          f"{flow['duplicated']}",
                          "-" if delay is None else f"{delay['median'] * 1e3:.3g}")
        if not shown:
            table.add_row(link["link"], "(nothing crossed)", *["0"] * 6, "-")
        hidden = len(link["flows"]) - len(shown)
        if hidden:
            table.add_row(link["link"], f"... {hidden} more flow(s)", *[""] * 7)
    return table


def _capture_notes(flows: dict) -> list[str]:
    """What limits the counts: files cut at their size limit, frames the capture dropped."""
    notes = []
    for link in flows["links"]:
        cut = [side for side, truncated in link["truncated"].items() if truncated]
        if cut:
            notes.append(f"[yellow]{link['link']}: {' and '.join(cut)} file cut at "
                         f"{flows['max_bytes']} bytes: counted as far as both files go")
        dropped = {side: n for side, n in link["kernel_drops"].items() if n}
        if dropped:
            notes.append(f"[yellow]{link['link']}: the capture missed frames ("
                         + ", ".join(f"{side} {n}" for side, n in dropped.items())
                         + "): the host could not keep up; lost counts are too high by as many")
    return notes


def _command_tails(cluster, result) -> dict[int, list[str]]:
    """The last lines of the stderr of each failed worker's command (a command job)."""
    if cluster.scenario.command is None:
        return {}
    tails = {}
    for w in result.workers:
        path = result.run_dir / "logs" / f"worker-{w.rank}.stderr"
        if w.status == "failed" and path.exists():
            tails[w.rank] = path.read_text(errors="replace").rstrip("\n").splitlines()[-10:]
    return tails


if __name__ == "__main__":  # `python -m testbed.cli`, as the sandbox runs it in a guest
    app()
