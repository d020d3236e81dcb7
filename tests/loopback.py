"""Groups of every in-process collective on loopback (ring, lossy, Moshpit, and compressors
over them), their sockets bound first so the addresses are free ports, and one all-reduce
across a group; free ports and fresh processes for what needs a process per rank (gloo, DDP):
what tests of the collectives' device and dtype handling share (tests/unit, tests/gpu)."""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from live import collect

from testbed.collectives.base import AllReduceStats, CollectiveBase
from testbed.collectives.compression import wrap
from testbed.collectives.lab import run_concurrently
from testbed.collectives.lossy import Lossy
from testbed.collectives.membership import host_store
from testbed.collectives.moshpit import Moshpit
from testbed.collectives.ring import Ring
from testbed.transport.tcp import Listener
from testbed.transport.udp import DatagramEndpoint

RUN = 11
# Nothing is lost on loopback for the small tensors these tests use: a fixed, generous deadline
# costs nothing then, and a busy host cannot make a learned one cut chunks off.
LOSSY = {"deadline_initial": 5.0, "deadline_floor": 5.0, "settle": None}
KINDS = ("ring", "lossy", "moshpit", "ring+int8", "lossy+topk")


def _rings(world: int) -> list[CollectiveBase]:
    listeners = [Listener(("127.0.0.1", 0)) for _ in range(world)]
    where = [listener.address for listener in listeners]
    return run_concurrently(*(partial(Ring, rank, world, addresses=where,
                                      listener=listeners[rank]) for rank in range(world)))


def _lossy(world: int) -> list[CollectiveBase]:
    endpoints = [DatagramEndpoint(rank, RUN, ("127.0.0.1", 0)) for rank in range(world)]
    listeners = [Listener(("127.0.0.1", 0)) for _ in range(world)]
    return run_concurrently(*(partial(
        Lossy, rank, world, addresses=[e.address for e in endpoints], endpoint=endpoints[rank],
        run_id=RUN, stream_addresses=[x.address for x in listeners], listener=listeners[rank],
        **LOSSY) for rank in range(world)))


def _moshpit(world: int, store: tuple[str, int]) -> list[CollectiveBase]:
    return run_concurrently(*(partial(Moshpit, rank, world, store=store, serve_store=False,
                                      group_size=2, timeout=5.0) for rank in range(world)))


@contextmanager
def group(kind: str, world: int = 2) -> Iterator[list[CollectiveBase]]:
    """`world` workers of `kind` (one of KINDS: a collective, or `collective+compressor`),
    closed at the end."""
    inner, _, compressor = kind.partition("+")
    served = host_store(("127.0.0.1", 0)) if inner == "moshpit" else None
    if inner == "ring":
        made = _rings(world)
    elif inner == "lossy":
        made = _lossy(world)
    else:
        assert served is not None
        made = _moshpit(world, ("127.0.0.1", served.port))
    if compressor:
        made = [wrap(collective, compressor) for collective in made]
    try:
        yield made
    finally:
        run_concurrently(*(collective.close for collective in made))
        del served


def allreduce(collectives: Sequence[CollectiveBase], inputs: Sequence[torch.Tensor],
              step: int) -> list[tuple[torch.Tensor, AllReduceStats]]:
    """Every worker's call with its input, at once."""
    calls: list[Callable[[], object]] = [
        partial(collective.allreduce, tensor, step)
        for collective, tensor in zip(collectives, inputs, strict=True)]
    return run_concurrently(*calls)  # type: ignore[return-value]


def free_ports(count: int, kind: socket.SocketKind = socket.SOCK_STREAM) -> list[int]:
    """`count` ports free on loopback now (of `kind`)."""
    sockets = [socket.socket(socket.AF_INET, kind) for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def spawn(target: Callable[..., None], world: int, *args: object,
          wait: float = 120.0) -> list[object]:
    """Run `target(rank, *args, results)` in `world` fresh processes; what each put in
    `results`. A process that dies fails the test at once, not after the whole wait."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=target, args=(rank, *args, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    try:
        collected = collect(results, processes, wait)
        for process in processes:
            process.join(30)
            assert process.exitcode == 0, f"a process exited with {process.exitcode}"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    return collected
