"""Sockets in other network namespaces, made by this thread from inside them.

A socket stays in the namespace it was created in, so a thread can step into a namespace
(setns), open what it needs and step back, without helper processes: pyroute2's own
`IPRoute(netns=...)` forks one, which costs tens of milliseconds in a process as large as one
that imported torch. Shaping, labs, offloads and probes all open their sockets this way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from collections.abc import Iterator

from pyroute2 import IPRoute

CLONE_NEWNET = 0x40000000


class NamespaceError(RuntimeError):
    """A network namespace could not be entered (missing, or no permission)."""


def _namespace_path(netns: str) -> str:
    """A name under /run/netns (as `ip netns` makes them) or a path such as /proc/PID/ns/net."""
    return netns if "/" in netns else f"/run/netns/{netns}"


@contextlib.contextmanager
def inside(netns: str | None) -> Iterator[None]:
    """Run the body with this thread in another network namespace; sockets made there stay."""
    if netns is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        target = os.open(_namespace_path(netns), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NamespaceError(f"network namespace {netns!r}: {exc.strerror}") from None
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise NamespaceError(f"network namespace {netns!r}: setns: {os.strerror(error)}")
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover - cannot fail for home
                raise OSError(ctypes.get_errno(), "setns back to the original namespace")
    finally:
        os.close(target)
        os.close(home)


def netlink_in(netns: str | None) -> IPRoute:
    """A netlink socket in `netns` (use it as a context manager)."""
    with inside(netns):
        return IPRoute()


def udp_socket_in(netns: str | None) -> socket.socket:
    """A UDP socket in `netns`."""
    with inside(netns):
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def interface_with(address: str) -> str | None:
    """The name of the interface that holds IPv4 `address` in this thread's namespace (None:
    no interface does)."""
    with IPRoute() as ipr:
        for entry in ipr.get_addr(family=socket.AF_INET):
            if entry.get_attr("IFA_ADDRESS") == address:
                (link,) = ipr.get_links(entry["index"])
                return link.get_attr("IFLA_IFNAME")
    return None
