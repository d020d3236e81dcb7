"""The processes a run starts itself (`worker` in a namespace, `node` in a Compose container)
and the Moshpit demonstration's peers (`moshpit-peer`), apart from the user's commands: each a
thin wrapper around a function that takes the parsed values and returns the exit code: 0 done, 1
the training failed, 2 bad input (a spec, a scenario, a kernel that cannot shape the links), 143
ended by SIGTERM. `worker` and `moshpit-peer` are hidden from --help."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

commands = typer.Typer()


@commands.command("moshpit-peer", hidden=True)
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


@commands.command(hidden=True)
def worker(
    spec: Annotated[Path, typer.Argument(help="The worker's spec (WorkerSpec JSON), as the "
                                         "runner writes it into the run directory's logs/.")],
) -> None:
    """One worker of a namespace run (the runner starts it in the worker's namespace)."""
    from testbed.cluster.worker import run_worker

    _end(run_worker(spec))


@commands.command()
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

    _end(run_node(scenario, rank, hosts.split(","), runs, steps=steps, iface=iface,
                  base_dir=base_dir, key_file=key_file or KEY_FILE))


def _end(code: int) -> None:
    """End a worker's process with `code` once its own clean-up ran (the collective, the
    metrics, the event files): without the interpreter's finalization, which would abort
    (exit 134) if a helper thread were still inside a store call to a peer gone or behind a
    lossy link."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

