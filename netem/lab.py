"""A throwaway network of hosts on one machine: one namespace per host, all on one bridge.

The bridge lives in a namespace of its own (the "switch"), so a lab touches nothing in the
root namespace and removing its namespaces removes every veth with them. The bridge holds the
subnet's last address (`switch_address`): services of the lab's own (a run's coordination
store, say) listen there, reachable from every host over the bridge without being one of the
hosts, so shaping the links between hosts can leave their traffic alone. Every name starts with
the lab's prefix, which is how `clean` finds what a killed run left behind.

Every host has an IPv6 address beside its IPv4 one, numbered alike (host i is the (i + 1)th of
each subnet: 198.18.0.1 and fd00:7e57::1 for host 0), without duplicate address detection, so it
is usable at once.

Every veth runs with segmentation and aggregation offloads off (netem.offload): a sender's
super-packets would otherwise cross the bridge whole, and a shaped switch port would drop and
meter 64 KB at a time instead of wire-sized frames.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2 import IPRoute, netns
from pyroute2.netlink.rtnl.ifaddrmsg import IFA_F_NODAD

from netem.lifecycle import StartsOnEnter
from netem.namespace import netlink_in
from netem.offload import set_offloads

NAME_PREFIX = "tb"
DEFAULT_SUBNET = "198.18.0.0/24"  # RFC 2544 benchmarking range: never routed anywhere
DEFAULT_SUBNET6 = "fd00:7e57::/64"  # a unique local (RFC 4193) /64: never routed anywhere
PARALLEL_HOSTS = 8  # threads adding hosts
OWNERS = Path("/run/netem-testbed/labs")  # one file per live lab: "<pid> <process start time>"


@dataclass(frozen=True)
class Host:
    """One host of a lab: its namespace, its interface there and its addresses."""

    index: int
    netns: str
    iface: str
    address: str  # IPv4
    address6: str  # IPv6
    switch_port: str


@dataclass
class Lab(StartsOnEnter):
    """Hosts in namespaces joined by a bridge. Use as a context manager; `close` is idempotent."""

    size: int
    prefix: str = field(default_factory=lambda: f"{NAME_PREFIX}{secrets.token_hex(2)}")
    subnet: str = DEFAULT_SUBNET
    subnet6: str = DEFAULT_SUBNET6
    mtu: int = 1500
    hosts: list[Host] = field(default_factory=list, init=False)
    # pyroute2 forks helpers that carry a copy of this object; a copy that unwinds (a signal in
    # the helper) must not tear down the lab under its builder, so only the builder closes it.
    _builder: int = field(default=0, init=False, repr=False)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def switch_address(self) -> str:
        """The bridge's own address in the switch namespace: the subnet's last usable one."""
        return str(ipaddress.ip_network(self.subnet).broadcast_address - 1)

    def addresses(self, index: int) -> tuple[str, str]:
        """Host `index`'s IPv4 and IPv6 addresses (known before the lab starts)."""
        ipv4, ipv6 = (ipaddress.ip_network(subnet).network_address + index + 1
                      for subnet in (self.subnet, self.subnet6))
        return str(ipv4), str(ipv6)

    def start(self) -> None:
        self._builder = os.getpid()
        network = ipaddress.ip_network(self.subnet)
        most = network.num_addresses - 3  # less the network, broadcast and switch addresses
        most6 = ipaddress.ip_network(self.subnet6).num_addresses - 1  # less the subnet's own
        if self.size < 1 or self.size > min(most, most6):
            raise ValueError(f"size: a lab on {self.subnet} and {self.subnet6} holds "
                             f"1..{min(most, most6)} hosts")
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / self.prefix).write_text(process_identity(os.getpid()))
        _create_namespace(self.switch)
        with netlink_in(self.switch) as switch:
            switch.link("add", ifname="br0", kind="bridge")
            (bridge,) = switch.link_lookup(ifname="br0")
            switch.link("set", index=bridge, state="up", mtu=self.mtu)
            switch.addr("add", index=bridge, address=self.switch_address,
                        prefixlen=network.prefixlen)
            switch.link("set", index=switch.link_lookup(ifname="lo")[0], state="up")

        # A host is a few short helper processes that mostly wait (32 one at a time took ~5 s),
        # so threads add them, each with a socket of its own in the switch.
        def add(indices: range) -> list[Host]:
            with netlink_in(self.switch) as switch:
                return [self._add_host(switch, bridge, index) for index in indices]

        threads = min(PARALLEL_HOSTS, self.size)
        with ThreadPoolExecutor(threads) as pool:
            added = pool.map(add, [range(k, self.size, threads) for k in range(threads)])
            self.hosts.extend(sorted((host for hosts in added for host in hosts),
                                     key=lambda host: host.index))

    def _add_host(self, switch: IPRoute, bridge: int, index: int) -> Host:
        address, address6 = self.addresses(index)
        host = Host(
            index=index,
            netns=f"{self.prefix}-h{index}",
            iface="eth0",
            address=address,
            address6=address6,
            switch_port=f"p{index}",
        )
        _create_namespace(host.netns)
        switch.link(
            "add",
            ifname=host.switch_port,
            kind="veth",
            peer={"ifname": host.iface, "net_ns_fd": host.netns},
        )
        (port,) = switch.link_lookup(ifname=host.switch_port)
        switch.link("set", index=port, master=bridge, mtu=self.mtu, state="up")
        with netlink_in(host.netns) as ns:
            (iface,) = ns.link_lookup(ifname=host.iface)
            ns.link("set", index=iface, mtu=self.mtu, state="up")
            ns.addr("add", index=iface, address=host.address,
                    prefixlen=ipaddress.ip_network(self.subnet).prefixlen)
            ns.addr("add", index=iface, address=host.address6,
                    prefixlen=ipaddress.ip_network(self.subnet6).prefixlen, flags=IFA_F_NODAD)
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        set_offloads(host.switch_port, netns=self.switch)
        set_offloads(host.iface, netns=host.netns)
        return host

    def run(self, host: Host, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess[str]:
        """Run a command inside a host's namespace and wait for it."""
        kwargs.setdefault("text", True)
        kwargs.setdefault("capture_output", True)
        return subprocess.run(["ip", "netns", "exec", host.netns, *argv], **kwargs)

    def popen(self, host: Host, argv: Sequence[str], **kwargs) -> subprocess.Popen[str]:
        """Start a command inside a host's namespace."""
        kwargs.setdefault("text", True)
        return subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], **kwargs)

    def close(self) -> None:
        if self._builder != os.getpid():
            return
        remove_namespaces(self.prefix)
        (OWNERS / self.prefix).unlink(missing_ok=True)
        self.hosts.clear()


def _create_namespace(name: str) -> None:
    """`ip netns add`: a process spawned, not forked (pyroute2's `netns.create` forks this
    process, which costs tens of milliseconds once torch is imported)."""
    result = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if result.returncode:
        raise OSError(f"ip netns add {name}: {result.stderr.strip()}")


def lab_namespaces(prefix: str = NAME_PREFIX, *, orphans_only: bool = False) -> list[str]:
    """Namespaces whose name marks them as made by a lab with this prefix (`orphans_only`:
    only those whose owning process is gone, which nobody will remove but `clean`)."""
    return sorted(name for name in netns.listnetns() if _is_ours(name, prefix)
                  and not (orphans_only and _owner_alive(name.partition("-")[0])))


def remove_namespaces(prefix: str = NAME_PREFIX, *, orphans_only: bool = False) -> list[str]:
    """Kill the processes inside and delete every namespace of labs with this prefix.

    With `orphans_only`, labs whose owning process is still running are left alone, so a clean
    never pulls the network from under a live run.
    """
    removed = []
    for name in lab_namespaces(prefix, orphans_only=orphans_only):
        lab = name.partition("-")[0]
        _kill_processes_in(name)
        netns.remove(name)
        (OWNERS / lab).unlink(missing_ok=True)
        removed.append(name)
    return removed


def _owner_alive(lab: str) -> bool:
    try:
        pid, _ = (OWNERS / lab).read_text().split()
    except (OSError, ValueError):
        return False
    return process_identity(int(pid)) == (OWNERS / lab).read_text()


def process_identity(pid: int) -> str:
    """pid plus its start time, so a recycled pid is not mistaken for the owner ("" when no
    such process runs)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return f"{pid} {stat.rpartition(')')[2].split()[19]}"


def _is_ours(name: str, prefix: str) -> bool:
    head, _, tail = name.partition("-")
    return head.startswith(prefix) and (tail == "sw" or tail.startswith("h"))


def _kill_processes_in(name: str) -> None:
    result = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    for pid in result.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)
