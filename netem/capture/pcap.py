"""pcap files: a writer that stops at a size, and a reader into arrays.

The writer makes classic pcap with nanosecond timestamps (magic 0xa1b23c4d, Ethernet frames),
which Wireshark, tcpdump and scapy read. It never lets the file grow past `max_bytes` (the
24-byte header included): the first frame that would not fit ends the writing, the file says so
(`truncated`, the time of that frame in `cut`), and later frames are only counted.

The reader takes a file through scapy's `RawPcapReader` and gives its frames as arrays (times,
lengths, and the captured bytes as one matrix), for the vectorised analysis of `flows`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC_NS = 0xA1B23C4D  # pcap with nanosecond timestamps
LINKTYPE_ETHERNET = 1
HEADER = struct.Struct("<IHHiIII")  # magic, version 2.4, thiszone, sigfigs, snaplen, linktype
RECORD = struct.Struct("<IIII")  # seconds, nanoseconds, captured length, length on the wire
BUFFER = 1 << 20


class PcapError(ValueError):
    """A pcap file that cannot be read; the message names the file."""


@dataclass
class PcapStats:
    """What one bounded file holds: frames written, frames seen (written or not), its size in
    bytes, whether it was cut at `max_bytes` and, if so, the time (seconds since the epoch) of
    the first frame left out."""

    packets: int = 0
    seen: int = 0
    bytes: int = HEADER.size
    truncated: bool = False
    cut: float | None = None


class BoundedPcap:
    """A pcap file that stops growing at `max_bytes`. `write` frames, `flush` now and then
    (the file then ends on a whole frame), `close` once (idempotent)."""

    def __init__(self, path: str | Path, *, snap: int, max_bytes: int) -> None:
        if max_bytes < HEADER.size:
            raise ValueError(f"max_bytes: at least {HEADER.size} (the file's header), got "
                             f"{max_bytes}")
        self.path = Path(path)
        self.snap, self.max_bytes = snap, max_bytes
        self.stats = PcapStats()
        self._file: BinaryIO | None = open(self.path, "wb", buffering=BUFFER)  # noqa: SIM115
        self._file.write(HEADER.pack(MAGIC_NS, 2, 4, 0, 0, snap, LINKTYPE_ETHERNET))

    @property
    def closed(self) -> bool:
        return self._file is None

    def write(self, sec: int, nsec: int, length: int, data: bytes) -> bool:
        """One frame (its time, its length on the wire, its first bytes, cut to `snap` here if
        longer); False once the file is full (the frame is counted, not written)."""
        stats = self.stats
        stats.seen += 1
        if stats.truncated:
            return False
        if len(data) > self.snap:
            data = data[:self.snap]
        size = RECORD.size + len(data)
        if stats.bytes + size > self.max_bytes:
            stats.truncated = True
            stats.cut = sec + nsec * 1e-9
            return False
        assert self._file is not None, "the file is closed"
        self._file.write(RECORD.pack(sec, nsec, len(data), length))
        self._file.write(data)
        stats.bytes += size
        stats.packets += 1
        return True

    def skipped(self, count: int, when: float | None = None) -> None:
        """`count` frames that came after the file was full (counted only)."""
        self.stats.seen += count
        if count and not self.stats.truncated:
            self.stats.truncated, self.stats.cut = True, when

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> PcapStats:
        if self._file is not None:
            self._file.close()
            self._file = None
        return self.stats


@dataclass
class Frames:
    """The frames of one pcap file as arrays, in file order: `time` (nanoseconds since the
    epoch), `length` on the wire, `caplen` (bytes kept), and `data`: the kept bytes, one row per
    frame, zero-padded to `width` columns. `snap` is the file's own."""

    time: np.ndarray
    length: np.ndarray
    caplen: np.ndarray
    data: np.ndarray
    snap: int

    def __len__(self) -> int:
        return len(self.time)

    @property
    def width(self) -> int:
        return self.data.shape[1]


def read_frames(path: str | Path, *, width: int | None = None) -> Frames:
    """Every frame of a pcap file (Ethernet), through scapy's `RawPcapReader`; `width`: the
    columns of `data` (default: the file's snap length, at most 256 and at least 96, enough
    for Ethernet, IPv4 and TCP headers with options)."""
    from scapy.error import Scapy_Exception
    from scapy.utils import RawPcapReader

    path = Path(path)
    try:
        reader = RawPcapReader(str(path))
    except (OSError, Scapy_Exception) as error:
        raise PcapError(f"{path}: {error}") from None
    with reader:
        if reader.linktype != LINKTYPE_ETHERNET:
            raise PcapError(f"{path}: link type {reader.linktype}, expected Ethernet (1)")
        snap = int(reader.snaplen) or 65535
        columns = width or min(max(snap, 96), 256)
        scale = 1 if reader.nano else 1000
        rows: list[bytes] = []
        seconds: list[int] = []
        fractions: list[int] = []
        lengths: list[int] = []
        caplens: list[int] = []
        try:
            for frame, meta in reader:
                seconds.append(meta.sec)
                fractions.append(meta.usec)
                lengths.append(meta.wirelen)
                caplens.append(len(frame))
                rows.append(frame[:columns].ljust(columns, b"\0"))
        except Scapy_Exception as error:  # a frame cut short: keep what came before it
            raise PcapError(f"{path}: {error}") from None
    count = len(rows)
    data = np.frombuffer(b"".join(rows), np.uint8).reshape(count, columns) if count else (
        np.zeros((0, columns), np.uint8))
    time = np.array(seconds, np.int64) * 1_000_000_000 + np.array(fractions, np.int64) * scale
    return Frames(time=time, length=np.array(lengths, np.int64),
                  caplen=np.array(caplens, np.int64), data=data, snap=snap)
