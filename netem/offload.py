"""Segmentation and aggregation offloads of an interface, switched through the SIOCETHTOOL ioctl.

With TSO/GSO/USO on, a sender hands the kernel up to 64 KB "super-packets" that are cut into
wire-sized frames only when they leave the last device; with GRO/LRO on, a receiver glues frames
back together before tc and netfilter see them. A qdisc or an nft rule then drops, delays and
meters super-packets: one "lost packet" is dozens of frames and rates are coarse. Shaped links
therefore run with these offloads off, so that loss and delay act on MTU-sized frames.

pyroute2's ioctl ethtool client does the work (no `ethtool` subprocess); its socket is created
inside the interface's namespace, since SIOCETHTOOL acts on the namespace of the socket.
"""

from __future__ import annotations

import contextlib
import os

from pyroute2.ethtool.ioctl import IoctlEthtool

from netem.namespace import udp_socket_in

# ethtool's short names -> the kernel's feature names (`ethtool -k` shows both). UFO (UDP
# fragmentation offload) left the kernel in 4.14; USO (UDP segmentation) is what replaced it.
OFFLOADS: dict[str, tuple[str, ...]] = {
    "tso": (
        "tx-tcp-segmentation",
        "tx-tcp-ecn-segmentation",
        "tx-tcp-mangleid-segmentation",
        "tx-tcp6-segmentation",
        "tx-tcp-accecn-segmentation",
    ),
    "gso": ("tx-generic-segmentation",),
    "uso": ("tx-udp-segmentation",),
    "gro": ("rx-gro",),
    "lro": ("rx-lro",),
}
# How `ethtool -K` spells each one (it has no short name for USO).
ETHTOOL_NAMES = {"tso": "tso", "gso": "gso", "uso": "tx-udp-segmentation", "gro": "gro",
                 "lro": "lro"}


def set_offloads(iface: str, *, netns: str | None = None, enabled: bool = False) -> dict[str, bool]:
    """Switch every offload of `OFFLOADS` that the device lets change; return each one's state
    afterwards (True: on), for those the device has. A feature fixed by the driver keeps its
    state, and the result says so: callers report what is really off, not what was asked."""
    with contextlib.closing(_ethtool(iface, netns)) as ethtool:
        try:
            features = ethtool.get_features()
            for names in OFFLOADS.values():
                for name in names:
                    if name in features and features.is_available(name):
                        features[name] = enabled
            ethtool.set_features(features)
            features = ethtool.get_features()
        except OSError as exc:  # ENODEV for a bad name, EPERM without CAP_NET_ADMIN
            raise OSError(exc.errno, f"{iface}: offloads: {os.strerror(exc.errno)}") from None
    return {
        short: any(features[name] for name in names if name in features)
        for short, names in OFFLOADS.items()
        if any(name in features for name in names)
    }


def _ethtool(iface: str, netns: str | None) -> IoctlEthtool:
    """An ethtool client for `iface` whose socket lives in `netns` (a name or a path)."""
    ethtool = IoctlEthtool(iface)
    if netns is not None:
        ethtool.sock.close()
        ethtool.sock = udp_socket_in(netns)  # a missing namespace is an error, never created
    return ethtool
