"""`testbed scenario`: scenario files validated, and their JSON Schema for editors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

commands = typer.Typer(
    help="Scenario files: validate them, and the JSON Schema for editors (docs/scenarios.md).",
    no_args_is_help=True,
)


@commands.command("schema")
def scenario_schema(
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="Write the schema to this file instead of printing it.",
        show_default=False)] = None,
) -> None:
    """Print (or write) the JSON Schema of scenario files, for editor completion and checks."""
    from testbed.scenario import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if out is None:
        typer.echo(text, nl=False)
    else:
        try:
            Path(out).write_text(text)
        except OSError as error:
            typer.echo(f"--out: {out}: {error.strerror or error}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"schema: {out}")


@commands.command("check")
def scenario_check(
    files: Annotated[list[str], typer.Argument(
        help="Scenario files (YAML), or the names of shipped ones (compose/scenarios/NAME.yaml).",
        show_default=False)],
    steps: Annotated[int | None, typer.Option(
        min=1, help="Check the scenario shortened to this many steps (as CI runs it).",
        show_default=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object per file "
                                              "in a list (docs/cli.md).")] = False,
) -> None:
    """Validate scenario files: one summary line per good file (and how the run orders its
    timeline where that is not the file's order), every problem of a bad one (path, line,
    what is allowed), a command job's missing directory, program or script included. Exit code
    2 if any file is bad (bad input)."""
    from testbed.cli.render import trace_line
    from testbed.scenario import ScenarioError, find_scenario, load_scenario
    from testbed.scenario.timeline import order_note

    results = []
    for name in files:
        try:
            scenario = load_scenario(find_scenario(name), steps=steps, files=True)
        except ScenarioError as error:
            results.append({"file": name, "ok": False, "problems": [
                {"path": p.path, "line": p.line, "message": p.message} for p in error.problems]})
            if not json_output:
                typer.echo(str(error), err=True)
        else:
            traces = {link.trace.file: link.trace.schedule().describe()
                      for link in scenario.topology.links if link.trace is not None}
            results.append({"file": name, "ok": True, "name": scenario.name,
                            "summary": scenario.summary(),
                            "traces": [dataclasses.asdict(t) for t in traces.values()],
                            "traffic": {name: flow.describe()
                                        for name, flow in scenario.flows().items()}})
            if not json_output:
                typer.echo(f"ok {name}: {scenario.summary()}")
                for summary in traces.values():
                    typer.echo(f"  trace {trace_line(summary)}")
                for flow_name, flow in scenario.flows().items():
                    typer.echo(f"  traffic {flow_name}: {flow.describe()}")
                note = order_note(scenario.timeline)
                if note is not None:
                    typer.echo(f"  note: {note}")
    bad = sum(not result["ok"] for result in results)
    if json_output:
        typer.echo(json.dumps(results, indent=2))
    elif bad:
        typer.echo(f"{bad} of {len(files)} scenario file(s) invalid", err=True)
    if bad:
        raise typer.Exit(2)

