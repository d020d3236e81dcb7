"""A hostile neighbour: what a stranger who can reach the workers' UDP ports may send them, at
a bounded rate, from a process of its own (tests and benchmarks flood workers with it).

Five kinds, in turn, each to a worker drawn at random: random bytes; a well-formed datagram
naming a real rank (the run's id, a key the run is using, a fresh incarnation and sequence
number, absurd values); and, of genuine datagrams captured on the wire (a packet socket where
the run's traffic passes, e.g. a lab's switch), exact replays (to their own receiver or to
another), copies cut short and copies with bits flipped. Until something is captured, the
well-formed forgery stands in for a genuine datagram. With `spoof`, every datagram goes out with
the source address and port of a real peer (a raw socket with IP_HDRINCL), as a stranger inside
the network can send; without, from the flooder's own address.

    python -m testbed.transport.flood '{"targets": [["198.18.0.1", 29500], ...], ...}'

prints `{"flooding": true}` once it is about to send, runs until a line (or end of input) on
stdin or `seconds`, then prints what it sent to each target, by kind, as one JSON object. No
torch here.
"""

from __future__ import annotations

import dataclasses
import json
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from pyroute2 import IPRoute

from netem.namespace import inside
from testbed.transport.wire import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Codec,
    Header,
    Kind,
    encode,
    payload_capacity,
)

KINDS = ("random", "forged", "replayed", "truncated", "flipped")
TICK = 0.005  # seconds between bursts: the rate is kept per tick
# At most this many ticks' share goes out at once: a flooder that fell behind (a busy host)
# skips the rest instead of catching up in one burst, so the rate is a bound.
CATCH_UP = 4
CAPTURED = 512  # genuine datagrams kept (the newest)
ETH_P_ALL, ETH_P_IP = 0x0003, 0x0800
PACKET_OUTGOING = 4  # sockaddr_ll's pkttype of a frame leaving an interface
_IP = struct.Struct("!BBHHHBBH4s4s")
_UDP = struct.Struct("!HHHH")


@dataclass(frozen=True)
class Flood:
    """Whom to flood (`targets`: each worker's UDP address, by rank) and how: `rate`
    datagrams per second in all, for at most `seconds`; the run's id (which anyone watching
    the wire reads in every header); where to capture genuine datagrams (`capture_netns`, a
    namespace the traffic crosses; None: nowhere); whether to forge peers' source addresses."""

    targets: list[tuple[str, int]]
    run_id: int
    rate: float
    seconds: float
    seed: int = 0
    capture_netns: str | None = None
    spoof: bool = False
    mtu: int = 1500

    @classmethod
    def from_json(cls, text: str) -> Flood:
        data = json.loads(text)
        data["targets"] = [tuple(target) for target in data["targets"]]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


class _Capture:
    """Genuine datagrams between the targets, read from a packet socket in `netns` as they
    enter it (a bridge's port: a tap of every protocol, ETH_P_ALL, sees a frame before the
    bridge takes it; one of a single protocol would not). Frames this flooder sent (from one
    of its own interfaces' MAC addresses) are not genuine."""

    def __init__(self, netns: str, targets: list[tuple[str, int]]) -> None:
        with IPRoute() as ipr:  # in the flooder's own namespace
            self._own = {bytes.fromhex(link.get_attr("IFLA_ADDRESS").replace(":", ""))
                         for link in ipr.get_links() if link.get_attr("IFLA_ADDRESS")}
        with inside(netns):
            self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW,
                                       socket.htons(ETH_P_ALL))
        self._sock.setblocking(False)
        self._targets = {(socket.inet_aton(host), port) for host, port in targets}
        self.datagrams: list[tuple[bytes, bytes, int, int]] = []  # (datagram, source, sport, to)
        self._rank = {(socket.inet_aton(host), port): rank
                      for rank, (host, port) in enumerate(targets)}
        self.seen = 0

    def read(self) -> None:
        while True:
            try:
                frame, link = self._sock.recvfrom(65536)
            except BlockingIOError:
                return
            if (link[2] == PACKET_OUTGOING or len(frame) < 14 + _IP.size + _UDP.size
                    or int.from_bytes(frame[12:14], "big") != ETH_P_IP
                    or frame[14 + 9] != socket.IPPROTO_UDP or frame[6:12] in self._own):
                continue
            ihl = (frame[14] & 0x0F) * 4
            source, destination = frame[14 + 12:14 + 16], frame[14 + 16:14 + 20]
            sport, dport, length, _ = _UDP.unpack_from(frame, 14 + ihl)
            datagram = frame[14 + ihl + _UDP.size:14 + ihl + length]
            if ((destination, dport) not in self._targets or (source, sport) not in self._targets
                    or datagram[:2] != MAGIC.to_bytes(2, "big")):
                continue
            self.seen += 1
            self.datagrams.append((datagram, source, sport, self._rank[destination, dport]))
            del self.datagrams[:-CAPTURED]

    def close(self) -> None:
        self._sock.close()


class _Sender:
    """Datagrams out, from the flooder's own address or (spoofing) from any address."""

    def __init__(self, spoof: bool) -> None:
        self.spoof = spoof
        if spoof:  # IPPROTO_RAW implies IP_HDRINCL: the header given is the one sent
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        else:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.errors = 0

    def send(self, datagram: bytes, target: tuple[str, int], source: tuple[str, int]) -> bool:
        try:
            if not self.spoof:
                self._sock.sendto(datagram, target)
                return True
            udp = _UDP.pack(source[1], target[1], _UDP.size + len(datagram), 0)  # no checksum
            # version 4, 5 words; the kernel fills in the length, id and checksum
            ip = _IP.pack(0x45, 0, 0, 0, 0, 64, socket.IPPROTO_UDP, 0,
                          socket.inet_aton(source[0]), socket.inet_aton(target[0]))
            self._sock.sendto(ip + udp + datagram, (target[0], 0))
            return True
        except OSError:
            self.errors += 1
            return False

    def close(self) -> None:
        self._sock.close()


class Flooder:
    """One flood (`Flood`), run by `run` until `stop` is set or its time is up."""

    def __init__(self, flood: Flood) -> None:
        self.flood = flood
        self.rng = np.random.default_rng(flood.seed)
        self.capture = (None if flood.capture_netns is None
                        else _Capture(flood.capture_netns, flood.targets))
        self.sender = _Sender(flood.spoof)
        self.sent = {f"{host}:{port}": Counter() for host, port in flood.targets}
        self._capacity = payload_capacity(flood.mtu)

    def run(self, stop: threading.Event, on_start: Callable[[], None] = lambda: None) -> dict:
        """Flood until `stop` is set or the time is up (`on_start` as it begins); what it
        sent to each target, by kind."""
        on_start()
        started, cpu, due, count = time.monotonic(), time.process_time(), 0, 0
        burst = max(1, int(self.flood.rate * TICK * CATCH_UP))
        try:
            while not stop.is_set():
                elapsed = time.monotonic() - started
                if elapsed >= self.flood.seconds:
                    break
                if self.capture is not None:
                    self.capture.read()
                now_due = int(elapsed * self.flood.rate)
                for _ in range(min(now_due - due, burst)):
                    self._one(KINDS[count % len(KINDS)])
                    count += 1
                due = now_due
                stop.wait(TICK)  # pacing: the next tick's share
        finally:
            self.sender.close()
            if self.capture is not None:
                self.capture.close()
        return {"sent": {target: dict(kinds) for target, kinds in self.sent.items()},
                "seconds": time.monotonic() - started, "cpu_seconds": time.process_time() - cpu,
                "send_errors": self.sender.errors,
                "captured": self.capture.seen if self.capture is not None else 0}

    def _one(self, kind: str) -> None:
        to = int(self.rng.integers(len(self.flood.targets)))
        datagram, kind, to, named = self.datagram(kind, to)
        targets = self.flood.targets
        if self.sender.send(datagram, targets[to], targets[named]):
            self.sent[f"{targets[to][0]}:{targets[to][1]}"][kind] += 1

    def datagram(self, kind: str, to: int) -> tuple[bytes, str, int, int]:
        """One datagram of `kind` for target `to`: (its bytes, the kind it is: a forgery until
        something is captured, the target it goes to, the rank whose address it claims)."""
        named = self._other(to)  # the rank a datagram claims to be (and spoofs, if so)
        captured = self.capture.datagrams if self.capture is not None else []
        if kind == "random":
            datagram = self.rng.bytes(int(self.rng.integers(0, self._capacity + HEADER_SIZE)))
        elif kind == "forged" or not captured:
            kind, datagram = "forged", self._forged(named, captured)
        else:
            datagram, source, port, receiver = captured[int(self.rng.integers(len(captured)))]
            named = self._rank_at(source, port, receiver)
            if to == named:  # a worker drops what claims its own address (a martian source)
                to = self._other(named)
            if kind == "replayed" and self.rng.random() < 0.5:
                to = receiver  # to the worker it was meant for
            elif kind == "truncated":
                datagram = datagram[:int(self.rng.integers(0, len(datagram)))]
            elif kind == "flipped":
                flipped = bytearray(datagram)
                for at in self.rng.integers(0, len(flipped), int(self.rng.integers(1, 9))):
                    flipped[at] ^= 1 << int(self.rng.integers(8))
                datagram = bytes(flipped)
        return datagram, kind, to, named

    def _other(self, rank: int) -> int:
        """A real rank other than `rank` (itself in a world of one)."""
        world = len(self.flood.targets)
        return (rank + 1 + int(self.rng.integers(max(world - 1, 1)))) % world

    def _rank_at(self, source: bytes, port: int, receiver: int) -> int:
        """The rank whose address a captured datagram came from (a peer of `receiver`)."""
        for rank, (host, rank_port) in enumerate(self.flood.targets):
            if (socket.inet_aton(host), rank_port) == (source, port):
                return rank
        return self._other(receiver)

    def _forged(self, sender: int, captured: list[tuple[bytes, bytes, int, int]]) -> bytes:
        """A well-formed datagram naming `sender`: the header of a captured one (its key, its
        length, any MAC after it, which no longer fits), or a one-chunk gradient of step 0;
        a fresh incarnation and sequence number; absurd values."""
        if captured:
            datagram = captured[int(self.rng.integers(len(captured)))][0]
            header = Header._make(HEADER.unpack_from(datagram))
            payload_len, trailer = header.payload_len, datagram[HEADER_SIZE + header.payload_len:]
        else:
            header = Header(MAGIC, VERSION, Kind.GRADIENT, Codec.FLOAT32, sender,
                            self.flood.run_id, 0, 0, 0, 0, 0, 1, 0)
            payload_len, trailer = self._capacity // 4 * 4, b""
        header = header._replace(sender=sender, incarnation=int(self.rng.integers(1 << 32)),
                                 seq=int(self.rng.integers(1 << 20)), payload_len=payload_len)
        values = np.full(payload_len // 4, 4.3e9, dtype=np.float32).tobytes()
        return encode(header, values + bytes(payload_len - len(values))) + trailer


def start(flood: Flood, prefix: Sequence[str] = (), timeout: float = 30.0,
          ) -> subprocess.Popen[str]:
    """A flooder process (`prefix` in front of its command, e.g. `ip netns exec NS`), returned
    once it floods; RuntimeError naming what it said if it has not begun within `timeout`."""
    process = subprocess.Popen([*prefix, sys.executable, "-m", __name__, flood.to_json()],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready or "flooding" not in process.stdout.readline():
        process.kill()
        _, errors = process.communicate()
        raise RuntimeError(f"the flooder did not begin within {timeout:g} s: {errors.strip()}")
    return process


def stop(process: subprocess.Popen[str], timeout: float = 30.0) -> dict:
    """End a flooder `start` began; what it sent (`Flooder.run`)."""
    out, errors = process.communicate("stop\n", timeout=timeout)
    if process.returncode:
        raise RuntimeError(f"the flooder failed ({process.returncode}): {errors.strip()}")
    return json.loads(out)


def main(argv: list[str]) -> int:
    flood = Flood.from_json(argv[0])
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    flooder = Flooder(flood)
    sent = flooder.run(stop, on_start=lambda: print(json.dumps({"flooding": True}), flush=True))
    print(json.dumps(sent), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
