"""What a collective kind can do, declared, never discovered: the registry declares each kind's
`Capabilities` here as it registers the kind, and `CollectiveBase` reads them by the
collective's name. A leaf (it imports nothing of the testbed), so that the contract
(`base.py`) need not import the registry that imports it.

A collective no registry entry declares (a user's own, deriving from `CollectiveBase` or not)
has `UNDECLARED`: nothing beyond the contract, which is what a caller may assume of a
collective it knows nothing of."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a collective kind can do, declared once in its registry entry; scenario checks,
    the worker and the compression layer read these, never a kind's name."""

    exact: bool = False  # every worker gets the same, exact mean
    sharded_step: bool = False  # owns the update of its shards (`ShardedStep`: strategy sharded)
    takes_back: bool = False  # a restarted worker can rejoin the running collective
    reliable_exchange: bool = False  # offers compressors a reliable neighbour exchange
    datagrams: bool = False  # moves data as datagrams (`endpoint`: per-peer datagram counters)
    # proves the run's key on every socket of its own (datagram MACs, TCP hellos): `key`
    authenticates: bool = False


# The conservative defaults: an inexact mean (compressors that agree on a pattern need a
# reliable exchange, which it does not offer either), no owners' update, no rejoin, no
# datagram counters, no proof of the run's key.
UNDECLARED = Capabilities()

_DECLARED: dict[str, Capabilities] = {}


def declare(name: str, capabilities: Capabilities) -> None:
    """Collective `name` has `capabilities` (the registry's `register` declares every kind)."""
    _DECLARED[name] = capabilities


def declared(name: str) -> Capabilities:
    """The capabilities of collective `name`: its declaration, else `UNDECLARED`."""
    return _DECLARED.get(name, UNDECLARED)
