"""The workers' meeting point, the run's store (a torch TCPStore), apart from the collective so
that a lossy one still gets exact figures.

`PeerExchange` does what must happen before training goes on: the start barrier, and for a
worker that rejoins, the others' progress and their parameters. `FigureRelay` does what happens
while training runs, on a thread of its own over a connection of its own: this worker's
progress, its parameters for a worker that rejoins, and every worker's figures of a step (the
drift sketch and compute times). The training loop only hands it values and never waits on the
store: a peer that is killed, late, or behind a lossy link (the store's TCP crosses the shaped
links) holds no step up, so the workers stay exactly as coupled as their collective makes them.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from testbed.cluster.worker import WorkerSpec

# Seconds the relay keeps looking for the other workers' figures of a step after posting its
# own; a step some worker never posts (killed by the timeline) is then given up. Off the
# training path, so it bounds only how long the end of a run waits for the last figures.
FIGURES_WAIT = 10.0
RELAY_POLL = 0.05  # seconds between the relay's looks at the store while figures are due
STORE_TIMEOUT = datetime.timedelta(seconds=60)  # one store operation


def serve_run_store(host: str, port: int) -> Any:
    """The run's store (a torch TCPStore), served by the calling thread's network namespace
    for as long as the returned object lives. The runner serves it from worker 0's namespace,
    so it outlives any worker: one that ends or is killed first takes nothing with it."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


def _client(spec: WorkerSpec, timeout: datetime.timedelta = STORE_TIMEOUT) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(spec.run_store or spec.hosts[0], spec.port("drift", 0), is_master=False,
                    timeout=timeout)


class PeerExchange:
    """What a worker asks of the others before it trains: the start barrier, and for a worker
    that rejoins, how far the others got and their parameters."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.store = _client(spec)

    def barrier(self, name: str, timeout: float) -> None:
        """Return once every worker reached barrier `name`; raise naming the workers that did
        not within `timeout` seconds."""
        self.store.set(f"{name}/{self.spec.rank}", b"1")
        keys = [f"{name}/{rank}" for rank in range(self.spec.world)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout))
        except RuntimeError:  # a timeout: c10d raises DistStoreError, a RuntimeError
            absent = [rank for rank in range(self.spec.world)
                      if not self.store.check([f"{name}/{rank}"])]
            raise RuntimeError(f"workers {absent} did not reach {name!r} within {timeout:g} s "
                               f"(see their logs)") from None

    def request_parameters(self, timeout: float) -> tuple[int, Any] | None:
        """A rejoining worker asks the live ones for their parameters (for collectives that
        cannot hand them over themselves): (the step the sender had finished, its flat
        parameter vector), or None if no live worker answered within `timeout` seconds."""
        import torch

        number = self.store.add("parameters/asked", 1)
        try:
            self.store.wait([f"parameters/{number}"], datetime.timedelta(seconds=timeout))
        except RuntimeError:  # a timeout: c10d raises DistStoreError, a RuntimeError
            return None
        reply = bytearray(self.store.get(f"parameters/{number}"))
        step = int.from_bytes(reply[:8], "big", signed=True)
        return step, torch.frombuffer(reply[8:], dtype=torch.float32)

    def progress(self) -> int:
        """The last step the most advanced other worker finished (-1: none yet)."""
        keys = [f"progress/{rank}" for rank in range(self.spec.world) if rank != self.spec.rank]
        return max((int(self.store.get(key)) for key in keys if self.store.check([key])),
                   default=-1)


class FigureRelay:
    """This worker's side of the store while it trains, on a thread of its own.

    `post_figures(step, values)` posts this worker's figures of `step` (a float64 tensor) and
    returns at once; once every worker's figures of that step are in the store, the relay calls
    `on_rows(step, rows)` on its thread with them by rank, or `on_rows(step, None)` if some
    worker's did not come within FIGURES_WAIT. With `rejoinable` (a timeline restarts workers)
    it also posts this worker's progress (`post_progress`) and watches for parameter requests
    made from now on: `parameters_wanted` turns true, and the training loop hands the
    parameters over between two steps (`answer_parameters`). `close()` waits for the figures
    still due (bounded by their deadlines), then ends the thread."""

    def __init__(self, spec: WorkerSpec, on_rows: Callable[[int, dict[int, Any] | None], None],
                 *, rejoinable: bool) -> None:
        self.spec, self.on_rows, self.rejoinable = spec, on_rows, rejoinable
        # A store call slower than this (the store's TCP behind a lossy link, or gone) ends the
        # relay rather than outlasting `close`.
        self.store = _client(spec, datetime.timedelta(seconds=FIGURES_WAIT))
        # Requests for parameters made before now are not this worker's to answer.
        self._answered = self.store.add("parameters/asked", 0) if rejoinable else 0
        self.parameters_wanted = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._progress: int | None = None
        self._answer: tuple[int, Any] | None = None
        self._posts: deque[tuple[int, bytes]] = deque()
        self._due: deque[tuple[int, float]] = deque()  # (step, deadline), oldest first
        self._closing = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="figure-relay", daemon=True)
        self._thread.start()

    def post_progress(self, step: int) -> None:
        """This worker finished `step` (what a rejoining worker reads); only the latest counts."""
        with self._lock:
            self._progress = step
        self._wake.set()

    def answer_parameters(self, step: int, vector: Any) -> None:
        """This worker's flat parameters after `step`, for the requests pending."""
        with self._lock:
            self._answer = (step, vector)
            self.parameters_wanted = False
        self._wake.set()

    def post_figures(self, step: int, values: Any) -> None:
        """This worker's figures of `step` (a float64 tensor); returns at once."""
        with self._lock:
            self._posts.append((step, values.numpy().tobytes()))
        self._wake.set()

    def close(self) -> None:
        """Wait for the figures still due (each until its deadline), then end the thread."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=FIGURES_WAIT + 5.0)
        if self.error is not None:
            print(f"worker {self.spec.rank}: the run's store failed, figures stopped: "
                  f"{self.error}", file=sys.stderr)

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(RELAY_POLL if (self._due or self.rejoinable) else None)
                self._wake.clear()
                with self._lock:
                    progress, self._progress = self._progress, None
                    answer, self._answer = self._answer, None
                    posts = list(self._posts)
                    self._posts.clear()
                if progress is not None:
                    self.store.set(f"progress/{self.spec.rank}", str(progress))
                if answer is not None:
                    self._send_parameters(*answer)
                for step, value in posts:
                    self.store.set(f"{step}/{self.spec.rank}", value)
                    self._due.append((step, time.monotonic() + FIGURES_WAIT))
                self._collect()
                if self.rejoinable and not self._closing:
                    asked = self.store.add("parameters/asked", 0)
                    self.parameters_wanted = asked > self._answered
                if self._closing and not self._due and not self._posts:
                    return
        except BaseException as error:  # the store went away: figures stop, training goes on
            self.error = error

    def _collect(self) -> None:
        """Hand over the steps whose figures are all in, oldest first; give up those past their
        deadline."""
        import torch

        while self._due:
            step, deadline = self._due[0]
            keys = [f"{step}/{rank}" for rank in range(self.spec.world)]
            if self.store.check(keys):
                rows = {rank: torch.frombuffer(bytearray(self.store.get(key)),
                                               dtype=torch.float64)
                        for rank, key in enumerate(keys)}
            elif time.monotonic() >= deadline:
                rows = None
            else:
                return
            self._due.popleft()
            self.on_rows(step, rows)

    def _send_parameters(self, step: int, vector: Any) -> None:
        """Answer the requests made since the last look (the first live worker to claim one
        answers it)."""
        import torch

        asked = self.store.add("parameters/asked", 0)
        while self._answered < asked:
            self._answered += 1
            key = f"parameters/{self._answered}"
            claim = self.store.compare_set(f"{key}/by", "", str(self.spec.rank))
            if claim.decode() == str(self.spec.rank):
                data = vector.detach().to(dtype=torch.float32).contiguous().numpy().tobytes()
                self.store.set(key, step.to_bytes(8, "big", signed=True) + data)
