"""Links that replay recorded traces, from the one place every link change goes through.

A scenario's traced links (`topology.links[].trace`, `Scenario.traces`) are replayed by one
thread per placement: the namespace cluster's for every traced link, a Compose node's for the
links into its worker. Each window boundary of each trace, the links whose profile changes
there get it through `ShapedNetwork.set_links` (all that change at one instant in one call):
the same lock and the same in-place change of the kernel's qdisc as a timeline's `set_link`,
so the queue is kept and no moment is unshaped, and a cut link stays cut. Window k of a trace
is due at origin + k * its resolution on the monotonic clock, so lateness never adds up; a
change that overruns whole windows skips to the window that is due. A trace that does not loop
puts the link back to its profile at its end.

The profiles are built and checked once, before the first change (`Schedule.profiles`, on top
of the link's profile as the run starts): a timeline `set_link` on a traced link lasts until
the trace's next change of that link.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from netem.profile import LinkProfile
from testbed.cluster.shaped import ShapedNetwork
from testbed.scenario.links import Pair
from testbed.scenario.topology import LinkTrace


@dataclass(frozen=True)
class _Traced:
    """One traced link: its profiles (the last is its own, for after a trace that ends) and
    which of them each window sets."""

    pair: Pair
    trace: LinkTrace
    profiles: list[LinkProfile]
    windows: np.ndarray  # int: an index into profiles, per window


class LinkReplay:
    """Replay `traces` (directed link -> its trace) on `network`, from `start` until `stop`.
    `on_change(pairs, lateness)` hears of every change made (for the run's records); a change
    that fails ends the replay, and `stop` raises its error once the links are left as they
    are (the network's own clean-up removes them)."""

    def __init__(self, network: ShapedNetwork, traces: Mapping[Pair, LinkTrace], *,
                 on_change: Callable[[list[Pair], float], None] = lambda pairs, late: None
                 ) -> None:
        self.network = network
        self.on_change = on_change
        self._links: list[_Traced] = []
        for pair, trace in sorted(traces.items()):
            own = network.links.current(*pair)
            profiles, windows = trace.schedule().profiles(own)
            self._links.append(_Traced(pair, trace, [*profiles, own], windows))
        self.lateness: list[float] = []  # of each change, in order
        self.skipped = 0  # windows passed over because a change before them overran
        self.error: BaseException | None = None
        self.origin: float | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def __bool__(self) -> bool:
        return bool(self._links)

    def profiles(self) -> list[LinkProfile]:
        """Every profile the replay may set (each traced link's windows', and its own)."""
        return [profile for link in self._links for profile in link.profiles]

    def start(self, elapsed: float = 0.0) -> LinkReplay:
        """Set every traced link's window now, and replay the rest on a thread. `elapsed`:
        seconds since the replay's time zero (a Compose worker that rejoins a running run
        joins its traces where the others are)."""
        self.origin = time.monotonic() - max(elapsed, 0.0)
        now = time.monotonic() - self.origin
        first = [int(now // link.trace.resolution) for link in self._links]
        current = {link.pair: self._wanted(link, index)
                   for link, index in zip(self._links, first, strict=True)}
        if current:
            self.network.set_links({link.pair: link.profiles[current[link.pair]]
                                    for link in self._links})
        self._thread = threading.Thread(target=self._run, args=(self.origin, first, current),
                                        daemon=True, name="link replay")
        self._thread.start()
        return self

    @staticmethod
    def _wanted(link: _Traced, index: int) -> int:
        """Which of the link's profiles window `index` sets: the trace's, looping, or the
        link's own once a trace that does not loop has ended."""
        count = len(link.windows)
        if index >= count and not link.trace.loop:
            return len(link.profiles) - 1
        return int(link.windows[index % count])

    def stop(self) -> None:
        """End the replay (idempotent); raises the error of a change that failed."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def summary(self) -> dict[str, Any]:
        """What the replay did, for the run's records: the traced links, the changes made,
        the windows skipped and how late the changes were (seconds)."""
        late = np.array(self.lateness) if self.lateness else np.zeros(1)
        return {"links": [f"{s}->{d}" for (s, d) in (link.pair for link in self._links)],
                "traces": sorted({link.trace.file for link in self._links}),
                "changes": len(self.lateness), "skipped": self.skipped,
                "late_mean_seconds": float(late.mean()),
                "late_p99_seconds": float(np.percentile(late, 99)),
                "late_max_seconds": float(late.max())}

    def _run(self, origin: float, first: list[int], current: dict[Pair, int]) -> None:
        # (when window `index` of link `number` is due, index, number): one heap for all.
        due = [(origin + (index + 1) * link.trace.resolution, index + 1, number)
               for number, (link, index) in enumerate(zip(self._links, first, strict=True))
               if link.trace.loop or index < len(link.windows)]
        heapq.heapify(due)
        try:
            while due:
                when = due[0][0]
                if self._stopping.wait(max(0.0, when - time.monotonic())):
                    return
                now = time.monotonic()
                changes: dict[Pair, LinkProfile] = {}
                while due and due[0][0] <= now:
                    _, index, number = heapq.heappop(due)
                    link = self._links[number]
                    step, count = link.trace.resolution, len(link.windows)
                    reached = int((now - origin) // step)
                    if reached > index:  # a change before overran whole windows
                        self.skipped += reached - index
                        index = reached
                    wanted = self._wanted(link, index)
                    if link.trace.loop or index < count:  # else: ended, at its own profile
                        heapq.heappush(due, (origin + (index + 1) * step, index + 1, number))
                    if wanted != current[link.pair]:
                        changes[link.pair] = link.profiles[wanted]
                        current[link.pair] = wanted
                if changes:
                    self.network.set_links(changes)
                    late = time.monotonic() - when
                    self.lateness.append(late)
                    self.on_change(sorted(changes), late)
        except BaseException as error:  # handed to whoever stops the replay
            self.error = error
