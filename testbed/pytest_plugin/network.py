"""A shaped network for one test: `NetemNetwork`, its hosts, and what the marker and the factory
take (`NetworkSpec`).

The network is a `testbed.cluster.network.ClusterNetwork`: one namespace per host on a bridge,
every directed link src -> dst shaped on the egress of dst's switch port, per source address.
Partitions and heals go through its link state, as a scenario's timeline does. Measuring a link
is `netem.probe.probe` between the two namespaces, compared with `netem.probe.compare` against
what the link carries at that moment.

Every network has a seed, given or drawn (`seed`): each link's netem seed is derived from it as a
scenario's are (`testbed.scenario.links`), so a failed test can be replayed with the same
decisions to lose, duplicate, reorder and corrupt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import subprocess
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netem.plan import UnsupportedByKernel, build_plan
from netem.probe import (
    Check,
    ProbeResult,
    compare,
    offered_load,
    probe,
)
from netem.profile import LinkProfile, ProfileError
from netem.trace import TraceError
from testbed.cluster.network import ClusterNetwork
from testbed.cluster.replay import LinkReplay
from testbed.pytest_plugin.requirements import lacking_netem, missing
from testbed.scenario import Scenario, find_scenario, load_scenario

Pair = tuple[int, int]
ProfileLike = LinkProfile | Mapping[str, Any]
NETWORK_OPTIONS = ("hosts", "links", "scenario")  # the marker's keywords besides profile fields
SEED_BITS = 32  # of a drawn seed: short enough to paste
DEFAULT_HOSTS = 2
STOP_GRACE = 3.0  # seconds a host's process gets between SIGTERM and SIGKILL
RATE_SECONDS = 1.0  # the bulk train that measures a link's rate

_live: weakref.WeakSet[NetemNetwork] = weakref.WeakSet()  # started and not closed


def as_profile(value: ProfileLike | None, where: str | None = "profile") -> LinkProfile:
    """A `LinkProfile`, or a mapping of its fields in human units (`{"loss": "5%"}`); errors
    start with `where`."""
    if value is None:
        return LinkProfile()
    if isinstance(value, LinkProfile):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(LinkProfile.model_fields))
        if unknown:
            raise ProfileError(
                f"{where or 'profile'}: unknown field {', '.join(map(repr, unknown))}; a link "
                f"profile's fields are {', '.join(LinkProfile.model_fields)}")
        try:
            return LinkProfile.parse(value)
        except ProfileError as error:
            raise ProfileError(f"{where}: {error}" if where else str(error)) from None
    raise TypeError(f"{where or 'profile'}: expected a LinkProfile or a mapping of its fields, "
                    f"got {value!r}")


@dataclass(frozen=True)
class NetworkSpec:
    """What a network is made of; None: not given (the marker's, then the default)."""

    hosts: int | None = None
    profile: LinkProfile | None = None  # every link's, unless `links` says otherwise
    links: Mapping[Pair, LinkProfile] | None = None  # directed links with a profile of their own
    scenario: str | Path | None = None  # a scenario file (or a shipped one's name): its topology
    seed: int | None = None  # each link's seed is derived from it (a scenario: its own seed)

    @classmethod
    def of(cls, profile: ProfileLike | None = None, /, *, hosts: int | None = None,
           links: Mapping[Pair, ProfileLike] | None = None,
           scenario: str | Path | None = None, seed: int | None = None,
           **fields: Any) -> NetworkSpec:
        """From the marker's or the factory's arguments: a profile (or a mapping of its fields)
        and/or its fields as keywords (which win), `hosts`, `links`, `scenario`, `seed`. Raises
        `ProfileError` or `TypeError` naming what is wrong."""
        unknown = sorted(set(fields) - set(LinkProfile.model_fields))
        if unknown:
            raise ProfileError(
                f"unknown field {', '.join(map(repr, unknown))}: expected a link profile's "
                f"fields ({', '.join(LinkProfile.model_fields)}) or "
                f"{', '.join(NETWORK_OPTIONS)}")
        if hosts is not None and (isinstance(hosts, bool) or not isinstance(hosts, int)
                                  or hosts < 1):
            raise TypeError(f"hosts: expected a number of hosts (1 or more), got {hosts!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise TypeError(f"seed: expected an integer, 0 or more, got {seed!r}")
        given = None
        if profile is not None or fields:
            base = as_profile(profile).to_spec() if profile is not None else {}
            given = as_profile({**base, **fields}, where=None if profile is None else "profile")
        if scenario is not None and given is not None:
            raise TypeError("give a profile or a scenario (whose topology is the network), "
                            "not both")
        return cls(hosts, given, _links(links), scenario, seed)

    def under(self, marker: NetworkSpec) -> NetworkSpec:
        """This spec with what it leaves out taken from the marker's: the profile and the
        scenario as one (a given profile drops the marker's scenario and the other way round),
        hosts, links and the seed each on its own."""
        own_topology = self.profile is not None or self.scenario is not None
        return NetworkSpec(
            hosts=self.hosts if self.hosts is not None else marker.hosts,
            profile=self.profile if own_topology else marker.profile,
            links=self.links if self.links is not None else marker.links,
            scenario=self.scenario if own_topology else marker.scenario,
            seed=self.seed if self.seed is not None else marker.seed,
        )

    @property
    def needs_seed(self) -> bool:
        """Whether the network would have no seed: none given, and no scenario (whose seed it
        would be)."""
        return self.seed is None and self.scenario is None

    def scenario_model(self) -> Scenario:
        """The scenario whose topology the network is (`links` are set on top of it), with the
        spec's seed where it has one."""
        seed = {} if self.seed is None else {"seed": self.seed}
        if self.scenario is not None:
            scenario = load_scenario(find_scenario(self.scenario))
            if self.hosts is not None and self.hosts != scenario.count:
                raise TypeError(f"hosts: {self.hosts}, but scenario {self.scenario} has "
                                f"{scenario.count} workers")
            return scenario.model_copy(update=seed)
        return Scenario.model_validate({
            "name": "pytest",
            "workers": self.hosts if self.hosts is not None else DEFAULT_HOSTS,
            "topology": {"default": self.profile or LinkProfile()},
            **seed,
        })


def drawn_seed() -> int:
    """A seed for a network that was given none (the test's report says it, to replay)."""
    return secrets.randbits(SEED_BITS)


def _links(links: Mapping[Pair, ProfileLike] | None) -> dict[Pair, LinkProfile] | None:
    if links is None:
        return None
    if not isinstance(links, Mapping):
        raise TypeError(f"links: expected a mapping {{(src, dst): profile}}, got {links!r}")
    checked = {}
    for pair, value in links.items():
        if not (isinstance(pair, tuple) and len(pair) == 2
                and all(isinstance(end, int) and not isinstance(end, bool) for end in pair)):
            raise TypeError(f"links: expected (src, dst) host indices as keys, got {pair!r}")
        checked[pair] = as_profile(value, f"links[{pair}]")
    return checked


@dataclass(frozen=True)
class NetemHost:
    """One host of a `NetemNetwork`: its index, addresses and namespace; commands run inside.
    Its IPv6 address is on the same link as its IPv4 one: shaped alike, in the same class."""

    index: int
    address: str  # IPv4
    address6: str  # IPv6
    netns: str
    iface: str
    _network: NetemNetwork = field(repr=False, compare=False)

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside this host and wait (`subprocess.run`; text and output captured
        unless told otherwise)."""
        return self._network._cluster.lab.run(self._lab_host, argv, **kwargs)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start `argv` inside this host (`subprocess.Popen`, text mode unless told otherwise).
        The network stops it when it closes if it is still running: SIGTERM, then SIGKILL."""
        process = self._network._cluster.lab.popen(self._lab_host, argv, **kwargs)
        self._network._processes.append(process)
        return process

    @property
    def _lab_host(self) -> Any:
        return self._network._cluster.lab.hosts[self.index]

    def __str__(self) -> str:
        return f"h{self.index} ({self.address})"


@dataclass(frozen=True)
class Measurement:
    """A probe train across one link beside what the link was configured to do."""

    source: int
    destination: int
    configured: LinkProfile
    result: ProbeResult
    checks: dict[str, Check]  # by quantity: "loss", "delay mean", "rate", ...

    @property
    def passed(self) -> bool:
        """No check failed (quantities that cannot be predicted are not checks that fail)."""
        return not self.failures

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks.values() if check.passed is False]

    def assert_passed(self, *quantities: str) -> None:
        """Raise `AssertionError` with the whole table unless these quantities ("loss", "delay
        mean", ...) were checked and passed; without any, unless no check failed."""
        __tracebackhide__ = True
        unknown = [name for name in quantities if name not in self.checks]
        if unknown:
            raise KeyError(f"no check {', '.join(map(repr, unknown))}; the checks are "
                           f"{', '.join(map(repr, self.checks))}")
        wrong = ([name for name in quantities if self.checks[name].passed is not True]
                 if quantities else [check.quantity for check in self.failures])
        if wrong:
            raise AssertionError(f"{', '.join(wrong)}: not as configured\n{self}")

    def __str__(self) -> str:
        lines = [f"link {self.source}->{self.destination} ({self.configured}): "
                 f"{self.result.received}/{self.result.sent} probes arrived"]
        for check in self.checks.values():
            verdict = {True: "pass", False: "FAIL", None: "not checked"}[check.passed]
            lines.append(
                f"  {check.quantity}: configured {check.show(check.configured)}, measured "
                f"{check.show(check.measured)}, tolerance {check.show(check.tolerance)}: "
                f"{verdict}" + (f" ({check.note})" if check.note else ""))
        return "\n".join(lines)


class NetemNetwork:
    """Hosts in network namespaces on one bridge, every directed link shaped. Build it with the
    `make_netem_network` fixture (or `netem_network`); links are named by host index or host,
    `(src, dst)`, one direction each. A spec without a seed (nor a scenario) gets one drawn."""

    def __init__(self, spec: NetworkSpec,
                 on_unsupported: Callable[[str], None] | None = None) -> None:
        self.spec = dataclasses.replace(spec, seed=drawn_seed()) if spec.needs_seed else spec
        self._cluster = ClusterNetwork(self.spec.scenario_model())
        if spec.links:
            self._cluster.links.set(
                {self._cluster.links.pair(*pair): profile for pair, profile in spec.links.items()})
        self._on_unsupported = on_unsupported
        self._processes: list[subprocess.Popen[str]] = []
        self._replays: list[LinkReplay] = []
        self._owner = os.getpid()
        self.hosts: list[NetemHost] = []

    # -- life cycle

    def missing(self) -> str | None:
        """Why this host cannot build and shape the network, or None (creates nothing)."""
        return missing(self._cluster)

    def start(self) -> NetemNetwork:
        """Build the namespaces and shape every link; on any failure (Ctrl-C included) what was
        made is removed before the error goes on."""
        _live.add(self)
        try:
            self._cluster.start()
        except BaseException:
            self.close()
            raise
        self.hosts = [NetemHost(host.index, host.address, host.address6, host.netns, host.iface,
                                self) for host in self._cluster.lab.hosts]
        return self

    def close(self) -> None:
        """Stop the processes started in the hosts (SIGTERM, then SIGKILL), then remove every
        namespace with whatever still runs inside. Idempotent; only in the process that built
        the network."""
        if os.getpid() != self._owner:
            return
        try:
            for replay in self._replays:
                with contextlib.suppress(Exception):  # its error was the test's to see
                    replay.stop()
            self._stop_processes()
        finally:
            self._cluster.close()
            self.hosts = []
            _live.discard(self)

    def __enter__(self) -> NetemNetwork:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stop_processes(self) -> None:
        running = [process for process in self._processes if process.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        deadline = time.monotonic() + STOP_GRACE
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for process in self._processes:
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()

    def __repr__(self) -> str:
        state = f"{len(self.hosts)} hosts" if self.hosts else "not running"
        return f"<NetemNetwork {self.prefix}: {state}, {self.backend} shaping>"

    # -- what is where

    @property
    def prefix(self) -> str:
        """The start of every namespace's name (`<prefix>-h0`, ..., `<prefix>-sw`)."""
        return self._cluster.prefix

    @property
    def backend(self) -> str:
        """What shapes the links: "netem", or "fallback" (loss, rate and limit only)."""
        return self._cluster.backend

    @property
    def seed(self) -> int:
        """The network's seed: each link's netem seed is derived from it (`derive_seed(seed,
        src, dst)`) unless its profile gives one; the fallback's loss takes none."""
        return self._cluster.scenario.seed

    def __getitem__(self, index: int) -> NetemHost:
        return self.hosts[index]

    def __iter__(self) -> Iterator[NetemHost]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def profile(self, src: int | NetemHost, dst: int | NetemHost) -> LinkProfile:
        """What the link src -> dst carries now (a cut link: 100% loss)."""
        return self._cluster.links.effective(_index(src), _index(dst))

    # -- changes

    def set_link(self, src: int | NetemHost, dst: int | NetemHost,
                 profile: ProfileLike | None = None, **fields: Any) -> None:
        """Give the link src -> dst a profile (a `LinkProfile`, a mapping of its fields, and/or
        its fields as keywords), in place. A cut link stays cut until healed."""
        __tracebackhide__ = True
        base = as_profile(profile).to_spec() if profile is not None else {}
        new = as_profile({**base, **fields}, where=None if profile is None else "profile")
        self._shapeable(new)
        self._cluster.set_link(_index(src), _index(dst), new)

    def replay(self, src: int | NetemHost, dst: int | NetemHost, trace: str | Path, *,
               format: str | None = None, loop: bool = True,
               resolution: float = 0.1) -> LinkReplay:
        """Replay a recorded link trace (Mahimahi's or a CSV of changes, docs/conditions.md) on
        the link src -> dst from now, on top of its profile, every `resolution` seconds in
        place; looping unless `loop` is False (then the link goes back to its profile at the
        trace's end). Ends with the network, or at `stop()` of what it returns (which also
        raises the error of a change that failed). A bad trace raises ValueError naming the
        file, line and field."""
        __tracebackhide__ = True
        from pydantic import ValidationError

        from testbed.scenario.fields import dotted
        from testbed.scenario.messages import messages
        from testbed.scenario.topology import LinkTrace

        pair = self._cluster.links.pair(_index(src), _index(dst))
        given = {"file": str(trace), "format": format, "loop": loop, "resolution": resolution}
        try:
            replay = LinkReplay(self._cluster, {pair: LinkTrace.model_validate(given)})
        except ValidationError as error:
            raise ValueError("; ".join(f"{dotted(where) or 'trace'}: {message}"
                                       for where, message in messages(error, given))) from None
        except TraceError as error:  # a window that makes no profile with the link's
            raise ValueError(str(error)) from None
        for profile in replay.profiles():
            self._shapeable(profile)
        self._replays.append(replay.start())
        return replay

    def partition(self, links: Iterable[tuple[int | NetemHost, int | NetemHost]]) -> None:
        """Cut these directed links (100% loss): `[(0, 1), (1, 0)]` cuts both ways."""
        self._cluster.partition([(_index(src), _index(dst)) for src, dst in links])

    def heal(self, links: Iterable[tuple[int | NetemHost, int | NetemHost]] | None = None) -> None:
        """Restore these cut links (None: every cut link) to their profile."""
        pairs = None if links is None else [(_index(src), _index(dst)) for src, dst in links]
        self._cluster.heal(pairs)

    def _shapeable(self, profile: LinkProfile) -> None:
        """Raise (or skip the test) before anything changes if the backend cannot shape it."""
        __tracebackhide__ = True
        try:
            build_plan("p0", profile, backend=self._cluster.backend)
        except UnsupportedByKernel as error:
            if self._on_unsupported is not None:
                self._on_unsupported(lacking_netem([profile]) or str(error))
            raise

    # -- measuring

    def measure(self, src: int | NetemHost, dst: int | NetemHost, *, count: int = 5000,
                interval: float = 0.0004, rate: bool | None = None,
                timeout: float = 5.0) -> Measurement:
        """Send a probe train across src -> dst (`count` probes every `interval` seconds; with
        `rate`, by default when the link has one, a bulk train for the rate) and compare what
        arrived with what the link carries now (docs/probes.md has the tolerances). On a link
        with `ecn` the probes are ECN-capable, so the link marks them instead of dropping."""
        s, d = _index(src), _index(dst)
        configured = self.profile(s, d)
        source, destination = self.hosts[s], self.hosts[d]
        bulk = configured.rate is not None if rate is None else rate
        result = probe(source.netns, destination.netns, destination.address, count=count,
                       interval=interval, timeout=timeout,
                       rate_duration=RATE_SECONDS if bulk else 0.0,
                       offered_rate=offered_load(configured), ecn=configured.ecn)
        checks = {check.quantity: check
                  for check in compare(configured, result)}
        return Measurement(s, d, configured, result, checks)

    # -- for a failed test's report

    def describe(self) -> str:
        """Hosts, the seed, links that are not perfect, cut links and the processes started in
        hosts."""
        links = self._cluster.links
        lines = [f"{len(self.hosts)} hosts, namespaces {self.prefix}-h*, {self.backend} "
                 "shaping", f"seed {self.seed}"]
        lines += [f"  {host}: netns {host.netns}" for host in self.hosts]
        shaped = [f"  {src}->{dst}: {links.current(src, dst)}"
                  + (" (cut)" if links.is_cut(src, dst) else "")
                  for src in range(links.count) for dst in range(links.count)
                  if src != dst and (not links.current(src, dst).is_perfect
                                     or links.is_cut(src, dst))]
        lines += ["links:", *(shaped or ["  every link perfect"])]
        if self._processes:
            lines.append("processes started in hosts:")
            for process in self._processes:
                code = process.poll()
                state = "running" if code is None else f"exit code {code}"
                lines.append(f"  pid {process.pid} {_argv(process)}: {state}")
        return "\n".join(lines)


def _index(host: int | NetemHost) -> int:
    return host.index if isinstance(host, NetemHost) else host


def _argv(process: subprocess.Popen[str]) -> str:
    args = process.args
    words = [str(a) for a in args] if isinstance(args, list | tuple) else [str(args)]
    text = " ".join(words[4:] if words[:3] == ["ip", "netns", "exec"] else words)
    text = " ".join(text.split())  # a script given with -c on one line
    return text if len(text) <= 120 else text[:117] + "..."


def close_all() -> None:
    """Close every network still open in this process (a safety net for an interrupted
    session)."""
    for network in list(_live):
        with contextlib.suppress(Exception):
            network.close()
