"""What the collectives benchmark measures: its cells (a collective, a tensor size, a link rate
and loss, a world), what a cell's run came to (`Outcome`), and how both are named in the
results files and the progress lines."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from netem.profile import DEFAULT_LIMIT
from testbed.collectives.grid import Grid
from testbed.scenario.topology import Topology

WORLD = 4
GRID_WORLDS = (8, 16)  # --grid: Moshpit's peers, in groups of GRID_GROUP
GRID_KINDS = ("moshpit", "ring")  # --grid: the ring shows what TCP reaches on the same links
GRID_GROUP = 4
GRID_RATE = 100e6  # --grid: every peer's downlink and uplink
SIZES = {"1M": 1_000_000, "10M": 10_000_000, "100M": 100_000_000}
RATES = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9}
LOSSES = (0.0, 0.01, 0.05, 0.10)
KINDS = ("lossy", "lossy-keyed", "ring", "moshpit", "gloo-cubic", "gloo-bbr")
# ring and moshpit, per socket: a scenario's default (cubic), not this host's (bbr here)
TCP_CONGESTION = Topology.model_fields["congestion"].default
REPS = {1_000_000: 5, 10_000_000: 2, 100_000_000: 1}  # timed calls, after the warm-ups
QUICK_REPS = {1_000_000: 3, 10_000_000: 1}
# The warm-up call sets up connections and buffers; past this size the others warm up on a
# slice of the input (lossy always warms up on the whole: it learns its deadlines from it).
WARMUP_NUMEL = 10_000_000
# Every collective but lossy first makes a call of this many elements: it sets up the
# connections and threads, so what the later calls add to memory is the tensor's alone. (Lossy
# would learn its deadlines from it.)
SETUP_NUMEL = 1024
# Lossy's pacing, as a fraction of the link rate. Each sender interleaves its three peers, so
# a downlink gets at most its rate from the four together; the batched receivers keep up (no
# rcvbuf drops, nothing lost on lossless links at 100 Mbit/s and 1 Gbit/s). At 0.97, with one
# Python call per datagram, the receivers fell behind and the headroom was for the queue.
PACE = 1.0
# Lossy's pacing never goes past this (unshaped links have no rate to pace at). Four workers on
# two cores move about 450 Mbit/s each when paced faster; at this pace they keep up, and the
# deadlines computed from it hold. With one Python call per datagram, the receivers dropped
# datagrams beyond 200 Mbit/s.
LOSSY_PACE_CAP = 400e6


def all_reduce_share(members: int) -> float:
    """The tensors' worth each of `members` receives in a bandwidth-optimal all-reduce."""
    return 2 * (members - 1) / members


@dataclass(frozen=True)
class Cell:
    kind: str
    numel: int
    rate: float | None  # bits/s on every downlink; None: unshaped
    loss: float
    quick: bool = field(default=False, compare=False)
    world: int = WORLD
    uplinks: bool = False  # the rate on every uplink too
    congestion: str = TCP_CONGESTION  # ring's and Moshpit's, per socket (--congestion)
    queue_limit: int = DEFAULT_LIMIT  # packets each shaped link's queue holds (--queue-limit)
    # TCP's congestion window restarts after an idle retransmission timeout (the kernel's
    # default, net.ipv4.tcp_slow_start_after_idle); --no-idle-restart turns it off
    idle_restart: bool = True

    @property
    def bytes(self) -> int:
        return self.numel * 4

    @property
    def factor(self) -> float:
        """The tensors' worth each worker receives at least: 2(N-1)/N; for Moshpit one group
        all-reduce per axis of its grid (groups of four), 2(g-1)/g per side g."""
        if self.kind == "moshpit":
            return sum(map(all_reduce_share, Grid.for_world(self.world).sides))
        return all_reduce_share(self.world)

    @property
    def bound(self) -> float | None:
        """Seconds the bandwidth bound allows: `factor` tensors at the rate."""
        if self.rate is None:
            return None
        return self.factor * self.bytes * 8 / self.rate

    @property
    def call_timeout(self) -> float:
        """Seconds allowed per call: 10x the bound (1 Gbit/s's where unshaped; lossy's at its
        pacing cap where that is lower), 30..120."""
        rate = self.rate or 1e9
        if self.kind.startswith("lossy"):
            rate = min(rate, LOSSY_PACE_CAP)
        bound = self.factor * self.bytes * 8 / rate
        return min(max(10 * bound, 30.0), 120.0)

    @property
    def setup_call(self) -> bool:
        """Whether the first call is a SETUP_NUMEL one (counted among the warm-ups)."""
        return not self.kind.startswith("lossy")

    @property
    def warmups(self) -> int:
        """Lossy learns its deadlines from the last arrivals of earlier calls: three warm-ups
        where they are cheap; the others one, after their set-up call."""
        if self.kind.startswith("lossy"):
            return 3 if self.numel <= WARMUP_NUMEL else 1
        return 2

    @property
    def reps(self) -> int:
        return (QUICK_REPS if self.quick else REPS).get(self.numel, 1)

    @property
    def warmup_numel(self) -> int:
        return self.numel if self.kind.startswith("lossy") else min(self.numel, WARMUP_NUMEL)


@dataclass
class Outcome:
    cell: Cell
    status: str  # ok | timeout | failed | skipped
    seconds: list[float] = field(default_factory=list)  # per timed call: the slowest rank's
    warmup: float = math.nan
    coverage: float = math.nan  # mean over ranks and timed calls
    exact: bool = False
    relative_error: float = math.nan  # worst rank: |result - mean| / the inputs' rms offset
    extra_memory: float = math.nan  # worst rank, in tensor sizes, from the collective built
    call_memory: float = math.nan  # worst rank: the timed calls' peak over where they began
    tcp: dict[str, int] = field(default_factory=dict)
    tcp_default: str = ""
    counters: dict[str, float] = field(default_factory=dict)  # summed over ranks, timed calls
    # Moshpit: per round, the slowest peer's (seconds, roll call's, reduce-scatter's), averaged
    # over the timed calls; and what a call spent outside its rounds (the slowest peer's)
    round_seconds: list[tuple[float, float, float]] = field(default_factory=list)
    outside_rounds: float = math.nan
    start_skew: float = math.nan  # seconds from the first peer's start of a call to the last's
    after_last_start: float = math.nan  # seconds from the last peer's start to the last end
    cpu_busy: float = math.nan  # the host's CPUs during the timed calls: 1 - idle share
    note: str = ""
    wall: float = 0.0

    @property
    def time(self) -> float:
        return sum(self.seconds) / len(self.seconds) if self.seconds else math.nan

    @property
    def fraction(self) -> float:
        bound = self.cell.bound
        return bound / self.time if bound and self.seconds else math.nan


def rate_name(rate: float | None) -> str:
    if rate is None:
        return "unshaped"
    return next((name for name, value in RATES.items() if value == rate), f"{rate:g} bit/s")


def size_name(numel: int) -> str:
    return next((name for name, value in SIZES.items() if value == numel), str(numel))


def show(o: Outcome | None, *, with_bound: bool = True) -> str:
    """An outcome as the tables and progress lines give it: its time (and fraction of the
    bound), its coverage where short, or why it has no time."""
    if o is None:
        return "-"
    if o.status == "skipped":
        return f"not run ({o.note})"
    if o.status == "timeout":
        return f"> {o.cell.call_timeout:.0f} s (timed out)"
    if o.status != "ok":
        return f"failed: {o.note}"
    text = f"{o.time:.3g} s"
    if with_bound and o.cell.bound:
        text += f" ({o.fraction:.2f})"
    if o.cell.kind.startswith(("lossy", "moshpit")) and o.coverage < 1:
        text += f" cov {o.coverage:.3f}"
    if o.cell.loss == 0 and not o.exact:
        text += " **inexact**" if o.coverage < 1 else " **WRONG**"
    return text


def congestion_of(outcomes: list[Outcome]) -> str:
    """The ring's and Moshpit's congestion control in this run (`--congestion`)."""
    return outcomes[0].cell.congestion if outcomes else TCP_CONGESTION


def verdict(ok: bool | None) -> str:
    """A target's word: PASS or FAIL, or info for a figure given beside the targets."""
    return "PASS" if ok else "FAIL" if ok is False else "info"
