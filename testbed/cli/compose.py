"""A scenario under Docker: `compose` writes its Compose project (or with --swarm its Swarm
stack) and with --up runs it; `dashboards` writes their Grafana dashboards."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast

import typer

from testbed.cli.render import compose_report_lines
from testbed.cli.sandbox import Sandbox, call_sandbox, in_guest

if TYPE_CHECKING:
    from testbed.scenario import Scenario

commands = typer.Typer()


@commands.command()
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
    sandbox: Annotated[Sandbox, typer.Option(
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
    from testbed.compose import ComposeError, default_directory, write_project
    from testbed.compose.project import SUBNET
    from testbed.scenario import ScenarioError, find_scenario, load_scenario

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
        for line in compose_report_lines(report):
            typer.echo(line)
    if not report.get("success"):
        raise typer.Exit(1)


def _write_stack(path: Path, scenario: Scenario, *, out: str | None, steps: int | None,
                 place: str, runs: Path | None, grafana: bool, subnet: str | None) -> None:
    """`testbed compose --swarm`: the stack files, and how to deploy them."""
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


def _compose_up(project: Path, scenario: Scenario, *, sandbox: Sandbox, keep: bool,
                say: Callable[[str], None], json_output: bool) -> dict:
    """`testbed compose --up`: the project run here or in the guest; bad input exits 2."""
    from testbed.compose.engine import EngineError, docker
    from testbed.compose.up import UpError, run_in_guest, run_project

    guest = in_guest(sandbox, scenario)
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
                return call_sandbox(lambda: run_in_guest(project, say=say))
        if docker({}, "info", check=False).returncode != 0:
            typer.echo("--up: no Docker Engine answers here (start dockerd, or run in the "
                       "guest with --sandbox uml)", err=True)
            raise typer.Exit(2)
        return run_project(project, {}, say=say, keep=keep)
    except (UpError, EngineError) as error:
        typer.echo(f"compose --up: {error}", err=True)
        raise typer.Exit(1) from None


@commands.command()
def dashboards(
    check: Annotated[bool, typer.Option(help="Write nothing; exit 1 if the committed JSON "
                                        "differs from testbed/dashboards.py.")] = False,
    out: Annotated[Path | None, typer.Option(help="Where to write (default: "
                                             "grafana/dashboards).")] = None,
) -> None:
    """Write the Grafana dashboards' JSON from testbed/dashboards.py (docs/grafana.md)."""
    from testbed import dashboards as generator

    raise typer.Exit(generator.write(out or generator.DASHBOARD_DIR, check=check))

