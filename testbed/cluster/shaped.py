"""A placement's network as the timeline and the tests see it: link state (`links`, the pure
`testbed.scenario.links.LinkState`) and a kernel that follows it (`shape`). The namespace
cluster (`network.ClusterNetwork`) and a Compose node (`node.IngressLinks`) differ only in how
they shape."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from netem.profile import LinkProfile
from testbed.scenario.links import LinkState, Pair


class ShapedNetwork:
    """`links` with the kernel kept in line: every change updates the state, then `shape`s the
    links it touched, under one lock (the timeline's scheduler thread and the runner may change
    links at once). Each change returns the seconds the kernel took."""

    def __init__(self, links: LinkState) -> None:
        self.links = links
        self._lock = threading.RLock()

    def shape(self, touched: set[Pair]) -> float:
        """Make the kernel carry what `links` says on these links; returns seconds."""
        raise NotImplementedError

    def set_links(self, changes: Mapping[Pair, LinkProfile]) -> float:
        """Give these links these profiles (a cut link stays cut: `heal` restores it)."""
        with self._lock:
            return self.shape(self.links.set(changes))

    def set_link(self, src: int, dst: int, profile: LinkProfile) -> float:
        return self.set_links({(src, dst): profile})

    def partition(self, pairs: Iterable[Pair]) -> float:
        """Cut these directed links (100% loss)."""
        with self._lock:
            return self.shape(self.links.cut_links(pairs))

    def heal(self, pairs: Iterable[Pair] | None = None) -> float:
        """Restore these cut links (None: every one) to their current profile."""
        with self._lock:
            return self.shape(self.links.heal_links(pairs))

    def apply(self, event: Any) -> tuple[set[Pair], float]:
        """A timeline event's link action (set_link, partition, heal): the links it touched and
        the seconds the kernel took."""
        with self._lock:
            touched = self.links.apply(event)
            return touched, self.shape(touched)
