"""Carry out shaping plans on a kernel, read them back, remove them.

qdiscs, classes, filters and the ifb go through rtnetlink (pyroute2), never a `tc` subprocess;
netem leaves through `netem.netlink`, which encodes netem's options the way `tc` does. The
fallback's nftables rules go through `nft -f -` (one transaction per change, in a table named
`netem_testbed` per namespace): pyroute2 has no usable nftables API, and the nft command is what
every distribution ships.

`apply` makes an interface shape exactly as told (whatever was there goes); `change` updates the
profiles in place when the tree stays the same (no moment unshaped, queues kept), else rebuilds;
`show` reads the rules back from the kernel; `clear` removes everything. A step that fails leaves
the interface unshaped, never half-shaped.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import TC_H_INGRESS, TC_H_ROOT

from netem import netlink
from netem.capabilities import netem_available
from netem.namespace import NamespaceError, netlink_in
from netem.offload import set_offloads
from netem.plan import (
    DEFAULT_MINOR,
    INGRESS,
    LOSS_MODULUS,
    NFT_TABLE,
    QUANTUM,
    ROOT,
    UNLIMITED,
    Backend,
    Direction,
    FifoLeaf,
    HtbClass,
    Ifb,
    IngressQdisc,
    NetemLeaf,
    Network,
    NftLoss,
    Offloads,
    Plan,
    Redirect,
    RootHtb,
    Rules,
    Source,
    SourceFilter,
    Step,
    UnsupportedByKernel,
    build_plan,
    ifb_name,
    netns_prefix,
    nft_chain,
    parse_source,
    render_commands,
    source_key,
)
from netem.profile import LinkProfile

ETH_P_ALL = 0x0003
ETHER_TYPES = {4: 0x0800, 6: 0x86DD}  # by IP version: the filter's protocol
IP_SRC_OFFSETS = {4: 12, 6: 8}  # of the source address in the IP header, where u32 matches it
NETWORKS = {4: ipaddress.IPv4Network, 6: ipaddress.IPv6Network}
ADDRESS_BITS = {4: ipaddress.IPV4LENGTH, 6: ipaddress.IPV6LENGTH}
U32_SEL = struct.Struct("=BBBxHHhhI")  # struct tc_u32_sel, followed by its keys
U32_KEY = struct.Struct("=4s4sii")  # struct tc_u32_key: mask, value (network order), off, offmask
NFT_FAMILIES: dict[Direction, str] = {"egress": "netdev", "ingress": "ip"}


class ShapingError(RuntimeError):
    """The kernel refused a step; the message is the equivalent command and the reason."""


@dataclass(frozen=True)
class AppliedShaping:
    """What `apply`/`change` installed: the plan, where, and what else was done for it."""

    plan: Plan
    netns: str | None
    offloads_disabled: list[str] = field(default_factory=list)
    in_place: bool = False  # `change` updated the profiles without rebuilding the tree

    @property
    def iface(self) -> str:
        return self.plan.iface

    @property
    def device(self) -> str:
        return self.plan.device

    @property
    def direction(self) -> Direction:
        return self.plan.direction

    @property
    def backend(self) -> Backend:
        return self.plan.backend

    @property
    def rules(self) -> dict[str | None, LinkProfile]:
        return self.plan.profiles()

    def commands(self) -> list[str]:
        """The equivalent tc/nft command lines."""
        return render_commands(self.plan, self.netns)


def resolve_backend(backend: Literal["auto", "netem", "fallback"]) -> Backend:
    """'auto' is netem where the kernel has sch_netem (tried once per process), else fallback."""
    if backend == "auto":
        return "netem" if netem_available() else "fallback"
    return backend


def apply(
    iface: str,
    rules: Rules | LinkProfile,
    *,
    netns: str | None = None,
    direction: Direction = "egress",
    backend: Literal["auto", "netem", "fallback"] = "auto",
) -> AppliedShaping:
    """Shape `iface` (in `netns`, a name or path; None: this namespace) as `rules` say.

    `rules` maps a source (an IPv4 or IPv6 address or network, or a tuple of them that share
    one class) to the profile of the traffic it sends through `iface`; None is everyone else (a
    perfect link unless given). A profile alone is one rule for everyone. Whatever shaping the
    interface had is replaced. Offloads are turned off on the interface (see netem.offload).
    Raises UnsupportedByKernel before touching anything when the backend cannot do what is
    asked.
    """
    plan = build_plan(iface, rules, direction=direction, backend=usable(backend))
    clear(iface, netns=netns)
    return carry_out(plan, netns, change=False)


def change(
    iface: str,
    rules: Rules | LinkProfile,
    *,
    netns: str | None = None,
    direction: Direction = "egress",
    backend: Literal["auto", "netem", "fallback"] = "auto",
) -> AppliedShaping:
    """Like `apply`, but when the interface already carries the same tree (direction, backend,
    sources) only the profiles are replaced, in place: no moment without shaping, no queue
    flushed. Anything else is rebuilt by `apply`. Every netem leaf gets its whole profile again,
    a seed included: netem draws its random numbers from the seed's start again."""
    plan = build_plan(iface, rules, direction=direction, backend=usable(backend))
    with _netlink(netns) as ipr:
        installed = _installed(ipr, iface, netns)
    if installed is None or installed.layout != plan.layout:
        return apply(iface, rules, netns=netns, direction=direction, backend=plan.backend)
    return carry_out(plan, netns, change=True)


def show(iface: str, *, netns: str | None = None) -> dict[str | None, LinkProfile]:
    """The rules shaping `iface`, read from the kernel ({} if it is not shaped by `apply`).

    The default rule (None) is always present when it is shaped."""
    plan = installed(iface, netns=netns)
    return {} if plan is None else plan.profiles()


def installed(iface: str, *, netns: str | None = None) -> Plan | None:
    """What the kernel has on `iface`, as the plan that would install it (its direction, its
    backend: netem leaves or the fallback's, its rules), or None if `apply` did not shape it."""
    with _netlink(netns) as ipr:
        return _installed(ipr, iface, netns)


def clear(iface: str, *, netns: str | None = None) -> None:
    """Remove all shaping from `iface`: its root and ingress qdiscs (with every class, leaf and
    filter), its ifb, its nft chain (and the table when it was the last one), what was
    recorded of its netem leaves (distributions, seeds). Idempotent. Offloads stay off."""
    ifb = ifb_name(iface)
    with _netlink(netns) as ipr:
        index = _index(ipr, iface)
        for qdisc in ipr.get_qdiscs(index=index):
            if qdisc["parent"] in (TC_H_ROOT, TC_H_INGRESS) and qdisc["handle"]:
                _ignore_missing(ipr.tc, "del", index=index, handle=qdisc["handle"],
                                parent=qdisc["parent"])
        ifb_index = _ifb_index(ipr, ifb)
        if ifb_index is not None:
            _ignore_missing(ipr.link, "del", index=ifb_index)
    _drop_nft(iface, netns)
    for device in (iface, ifb):
        netlink.forget_annotations(_annotation_key(netns, device))


def usable(backend: Literal["auto", "netem", "fallback"]) -> Backend:
    """The backend `backend` resolves to, or the clear error when netem is asked of a kernel
    without sch_netem."""
    resolved = resolve_backend(backend)
    if backend == "netem" and not netem_available():
        raise UnsupportedByKernel(
            "backend: netem needs sch_netem, which this kernel lacks; use backend 'fallback' "
            "(loss, rate and limit only) or run in the UML sandbox, whose kernel has netem: "
            "`python -m netem.sandbox run -- CMD` (docs/sandbox.md)"
        )
    return resolved


# ---------------------------------------------------------------------------------------------
# Carrying out a plan


def carry_out(plan: Plan, netns: str | None, *, change: bool) -> AppliedShaping:
    """Run the plan's steps (on change: only those that carry profiles). On any failure,
    Ctrl-C included, the interface is cleared before the error goes on."""
    try:
        with _netlink(netns) as ipr:
            run = _Run(ipr, netns, change)
            for step in plan.steps:
                if not (change and step.structural):
                    run.step(step)
            # A change in place keeps the layout, the backend included: only the fallback's
            # tree can have a drop rule left that the new profiles no longer want.
            if change and plan.backend == "fallback" and not any(
                    isinstance(step, NftLoss) for step in plan.steps):
                _drop_nft(plan.iface, netns)
    except BaseException:
        clear(plan.iface, netns=netns)
        raise
    return AppliedShaping(plan, netns, run.offloads_disabled, in_place=change)


@dataclass
class _Run:
    """Carries out steps through one netlink socket in the namespace."""

    ipr: IPRoute
    netns: str | None
    change: bool
    offloads_disabled: list[str] = field(default_factory=list)

    def step(self, step: Step) -> None:
        try:
            self._do(step)
        except (NetlinkError, OSError) as exc:
            reason = os.strerror(exc.code) if isinstance(exc, NetlinkError) else exc
            raise ShapingError(f"{'; '.join(step.commands())}: {reason}") from exc

    def _do(self, step: Step) -> None:
        ipr, verb = self.ipr, "change" if self.change else "add"
        match step:
            case Offloads(device=device):
                states = set_offloads(device, netns=self.netns)
                self.offloads_disabled = [name for name, on in states.items() if not on]
            case Ifb(name=name):
                ipr.link("add", ifname=name, kind="ifb")
                ipr.link("set", index=_index(ipr, name), state="up")
            case RootHtb(device=device):
                ipr.tc("replace", "htb", index=_index(ipr, device), handle=ROOT,
                       parent=TC_H_ROOT, default=DEFAULT_MINOR)
            case HtbClass(device=device, classid=classid, rate=rate):
                ipr.tc(f"{verb}-class", "htb", index=_index(ipr, device), handle=classid,
                       parent=ROOT, rate=rate // 8, ceil=rate // 8, quantum=QUANTUM)
            case NetemLeaf(device=device, parent=parent, handle=handle, profile=profile):
                netlink.add_netem(ipr, _index(ipr, device), parent, handle, profile,
                                  command=verb, annotate=_annotation_key(self.netns, device))
            case FifoLeaf(device=device, parent=parent, handle=handle, limit=limit):
                ipr.tc(verb, "pfifo", index=_index(ipr, device), handle=handle, parent=parent,
                       limit=limit)
            case SourceFilter(device=device, prio=prio, source=source, classid=classid):
                network = parse_source(source)
                ipr.tc("add-filter", "u32", index=_index(ipr, device), parent=ROOT, prio=prio,
                       protocol=ETHER_TYPES[network.version], target=classid,
                       keys=_u32_keys(network))
            case IngressQdisc(device=device):
                ipr.tc("add", "ingress", index=_index(ipr, device))
            case Redirect(device=device, ifb=ifb):
                mirred = {"kind": "mirred", "direction": "egress", "action": "redirect",
                          "ifindex": _index(ipr, ifb)}
                ipr.tc("add-filter", "u32", index=_index(ipr, device), parent=INGRESS, prio=1,
                       protocol=ETH_P_ALL, target=ROOT, keys=["0x0/0x0+0"], action=[mirred])
            case NftLoss():
                nft_script(step.statements(), self.netns)
            case _:  # pragma: no cover - every step type of netem.plan is handled above
                raise TypeError(f"no way to carry out {step!r}")


# ---------------------------------------------------------------------------------------------
# Reading the kernel back


@dataclass(frozen=True)
class _Class:
    rate: int  # bit/s
    leaf: str  # the leaf qdisc's kind
    leaf_handle: int
    limit: int  # of a pfifo leaf


def _installed(ipr: IPRoute, iface: str, netns: str | None) -> Plan | None:
    """The plan that would install what the kernel has on `iface`, or None if it carries no
    tree of ours. The direction is ingress when the interface redirects to its ifb."""
    index = _index(ipr, iface)
    ifb = ifb_name(iface)
    redirected = any(q["parent"] == TC_H_INGRESS for q in ipr.get_qdiscs(index=index))
    ingress = redirected and _ifb_index(ipr, ifb) is not None
    direction: Direction = "ingress" if ingress else "egress"
    device = ifb if ingress else iface
    device_index = _index(ipr, device)
    qdiscs = list(ipr.get_qdiscs(index=device_index))
    root = next((q for q in qdiscs if q["parent"] == TC_H_ROOT), None)
    if root is None or root.get_attr("TCA_KIND") != "htb" or root["handle"] != ROOT:
        return None
    leaves = {q["parent"]: q for q in qdiscs if q["parent"] >> 16 == ROOT >> 16}
    classes = {
        c["handle"]: _htb_class(c, leaves.get(c["handle"]))
        for c in ipr.get_classes(index=device_index)
    }
    kinds = {c.leaf for c in classes.values()}
    if kinds not in ({"netem"}, {"pfifo"}):
        raise ValueError(
            f"{device}: an htb root whose leaves are {', '.join(sorted(kinds))}: not a tree "
            "made by netem.apply (clear it first)"
        )
    backend: Backend = "netem" if kinds == {"netem"} else "fallback"
    matched: dict[int, list[str]] = {}  # class -> its sources, by prio
    for _, source, classid in _source_filters(ipr, device_index):
        matched.setdefault(classid, []).append(source)
    sources: dict[int, Source] = {
        classid: found[0] if len(found) == 1 else tuple(found)
        for classid, found in matched.items()
    }
    losses = _nft_losses(direction, iface, netns) if backend == "fallback" else {}
    rules: dict[Source | None, LinkProfile] = {}
    for classid in (*sources, ROOT | DEFAULT_MINOR):
        source, found = sources.get(classid), classes[classid]
        if backend == "netem":
            rules[source] = netlink.read_netem(ipr, device_index, found.leaf_handle,
                                               annotate=_annotation_key(netns, device))
        else:
            rate = None if found.rate == UNLIMITED else found.rate
            loss = losses.get(matched[classid][0] if classid in matched else None, 0.0)
            rules[source] = LinkProfile(loss=loss, rate=rate, limit=found.limit)
    return build_plan(iface, rules, direction=direction, backend=backend)


def _htb_class(message: Any, leaf: Any) -> _Class:
    parms = message.get_attr("TCA_OPTIONS")
    rate = parms.get_attr("TCA_HTB_RATE64") or parms.get_attr("TCA_HTB_PARMS")["rate"]
    if leaf is None:
        return _Class(rate * 8, "none", 0, 0)
    kind = leaf.get_attr("TCA_KIND")
    limit = leaf.get_attr("TCA_OPTIONS")["limit"] if kind == "pfifo" else 0
    return _Class(rate * 8, kind, leaf["handle"], limit)


def _source_filters(ipr: IPRoute, index: int) -> list[tuple[int, str, int]]:
    """(prio, source, class) of the u32 `match ip src` and `match ip6 src` filters on the htb
    root, by prio."""
    found = []
    for message in ipr.get_filters(index=index, parent=ROOT):
        options = message.get_attr("TCA_OPTIONS")
        if message.get_attr("TCA_KIND") != "u32" or options is None:
            continue
        classid = options.get_attr("TCA_U32_CLASSID")
        if classid is None or options.get_attr("TCA_U32_SEL") is None:
            continue  # the hash tables u32 dumps beside its filters
        found.append((message["info"] >> 16, _u32_source(options.nla("TCA_U32_SEL")), classid))
    return sorted(found)


def _u32_keys(network: Network) -> list[str]:
    """u32 keys ("value/mask+offset") that match `network` as the source: one per 32-bit word
    of the address that the prefix reaches into (at least one), as `tc` makes them."""
    address, mask, bits = int(network.network_address), int(network.netmask), network.max_prefixlen
    keys = []
    for word in range(max(1, -(-network.prefixlen // 32))):
        shift = bits - 32 * (word + 1)
        keys.append(f"{address >> shift & 0xFFFFFFFF:#010x}/{mask >> shift & 0xFFFFFFFF:#010x}"
                    f"+{IP_SRC_OFFSETS[network.version] + 4 * word}")
    return keys


def _u32_source(selector: Any) -> str:
    """The source of a u32 selector made by `_u32_keys` (IPv4: one key at the source address;
    IPv6: a key per word from its start). Decoded here from the raw attribute: pyroute2 0.9.7
    reads the keys 4 bytes off."""
    start = selector.offset + 4  # past the attribute's own header
    nkeys = U32_SEL.unpack_from(selector.data, start)[2]
    keys = [
        U32_KEY.unpack_from(selector.data, start + U32_SEL.size + n * U32_KEY.size)
        for n in range(nkeys)
    ]
    offsets = [key[2] for key in keys]
    version = next((v for v, first in IP_SRC_OFFSETS.items()
                    if 0 < len(keys) <= ADDRESS_BITS[v] // 32
                    and offsets == list(range(first, first + 4 * len(keys), 4))), None)
    if version is None:
        raise ValueError(f"a u32 filter with keys {keys}: not a source match of netem.apply")
    bits = ADDRESS_BITS[version]
    value = mask = 0
    for n, (word_mask, word, _, _) in enumerate(keys):
        shift = bits - 32 * (n + 1)
        value |= int.from_bytes(word, "big") << shift
        mask |= int.from_bytes(word_mask, "big") << shift
    return source_key(NETWORKS[version]((value, mask.bit_count())))


# ---------------------------------------------------------------------------------------------
# nftables (the fallback's loss)


def _nft(netns: str | None, *args: str, script: str | None = None) -> str:
    """Run nft in the namespace (a script on stdin is one transaction); return its output."""
    if shutil.which("nft") is None:
        raise ShapingError("the fallback's loss needs the nft command (Debian package nftables)")
    result = subprocess.run([*netns_prefix(netns), "nft", *args], input=script,
                            capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise ShapingError(f"nft {' '.join(args)}: {result.stderr.strip() or 'failed'}")
    return result.stdout


def nft_script(statements: list[str], netns: str | None) -> None:
    """Run nft `statements` as one transaction (`nft -f -`): all or nothing."""
    _nft(netns, "-f", "-", script="\n".join(statements) + "\n")


def _nft_chains(netns: str | None) -> set[tuple[str, str, str]]:
    """(family, table, chain) of every nft chain in the namespace. None without a usable
    nftables (no nft command, or a kernel without nf_tables, where `list` itself fails): then
    nothing of the fallback's can be there, and the netem backend, which needs no nftables,
    goes on."""
    if shutil.which("nft") is None:
        return set()
    try:
        listing = json.loads(_nft(netns, "-j", "list", "chains"))
    except ShapingError:
        return set()
    return {
        (item["chain"]["family"], item["chain"]["table"], item["chain"]["name"])
        for item in listing["nftables"]
        if "chain" in item
    }


def _drop_nft(iface: str, netns: str | None) -> None:
    """Delete the interface's chains, and the table with its last chain."""
    chains = _nft_chains(netns)
    statements = []
    for direction, family in NFT_FAMILIES.items():
        ours = {name for fam, table, name in chains if (fam, table) == (family, NFT_TABLE)}
        chain = nft_chain(direction, iface)
        if chain not in ours:
            continue
        if ours == {chain}:
            statements.append(f"delete table {family} {NFT_TABLE}")
        else:
            statements.append(f"delete chain {family} {NFT_TABLE} {chain}")
    if statements:
        nft_script(statements, netns)


def _nft_losses(direction: Direction, iface: str, netns: str | None) -> dict[str | None, float]:
    """{source: loss} of the interface's drop rules (`numgen random mod M < k drop`, or a plain
    `drop`: all of it)."""
    family, chain = NFT_FAMILIES[direction], nft_chain(direction, iface)
    if (family, NFT_TABLE, chain) not in _nft_chains(netns):
        return {}
    listing = json.loads(_nft(netns, "-j", "list", "chain", family, NFT_TABLE, chain))
    losses: dict[str | None, float] = {}
    for item in listing["nftables"]:
        expressions = item.get("rule", {}).get("expr", [])
        if not any("drop" in expression for expression in expressions):
            continue
        source, cut = None, LOSS_MODULUS  # a drop without numgen drops everything
        for expression in expressions:
            match = expression.get("match", {})
            left, right = match.get("left", {}), match.get("right")
            if left.get("payload", {}).get("field") == "saddr":
                prefix = right.get("prefix") if isinstance(right, dict) else None
                source = f"{prefix['addr']}/{prefix['len']}" if prefix else right
            elif "numgen" in left and match.get("op") == "<":
                if left["numgen"]["mod"] != LOSS_MODULUS:
                    raise ValueError(f"{chain}: a numgen rule not made by netem.apply: {item}")
                cut = right
        key = None if source is None else source_key(parse_source(source))
        losses[key] = round(cut / LOSS_MODULUS, 9)
    return losses


# ---------------------------------------------------------------------------------------------
# Helpers


@contextmanager
def _netlink(netns: str | None) -> Iterator[IPRoute]:
    """A netlink socket in the namespace; a missing namespace is an error, never created."""
    try:
        ipr = netlink_in(netns)
    except NamespaceError:
        raise ShapingError(f"network namespace {netns!r} does not exist") from None
    with ipr:
        yield ipr


def _index(ipr: IPRoute, device: str) -> int:
    found = ipr.link_lookup(ifname=device)
    if not found:
        raise ShapingError(f"no interface {device!r} in this namespace")
    return found[0]


def _ifb_index(ipr: IPRoute, name: str) -> int | None:
    """The index of the ifb device of that name, if there is one (another kind is not ours)."""
    for link in ipr.get_links(ifname=name):
        info = link.get_attr("IFLA_LINKINFO")
        if info is not None and info.get_attr("IFLA_INFO_KIND") == "ifb":
            return link["index"]
    return None


def _ignore_missing(call: Any, *args: Any, **kwargs: Any) -> None:
    """Remove something that may have gone already (a parallel clear, the namespace's end)."""
    try:
        call(*args, **kwargs)
    except NetlinkError as exc:
        if exc.code not in (errno.ENOENT, errno.ENODEV, errno.EINVAL):
            raise


def _annotation_key(netns: str | None, device: str) -> str:
    """Where netem.netlink records what the kernel does not dump of a tree's netem leaves."""
    return f"{netns or '-'}/{device}"
