"""Where each peer's datagrams must come from: a datagram is taken only from the address
registered for the sender its header names.

A header is whatever its writer chose, and anyone who can reach a worker's port can write one
naming any rank. The receive ring keeps each datagram's source address (its C sockaddr,
`mmsg.ReceiveRing.names`); this table holds the sockaddr registered for each rank and checks a
whole batch with numpy: one gather and one comparison, however many datagrams. It also says
which peer an address belongs to, so what is refused is counted against the peer that really
sent it (or `UNKNOWN_PEER`). Family, port and address are compared (for IPv6 not the flow label
or the scope). No torch here.
"""

from __future__ import annotations

import numpy as np

from testbed.transport.counters import UNKNOWN_PEER

# The sockaddr bytes compared: sockaddr_in's family, port and address (the rest is zero);
# sockaddr_in6's family and port, then (past the flow label) its 16-byte address.
_IPV4 = np.arange(8)
_IPV6 = np.r_[0:4, 8:24]


class SourceTable:
    """The registered source address of each rank, for one endpoint's address family."""

    def __init__(self, *, ipv6: bool) -> None:
        self._columns = _IPV6 if ipv6 else _IPV4
        width = len(self._columns)
        self._key = np.dtype(f"S{width}")  # an address as one fixed-width string: sortable
        self._names: dict[int, bytes] = {}
        # Row r: rank r's address; the last row is never registered, for senders beyond.
        self._rows = np.zeros((1, width), dtype=np.uint8)
        self._known = np.zeros(1, dtype=bool)
        self._sorted = np.zeros(0, dtype=self._key)  # registered addresses, sorted
        self._owners = np.zeros(0, dtype=np.int64)  # the (lowest) rank at each of them

    def add(self, rank: int, name: bytes) -> None:
        """Register `rank`'s address (its C sockaddr, as `mmsg.sockaddr` makes it); a rank
        registered before moves."""
        self._names[rank] = name
        size = max(self._names) + 2
        self._rows = np.zeros((size, len(self._columns)), dtype=np.uint8)
        self._known = np.zeros(size, dtype=bool)
        for each, each_name in self._names.items():
            self._rows[each] = np.frombuffer(each_name, dtype=np.uint8)[self._columns]
            self._known[each] = True
        keys = self._keys(self._rows[self._known])
        ranks = np.flatnonzero(self._known)
        order = np.lexsort((ranks, keys))
        keys, ranks = keys[order], ranks[order]
        first = np.ones(len(keys), dtype=bool)
        first[1:] = keys[1:] != keys[:-1]
        self._sorted, self._owners = keys[first], ranks[first]

    def registered(self, senders: np.ndarray, names: np.ndarray) -> np.ndarray:
        """Whether each datagram came from the address registered for its sender: `senders`
        from the headers, `names` the ring's sockaddr rows (k, NAME_BYTES), a bool each."""
        rows = np.minimum(senders, len(self._known) - 1)
        return self._known[rows] & (names[:, self._columns] == self._rows[rows]).all(axis=1)

    def owners(self, names: np.ndarray) -> np.ndarray:
        """The rank registered at each datagram's source address (the lowest, if several
        share one), or UNKNOWN_PEER."""
        if not len(self._sorted):
            return np.full(len(names), UNKNOWN_PEER, dtype=np.int64)
        keys = self._keys(names[:, self._columns])
        at = np.minimum(np.searchsorted(self._sorted, keys), len(self._sorted) - 1)
        return np.where(self._sorted[at] == keys, self._owners[at], UNKNOWN_PEER)

    def _keys(self, addresses: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(addresses).view(self._key)[:, 0]
