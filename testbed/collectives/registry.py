"""Every collective kind and compressor kind, declared once: what a scenario may set, what the
kind can do, where its implementation lives and how a worker places it.

A kind's entry is all that the rest of the testbed knows of it: scenario validation and its
JSON Schema read `options`, the worker reads `place` and `implementation`, scenario checks and
the compression layer read `capabilities`. Adding a collective is its own module (a class
deriving from `base.CollectiveBase`) plus one `register(Kind(...))` here (docs/collectives.md,
"Adding a collective").

Torch-free: `testbed scenario check` and `testbed compose` import this, not the collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Self, TypeVar, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from netem.profile import A_NUMBER, Integer, Number
from testbed.collectives.capabilities import Capabilities, declare

Address = tuple[str, int]
T = TypeVar("T")


class CollectiveOptions(BaseModel):
    """What a scenario's `collective` section may set for one kind (the rest comes from the
    placement). A kind whose rejoin depends on its options says so in `rejoin_problem`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def checked(cls, **given: Any) -> Self:
        """`given` as these options, for a constructor called directly: refused as a scenario
        would refuse them, by a ValueError that names the field."""
        try:
            return cls(**given)
        except ValidationError as error:
            raise ValueError("; ".join(map(_in_words, error.errors()))) from None

    def rejoin_problem(self, compressor: str) -> str | None:
        """Why a restarted worker could not rejoin with these options and `compressor`
        (None: it can, if the kind `takes_back` at all)."""
        return None

    def strategy_problem(self, strategy: str) -> tuple[str, str] | None:
        """(the option, why) where these options do not fit the job's `strategy` (None: they
        do)."""
        return None


def _in_words(error: ErrorDetails) -> str:
    """`field: what is wrong` (a rule across fields names its field itself)."""
    where = ".".join(map(str, error["loc"]))
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


@dataclass(frozen=True)
class Placement:
    """Where a worker is: what the cluster knows and a scenario's options do not."""

    rank: int
    world: int
    hosts: Sequence[str]  # every worker's address, by rank
    port: Callable[[str, int], int]  # port(name, rank): a named port of a worker
    run_id: int = 0
    mtu: int = 1500
    congestion: str | None = None  # the worker's TCP congestion control
    rejoining: bool = False  # restarted after a preemption
    # The run's secret, where it authenticates (docs/transport.md); never printed.
    key: bytes | None = field(default=None, repr=False)

    def at(self, port: str) -> list[Address]:
        """Every worker's (address, port) of a named port, by rank."""
        return [(self.hosts[r], self.port(port, r)) for r in range(self.world)]


@dataclass(frozen=True)
class Kind:
    """One collective kind: `implementation` is "module:Class" (imported on first use),
    `place` gives the constructor's options that come from the `Placement`."""

    name: str
    implementation: str
    options: type[CollectiveOptions]
    capabilities: Capabilities
    place: Callable[[Placement], dict[str, Any]]
    summary: str


@dataclass(frozen=True)
class CompressorKind:
    """One compressor kind: the parameters it takes, and whether it needs the inner
    collective's reliable exchange (`needs_exchange`: it gathers payloads over it; `agrees`: it
    agrees on a pattern, by an exact all-reduce where the inner is exact, else the exchange)."""

    name: str
    parameters: tuple[str, ...]
    needs_exchange: bool = False
    agrees: bool = False

    def exchange_needed(self, inner: Capabilities) -> bool:
        """Whether over a collective with these capabilities this compressor needs its
        reliable exchange."""
        return self.needs_exchange or (self.agrees and not inner.exact)


_KINDS: dict[str, Kind] = {}


def register(entry: Kind) -> Kind:
    """Add a collective kind (its name must be new), declaring its capabilities."""
    if entry.name in _KINDS:
        raise ValueError(f"collective kind {entry.name!r} is registered already")
    _KINDS[entry.name] = entry
    declare(entry.name, entry.capabilities)
    return entry


def kinds() -> tuple[str, ...]:
    """The registered collective kinds, in registration order."""
    return tuple(_KINDS)


def kind(name: str) -> Kind:
    """The entry of collective `name`; an unknown name is told what is allowed."""
    return _entry(_KINDS, "collective.kind", name)


def _entry(table: dict[str, T], field: str, name: str) -> T:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{field}: expected one of {', '.join(table)}, got {name!r}") from None


def with_capability(flag: str) -> list[str]:
    """The kinds whose capabilities have `flag` set (for messages that name them)."""
    return [name for name, entry in _KINDS.items() if getattr(entry.capabilities, flag)]


# --- the collectives ----------------------------------------------------------------------------

TIMEOUT_HELP = "Seconds a send or receive may take before the call fails."
RENDEZVOUS_HELP = ("Seconds every rank has to meet the others at the start (ranks may arrive "
                   "that far apart: a DDP script broadcasts its model before its hook meets).")


class RingOptions(CollectiveOptions):
    timeout: Number = Field(default=30.0, gt=0, description=TIMEOUT_HELP)
    rendezvous_timeout: Number = Field(default=300.0, gt=0, description=RENDEZVOUS_HELP)


class GlooOptions(CollectiveOptions):
    timeout: Number = Field(default=60.0, gt=0, description="Seconds torch.distributed waits "
                            "for a peer (its process group's timeout).")


class MoshpitOptions(CollectiveOptions):
    group_size: Integer = Field(default=4, ge=2, description="Peers per group: the virtual grid's "
                                "side (at least 2: a group of one averages nothing).")
    timeout: Number = Field(default=5.0, gt=0, description="Seconds a call may take (it "
                            "returns within this plus 0.25 s): peers not there in time are "
                            "left out. At least twice what a call takes when nothing fails.")
    heartbeat: Number = Field(default=1.0, gt=0, description="Seconds between a peer's signs of "
                              "life in the membership.")
    expiry: Annotated[float, Field(gt=0), A_NUMBER] | None = Field(default=None, description=(
        "Seconds of silence after which a peer counts as gone (default: four heartbeats)."))
    rendezvous_timeout: Number = Field(default=60.0, gt=0, description=RENDEZVOUS_HELP)

    @model_validator(mode="after")
    def _expiry_after_heartbeat(self) -> Self:
        """A peer is gone after `expiry` seconds without a sign of life: at least one heartbeat
        must fit in it."""
        if self.expiry is not None and self.expiry <= self.heartbeat:
            raise ValueError(f"expiry: expected more than heartbeat ({self.heartbeat!r} s), "
                             f"got {self.expiry!r}")
        return self


# What a worker's copy holds where it missed a chunk of an owner's parameter broadcast (`step`):
# its stale value, that plus the last per-step update it received there, or that plus the
# update its own optimizer makes of its local gradient there.
Missed = Literal["keep", "last_update", "local"]
MISSED: tuple[str, ...] = get_args(Missed)
# Which peers an owner's broadcast carries parity to: those that lost some of it lately, or all.
ParityWhen = Literal["loss", "always"]
PARITY_WHEN: tuple[str, ...] = get_args(ParityWhen)
# "Lately": within this many calls after the peer last said it lost some.
PARITY_MEMORY = 16


def _expecting(expected: str) -> WrapValidator:
    """A field refused in words that say what it takes (`expected ..., got ...`), alike in a
    scenario and in a constructor called directly; its constraints, and so the JSON Schema,
    stay the field's own."""

    def refuse_in_words(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("expected", "expected {expected}, got {got}",
                                      {"expected": expected, "got": repr(value)}) from None

    return WrapValidator(refuse_in_words)


class LossyOptions(CollectiveOptions):
    rate: Annotated[float, Field(gt=0), A_NUMBER] | None = Field(default=None, description=(
        "Bits/s each sender paces its datagrams at (null: unpaced)."))
    rcvbuf: Integer = Field(default=32 << 20, ge=4096, description="Bytes of each datagram "
                            "socket's receive buffer: three unpaced peers' 10 MB shards "
                            "overflow 8 MiB.")
    deadline_initial: Number = Field(default=1.0, gt=0, description="Seconds of the transfer "
                                     "deadline (from a peer's first chunk of a phase) until it "
                                     "has learned from the calls.")
    deadline_floor: Number = Field(default=0.02, gt=0, description="Least seconds the learned "
                                   "deadline may be.")
    deadline_ceiling: Number = Field(default=5.0, gt=0, description="Most seconds the learned "
                                     "deadline may be.")
    straggler_timeout: Annotated[Number, _expecting("seconds > 0")] = Field(
        default=5.0, gt=0, description="Seconds a peer that is behind (its first chunk of a "
        "phase not yet sent) is waited for.")
    settle: Annotated[PositiveFloat | Literal["auto"] | None, _expecting(
        "seconds > 0, 'auto' (learned) or null (wait to the deadline)")] = Field(
        default="auto", description="Seconds of quiet after every sender's stream ended before a "
        "phase closes (auto: learned between 1 and 10 ms from what came late; null: wait to "
        "the deadline).")
    resync_every: Annotated[Integer, _expecting("0 (never) or more")] = Field(
        default=0, ge=0, description="Every N steps the broadcast goes reliably over TCP, so "
        "every copy is exact again (0: never).")
    parity: Annotated[Integer, _expecting("0 (none) or the chunks per parity chunk")] = Field(
        default=4, ge=0, description="Broadcast chunks per XOR parity chunk, from which a "
        "receiver rebuilds one lost chunk of each group (0: no parity; 1: every chunk twice). "
        "Costs 1/parity more broadcast bytes to each peer it goes to (parity_when).")
    parity_when: Annotated[ParityWhen, _expecting(f"one of {', '.join(PARITY_WHEN)}")] = Field(
        default="loss", description="Which peers an owner's broadcast carries parity to: loss "
        f"(those that said, in their resend asks, that they lost some of it within the last "
        f"{PARITY_MEMORY} calls: clean links carry none) or always (every peer; also what "
        "loss does without resend).")
    missed: Annotated[Missed, _expecting(f"one of {', '.join(MISSED)}")] = Field(
        default="keep", description="What a worker's copy holds where it missed a chunk of an "
        "owner's parameter broadcast (strategy sharded): keep (its stale value), last_update "
        "(that plus the last update it received there, per step missed), local (that plus its "
        "own optimizer's update of its local gradient).")
    resend: bool = Field(default=True, description="After the broadcast, every worker asks "
                         "each owner once for the chunks it lacks and gets them again within "
                         "the call (two more exchanges per call).")
    ecn: bool = Field(default=False, description="Send the datagrams ECN-capable (ECT(0)): a "
                      "link with ecn marks them CE instead of dropping them, and the marks are "
                      "counted (testbed_datagrams_ce_marked_total); nothing slows down on them.")
    timeout: Number = Field(default=30.0, gt=0, description=TIMEOUT_HELP)
    rendezvous_timeout: Number = Field(default=300.0, gt=0, description=RENDEZVOUS_HELP)

    @model_validator(mode="after")
    def _deadlines_in_order(self) -> Self:
        """The transfer deadline starts at deadline_initial and is learned within
        [deadline_floor, deadline_ceiling]."""
        floor, initial, ceiling = self.deadline_floor, self.deadline_initial, self.deadline_ceiling
        if floor > ceiling:
            raise ValueError(f"deadline_floor: expected at most deadline_ceiling ({ceiling!r}), "
                             f"got {floor!r}")
        if not floor <= initial <= ceiling:
            raise ValueError(f"deadline_initial: expected deadline_floor to deadline_ceiling "
                             f"({floor!r} to {ceiling!r}), got {initial!r}")
        return self

    def strategy_problem(self, strategy: str) -> tuple[str, str] | None:
        if self.missed != "keep" and strategy != "sharded":
            return ("missed", f"{self.missed} fills in the parameters the owners broadcast, "
                    f"which only strategy sharded has; with strategy {strategy} use keep")
        return None

    def rejoin_problem(self, compressor: str) -> str | None:
        if self.resync_every:
            return ("a restarted worker has no TCP streams to lossy's resync: set "
                    "collective.resync_every to 0, or kill without restart")
        if compressor != "none" and compressor_kind(compressor).exchange_needed(
                kind("lossy").capabilities):
            return (f"compressor {compressor} exchanges over lossy's TCP streams, which a "
                    "restarted worker has not: use randk, powersgd or none")
        return None


register(Kind(
    "ring", "testbed.collectives.ring:Ring", RingOptions,
    Capabilities(exact=True, reliable_exchange=True, authenticates=True),
    lambda p: {"addresses": p.at("collective"), "run_id": p.run_id,
               "congestion": p.congestion, "key": p.key},
    "reliable ring all-reduce over TCP (baseline)"))
register(Kind(
    "gloo", "testbed.collectives.gloo:Gloo", GlooOptions,
    Capabilities(exact=True, reliable_exchange=True),
    lambda p: {"master": (p.hosts[0], p.port("store", 0)),
               "interface_address": p.hosts[p.rank]},
    "torch.distributed's gloo all-reduce (baseline)"))
register(Kind(
    "moshpit", "testbed.collectives.moshpit:Moshpit", MoshpitOptions,
    Capabilities(takes_back=True, authenticates=True),
    lambda p: {"store": (p.hosts[0], p.port("store", 0)), "listen": p.at("collective")[p.rank],
               "run_id": p.run_id, "congestion": p.congestion, "key": p.key},
    "Moshpit averaging in groups on a virtual grid"))
register(Kind(
    "lossy", "testbed.collectives.lossy:Lossy", LossyOptions,
    Capabilities(sharded_step=True, takes_back=True, reliable_exchange=True, datagrams=True,
                 authenticates=True),
    lambda p: {"addresses": p.at("collective"), "stream_addresses": p.at("stream"),
               "run_id": p.run_id, "mtu": p.mtu, "congestion": p.congestion,
               "rejoining": p.rejoining, "key": p.key},
    "loss-tolerant all-reduce over unreliable datagrams"))


# --- the compressors ----------------------------------------------------------------------------

_SPARSIFIER = ("density", "error_feedback", "feedback", "momentum", "resync_every")
# The sparsifiers' error feedback (docs/compression.md): EF21M (with momentum, a shared
# estimate) or EF14 (each worker's own error, no shared state).
FEEDBACKS = ("ef21m", "ef14")
_QUANTIZER = ("group_size", "symmetric", "stochastic", "seed")
# ARC-Top-K's sketches (docs/compression.md): `projection`, the paper's (each weight matrix's
# rows projected on a shared random matrix of `sketch_rank` columns, whole rows kept), and
# `marginal` (row and column energies, single coordinates kept).
ARC_SKETCHES = ("projection", "marginal")
COMPRESSORS: dict[str, CompressorKind] = {c.name: c for c in (
    CompressorKind("none", ()),
    CompressorKind("topk", _SPARSIFIER, needs_exchange=True),
    CompressorKind("randk", (*_SPARSIFIER, "seed")),
    CompressorKind("arc_topk", (*_SPARSIFIER, "sketch", "sketch_rank", "block", "seed"),
                   agrees=True),
    CompressorKind("int8", _QUANTIZER, needs_exchange=True),
    CompressorKind("int4", _QUANTIZER, needs_exchange=True),
    CompressorKind("powersgd", ("rank", "error_feedback", "seed")),
)}


def compressor_kind(name: str) -> CompressorKind:
    """The entry of compressor `name`; an unknown name is told what is allowed."""
    return _entry(COMPRESSORS, "compressor.kind", name)
