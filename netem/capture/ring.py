"""A packet socket that sees one link's frames: AF_PACKET with a TPACKET_V3 receive ring.

The socket is made inside the interface's namespace (`netem.namespace.inside`) and stays there.
A classic BPF program, attached before the socket is bound, keeps only IPv4 frames from one
address to another and cuts each to `snap` bytes in the kernel, so nothing else is copied. The
kernel writes frames into blocks of a ring shared with this process (mmap), with their
timestamps (nanoseconds) and their length on the wire; a block is handed over when full or
`retire_ms` after its first frame, and given back once read. The ring is the only buffer: when
the reader falls behind, the kernel drops frames and counts them (`Ring.drops`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import mmap
import socket
import struct
from collections.abc import Iterator

from netem.namespace import inside

SOL_PACKET = 263
PACKET_RX_RING = 5
PACKET_STATISTICS = 6
PACKET_VERSION = 10
TPACKET_V3 = 2
SO_ATTACH_FILTER = 26
ETH_P_ALL = 0x0003  # outgoing frames reach only ETH_P_ALL taps
ETH_P_IP = 0x0800
TP_STATUS_KERNEL = 0
TP_STATUS_USER = 1

BLOCK_SIZE = 1 << 18  # bytes per block (a multiple of the page size)
BLOCKS = 16  # blocks per ring: 4 MiB, about 20 000 frames of 128 bytes
FRAME_SIZE = 1 << 11  # V3 packs frames of any size into a block; the kernel still checks this
RETIRE_MS = 50  # a block that is not full is handed over this long after its first frame

# struct tpacket_block_desc: version, offset_to_priv, then tpacket_hdr_v1: block_status,
# num_pkts, offset_to_first_pkt, ...
_BLOCK = struct.Struct("<III")  # block_status, num_pkts, offset_to_first_pkt (at offset 8)
# struct tpacket3_hdr: tp_next_offset, tp_sec, tp_nsec, tp_snaplen, tp_len, tp_status, tp_mac
_FRAME = struct.Struct("<IIIIIIH")


Frame = tuple[int, int, int, bytes]  # seconds, nanoseconds, length on the wire, first bytes


def link_filter(src: str, dst: str, snap: int) -> bytes:
    """Classic BPF: accept IPv4 frames from `src` to `dst` (Ethernet, no VLAN tag), cut to
    `snap` bytes; drop the rest."""
    ld_h, ld_w, jeq, ret = 0x28, 0x20, 0x15, 0x06  # ldh [k], ld [k], jeq #k, ret #k
    src_k = int(ipaddress.IPv4Address(src))
    dst_k = int(ipaddress.IPv4Address(dst))
    program = [
        (ld_h, 0, 0, 12),  # the EtherType
        (jeq, 0, 5, ETH_P_IP),
        (ld_w, 0, 0, 26),  # the IPv4 source
        (jeq, 0, 3, src_k),
        (ld_w, 0, 0, 30),  # the IPv4 destination
        (jeq, 0, 1, dst_k),
        (ret, 0, 0, snap),
        (ret, 0, 0, 0),
    ]
    return b"".join(struct.pack("<HBBI", *instruction) for instruction in program)


class Ring:
    """A receive ring on `iface` of `netns` (None: this thread's namespace) for the IPv4 frames
    from `src` to `dst`, cut to `snap` bytes. Needs CAP_NET_RAW. `close` is idempotent."""

    def __init__(self, iface: str, src: str, dst: str, *, snap: int, netns: str | None = None,
                 blocks: int = BLOCKS, block_size: int = BLOCK_SIZE,
                 retire_ms: int = RETIRE_MS) -> None:
        self.blocks, self.block_size, self.retire_ms = blocks, block_size, retire_ms
        self._next = 0
        self.drops = 0  # frames the kernel could not put in the ring (it was full)
        self.seen = 0  # frames the filter let through, as the kernel counts them
        with inside(netns):
            # Protocol 0 receives nothing until bound: no frame slips in before the filter.
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        self._map: mmap.mmap | None = None
        try:
            code = link_filter(src, dst, snap)
            buffer = ctypes.create_string_buffer(code)
            program = struct.pack("@HP", len(code) // 8, ctypes.addressof(buffer))
            self.sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, program)
            self.sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3)
            frames = block_size // FRAME_SIZE * blocks
            request = struct.pack("<7I", block_size, blocks, FRAME_SIZE, frames, retire_ms, 0, 0)
            self.sock.setsockopt(SOL_PACKET, PACKET_RX_RING, request)
            self._map = mmap.mmap(self.sock.fileno(), block_size * blocks, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            self.sock.bind((iface, ETH_P_ALL))  # the name is looked up in the socket's netns
        except BaseException:
            self.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def frames(self) -> Iterator[Frame]:
        """Every frame of the blocks the kernel has handed over, in order, as (seconds,
        nanoseconds, length on the wire, the first `snap` bytes); each block goes back to the
        kernel once its frames were read (or the iteration was left)."""
        ring = self._open()
        unpack = _FRAME.unpack_from
        while True:
            base = self._next * self.block_size
            status, count, offset = _BLOCK.unpack_from(ring, base + 8)
            if not status & TP_STATUS_USER:
                return
            offset += base
            try:
                for _ in range(count):
                    step, sec, nsec, snaplen, length, _status, mac = unpack(ring, offset)
                    start = offset + mac
                    yield sec, nsec, length, ring[start:start + snaplen]
                    offset += step
            finally:
                self._release(base)

    def skip(self) -> int:
        """Hand every block the kernel has handed over straight back; how many frames they
        held (nothing is copied)."""
        ring = self._open()
        skipped = 0
        while True:
            base = self._next * self.block_size
            status, count, _ = _BLOCK.unpack_from(ring, base + 8)
            if not status & TP_STATUS_USER:
                return skipped
            skipped += count
            self._release(base)

    def _open(self) -> mmap.mmap:
        if self._map is None:
            raise ValueError("the ring is closed")
        return self._map

    def _release(self, base: int) -> None:
        struct.pack_into("<I", self._map, base + 8, TP_STATUS_KERNEL)
        self._next = (self._next + 1) % self.blocks

    def statistics(self) -> tuple[int, int]:
        """(frames seen, frames dropped) since the ring was made (the kernel resets its counters
        on each read: they are summed here)."""
        with contextlib.suppress(OSError):
            packets, drops, _ = struct.unpack(
                "<III", self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 12))
            self.seen += packets
            self.drops += drops
        return self.seen, self.drops

    def close(self) -> None:
        if self._map is not None:
            self.statistics()
            self._map.close()
            self._map = None
        self.sock.close()
