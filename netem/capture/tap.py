"""Capturing links: a tap per capture point (a ring and a thread that drains it into a bounded
pcap file), two taps per link (where the sender puts frames on the wire, where the receiver
takes them off), and the record of what was captured (`capture.json`).

    with LinkCapture("run/capture", snap=128, max_bytes=20_000_000) as capture:
        capture.add_lab_link(lab, 0, 1)            # 0-1.sent.pcap, 0-1.received.pcap
        capture.start()
        ...                                         # traffic
    flows = analyse("run/capture")                  # netem.capture.flows

Every tap's socket is made inside its namespace and its thread writes only its own file, so
the taps need no lock between them. `close` stops the senders' taps first and the receivers'
`settle` seconds later (frames still crossing the link when the traffic ended are received,
not lost), ends every thread, closes every file and writes `capture.json`; it is idempotent and
safe on any path out (an exception, Ctrl-C).
"""

from __future__ import annotations

import json
import select
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from netem.capture.flows import MANIFEST
from netem.capture.pcap import BoundedPcap, PcapStats
from netem.capture.ring import Frame, Ring

POLL_MS = 100  # how long a tap's thread waits for the kernel before looking at its stop flag
JOIN_TIMEOUT = 5.0  # seconds `close` waits for a tap's thread


class Source(Protocol):
    """What a tap drains: a ring (or, in tests, anything that behaves like one)."""

    retire_ms: int

    def fileno(self) -> int: ...
    def frames(self) -> Iterator[Frame]: ...
    def skip(self) -> int: ...
    def statistics(self) -> tuple[int, int]: ...
    def close(self) -> None: ...


@dataclass
class TapStats:
    """One capture point after its end: where, its file's bounds, and what the kernel counted
    (`kernel_seen` frames through the filter, `kernel_drops` frames the ring had no room for)."""

    file: str
    netns: str | None
    iface: str
    packets: int = 0
    seen: int = 0
    bytes: int = 0
    truncated: bool = False
    cut: float | None = None
    kernel_seen: int = 0
    kernel_drops: int = 0
    error: str | None = None


class Tap:
    """One capture point: a `source` (a `Ring`) drained by a thread of its own into a
    `BoundedPcap` at `path`. `start` once, `stop` (idempotent) ends the thread after a last
    drain and closes the ring and the file."""

    def __init__(self, source: Source, path: str | Path, *, snap: int, max_bytes: int,
                 netns: str | None = None, iface: str = "") -> None:
        self.source = source
        self.path = Path(path)
        self.netns, self.iface = netns, iface
        self.pcap = BoundedPcap(self.path, snap=snap, max_bytes=max_bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain_until_stopped, daemon=True,
                                        name=f"capture {self.path.name}")
        self.error: str | None = None
        self._closed = False
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _drain_until_stopped(self) -> None:
        poller = select.poll()
        poller.register(self.source.fileno(), select.POLLIN | select.POLLERR)
        try:
            while not self._stop.is_set():
                poller.poll(POLL_MS)
                self._drain()
            # A block that is not full is handed over `retire_ms` after its first frame.
            deadline = time.monotonic() + 2 * self.source.retire_ms / 1000 + 0.02
            while (left := deadline - time.monotonic()) > 0:
                poller.poll(max(1, int(left * 1000)))
                self._drain()
        except Exception as exc:  # the interface went away, the disk is full: say so
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._close_files()

    def _drain(self) -> None:
        pcap = self.pcap
        if pcap.stats.truncated:
            pcap.skipped(self.source.skip())
            return
        before = pcap.stats.packets
        for frame in self.source.frames():  # once full, the rest of these is only counted
            pcap.write(*frame)
        if pcap.stats.packets > before:
            pcap.flush()  # the file ends on a whole frame: readable while the run goes on

    def _close_files(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.source.close()
            finally:
                self.pcap.close()

    def stop(self, timeout: float = JOIN_TIMEOUT) -> TapStats:
        """End the thread (after one last drain) and close; the tap's figures."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if self._thread.is_alive():
            self.error = self.error or f"the capture thread did not end within {timeout:g} s"
        else:
            self._close_files()  # never started: close here
        return self.stats()

    def stats(self) -> TapStats:
        pcap: PcapStats = self.pcap.stats
        seen, drops = self.source.statistics()
        return TapStats(file=self.path.name, netns=self.netns, iface=self.iface,
                        packets=pcap.packets, seen=pcap.seen, bytes=pcap.bytes,
                        truncated=pcap.truncated, cut=pcap.cut, kernel_seen=seen,
                        kernel_drops=drops, error=self.error)


@dataclass(frozen=True)
class Endpoint:
    """Where one end of a link is captured: a namespace (None: this one) and an interface."""

    netns: str | None
    iface: str


@dataclass
class CapturedLink:
    """A link to capture: its name ("0->1"), the file stem ("0-1"), the IPv4 addresses of its
    sender and receiver, and where each end is captured."""

    name: str
    stem: str
    src: str
    dst: str
    sender: Endpoint
    receiver: Endpoint
    taps: dict[str, Tap] = field(default_factory=dict)


RingFactory = Callable[[Endpoint, str, str, int], Source]


def _ring(endpoint: Endpoint, src: str, dst: str, snap: int) -> Source:
    return Ring(endpoint.iface, src, dst, snap=snap, netns=endpoint.netns)


class LinkCapture:
    """Captures of links into `directory`: for each, `STEM.sent.pcap` (what the sender put on
    the wire towards the receiver) and `STEM.received.pcap` (what reached the receiver from the
    sender), each at most `max_bytes` bytes, frames cut to `snap` bytes. A context manager;
    `close` is idempotent."""

    def __init__(self, directory: str | Path, *, snap: int = 128, max_bytes: int = 20_000_000,
                 origin: float | None = None, ring: RingFactory = _ring) -> None:
        self.directory = Path(directory)
        self.snap, self.max_bytes = snap, max_bytes
        self.origin = origin  # seconds since the epoch that times in flows.json count from
        self.links: list[CapturedLink] = []
        self._ring = ring
        self._started: float | None = None
        self.manifest: dict[str, Any] | None = None

    def add(self, name: str, src: str, dst: str, sender: Endpoint, receiver: Endpoint, *,
            stem: str | None = None) -> CapturedLink:
        """A link from address `src` to `dst`: captured leaving `sender`, arriving at
        `receiver`."""
        if self._started is not None:
            raise RuntimeError("add links before start")
        stem = stem or name.replace("->", "-")
        if any(link.stem == stem for link in self.links):
            raise ValueError(f"link {name}: captured twice")
        link = CapturedLink(name, stem, src, dst, sender, receiver)
        self.links.append(link)
        return link

    def add_lab_link(self, lab: Any, src: int, dst: int) -> CapturedLink:
        """Host `src` to host `dst` of a `netem.lab.Lab`: on the sender's interface in its
        namespace, and on the receiver's in its own (after the switch, where links are shaped)."""
        a, b = lab.hosts[src], lab.hosts[dst]
        return self.add(f"{src}->{dst}", a.address, b.address, Endpoint(a.netns, a.iface),
                        Endpoint(b.netns, b.iface), stem=f"{src}-{dst}")

    def __enter__(self) -> LinkCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Open every tap (a failure closes those already open and raises), then start their
        threads: frames are captured from here on."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._started = time.time()
        try:
            for link in self.links:
                for side, endpoint in (("sent", link.sender), ("received", link.receiver)):
                    source = self._ring(endpoint, link.src, link.dst, self.snap)
                    try:
                        link.taps[side] = Tap(
                            source, self.directory / f"{link.stem}.{side}.pcap", snap=self.snap,
                            max_bytes=self.max_bytes, netns=endpoint.netns,
                            iface=endpoint.iface)
                    except BaseException:
                        source.close()
                        raise
        except BaseException:
            self.close()
            raise
        for link in self.links:
            for tap in link.taps.values():
                tap.start()

    def close(self, settle: float = 0.0) -> dict[str, Any] | None:
        """Stop the senders' taps, `settle` seconds later the receivers', end their threads,
        close the files and write `capture.json`; returns it (None if never started)."""
        if self.manifest is not None or self._started is None:
            return self.manifest
        stats: dict[tuple[str, str], TapStats] = {}

        def stop(side: str) -> None:
            taps = [(link, link.taps[side]) for link in self.links
                    if side in link.taps and (link.name, side) not in stats]
            for _, tap in taps:
                tap._stop.set()  # every tap of this side ends at once
            for link, tap in taps:
                stats[link.name, side] = tap.stop()

        try:
            stop("sent")
            if settle > 0:
                time.sleep(settle)
        finally:  # even when interrupted (a second Ctrl-C): every thread ends, every file closes
            stop("sent")
            stop("received")
            self.manifest = self._write_manifest(stats)
        return self.manifest

    def _write_manifest(self, stats: dict[tuple[str, str], TapStats]) -> dict[str, Any]:
        links = []
        for link in self.links:
            entry: dict[str, Any] = {"link": link.name, "src": link.src, "dst": link.dst}
            for side in ("sent", "received"):
                tap_stats = stats.get((link.name, side))
                entry[side] = asdict(tap_stats) if tap_stats is not None else None
            if entry["sent"] and entry["received"]:
                links.append(entry)
        manifest = {"format": 1, "snap": self.snap, "max_bytes": self.max_bytes,
                    "started": self._started, "stopped": time.time(), "origin": self.origin,
                    "links": links}
        (self.directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest

    def alive(self) -> list[str]:
        """The threads still running (none once closed)."""
        return [tap._thread.name for link in self.links for tap in link.taps.values()
                if tap.alive]
