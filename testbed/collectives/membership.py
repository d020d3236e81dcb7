"""Who takes part in a Moshpit run and where to reach them, kept in torch.distributed's TCPStore.

Every peer writes one key, `moshpit/<run>/member/<rank>` = "<incarnation> <host> <port> <beat>",
and rewrites it every `heartbeat` seconds with the next beat. A reader judges freshness by its
own clock: a member is alive while its value changed within `expiry` seconds of the reader
seeing it change, so no two hosts' clocks are ever compared. A peer that leaves writes "left"
(only over its own value, so a slow close cannot erase the registration of its successor); a
restarted peer registers again under the same rank with a new incarnation.

The store lives in the process that hosts it (rank 0 by default, or a launcher): it must
outlive the run, as torch.distributed's does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from torch.distributed import TCPStore

LEFT = "left"
T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One registration: a new process of the same rank is a new incarnation."""

    rank: int
    incarnation: int
    address: tuple[str, int]

    def encode(self) -> str:
        return f"{self.incarnation} {self.address[0]} {self.address[1]}"

    @classmethod
    def decode(cls, rank: int, text: str) -> Member | None:
        """The member `encode` wrote; None for anything else (network input is untrusted)."""
        fields = text.split()
        if len(fields) != 3:
            return None
        try:
            return cls(rank, int(fields[0]), (fields[1], int(fields[2])))
        except ValueError:
            return None


def host_store(address: tuple[str, int], timeout: float = 30.0) -> TCPStore:
    """Serve a store on `address` (port 0: any free port, see `.port`) until dropped."""
    return TCPStore(address[0], address[1], is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout))


class Membership:
    """This peer's registration, its heartbeat thread, and its view of who is alive."""

    def __init__(
        self,
        rank: int,
        world: int,
        store: tuple[str, int],
        *,
        run_id: int = 0,
        serve: bool = False,
        heartbeat: float = 1.0,
        expiry: float | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Connect to the store at `store` (or serve it there with `serve`); `expiry` defaults
        to four heartbeats, so one late beat on a busy host is no death."""
        if not 0 <= rank < world:
            raise ValueError(f"rank: expected 0..{world - 1}, got {rank}")
        if heartbeat <= 0:
            raise ValueError(f"heartbeat: needs a positive period in seconds, got {heartbeat}")
        self.rank, self.world, self.heartbeat = rank, world, heartbeat
        self.expiry = 4 * heartbeat if expiry is None else expiry
        if self.expiry <= heartbeat:
            raise ValueError(f"expiry: {self.expiry} s must exceed the heartbeat ({heartbeat} s)")
        self._serving = serve
        self._store = (host_store(store, timeout) if serve else
                       TCPStore(store[0], store[1], is_master=False,
                                timeout=timedelta(seconds=timeout)))
        self._keys = [f"moshpit/{run_id}/member/{peer}" for peer in range(world)]
        # One client connection: requests from the heartbeat thread and the caller take turns.
        # The view has a lock of its own, so reading it never waits for a slow store.
        self._store_lock = threading.Lock()
        self._view_lock = threading.Lock()
        for key in self._keys:  # make every key exist, so multi_get never waits for one
            self._store.compare_set(key, "", "")
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (value, when it last changed)
        self._value = ""
        self._beat = 0
        self._reachable = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, member: Member) -> None:
        """Announce this peer and keep announcing it until `close`."""
        self._announce = member.encode()
        self._tick()
        self._thread = threading.Thread(target=self._run, name=f"moshpit-{self.rank}-heartbeat",
                                        daemon=True)
        self._thread.start()

    def alive(self) -> dict[int, Member]:
        """The members whose heartbeat is fresh, this one included once registered."""
        now = time.monotonic()
        with self._view_lock:
            seen = dict(self._seen)
        members = {}
        for rank, (value, changed) in seen.items():
            member = _parse(rank, value)
            if member is not None and (rank == self.rank or now - changed < self.expiry):
                members[rank] = member
        return members

    def wait_registered(self, ranks: Iterable[int], timeout: float) -> set[int]:
        """Poll the store until every rank has registered at least once (a rendezvous that a
        rejoining peer passes at once); the ranks that had not when `timeout` ran out."""
        deadline = time.monotonic() + timeout
        ranks = set(ranks)
        while True:
            self._read()
            with self._view_lock:
                missing = {rank for rank in ranks if not self._seen.get(rank, ("", 0.0))[0]}
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(min(0.05, self.heartbeat))

    def close(self) -> None:
        """Stop beating and say "left" (if the key is still ours); idempotent. The host of the
        store first lingers, up to one expiry, for the others to leave, as the store goes with
        it."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._request(self._store.compare_set, self._keys[self.rank], self._value, LEFT)
        deadline = time.monotonic() + self.expiry
        while self._serving and set(self.alive()) - {self.rank} and time.monotonic() < deadline:
            time.sleep(self.heartbeat)
            self._read()
        del self._store

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat):
            self._tick()

    def _tick(self) -> None:
        """One beat: write our value with the next count, then read everyone's."""
        self._beat += 1
        self._value = f"{self._announce} {self._beat}"
        self._request(self._store.set, self._keys[self.rank], self._value)
        self._read()

    def _read(self) -> None:
        raw = self._request(self._store.multi_get, self._keys)
        if raw is None:  # keep the last view: it goes stale and the peers expire
            return
        now = time.monotonic()
        with self._view_lock:
            for rank, value in enumerate(item.decode() for item in raw):
                if self._seen.get(rank, ("", 0.0))[0] != value:
                    self._seen[rank] = (value, now)

    def _request(self, call: Callable[..., T], *args: object) -> T | None:
        """A store request; None if the store is unreachable (said once, not every beat)."""
        try:
            with self._store_lock:
                result = call(*args)
        except RuntimeError as exc:  # torch's DistStoreError and DistNetworkError
            if self._reachable:
                first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("rank %d: membership store unreachable: %s", self.rank, first_line)
            self._reachable = False
            return None
        if not self._reachable:
            log.warning("rank %d: membership store reachable again", self.rank)
        self._reachable = True
        return result


def _parse(rank: int, value: str) -> Member | None:
    """The member a key's value announces; None for "never registered", "left" or garbage."""
    announced, _, beat = value.rpartition(" ")
    return Member.decode(rank, announced) if beat.isdigit() else None
