"""The streams' sockets: TCP_NODELAY on every one, the congestion control a scenario names
(TCP_CONGESTION), and errors that say what the kernel's sysctl limits allow instead."""

from __future__ import annotations

import socket
from pathlib import Path

from testbed.transport.errors import TransportError

_SYSCTL = Path("/proc/sys/net/ipv4")


def stream_socket(address: tuple[str, int], congestion: str | None) -> socket.socket:
    """A TCP socket for `address`'s family with TCP_NODELAY and, if named, `congestion`."""
    sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        except OSError as exc:
            sock.close()
            raise _congestion_error(congestion, exc) from None
    return sock


def _congestion_error(name: str, exc: OSError) -> TransportError:
    if isinstance(exc, PermissionError):
        allowed = (_SYSCTL / "tcp_allowed_congestion_control").read_text().split()
        return TransportError(f"congestion: {name!r} needs CAP_NET_ADMIN here; without it only "
                              f"{allowed} (net.ipv4.tcp_allowed_congestion_control)")
    available = (_SYSCTL / "tcp_available_congestion_control").read_text().split()
    return TransportError(f"congestion: {name!r} is not available ({exc.strerror}); this kernel "
                          f"has {available}")


def congestion_of(sock: socket.socket) -> str:
    """The congestion control `sock` really uses."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    return raw.split(b"\0", 1)[0].decode()

