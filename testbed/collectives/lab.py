"""Collectives on a lab of namespaces (`netem.lab.Lab`): one worker per host, each in a thread
of this process inside its host's namespace; and `run_concurrently`, which runs blocking calls
at once in threads with a bounded wait (peers that live in one process, in a lab or not).

A thread that enters a namespace (`netem.namespace.inside`) makes its sockets there, and so do
the threads it starts: constructors and calls that may open connections or start senders run
inside their worker's namespace (`on_hosts`). Importing this module loads torch (the
collectives do), so nothing torch-free in `testbed` imports it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

from netem import LinkProfile, apply
from netem.lab import Lab
from netem.namespace import inside
from testbed.collectives.lossy import Lossy
from testbed.collectives.moshpit import Moshpit
from testbed.collectives.ring import Ring
from testbed.transport.tcp import Listener

PORT = 29500  # free on every host: its namespace is new
WAIT = 30.0  # seconds a call may take before `run_concurrently` gives up instead of hanging
T = TypeVar("T")


def run_concurrently(*calls: Callable[[], object], wait: float = WAIT) -> list[object]:
    """The calls' results in order, or the first exception one of them raised; TimeoutError
    if one has not finished within `wait` seconds (its thread is a daemon, left behind)."""
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(wait)
        if thread.is_alive():
            raise TimeoutError(f"a call did not finish within {wait} s")
    if errors:
        raise errors[0]
    return results


def shape_every_link(lab: Lab, profile: LinkProfile,
                     backend: Literal["auto", "netem", "fallback"] = "auto") -> None:
    """Shape every link into every host (the switch port's egress towards it) as `profile`."""
    for host in lab.hosts:
        apply(host.switch_port, profile, netns=lab.switch, backend=backend)


def on_hosts(lab: Lab, calls: Sequence[Callable[[], T]], wait: float = 60.0) -> list[T]:
    """Run calls[i] in host i's namespace, all at once; their results in order."""

    def within(index: int) -> T:
        with inside(lab.hosts[index].netns):
            return calls[index]()

    return run_concurrently(*(lambda i=i: within(i) for i in range(len(calls))), wait=wait)


def addresses(lab: Lab, port: int = PORT) -> list[tuple[str, int]]:
    """Every host's (address, `port`), in rank order."""
    return [(host.address, port) for host in lab.hosts]


def rings(lab: Lab, port: int = PORT, **options) -> list[Ring]:
    """A ring worker on every host of the lab, listening on `port`."""
    world, where = len(lab.hosts), addresses(lab, port)
    return on_hosts(lab, [
        lambda r=r: Ring(r, world, addresses=where, listener=Listener(where[r]), **options)
        for r in range(world)
    ])


def lossy_workers(lab: Lab, port: int = PORT, **options) -> list[Lossy]:
    """A lossy all-reduce worker on every host of the lab, on UDP `port`."""
    world, where = len(lab.hosts), addresses(lab, port)
    return on_hosts(lab, [lambda r=r: Lossy(r, world, addresses=where, **options)
                          for r in range(world)])


def moshpit_peers(lab: Lab, port: int = PORT, **options) -> list[Moshpit]:
    """A Moshpit peer on every host of the lab (on any free port); rank 0 serves the store on
    `port`. Their calls must run inside their namespaces too (`on_hosts`): a peer connects to
    another on first sending."""
    world, where = len(lab.hosts), addresses(lab, port)
    return on_hosts(lab, [
        lambda r=r: Moshpit(r, world, store=where[0], listen=(where[r][0], 0), **options)
        for r in range(world)
    ])


def close_all(lab: Lab, collectives: Sequence[Ring | Lossy | Moshpit]) -> None:
    """Close them all at once (the Moshpit store's host waits for the others to leave)."""
    on_hosts(lab, [collective.close for collective in collectives])
