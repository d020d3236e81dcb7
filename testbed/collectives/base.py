"""The one contract every collective keeps, so jobs, benchmarks and DDP hooks can swap them.

`allreduce(tensor, step)` returns this worker's view of the average of `tensor` over the
workers, and what it cost. A collective may be inexact by design (lossy: chunks that missed the
deadline; moshpit: peers left out of a group): its stats say how inexact.

What only some collectives do is declared, never discovered: each kind's `Capabilities` stand
in its registry entry (`registry.py`), which declares them to `capabilities.py`, where
`CollectiveBase.capabilities` reads them (a collective no entry declares has the conservative
defaults, `UNDECLARED`). `CollectiveBase` gives the optional parts a default that a collective
overrides where it has more (its transport, parameters for a rejoining worker, the shapes
behind a flat vector, the owners' update of strategy `sharded`).

Torch-free at import: the scenario, the registry and the command line read this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from testbed.collectives.capabilities import Capabilities, declared

if TYPE_CHECKING:
    import torch

    from testbed.collectives.compression.exchange import Shift
    from testbed.transport import DatagramEndpoint, StreamMesh


@dataclass(repr=False)
class AllReduceStats:
    """What one all-reduce did. `coverage` is the fraction of (peer, element) contributions that
    made it into the result (1.0 for exact collectives); `extra` holds collective-specific
    figures with Prometheus-friendly names (e.g. `deadline_seconds`, `late_chunks`). It prints
    as one short line (a collective's own fields, tensors among them, stay out of it)."""

    collective: str
    step: int
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    coverage: float = 1.0
    peers_missing: tuple[int, ...] = ()
    extra: dict[str, float] = field(default_factory=dict)
    # Where the call's time went, for collectives that time their phases (`PhaseClock`).
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __repr__(self) -> str:
        missing = f", peers missing {list(self.peers_missing)}" if self.peers_missing else ""
        return (f"{type(self).__name__}({self.collective} step {self.step}: "
                f"{self.seconds * 1e3:.1f} ms, coverage {self.coverage:.4g}, "
                f"{self.bytes_sent:,} B sent, {self.bytes_received:,} B received{missing}"
                f"{f', {len(self.extra)} more figures' if self.extra else ''})")


class PhaseClock:
    """Per phase of one call, wall seconds and this thread's CPU seconds, lap by lap: the
    wall beyond the CPU was waiting (sleeps, pacing, the peers, or the scheduler on a busy
    host), the CPU was this thread's own work (Python, per-datagram system calls, copies)."""

    def __init__(self) -> None:
        self.phases: dict[str, tuple[float, float]] = {}
        self._wall, self._cpu = time.monotonic(), time.thread_time()

    def lap(self, phase: str) -> None:
        """The time since the last lap (or the start) goes to `phase`."""
        wall, cpu = time.monotonic(), time.thread_time()
        was_wall, was_cpu = self.phases.get(phase, (0.0, 0.0))
        self.phases[phase] = (was_wall + wall - self._wall, was_cpu + cpu - self._cpu)
        self._wall, self._cpu = wall, cpu


@runtime_checkable
class Collective(Protocol):
    """An all-reduce among `world` workers; this object is worker `rank`'s end of it."""

    name: str
    rank: int
    world: int

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        """The average of `tensor` over the workers (a new tensor; the input is not modified)."""
        ...

    def close(self) -> None:
        """Release sockets and threads; idempotent."""
        ...


# An owner's optimizer on its shard: (start in the flat vector, the shard's current parameters,
# its averaged gradient) -> the shard's new parameters.
Update = Callable[[int, "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


@runtime_checkable
class ShardedStep(Protocol):
    """A collective whose shard owners apply the update (capability `sharded_step`; a user's
    own collective that has `step` qualifies too)."""

    def step(self, parameters: torch.Tensor, gradient: torch.Tensor, step: int,
             update: Update) -> tuple[torch.Tensor, AllReduceStats]: ...


class CollectiveBase:
    """The optional parts of the contract, with what a collective that lacks them does. Every
    collective of the registry derives from it; a user's own `Collective` need not."""

    name: ClassVar[str]
    rank: int
    world: int
    # The transports whose counters the metrics export: datagrams (lossy), TCP streams (ring,
    # lossy's mesh). None: this collective has no such transport.
    endpoint: DatagramEndpoint | None = None
    mesh: StreamMesh | None = None
    timeout: float = 30.0  # seconds a reliable exchange waits for a peer

    @property
    def capabilities(self) -> Capabilities:
        """What this collective's kind declares (`capabilities.UNDECLARED` where none does)."""
        return declared(self.name)

    def set_shapes(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """The shapes of the tensors a flat vector is made of (a model's parameters, in order);
        only a compressor that works per weight matrix uses them."""

    def pull_state(self) -> torch.Tensor | None:
        """A rejoining worker's parameters, pulled from its peers through the collective (None:
        this collective has no way; the run's store serves them)."""
        return None

    def peer_moved(self, rank: int, host: str) -> None:
        """Peer `rank` is at `host` now (its Swarm task restarted at another address): send
        to it there and take its datagrams from there. Nothing to do for a collective that
        cannot take a worker back (none of its peers ever returns) or that finds its peers
        through the run's store (Moshpit's membership lists the new address)."""

    def neighbour_exchange(self) -> Shift | None:
        """A reliable point-to-point exchange of its own for compressors (capability
        `reliable_exchange`; gloo: isend/irecv). None: the compression layer uses `mesh`, if
        the collective has one."""
        return None
