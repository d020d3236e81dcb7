"""Replay a schedule on one interface: its profiles set in place, window by window.

The first window goes through `netem.change`, which builds the tree (or changes the one there in
place); every later one through the in-place half of the same path (`carry_out` with
`change=True`: netem's own `change`, or the fallback's htb class and nft rule), without reading
the tree back, since the replay made it and every profile it sets has the same layout: the queue
is kept and there is no moment unshaped. A thread sets window k at start + k * resolution on
the monotonic clock, so lateness never adds up; a change that overruns whole windows skips to
the window that is due. `stop` puts back what the interface had before.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from netem.backend import carry_out, change, clear, installed, usable
from netem.lifecycle import StartsOnEnter
from netem.plan import Direction, Plan, build_plan
from netem.profile import LinkProfile
from netem.trace.schedule import Schedule


@dataclass(frozen=True)
class Lateness:
    """How late the changes reached the kernel after their deadlines (seconds)."""

    changes: int
    skipped: int  # windows passed over because a change before them overran
    mean: float
    p99: float
    max: float


class Replay(StartsOnEnter, close="stop"):
    """Replay `schedule` on top of `base_profile` as the only rule of `iface` (in `netns`),
    looping unless `loop` is False; `with` starts it and stops it. The profiles are all
    checked against the backend (the fallback does rate, loss and limit only) before anything
    is touched."""

    def __init__(
        self,
        iface: str,
        base_profile: LinkProfile,
        schedule: Schedule,
        netns: str | None = None,
        loop: bool = True,
        *,
        direction: Direction = "egress",
        backend: Literal["auto", "netem", "fallback"] = "auto",
    ) -> None:
        self.iface, self.netns, self.loop = iface, netns, loop
        self.schedule, self.direction, self.backend = schedule, direction, backend
        self.profiles, self.windows = schedule.profiles(base_profile)
        self.lateness: list[float] = []  # of each change, in order
        self.skipped = 0
        self.error: BaseException | None = None
        self.origin: float | None = None  # monotonic time window 0 started
        self._before: Plan | None = None
        self._plans: list[Plan] = []  # of each profile, as the backend installs it
        self._started = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Replay:
        """Set the first window's profile and replay the rest on a thread."""
        backend = usable(self.backend)
        self._plans = [build_plan(self.iface, profile, direction=self.direction, backend=backend)
                       for profile in self.profiles]
        self._before = installed(self.iface, netns=self.netns)
        self._started = True
        change(self.iface, self.profiles[int(self.windows[0])], netns=self.netns,
               direction=self.direction, backend=backend)
        self.origin = time.monotonic()  # window 0 starts once the kernel has it
        self._thread = threading.Thread(target=self._run, args=(self.origin,), daemon=True,
                                        name=f"replay {self.iface}")
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the trace's end (never, when it loops); True once it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def stop(self) -> None:
        """End the replay and put back what the interface had (nothing: cleared). Idempotent.
        Raises the replay's own error, if a change failed, once the interface is restored."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        if self._started:
            self._started = False
            if self._before is None:
                clear(self.iface, netns=self.netns)
            else:
                change(self.iface, self._before.as_rules(), netns=self.netns,
                       direction=self._before.direction, backend=self._before.backend)
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    @property
    def late(self) -> Lateness:
        """The lateness of the changes so far."""
        late = np.array(self.lateness) if self.lateness else np.zeros(1)
        return Lateness(len(self.lateness), self.skipped, float(late.mean()),
                        float(np.percentile(late, 99)), float(late.max()))

    def _run(self, origin: float) -> None:
        step, count = self.schedule.resolution, self.schedule.windows
        current, window = int(self.windows[0]), 1
        try:
            while self.loop or window < count:
                deadline = origin + window * step
                if self._stopping.wait(max(0.0, deadline - time.monotonic())):
                    return
                due = int((time.monotonic() - origin) // step)
                if due > window:
                    self.skipped += due - window
                    window, deadline = due, origin + due * step
                    if not self.loop and window >= count:
                        break
                wanted = int(self.windows[window % count])
                if wanted != current:
                    carry_out(self._plans[wanted], self.netns, change=True)
                    self.lateness.append(time.monotonic() - deadline)
                    current = wanted
                window += 1
            self._stopping.wait(max(0.0, origin + count * step - time.monotonic()))
        except BaseException as error:  # handed to whoever stops the replay
            self.error = error
