"""The fault timeline: a scenario's events turned into actions at the right moments.

Events `at` a time run on a scheduler thread against a monotonic clock whose zero is
`Timeline.start()` (training starts); events at a `step` run when the runner calls
`on_step(step)` before that step starts (it knows the slowest worker's step). Link actions go to
the placement's `ShapedNetwork` (what they do to the links is `LinkState`'s); kill, restart and
straggler bursts go to the runner's callbacks, since the workers are the runner's. Every event,
and every update of a ramp, is reported through `on_event(record)` once it took effect, with
when it was due, when it happened and how late: `RunWriter.fault(**record)` writes it to
`events.jsonl`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from netem.profile import LinkProfile
from testbed.cluster.shaped import ShapedNetwork
from testbed.scenario.links import Pair
from testbed.scenario.timeline import Event, RampLink

MAX_WAIT = 0.5  # the scheduler looks at the clock at least this often (seconds)


@dataclass(order=True)
class _Due:
    """A time-based item of the schedule: an event, or one update of a running ramp."""

    when: float  # seconds since start
    order: int
    run: Callable[[float], None] = field(compare=False)  # called with the scheduled time


@dataclass
class _Ramp:
    event: Event
    index: int
    start: dict[Pair, LinkProfile]  # each link's profile when the ramp started
    origin: float  # when elapsed = 0, seconds since start
    updates: int  # after the first, at origin + k * every (the last at origin + over)


class Timeline:
    """Runs `events` (a scenario's `timeline`) against `network`.

    `on_event(record)` gets one dict per event and per ramp update, ready for
    `RunWriter.fault(**record)`: `action`, `scheduled` and `t` (seconds on the run's time axis:
    the timeline's zero plus `start(offset=...)`), `late` (seconds the change took effect after
    it was due), `at` or `step`, `description`, `index` (in the timeline), and what changed
    (`link`, `pairs`, `profiles`, `workers`, `apply_seconds`, `error` if it failed).

    `on_kill(workers)`, `on_restart(workers)` and `on_straggler_burst(event)` carry out the
    worker faults. `clock` is monotonic seconds (a fake one in tests, driving `poll()`).
    """

    def __init__(
        self,
        events: Sequence[Event],
        network: ShapedNetwork,
        on_event: Callable[[dict[str, Any]], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        on_kill: Callable[[list[int]], None] | None = None,
        on_restart: Callable[[list[int]], None] | None = None,
        on_straggler_burst: Callable[[Event], None] | None = None,
    ) -> None:
        self.events = list(events)
        self.network = network
        self.on_event = on_event
        self.clock = clock
        self.on_kill, self.on_restart = on_kill, on_restart
        self.on_straggler_burst = on_straggler_burst
        self.records: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self._origin: float | None = None
        self._offset = 0.0
        self._order = itertools.count()
        self._queue: list[_Due] = []
        self._steps = sorted((e.step, i) for i, e in enumerate(self.events) if e.step is not None)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        for i, event in enumerate(self.events):
            if event.at is not None:
                heapq.heappush(self._queue, _Due(event.at, next(self._order),
                                                 self._runner(i, event)))

    # -- running

    def start(self, *, offset: float = 0.0, thread: bool = True,
              origin: float | None = None) -> None:
        """Training starts now: time zero of every `at`. `offset`: where that zero lies on the run's
        time axis (`RunWriter.now()` at this moment), added to `t` and `scheduled` in the records.
        `origin`: a clock reading that was time zero already (joining a running timeline: what
        was due by now runs at once). `thread=False` starts no scheduler: call `poll()` yourself
        (tests)."""
        with self._lock:
            if self._origin is not None:
                raise RuntimeError("the timeline has started already")
            self._origin = self.clock() if origin is None else origin
            self._offset = offset
        if thread:
            self._thread = threading.Thread(target=self._loop, name="fault-timeline", daemon=True)
            self._thread.start()

    def now(self) -> float:
        """Seconds since start."""
        if self._origin is None:
            raise RuntimeError("the timeline has not started")
        return self.clock() - self._origin

    def stop(self, timeout: float = 2.0) -> bool:
        """End the scheduler: nothing more runs (a running action finishes first). Returns whether
        the thread ended within `timeout` seconds."""
        self._stopped.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pending(self) -> int:
        """Time-based items (events, ramp updates) and step events not run yet."""
        with self._lock:
            return len(self._queue) + len(self._steps)

    def poll(self) -> float | None:
        """Run every time-based item that is due; return seconds until the next (None: none)."""
        while not self._stopped.is_set():
            with self._lock:
                if not self._queue:
                    return None
                wait = self._queue[0].when - self.now()
                if wait > 0:
                    return wait
                item = heapq.heappop(self._queue)
                item.run(item.when)
        return None

    def on_step(self, step: int) -> None:
        """Step `step` is about to start (on the slowest worker): run the events of every step up
        to it that have not run, in order."""
        while not self._stopped.is_set():
            with self._lock:
                if not self._steps or self._steps[0][0] > step:
                    return
                _, index = self._steps.pop(0)
                self._run_event(index, self.events[index], self.now())
            self._wake.set()  # a ramp may have scheduled updates

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                wait = self.poll()
            except BaseException as error:  # never let the scheduler die silently
                self.errors.append({"action": "scheduler", "error": repr(error)})
                wait = MAX_WAIT
            if self._stopped.is_set():
                return
            self._wake.wait(MAX_WAIT if wait is None else min(wait, MAX_WAIT))
            self._wake.clear()

    # -- actions

    def _runner(self, index: int, event: Event) -> Callable[[float], None]:
        return lambda scheduled: self._run_event(index, event, scheduled)

    def _run_event(self, index: int, event: Event, scheduled: float) -> None:
        record: dict[str, Any] = {"action": event.action, "index": index,
                                  "description": event.describe()}
        if event.at is not None:
            record["at"] = event.at
        else:
            record["step"] = event.step
        if event.note:
            record["note"] = event.note
        try:
            record.update(self._act(index, event, scheduled))
        except Exception as error:  # a failed fault is reported, the timeline goes on
            record["error"] = f"{type(error).__name__}: {error}"
        self._report(record, scheduled)

    def _act(self, index: int, event: Event, scheduled: float) -> dict[str, Any]:
        value = getattr(event, event.action)
        if event.action == "set_link":
            touched, seconds = self.network.apply(event)
            changes = {pair: self.network.links.current(*pair) for pair in touched}
            return {"link": value.link.describe(), **_changes(changes), "apply_seconds": seconds}
        if isinstance(value, RampLink):
            return self._start_ramp(index, event, value, scheduled)
        if event.action in ("partition", "heal"):
            touched, seconds = self.network.apply(event)
            return {"link": "|".join(value), "pairs": _pair_list(touched),
                    "apply_seconds": seconds}
        if event.action in ("kill", "restart"):
            handler = self.on_kill if event.action == "kill" else self.on_restart
            if handler is None:
                raise RuntimeError(f"no on_{event.action} handler was given to the timeline")
            handler(list(value))
            return {"workers": list(value), "rank": list(value)}
        if event.action == "straggler_burst":
            if self.on_straggler_burst is None:
                raise RuntimeError("no on_straggler_burst handler was given to the timeline")
            self.on_straggler_burst(event)
            burst = value
            return {"workers": list(burst.workers), "rank": list(burst.workers),
                    "delay_mean": burst.delay.mean_seconds, "duration": burst.duration,
                    "steps": burst.steps}
        raise ValueError(f"unknown action {event.action!r}")  # pragma: no cover

    def _start_ramp(self, index: int, event: Event, ramp: RampLink,
                    scheduled: float) -> dict[str, Any]:
        links = self.network.links
        start = links.ramp_start(ramp)
        # An event at a time ramps on the plan's clock; one at a step from when the step came.
        origin = scheduled if event.at is not None else self.now()
        updates = max(1, math.ceil(ramp.over / ramp.every - 1e-9))  # the last lands on `over`
        state = _Ramp(event, index, start, origin, updates)
        changes = links.ramp_profiles(ramp, start, 0.0)
        seconds = self.network.set_links(changes)
        for k in range(1, state.updates + 1):
            elapsed = min(k * ramp.every, ramp.over)
            heapq.heappush(self._queue, _Due(origin + elapsed, next(self._order),
                                             self._ramp_update(state, k, elapsed)))
        return {"link": ramp.link.describe(), "over": ramp.over, "every": ramp.every,
                "updates": state.updates, "elapsed": 0.0, **_changes(changes),
                "apply_seconds": seconds}

    def _ramp_update(self, ramp: _Ramp, k: int, elapsed: float) -> Callable[[float], None]:
        def run(scheduled: float) -> None:
            value = ramp.event.ramp_link
            record: dict[str, Any] = {"action": "ramp_step", "index": ramp.index,
                                      "description": ramp.event.describe(),
                                      "link": value.link.describe(), "update": k,
                                      "updates": ramp.updates, "elapsed": elapsed}
            try:
                changes = self.network.links.ramp_profiles(value, ramp.start, elapsed)
                record.update(_changes(changes))
                record["apply_seconds"] = self.network.set_links(changes)
            except Exception as error:
                record["error"] = f"{type(error).__name__}: {error}"
            self._report(record, scheduled)
        return run

    def _report(self, record: dict[str, Any], scheduled: float) -> None:
        actual = self.now()
        record["scheduled"] = round(scheduled + self._offset, 6)
        record["t"] = round(actual + self._offset, 6)
        record["late"] = round(actual - scheduled, 6)
        self.records.append(record)
        if "error" in record:
            self.errors.append(record)
        self.on_event(record)


def _pair_list(pairs: Iterable[Pair]) -> list[list[int]]:
    return [list(pair) for pair in sorted(pairs)]


def _changes(changes: Mapping[Pair, LinkProfile]) -> dict[str, Any]:
    """`pairs` and each link's new profile in human units (`profiles`, keyed "src->dst"); `set`
    when every link got the same one."""
    profiles = {f"{s}->{d}": profile.to_spec() for (s, d), profile in sorted(changes.items())}
    result: dict[str, Any] = {"pairs": _pair_list(changes), "profiles": profiles}
    distinct = {str(sorted(spec.items())) for spec in profiles.values()}
    if len(distinct) == 1:
        result["set"] = next(iter(profiles.values()))
    return result
