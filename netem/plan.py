"""Shaping plans: what goes on which device, as plain data, before anything touches a kernel.

A plan is built from an interface, a direction and rules ({source: profile}; None is everyone
else; a source is an IPv4 or IPv6 address or network, or a tuple of them that are one sender,
such as a host's IPv4 and IPv6 addresses: they share one class, so one link). It is a list of
small steps, each of which renders to the `tc`/`nft`/`ip`/`ethtool` command line doing the same
thing (`render_commands`, for dry runs), and which `netem.backend` carries out through netlink.
Nothing here needs root or does I/O.

Where the shaping happens (DESIGN: shape where the wire is): a drop on the sender's own egress is
seen by its stack (TCP retransmits at once, UDP gets an error), so links are shaped
- `egress`: on the egress of a device that forwards the traffic, e.g. the switch-side veth port
  towards the receiver (what a `Lab` uses): the sender's stack never learns of a loss;
- `ingress`: on the receiver's own interface. Ingress has no queue, so its traffic is redirected
  (u32 + `mirred`) to an ifb device whose egress carries the same tree.

The tree, on the interface (egress) or its ifb (ingress):

    htb 1: (default 1:1)
    ├── class 1:2 ─ leaf 102:     u32 `match ip src A` prio 1 -> 1:2   (most specific first)
    │                             u32 `match ip6 src A6` prio 3 -> 1:2 (IPv6 after IPv4)
    ├── class 1:3 ─ leaf 103:     u32 `match ip src B` prio 2 -> 1:3
    └── class 1:1 ─ leaf 101:     everyone else (the None rule)

The netem backend hangs a netem qdisc under each class (it does the rate too, in line with its
delay). The fallback, for kernels without sch_netem, meters the rate with the htb class itself,
keeps the queue limit in a pfifo leaf, and drops packets at random with nftables `numgen`; what
it cannot do raises `UnsupportedByKernel`, never a silent no-op.
"""

from __future__ import annotations

import ipaddress
import shlex
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from netem.offload import ETHTOOL_NAMES
from netem.profile import LinkProfile, ProfileError
from netem.tc import format_handle, netem_tc_args
from netem.units import format_rate

Direction = Literal["egress", "ingress"]
Backend = Literal["netem", "fallback"]
Source = str | tuple[str, ...]  # one address or network, or several that are one sender's
Rules = Mapping[Source | None, LinkProfile]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ROOT = 0x10000  # the htb root, "1:"
DEFAULT_MINOR = 1  # class 1:1 takes whatever no source filter claims
LEAF_BASE = 0x100  # class 1:m has its leaf at (0x100 + m):
INGRESS = 0xFFFF0000  # the ingress qdisc, "ffff:"
MAX_RULES = 4096  # classes 1:1.. and leaves 101:.. stay clear of the ingress handle ffff:
UNLIMITED = 8 * 10**12  # bit/s: the htb rate of a class that does not limit (no rate, netem)
QUANTUM = 1514  # bytes: htb classes take turns frame by frame when the device is the bottleneck
NFT_TABLE = "netem_testbed"
LOSS_MODULUS = 10**9  # numgen's range: a profile's loss is on a 1e-9 grid, so this is exact
# The seed goes too, unused: nftables' numgen takes none, so the fallback's loss is not repeatable.
FALLBACK_FIELDS = frozenset({"loss", "rate", "limit", "seed"})
IFNAMSIZ = 16


class UnsupportedByKernel(ProfileError):
    """The profile needs a kernel feature this one lacks; the message names the fields, the
    feature and the way out (the UML sandbox)."""


@dataclass(frozen=True)
class Rule:
    """One traffic class: its source (a normalised address or network, a tuple of them for a
    sender with several; None for everyone else) and its profile. `minor` numbers the htb class
    1:minor."""

    source: Source | None
    profile: LinkProfile
    minor: int

    @property
    def sources(self) -> tuple[str, ...]:
        """Every address or network the class takes (none for everyone else's)."""
        if self.source is None:
            return ()
        return self.source if isinstance(self.source, tuple) else (self.source,)

    @property
    def classid(self) -> int:
        return ROOT | self.minor

    @property
    def leaf(self) -> int:
        return (LEAF_BASE + self.minor) << 16


class Step:
    """One thing to set up. Structural steps build the tree; the others carry the profiles and
    are what `netem.backend.change` redoes in place when the tree stays the same."""

    structural: ClassVar[bool] = True

    def commands(self) -> list[str]:
        raise NotImplementedError


@dataclass(frozen=True)
class Offloads(Step):
    """Segmentation/aggregation offloads off, so the shaping acts on wire-sized frames."""

    device: str
    structural: ClassVar[bool] = False

    def commands(self) -> list[str]:
        switches = " ".join(f"{name} off" for name in ETHTOOL_NAMES.values())
        return [f"ethtool -K {self.device} {switches}"]


@dataclass(frozen=True)
class Ifb(Step):
    """The ifb device that gives an interface's ingress traffic a queue."""

    name: str

    def commands(self) -> list[str]:
        return [f"ip link add {self.name} type ifb", f"ip link set {self.name} up"]


@dataclass(frozen=True)
class RootHtb(Step):
    """The htb root; it replaces whatever root qdisc the device had."""

    device: str

    def commands(self) -> list[str]:
        return [
            f"tc qdisc replace dev {self.device} root handle {format_handle(ROOT)} htb "
            f"default {DEFAULT_MINOR:x}"
        ]


@dataclass(frozen=True)
class HtbClass(Step):
    """A class of the root, limited to `rate` bit/s (`UNLIMITED` when it should not limit)."""

    device: str
    classid: int
    rate: int
    structural: ClassVar[bool] = False

    def commands(self) -> list[str]:
        rate = format_rate(self.rate)
        return [
            f"tc class add dev {self.device} parent {format_handle(ROOT)} classid "
            f"{format_handle(self.classid)} htb rate {rate} ceil {rate} quantum {QUANTUM}"
        ]


@dataclass(frozen=True)
class NetemLeaf(Step):
    device: str
    parent: int
    handle: int
    profile: LinkProfile
    structural: ClassVar[bool] = False

    def commands(self) -> list[str]:
        return [
            f"tc qdisc add dev {self.device} parent {format_handle(self.parent)} handle "
            f"{format_handle(self.handle)} netem {' '.join(netem_tc_args(self.profile))}"
        ]


@dataclass(frozen=True)
class FifoLeaf(Step):
    """The fallback's leaf: a packet fifo, so the profile's queue limit holds here too."""

    device: str
    parent: int
    handle: int
    limit: int
    structural: ClassVar[bool] = False

    def commands(self) -> list[str]:
        return [
            f"tc qdisc add dev {self.device} parent {format_handle(self.parent)} handle "
            f"{format_handle(self.handle)} pfifo limit {self.limit}"
        ]


@dataclass(frozen=True)
class SourceFilter(Step):
    """Sends IPv4 or IPv6 packets from `source` to a class; lower `prio` is tried first."""

    device: str
    prio: int
    source: str
    classid: int

    def commands(self) -> list[str]:
        header = address_header(self.source)
        protocol = "ip" if header == "ip" else "ipv6"
        return [
            f"tc filter add dev {self.device} parent {format_handle(ROOT)} protocol {protocol} "
            f"prio {self.prio} u32 match {header} src {parse_source(self.source)} flowid "
            f"{format_handle(self.classid)}"
        ]


@dataclass(frozen=True)
class IngressQdisc(Step):
    device: str

    def commands(self) -> list[str]:
        return [f"tc qdisc add dev {self.device} handle {format_handle(INGRESS)} ingress"]


@dataclass(frozen=True)
class Redirect(Step):
    """Every packet arriving on `device` goes through `ifb` first (added last: the ifb's tree
    is complete before traffic reaches it)."""

    device: str
    ifb: str

    def commands(self) -> list[str]:
        return [
            f"tc filter add dev {self.device} parent {format_handle(INGRESS)} protocol all "
            f"prio 1 u32 match u32 0 0 action mirred egress redirect dev {self.ifb}"
        ]


@dataclass(frozen=True)
class NftLoss(Step):
    """The fallback's random loss: one nft chain per shaped interface, in table `NFT_TABLE`.

    - egress: family `netdev`, hook `egress` of the interface. It runs before the qdisc, so a
      packet is lost before it queues for the rate, as in netem.
    - ingress: family `ip`, hook `prerouting` at priority raw, for packets that arrived on the
      interface. Packets coming back from an ifb skip the netdev hooks of both devices, so this
      is the first place after the ifb's rate where they can be dropped: on the receiver's side,
      never in the sender's OUTPUT (which would hand the sender an error instead of a loss).

    Rules go in the filters' order (per family, most specific source first); a matched source
    ends the chain with `accept` so the default's rule never sees it. Drops use `numgen random
    mod 10^9 < k`, exact on a profile's 1e-9 grid; 100% loss is a plain `drop`. A source's rules
    match its family (`ip saddr`, `ip6 saddr`); the default's drops IPv4 only, and so does the
    ingress chain, whose family is `ip` (`build_plan` refuses lossy IPv6 sources there).
    """

    direction: Direction
    iface: str
    losses: tuple[tuple[str | None, float], ...]  # (source, loss) in class order
    structural: ClassVar[bool] = False

    @property
    def family(self) -> str:
        return "netdev" if self.direction == "egress" else "ip"

    @property
    def chain(self) -> str:
        return nft_chain(self.direction, self.iface)

    def statements(self) -> list[str]:
        """The nft commands, in one transaction: the chain's old rules go as the new ones come."""
        where = f"{self.family} {NFT_TABLE} {self.chain}"
        if self.direction == "egress":
            hook = f'type filter hook egress device "{self.iface}" priority 0; policy accept;'
            match, everyone = "", "meta protocol ip "
        else:
            hook = "type filter hook prerouting priority raw; policy accept;"
            match, everyone = f'iifname "{self.iface}" ', ""
        lines = [
            f"add table {self.family} {NFT_TABLE}",
            f"add chain {where} {{ {hook} }}",
            f"flush chain {where}",
        ]
        for source, loss in self.losses:
            selector = everyone if source is None else f"{address_header(source)} saddr {source} "
            cut = round(loss * LOSS_MODULUS)
            if cut >= LOSS_MODULUS:  # nft refuses `< 10^9` on a mod-10^9 number: drop all
                lines.append(f"add rule {where} {match}{selector}drop")
            elif cut:
                lines.append(
                    f"add rule {where} {match}{selector}numgen random mod {LOSS_MODULUS} < {cut} "
                    "drop"
                )
            if source is not None:
                lines.append(f"add rule {where} {match}{selector}accept")
        return lines

    def commands(self) -> list[str]:
        return [f"nft {shlex.quote('; '.join(self.statements()))}"]


@dataclass(frozen=True)
class Plan:
    """The rules in class order (sources most specific first, the default last) and the steps
    that install them."""

    iface: str
    direction: Direction
    backend: Backend
    rules: tuple[Rule, ...]
    steps: tuple[Step, ...]

    @property
    def device(self) -> str:
        """Where the htb tree sits: the interface, or its ifb for ingress."""
        return self.iface if self.direction == "egress" else ifb_name(self.iface)

    @property
    def layout(self) -> tuple[str, str, tuple[str | None, ...], tuple[bool, ...]]:
        """What fixes the tree: equal layouts differ only in what a change can set in place.
        That is all of a profile but a slot distribution coming or going: netem keeps a slot
        table once given, and with one it never takes min/max slots again."""
        return (self.direction, self.backend, tuple(rule.source for rule in self.rules),
                tuple(_slot_table(rule.profile) for rule in self.rules))

    def profiles(self) -> dict[str | None, LinkProfile]:
        """{source: profile} with each address or network on its own (what `show` answers)."""
        return {source: rule.profile for rule in self.rules for source in rule.sources or [None]}

    def as_rules(self) -> dict[Source | None, LinkProfile]:
        """The rules as `build_plan` takes them, a sender's sources together: they build this
        plan again."""
        return {rule.source: rule.profile for rule in self.rules}


def _slot_table(profile: LinkProfile) -> bool:
    return profile.slot is not None and profile.slot.distribution is not None


def build_plan(
    iface: str,
    rules: Rules | LinkProfile,
    *,
    direction: Direction = "egress",
    backend: Backend = "netem",
) -> Plan:
    """The plan that shapes `iface` as `rules` say (a profile alone: one rule for everyone).

    Raises ValueError for a bad interface name, direction, backend or source, ProfileError for a
    rate the fallback cannot meter, and UnsupportedByKernel when the fallback is asked for what
    only netem does.
    """
    _check_choice("direction", direction, Direction)
    _check_choice("backend", backend, Backend)
    check_iface(iface)
    ordered = normalize_rules(rules)
    if backend == "fallback":
        _check_fallback(ordered, direction)
    device = iface if direction == "egress" else ifb_name(iface)
    steps: list[Step] = [Offloads(iface)]
    if direction == "ingress":
        steps.append(Ifb(device))
    steps.append(RootHtb(device))
    for rule in ordered:
        rate = rule.profile.rate if backend == "fallback" and rule.profile.rate else UNLIMITED
        steps.append(HtbClass(device, rule.classid, rate))
        if backend == "netem":
            steps.append(NetemLeaf(device, rule.classid, rule.leaf, rule.profile))
        else:
            steps.append(FifoLeaf(device, rule.classid, rule.leaf, rule.profile.limit))
    matches = source_matches(ordered)
    steps += [
        SourceFilter(device, prio, source, rule.classid)
        for prio, (source, rule) in enumerate(matches, start=1)
    ]
    if backend == "fallback" and any(rule.profile.loss for rule in ordered):
        losses = ((source, rule.profile.loss) for source, rule in matches)
        steps.append(NftLoss(direction, iface, (*losses, (None, ordered[-1].profile.loss))))
    if direction == "ingress":
        steps += [IngressQdisc(iface), Redirect(iface, device)]
    return Plan(iface, direction, backend, ordered, tuple(steps))


def normalize_rules(rules: Rules | LinkProfile) -> tuple[Rule, ...]:
    """Rules in class order: sources by family (IPv4 first) and prefix length, longest first
    (ties keep their order; a sender with several goes by its most specific one), then the
    default (None), which is always there (a perfect link unless given)."""
    if isinstance(rules, LinkProfile):
        rules = {None: rules}
    sources: dict[tuple[Network, ...], LinkProfile] = {}
    seen: set[Network] = set()
    for key, profile in rules.items():
        if not isinstance(profile, LinkProfile):
            raise TypeError(f"rules[{key!r}]: expected a LinkProfile, got {type(profile).__name__}")
        if key is None:
            continue
        networks = sorted((parse_source(one) for one in _each_source(key)), key=_specificity)
        for network in networks:
            if network in seen:
                raise ValueError(f"rules: source {key!r} is given twice (as {network})")
            seen.add(network)
        sources[tuple(networks)] = profile
    if len(sources) + 1 > MAX_RULES:
        raise ValueError(f"rules: at most {MAX_RULES - 1} sources, got {len(sources)}")
    ordered = sorted(sources, key=lambda networks: _specificity(networks[0]))
    return (
        *(
            Rule(_rule_key(networks), sources[networks], minor)
            for minor, networks in enumerate(ordered, start=DEFAULT_MINOR + 1)
        ),
        Rule(None, rules.get(None, LinkProfile()), DEFAULT_MINOR),
    )


def _each_source(key: Source) -> tuple[str, ...]:
    if isinstance(key, tuple):
        if not key:
            raise ValueError("rules: a source () names no address; use None for everyone else")
        return key
    return (key,)


def _rule_key(networks: tuple[Network, ...]) -> Source:
    keys = tuple(source_key(network) for network in networks)
    return keys[0] if len(keys) == 1 else keys


def _specificity(network: Network) -> tuple[int, int]:
    """Sorts sources into the filters' order: per family (IPv4 first), longest prefix first."""
    return network.version, -network.prefixlen


def source_matches(rules: tuple[Rule, ...]) -> list[tuple[str, Rule]]:
    """(source, its rule) for every source of every rule, in the order the filters and the nft
    rules try them: per family, longest prefix first, so a host with its own rule is never
    caught by its network's (ties keep the classes' order)."""
    matches = [(source, rule) for rule in rules for source in rule.sources]
    return sorted(matches, key=lambda match: _specificity(parse_source(match[0])))


def parse_source(key: str) -> Network:
    """An IPv4 or IPv6 address or network (host bits clear), as a rule's source."""
    try:
        return ipaddress.ip_network(key)
    except ValueError as exc:
        raise ValueError(
            f"rules: source {key!r} is not an IPv4 address or network, nor an IPv6 one ({exc}); "
            "use None for everyone else"
        ) from None


def source_key(network: Network) -> str:
    """How a source is written in rules: '198.18.0.1' or 'fd00:7e57::1' for one host,
    '198.18.0.0/24' else."""
    if network.prefixlen == network.max_prefixlen:
        return str(network.network_address)
    return str(network)


def address_header(source: str) -> str:
    """What tc's u32 and nft call the header a source is matched in: `ip` or `ip6`."""
    return "ip" if parse_source(source).version == 4 else "ip6"


def check_iface(iface: str) -> None:
    """Interface names go into commands and nft rules: hold them to the kernel's own rules."""
    bad = [c for c in iface if c in "/:\"'" or c.isspace() or not c.isprintable()]
    if bad or not 0 < len(iface) < IFNAMSIZ:
        raise ValueError(
            f"iface: {iface!r} is not an interface name (1-{IFNAMSIZ - 1} characters, no "
            "spaces, quotes, '/' or ':')"
        )


def ifb_name(iface: str) -> str:
    """The ifb that takes `iface`'s ingress traffic: 'ifb-' + the name, or a hash if too long."""
    name = f"ifb-{iface}"
    if len(name) < IFNAMSIZ:
        return name
    return f"ifb-{iface[:3]}{zlib.crc32(iface.encode()):08x}"


def nft_chain(direction: Direction, iface: str) -> str:
    """The nft chain of an interface: its name with every character but letters and digits
    spelled _xx (nft identifiers allow few characters; this keeps names distinct)."""
    spelled = "".join(c if c.isascii() and c.isalnum() else f"_{ord(c):02x}" for c in iface)
    return f"{direction}_{spelled}"


def netns_prefix(netns: str | None) -> list[str]:
    """The command that runs what follows in `netns` (a name, or a path such as
    /proc/PID/ns/net)."""
    if netns is None:
        return []
    if "/" in netns:
        return ["nsenter", f"--net={netns}"]
    return ["ip", "netns", "exec", netns]


def render_commands(plan: Plan, netns: str | None = None) -> list[str]:
    """The shell command lines that set up the same as `plan`, in order (for --dry-run)."""
    prefix = " ".join(shlex.quote(word) for word in netns_prefix(netns))
    return [f"{prefix} {line}" if prefix else line for step in plan.steps for line in
            step.commands()]


def _check_choice(name: str, value: str, choices: object) -> None:
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")


def _check_fallback(rules: tuple[Rule, ...], direction: Direction) -> None:
    """The fallback does loss (nft), rate (htb) and the queue limit (pfifo), nothing else; at
    ingress its loss sees IPv4 only."""
    problems = []
    for rule in rules:
        unsupported = sorted(set(rule.profile.model_dump(exclude_defaults=True)) - FALLBACK_FIELDS)
        if unsupported:
            who = "everyone else" if rule.source is None else f"from {', '.join(rule.sources)}"
            problems.append(f"{', '.join(unsupported)} ({who})")
        if rule.profile.rate is not None and rule.profile.rate >= UNLIMITED:
            raise ProfileError(
                f"rate: the fallback's htb classes take less than {format_rate(UNLIMITED)}, got "
                f"{format_rate(rule.profile.rate)}"
            )
    lossy_ipv6 = [source for rule in rules if rule.profile.loss for source in rule.sources
                  if parse_source(source).version == 6]
    if direction == "ingress" and lossy_ipv6:
        raise UnsupportedByKernel(
            f"the fallback cannot drop IPv6 at ingress (loss from {', '.join(lossy_ipv6)}): its "
            "ingress chain is nftables family ip, which sees IPv4 only. Shape on egress (as a "
            "Lab's switch ports are) or with netem, in the UML sandbox: "
            "`python -m netem.sandbox run -- CMD` (docs/sandbox.md)"
        )
    if problems:
        raise UnsupportedByKernel(
            f"the fallback cannot shape {'; '.join(problems)}: these need sch_netem, which this "
            "kernel lacks (the fallback does loss, rate and limit only). Run the command in the "
            "UML sandbox, whose kernel has netem: `python -m netem.sandbox run -- CMD` "
            "(docs/sandbox.md)"
        )
