"""This host: what it can do (`doctor`), and what killed runs left on it (`clean`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from testbed.cli.render import capabilities_table

commands = typer.Typer()


@commands.command()
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


@commands.command()
def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print the capabilities as JSON "
                                              "(docs/cli.md).")] = False,
    require: Annotated[str | None, typer.Option(
        help="Capabilities that must be here, comma-separated (e.g. netem,docker): exit 1 if "
        "one is missing.", show_default=False)] = None,
) -> None:
    """What this host can do (found by trying it) and what follows for shaping and placement."""
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
    Console().print(capabilities_table(capabilities, CONSEQUENCES))
    if missing:
        typer.echo(f"required but missing: {', '.join(missing)}", err=True)
        raise typer.Exit(1)
