"""The cluster's network: one namespace per worker on one bridge, every directed link shaped.

Worker w is host w of a `netem.lab.Lab`: its own namespace, a veth to the bridge (which lives in
the lab's switch namespace), an IPv4 and an IPv6 address and the scenario's MTU. Traffic from
src to dst is shaped where the wire is: on the egress of dst's switch port
(`lab.hosts[dst].switch_port` in `lab.switch`), classified per source address (a worker's IPv4
and IPv6 addresses are one rule, one class), so one rule set per receiver holds every link into
it. The sender's own stack never sees the drops (its TCP does not retransmit at once, its UDP
sends never fail), as on a real network.

What each link carries is the pure `LinkState` (`testbed.scenario.links`: profiles, cuts,
partitions); this class only shapes the kernel after it, through a `netem.session.Session` on
the switch (which installs each port once and then changes only what differs, the fallback's
loss of every port in one nft transaction).

Per receiver, the catch-all rule (`None`) carries the profile most of its incoming links have;
the others, and every link the scenario's timeline will change or cut, get a source rule. A
source that once had a rule keeps it (the "layout" stays the same), so later changes go in
place: no moment unshaped, no queue flushed, no rebuild.

With netem, every link is given its seed (`LinkState.shaped`), and a link with a seed has a rule
of its own: its netem then draws for its sender's packets only (not for another sender's, nor
for what the catch-all takes, such as ARP), so the same traffic meets the same decisions.
The fallback cannot use a seed (nftables' numgen takes none): it is given the profiles as they
are, and its loss is not repeatable.

The lab's own address on the bridge (`control_address`: where the runner serves the run's store,
for barriers, drift sketches and parameter pulls) is exempt in every receiver's rules: the
testbed's coordination is not part of the experiment, so a lossy or partitioned link never
delays it, and it never adds to what a link's counters show.

Speed (benchmarks/scale.py): nearly all the time goes to short helper processes (pyroute2 forks
one for every socket it opens in a namespace; nft runs as `ip netns exec nft`) and to pyroute2's
netlink encoding, which the session spreads over threads.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Mapping
from typing import Literal

from netem.backend import resolve_backend, usable
from netem.lab import Lab
from netem.lifecycle import StartsOnEnter
from netem.plan import Source, UnsupportedByKernel
from netem.profile import LinkProfile
from netem.session import Session
from testbed.cluster.shaped import ShapedNetwork
from testbed.scenario.links import LinkState, Pair
from testbed.scenario.model import Scenario

Rules = dict[Source | None, LinkProfile]
SYSCTL = "/proc/sys/net/ipv4/"
ALLOWED = SYSCTL + "tcp_allowed_congestion_control"
AVAILABLE = SYSCTL + "tcp_available_congestion_control"


class NetworkError(RuntimeError):
    """The cluster's network could not be built or changed; the message says what and why."""


class ClusterNetwork(StartsOnEnter, ShapedNetwork):
    """The shaped network of a scenario's workers. Use as a context manager (or `start`/`close`);
    `close` is idempotent and runs on failure and Ctrl-C through the context manager."""

    def __init__(
        self,
        scenario: Scenario,
        prefix: str | None = None,
        backend: Literal["auto", "netem", "fallback"] = "auto",
    ) -> None:
        super().__init__(LinkState.of(scenario))
        self.scenario = scenario
        self.count = scenario.count
        self.backend = resolve_backend(backend)
        self._requested = backend
        lab_options = {"prefix": prefix} if prefix else {}
        self.lab = Lab(scenario.count, mtu=scenario.topology.mtu, **lab_options)
        self._base: dict[int, LinkProfile] = {}  # each receiver's catch-all profile
        self._sources: dict[int, set[int]] = {}  # each receiver's senders with a rule of their own
        # What the kernel is given for a link, and for each link into a receiver (by sender):
        # with the link's seed where the backend draws from one.
        seeded = self.backend == "netem"
        self._given = self.links.shaped if seeded else self.links.effective
        self._incoming = self.links.shaped_into if seeded else self.links.into
        self._session: Session | None = None
        self.congestion: dict[int, str] = {}  # worker -> TCP congestion control set in its netns
        self.apply_seconds: list[float] = []  # how long each change took, in order

    # -- life cycle

    def start(self) -> None:
        """Check every receiver's rules against the backend (nothing is created when one cannot be
        shaped: `UnsupportedByKernel` names the field), build the lab, shape every link, set each
        worker's TCP congestion control."""
        with self._lock:
            self.check()
            self.lab.start()
            self._session = Session(self.lab.switch, backend=self.backend, offloads=False)
            self._session.shape({self.switch_port(dst): self._rules(dst)
                                 for dst in range(self.count)})
            self._set_congestion_controls()

    def check(self) -> None:
        """Whether the backend can shape every link, now and along the timeline; pure (creates
        nothing), so it also says where a scenario can run: `UnsupportedByKernel` if not."""
        with self._lock:
            for dst in range(self.count):
                incoming = self._incoming(dst)
                unseeded = [profile for profile in incoming.values() if profile.seed is None]
                self._base[dst] = _most_common(unseeded) if unseeded else LinkProfile()
                self._sources[dst] = {src for src, profile in incoming.items()
                                      if profile != self._base[dst]}
            for src, dst in self.links.changed_by(self.scenario.timeline):
                self._sources[dst].add(src)  # their changes then go in place
            session = Session(None, backend=self.backend)
            for dst in range(self.count):  # pure: raises before anything is created
                session.plan(f"p{dst}", self._rules(dst))
            if self._requested == "netem":
                usable("netem")  # the clear error when the kernel lacks sch_netem
            self._check_timeline(session)

    def _check_timeline(self, session: Session) -> None:
        """Every profile the timeline's link changes will give (in file order, ramps at both
        ends), checked against the backend now rather than in the middle of the run."""
        events = self.scenario.timeline
        for index, (src, dst), profile in LinkState.of(self.scenario).replay(events):
            if isinstance(profile, Exception):
                raise profile
            try:
                session.plan("p0", profile)
            except UnsupportedByKernel as error:
                raise UnsupportedByKernel(
                    f"timeline[{index}] ({events[index].describe()}), link {src}->{dst}: "
                    f"{error}") from None

    def close(self) -> None:
        """Remove every namespace (with its veths, qdiscs and nft tables) and the processes in
        them. Idempotent."""
        with self._lock:
            self.lab.close()
            self._session = None

    # -- what is where

    @property
    def prefix(self) -> str:
        return self.lab.prefix

    @property
    def hosts(self) -> list[str]:
        """Each worker's address, by rank."""
        return [host.address for host in self.lab.hosts]

    @property
    def control_address(self) -> str:
        """Where the testbed's own services listen (in `self.lab.switch`), never shaped."""
        return self.lab.switch_address

    def namespace(self, worker: int) -> str:
        return self.lab.hosts[worker].netns

    def switch_port(self, worker: int) -> str:
        """The switch-side interface (in `self.lab.switch`) whose egress shapes links into it."""
        return self.lab.hosts[worker].switch_port

    # -- changes

    def shape(self, touched: set[Pair]) -> float:
        """Re-shape the receivers of the touched links: a sender that gets a profile apart from
        its receiver's catch-all gets a rule of its own, for good."""
        if self._session is None:
            raise NetworkError("the network is not running (start it, or use it as a context "
                               "manager)")
        for src, dst in touched:
            if self._given(src, dst) != self._base[dst]:
                self._sources[dst].add(src)
        receivers = sorted({dst for _, dst in touched})
        if not receivers:
            return 0.0
        seconds = self._session.shape({self.switch_port(dst): self._rules(dst)
                                       for dst in receivers})
        self.apply_seconds.append(seconds)
        return seconds

    def seeds(self) -> dict[str, int]:
        """The seed the kernel was given for each link that has one now, keyed "src->dst" as
        the run records them (with the fallback: only a profile's own, unused)."""
        given = {(src, dst): profile.seed for dst in range(self.count)
                 for src, profile in self._incoming(dst).items() if profile.seed is not None}
        return {f"{s}->{d}": seed for (s, d), seed in sorted(given.items())}

    def _rules(self, dst: int) -> Rules:
        rules: Rules = {self.lab.addresses(src): self._given(src, dst)
                        for src in sorted(self._sources[dst])}
        rules[self.control_address] = LinkProfile()
        rules[None] = self._base[dst]
        return rules

    def _set_congestion_controls(self) -> None:
        """Make each worker's algorithm its namespace's TCP default."""
        wanted = {w: self.scenario.congestion(w) for w in range(self.count)}
        set_default_congestion({self.namespace(w): algorithm for w, algorithm in wanted.items()})
        self.congestion.update(wanted)

    def read_congestion(self, worker: int) -> str:
        """The TCP congestion control the kernel reports in the worker's namespace."""
        result = subprocess.run(
            ["ip", "netns", "exec", self.namespace(worker), "cat",
             "/proc/sys/net/ipv4/tcp_congestion_control"],
            capture_output=True, text=True, timeout=30, check=True,
        )
        return result.stdout.strip()


def _most_common(profiles: list[LinkProfile]) -> LinkProfile:
    counts = Counter(profile.model_dump_json() for profile in profiles)
    key, _ = counts.most_common(1)[0]
    return next(profile for profile in profiles if profile.model_dump_json() == key)


def set_default_congestion(choices: Mapping[str, str]) -> None:
    """Make `choices[namespace]` the TCP congestion control of each namespace (sockets made
    later use it, also ones that are not ours to set, like gloo's). A namespace other than the
    host's may only pick one of net.ipv4.tcp_allowed_congestion_control (global); one that is
    missing there is allowed for the moment of the setting, and the list is put back at once."""
    allowed = _read(ALLOWED).split()
    missing = sorted(set(choices.values()) - set(allowed))
    if missing:
        _write(ALLOWED, " ".join([*allowed, *missing]))
    try:
        for namespace, algorithm in choices.items():
            result = subprocess.run(
                ["ip", "netns", "exec", namespace, "sysctl", "-qw",
                 f"net.ipv4.tcp_congestion_control={algorithm}"],
                capture_output=True, text=True, timeout=30,
            )
            if result.returncode != 0:
                raise NetworkError(
                    f"{namespace}: could not set TCP congestion control {algorithm!r}: "
                    f"{result.stderr.strip() or 'sysctl failed'} (this kernel offers: "
                    f"{_read(AVAILABLE) or 'unknown'}; bbr may need `modprobe tcp_bbr`)"
                )
    finally:
        if missing:
            _write(ALLOWED, " ".join(allowed))


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as file:
            file.write(text)
    except OSError as error:
        raise NetworkError(f"{path}: {error.strerror}: cannot allow the scenario's TCP "
                           "congestion control in the workers' namespaces") from None


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""
