"""What the transport counts, and the kernel's own counters beside it.

Per-peer counters are plain dataclasses (`dataclasses.asdict` gives the Prometheus-ready
dict). Kernel figures come from the socket itself where the kernel keeps them per socket
(`SO_MEMINFO` drops, `TCP_INFO` retransmits), and from /proc for the whole network namespace.
The /proc files are read through /proc/thread-self, so a thread that entered another namespace
with setns reads that namespace's counters.
"""

from __future__ import annotations

import re
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

UNKNOWN_PEER = -1  # counters of datagrams from addresses that are no known peer
SO_MEMINFO = 55  # Linux; Python's socket module does not name it
_MEMINFO_FIELDS = 9  # SK_MEMINFO_VARS
_MEMINFO_DROPS = 8  # SK_MEMINFO_DROPS: datagrams the kernel dropped for this socket


@dataclass
class DatagramCounters:
    """UDP traffic with one peer. `datagrams_lost` counts gaps in the peer's sequence numbers
    (whatever their cause; a reordered datagram fills its gap when it comes); `datagrams_late`
    is the part of `datagrams_received` that came after its step was closed, and
    `datagrams_ce_marked` the part a link marked CE (ECN) instead of dropping. Malformed,
    foreign and replayed datagrams are dropped and not received. Bytes are UDP payload bytes,
    wire header included."""

    datagrams_sent: int = 0
    bytes_sent: int = 0
    send_errors: int = 0
    datagrams_received: int = 0
    bytes_received: int = 0
    datagrams_lost: int = 0
    datagrams_late: int = 0
    datagrams_ce_marked: int = 0
    datagrams_malformed: int = 0
    datagrams_foreign: int = 0
    datagrams_replayed: int = 0


@dataclass
class SocketCounters:
    """One UDP socket: the drops the host caused (a full receive buffer: the kernel cannot say
    from which peer, so they are not per peer), and why datagrams were rejected."""

    rcvbuf_drops: int = 0
    receive_errors: int = 0
    rcvbuf_bytes: int = 0
    sndbuf_bytes: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


@dataclass
class StreamCounters:
    """One TCP connection. Bytes include the message headers; `tcp_retransmits` is the
    kernel's count of segments this socket retransmitted (tcpi_total_retrans)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    tcp_retransmits: int = 0


# struct tcp_info (include/uapi/linux/tcp.h) up to tcpi_reord_seen, in order. Two bytes of
# bitfields are kept as whole bytes. Older kernels return less: missing fields read as 0.
_TCP_INFO_FIELDS = (
    ("B", "state ca_state retransmits probes backoff options wscale flags"),
    ("I", "rto ato snd_mss rcv_mss unacked sacked lost retrans fackets last_data_sent "
          "last_ack_sent last_data_recv last_ack_recv pmtu rcv_ssthresh rtt rttvar "
          "snd_ssthresh snd_cwnd advmss reordering rcv_rtt rcv_space total_retrans"),
    ("Q", "pacing_rate max_pacing_rate bytes_acked bytes_received"),
    ("I", "segs_out segs_in notsent_bytes min_rtt data_segs_in data_segs_out"),
    ("Q", "delivery_rate busy_time rwnd_limited sndbuf_limited"),
    ("I", "delivered delivered_ce"),
    ("Q", "bytes_sent bytes_retrans"),
    ("I", "dsack_dups reord_seen"),
)
_TCP_INFO = struct.Struct("=" + "".join(code * len(names.split()) for code, names in
                                        _TCP_INFO_FIELDS))
_TCP_INFO_NAMES = tuple(name for _, names in _TCP_INFO_FIELDS for name in names.split())


@dataclass(frozen=True)
class TcpInfo:
    """The parts of the kernel's struct tcp_info a run reports (times in microseconds, rates
    in bytes/s, as the kernel gives them)."""

    state: int
    ca_state: int
    rto: int
    rtt: int
    rttvar: int
    min_rtt: int
    snd_mss: int
    snd_cwnd: int
    lost: int
    retrans: int
    total_retrans: int
    pacing_rate: int
    delivery_rate: int
    bytes_sent: int
    bytes_retrans: int
    bytes_acked: int
    bytes_received: int
    segs_out: int
    segs_in: int


def tcp_info(sock: socket.socket) -> TcpInfo:
    """TCP_INFO of a connected TCP socket."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    values = dict(zip(_TCP_INFO_NAMES, _TCP_INFO.unpack(raw.ljust(_TCP_INFO.size, b"\0")),
                      strict=True))
    return TcpInfo(**{name: values[name] for name in TcpInfo.__dataclass_fields__})


def socket_drops(sock: socket.socket) -> int:
    """Datagrams the kernel dropped for this socket (SO_MEMINFO; almost always a full receive
    buffer). Exact and current, unlike SO_RXQ_OVFL, which only rides on the next datagram."""
    raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * _MEMINFO_FIELDS)
    return struct.unpack(f"={_MEMINFO_FIELDS}I", raw)[_MEMINFO_DROPS]


def namespace_counters(proc: Path = Path("/proc/thread-self/net")) -> dict[str, int]:
    """Every counter of /proc/net/snmp and /proc/net/netstat of this thread's network namespace,
    with Prometheus-friendly names: `udp_rcvbuf_errors`, `tcp_retrans_segs`,
    `tcpext_tcp_lost_retransmit`..."""
    counters: dict[str, int] = {}
    for name in ("snmp", "netstat"):
        lines = (proc / name).read_text().splitlines()
        for heads, values in zip(lines[::2], lines[1::2], strict=True):
            section, _, names = heads.partition(":")
            for key, value in zip(names.split(), values.partition(":")[2].split(), strict=True):
                counters[f"{section.lower()}_{_snake(key)}"] = int(value)
    return counters


def _snake(name: str) -> str:
    """RcvbufErrors -> rcvbuf_errors, TCPLostRetransmit -> tcp_lost_retransmit."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
