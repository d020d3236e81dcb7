"""The endpoint's socket: a UDP socket whose datagrams are never fragmented, with the buffers
asked of the kernel (past the sysctl limits where allowed)."""

from __future__ import annotations

import socket

from netem.profile import ECT_0

SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # Linux; beyond rmem_max/wmem_max, needs CAP_NET_ADMIN
# Never fragment (one lost fragment loses the datagram): a datagram too large for the path is
# refused with EMSGSIZE, so a wrong `mtu` is an error at once instead of silent fragmentation.
IP_MTU_DISCOVER, IPV6_MTU_DISCOVER, PMTUDISC_DO = 10, 23, 2


def datagram_socket(address: tuple[str, int], *, ipv6: bool, rcvbuf: int, sndbuf: int,
                    ecn: bool = False) -> tuple[socket.socket, int, int]:
    """A UDP socket bound to `address` that never fragments and hands each datagram's TOS /
    TCLASS byte to recvmsg (where a CE mark shows); with `ecn` what it sends is ECN-capable
    (ECT(0)), so a link that marks instead of dropping (netem's `ecn`) marks it. With the
    receive and send buffer sizes the kernel granted. Nothing is left open when it raises
    (OSError)."""
    sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rcvbuf_bytes = _buffer(sock, socket.SO_RCVBUF, SO_RCVBUFFORCE, rcvbuf)
        sndbuf_bytes = _buffer(sock, socket.SO_SNDBUF, SO_SNDBUFFORCE, sndbuf)
        if ipv6:
            sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, PMTUDISC_DO)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
            if ecn:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, ECT_0)
        else:
            sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, PMTUDISC_DO)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
            if ecn:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, ECT_0)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock, rcvbuf_bytes, sndbuf_bytes


def _buffer(sock: socket.socket, option: int, force: int, size: int) -> int:
    """Ask for a socket buffer (forced past the sysctl limit if allowed); what was granted."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, size)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    return sock.getsockopt(socket.SOL_SOCKET, option)
