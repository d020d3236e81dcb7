"""The cluster's network: one namespace per worker on one bridge, every directed link shaped.

Worker w is host w of a `netem.lab.Lab`: its own namespace, a veth to the bridge (which lives in
the lab's switch namespace), an address and the scenario's MTU. Traffic from src to dst is shaped
where the wire is: on the egress of dst's switch port (`lab.hosts[dst].switch_port` in
`lab.switch`), classified per source address, so one `netem.apply` per receiver holds every link
into it. The sender's own stack never sees the drops (its TCP does not retransmit at once, its
UDP sends never fail), as on a real network.

Per receiver, the catch-all rule (`None`) carries the profile most of its incoming links have;
the others, and every link the scenario's timeline will change or cut, get a source rule. A
source that once had a rule keeps it (the "layout" stays the same), so later changes go through
`netem.change` in place: no moment unshaped, no queue flushed, no rebuild.

The lab's own address on the bridge (`control_address`: where the runner serves the run's store,
for barriers, drift sketches and parameter pulls) is exempt in every receiver's rules: the
testbed's coordination is not part of the experiment, so a lossy or partitioned link never
delays it, and it never adds to what a link's counters show.

A partition is 100% loss on the cut directed links; the profile each cut link would otherwise
have is remembered apart, so `heal` restores whatever the timeline set meanwhile.

Speed (benchmarks/scale.py): nearly all the time goes to short helper processes (pyroute2 forks
one for every socket it opens in a namespace; nft runs as `ip netns exec nft`) and to pyroute2's
netlink encoding, so hosts and receivers are done in parallel threads; and since this class alone
shapes the switch ports, it works from what it installed: a fresh port is not cleared first, a
change does not read the tree back (a fork, a dump, two nft runs) and makes only the steps whose
values differ, and the fallback's loss changes of all receivers go in one nft transaction.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import netem
from netem.backend import carry_out, nft_script, resolve_backend, usable
from netem.lab import Lab
from netem.plan import NFT_TABLE, NftLoss, Offloads, Plan, UnsupportedByKernel, build_plan
from netem.profile import LinkProfile
from testbed.scenario.model import RampLink, Scenario, SetLink, partition_pairs

Pair = tuple[int, int]
Rules = dict[str | None, LinkProfile]
CUT = LinkProfile(loss=1.0)  # what a partitioned link carries: nothing
PARALLEL = 8  # receivers shaped at once
SYSCTL = "/proc/sys/net/ipv4/"
ALLOWED = SYSCTL + "tcp_allowed_congestion_control"
AVAILABLE = SYSCTL + "tcp_available_congestion_control"


class NetworkError(RuntimeError):
    """The cluster's network could not be built or changed; the message says what and why."""


class ClusterNetwork:
    """The shaped network of a scenario's workers. Use as a context manager (or `start`/`close`);
    `close` is idempotent and runs on failure and Ctrl-C through the context manager.

    Thread-safe: the timeline's scheduler thread and the runner may change links at once.
    """

    def __init__(
        self,
        scenario: Scenario,
        prefix: str | None = None,
        backend: Literal["auto", "netem", "fallback"] = "auto",
    ) -> None:
        self.scenario = scenario
        self.count = scenario.count
        self.groups: dict[str, list[int]] = {k: list(v) for k, v in
                                             scenario.topology.groups.items()}
        self.backend = resolve_backend(backend)
        self._requested = backend
        lab_options = {"prefix": prefix} if prefix else {}
        self.lab = Lab(scenario.count, mtu=scenario.topology.mtu, **lab_options)
        self._profiles: dict[Pair, LinkProfile] = dict(scenario.links())
        self._cut: set[Pair] = set()
        self._base: dict[int, LinkProfile] = {}  # each receiver's catch-all profile
        self._sources: dict[int, set[int]] = {}  # each receiver's senders with a rule of their own
        self._lossy: dict[int, bool] = {}  # whether a receiver's shaping has an nft loss chain
        self._plans: dict[int, Plan] = {}  # what each receiver's port carries, as installed
        self.congestion: dict[int, str] = {}  # worker -> TCP congestion control set in its netns
        self.apply_seconds: list[float] = []  # how long each change took, in order
        self._lock = threading.RLock()
        self._started = False
        self.cut_profile = CUT

    # -- life cycle

    def __enter__(self) -> ClusterNetwork:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Check every receiver's rules against the backend (nothing is created when one cannot be
        shaped: `UnsupportedByKernel` names the field), build the lab, shape every link, set each
        worker's TCP congestion control."""
        with self._lock:
            self.check()
            self.lab.start()
            self._started = True
            receivers = list(range(self.count))
            self._in_parallel(receivers, {dst: self._rules(dst) for dst in receivers},
                              self._shape)
            self._nft_change({dst: self._plans[dst] for dst in receivers}, keep_table=True)
            self._set_congestion_controls()

    def check(self) -> None:
        """Whether the backend can shape every link, now and along the timeline; pure (creates
        nothing), so it also says where a scenario can run: `UnsupportedByKernel` if not."""
        with self._lock:
            for dst in range(self.count):
                incoming = [self._profiles[(s, dst)] for s in range(self.count) if s != dst]
                self._base[dst] = _most_common(incoming) if incoming else LinkProfile()
                self._sources[dst] = {
                    s for s in range(self.count)
                    if s != dst and self._profiles[(s, dst)] != self._base[dst]
                }
            for src, dst in self._timeline_pairs():  # their changes then go in place
                self._sources[dst].add(src)
            for dst in range(self.count):  # pure: raises before anything is created
                build_plan(f"p{dst}", self._rules(dst), backend=self.backend)
            if self._requested == "netem":
                usable("netem")  # the clear error when the kernel lacks sch_netem
            self._check_timeline()

    def _timeline_pairs(self) -> set[Pair]:
        """The links the scenario's timeline will change or cut."""
        pairs: set[Pair] = set()
        for event in self.scenario.timeline:
            value = getattr(event, event.action)
            if isinstance(value, SetLink | RampLink):
                pairs.update(value.link.pairs(self.groups, self.count))
            elif event.action == "partition":
                pairs |= partition_pairs(self.groups, list(value), self.count)
        return pairs

    def _check_timeline(self) -> None:
        """Every profile the timeline's link changes will give (in file order, ramps at both
        ends), checked against the backend now rather than in the middle of the run."""
        state = dict(self._profiles)
        for index, event in enumerate(self.scenario.timeline):
            value = getattr(event, event.action)
            if not isinstance(value, SetLink | RampLink):
                continue
            for pair in value.link.pairs(self.groups, self.count):
                if isinstance(value, SetLink):
                    profiles = [value.apply(state[pair])]
                else:
                    profiles = [value.profile_at(state[pair], 0.0),
                                value.profile_at(state[pair], value.over)]
                try:
                    for profile in profiles:
                        build_plan("p0", profile, backend=self.backend)
                except UnsupportedByKernel as error:
                    raise UnsupportedByKernel(
                        f"timeline[{index}] ({event.describe()}), link {pair[0]}->{pair[1]}: "
                        f"{error}") from None
                state[pair] = profiles[-1]

    def close(self) -> None:
        """Remove every namespace (with its veths, qdiscs and nft tables) and the processes in
        them. Idempotent."""
        with self._lock:
            self.lab.close()
            self._started = False

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

    def current(self, src: int, dst: int) -> LinkProfile:
        """The link's profile as the scenario and the timeline left it (what it carries when not
        partitioned; see `is_cut` and `effective`)."""
        with self._lock:
            return self._profiles[self._pair(src, dst)]

    def is_cut(self, src: int, dst: int) -> bool:
        with self._lock:
            return self._pair(src, dst) in self._cut

    def effective(self, src: int, dst: int) -> LinkProfile:
        """What the link carries now: `cut_profile` (100% loss) when partitioned, else `current`."""
        with self._lock:
            return self._effective(*self._pair(src, dst))

    @property
    def cut(self) -> set[Pair]:
        with self._lock:
            return set(self._cut)

    # -- changes

    def set_link(self, src: int, dst: int, profile: LinkProfile) -> float:
        """Give the link src -> dst this profile; returns the seconds the kernel change took."""
        return self.set_links({(src, dst): profile})

    def set_links(self, changes: Mapping[Pair, LinkProfile]) -> float:
        """Give these links these profiles, re-shaping only their receivers; returns seconds.
        A partitioned link stays cut: its remembered profile changes, restored by `heal`."""
        with self._lock:
            for pair, profile in changes.items():
                if not isinstance(profile, LinkProfile):
                    raise TypeError(f"link {pair}: expected a LinkProfile, got {profile!r}")
                self._profiles[self._pair(*pair)] = profile
            return self._reshape({dst for _, dst in changes}, changes)

    def partition(self, pairs: Iterable[Pair]) -> float:
        """Cut these directed links (100% loss); returns seconds."""
        with self._lock:
            new = {self._pair(*pair) for pair in pairs} - self._cut
            self._cut |= new
            return self._reshape({dst for _, dst in new}, new)

    def heal(self, pairs: Iterable[Pair] | None = None) -> float:
        """Restore these cut links (None: every cut link) to their current profile; returns
        seconds. Links that are not cut are left alone."""
        with self._lock:
            chosen = set(self._cut) if pairs is None else {self._pair(*p) for p in pairs}
            healed = chosen & self._cut
            self._cut -= healed
            return self._reshape({dst for _, dst in healed}, healed)

    # -- helpers

    def _pair(self, src: int, dst: int) -> Pair:
        if src == dst or not (0 <= src < self.count and 0 <= dst < self.count):
            raise ValueError(f"no link {src}->{dst}: workers are 0..{self.count - 1}, src != dst")
        return (src, dst)

    def _reshape(self, receivers: set[int], touched: Iterable[Pair]) -> float:
        if not self._started:
            raise NetworkError("the network is not running (start it, or use it as a context "
                               "manager)")
        rebuilt = set()
        for src, dst in touched:
            if self._effective(src, dst) != self._base[dst] and src not in self._sources[dst]:
                self._sources[dst].add(src)  # once a rule of its own, always (change in place)
                rebuilt.add(dst)
        begun = time.perf_counter()
        rules = {dst: self._rules(dst) for dst in receivers}
        # The fallback keeps every receiver's loss in one nft table of the switch, and deletes
        # the table with its last chain. Receivers that may delete it must not overlap those
        # that add to it: first those whose nft chain alone changes, in one transaction that
        # knows whether the table stays; then the others (they add to the table or touch only
        # their own chain and port) in parallel, then those losing their last loss rule in
        # parallel (each sees the others' chains until they are gone), then those rebuilt while
        # lossy.
        fallback = self.backend == "fallback"
        rebuilt = {dst for dst in rebuilt if fallback and self._lossy[dst]}
        nft_only = {dst: plan for dst in sorted(set(receivers) - rebuilt)
                    if (plan := self._nft_only(dst, rules[dst])) is not None}
        losing = {dst for dst in set(receivers) - rebuilt - set(nft_only)
                  if fallback and self._lossy[dst] and not _has_loss(rules[dst])}
        lossy_after = any(_has_loss(rules[dst]) for dst in receivers) or any(
            self._lossy[dst] for dst in range(self.count) if dst not in receivers)
        self._nft_change(nft_only, keep_table=lossy_after)
        self._in_parallel(sorted(set(receivers) - rebuilt - losing - set(nft_only)), rules)
        self._in_parallel(sorted(losing), rules)
        # A rebuild clears the receiver's chain, and the table with it when it is the last one:
        # all but one in parallel while the last one's chain keeps the table, then that one.
        *together, last = sorted(rebuilt) or [None]
        self._in_parallel(together, rules)
        if last is not None:
            self._change(last, rules[last])
        elapsed = time.perf_counter() - begun
        if receivers:
            self.apply_seconds.append(elapsed)
        return elapsed

    def _in_parallel(self, receivers: list[int], rules: dict[int, Rules],
                     do: Callable[[int, Rules], None] | None = None) -> None:
        do = do or self._change
        if len(receivers) == 1:
            do(receivers[0], rules[receivers[0]])
        elif receivers:
            with ThreadPoolExecutor(min(len(receivers), PARALLEL)) as pool:
                for future in [pool.submit(do, dst, rules[dst]) for dst in receivers]:
                    future.result()

    def _shape(self, dst: int, rules: Rules) -> None:
        """Shape a receiver's fresh switch port: `netem.apply` less its clear (nothing to clear),
        its offloads step (the lab turned them off) and its nft step (`_nft_change` does all)."""
        plan = build_plan(self.switch_port(dst), rules, backend=self.backend)
        steps = tuple(step for step in plan.steps if not isinstance(step, Offloads | NftLoss))
        carry_out(dataclasses.replace(plan, steps=steps), self.lab.switch, change=False)
        self._plans[dst] = plan
        self._lossy[dst] = _has_loss(rules)

    def _nft_only(self, dst: int, rules: Rules) -> Plan | None:
        """The receiver's new plan when, in place, at most its nft loss chain differs (the
        fallback's loss changes, cuts and heals): `_nft_change` does it with the others'."""
        plan = build_plan(self.switch_port(dst), rules, backend=self.backend)
        installed = self._plans.get(dst)
        if installed is None or plan.layout != installed.layout:
            return None
        tree = [step for step in plan.steps if not isinstance(step, NftLoss)]
        return plan if tree == [s for s in installed.steps if not isinstance(s, NftLoss)] else None

    def _nft_change(self, plans: Mapping[int, Plan], *, keep_table: bool) -> None:
        """Give these receivers their plans' loss chains (or none) in one nft transaction in the
        switch, where every receiver's chain is: one process, all or nothing. Without
        `keep_table` (no receiver will have loss) the table goes with the chains removed."""
        statements, removed = [], []
        for dst, plan in plans.items():
            installed = [s for s in self._plans[dst].steps if isinstance(s, NftLoss)]
            steps = [step for step in plan.steps if isinstance(step, NftLoss)]
            statements += [line for step in steps for line in step.statements()]
            if installed and not steps:
                removed.append(installed[0])
        if keep_table:
            statements += [f"delete chain {s.family} {NFT_TABLE} {s.chain}" for s in removed]
        elif removed:
            statements += sorted({f"delete table {s.family} {NFT_TABLE}" for s in removed})
        if statements:
            nft_script(statements, self.lab.switch)
        for dst, plan in plans.items():
            self._plans[dst], self._lossy[dst] = plan, _has_loss(plan.profiles())

    def _change(self, dst: int, rules: Rules) -> None:
        """`netem.change` from what this class installed rather than a read-back: in place when
        the layout is the same, changing only the steps that differ (the nft loss step always:
        an in-place change without one removes the chain); else rebuilt at once."""
        port, switch = self.switch_port(dst), self.lab.switch
        plan = build_plan(port, rules, backend=self.backend)
        installed = self._plans.pop(dst, None)  # unknown until this succeeds (a failure clears)
        if installed is not None and plan.layout == installed.layout:
            steps = tuple(step for step in plan.steps
                          if step not in installed.steps or isinstance(step, NftLoss))
            carry_out(dataclasses.replace(plan, steps=steps), switch, change=True)
        else:
            netem.apply(port, rules, netns=switch, backend=self.backend)
        self._plans[dst] = plan
        self._lossy[dst] = _has_loss(rules)

    def _effective(self, src: int, dst: int) -> LinkProfile:
        return self.cut_profile if (src, dst) in self._cut else self._profiles[(src, dst)]

    def _address(self, worker: int) -> str:
        """The worker's address (the lab's numbering: known before the lab exists)."""
        return str(ipaddress.ip_network(self.lab.subnet).network_address + worker + 1)

    def _rules(self, dst: int) -> dict[str | None, LinkProfile]:
        rules: dict[str | None, LinkProfile] = {
            self._address(src): self._effective(src, dst) for src in sorted(self._sources[dst])
        }
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


def _has_loss(rules: Mapping[str | None, LinkProfile]) -> bool:
    return any(profile.loss > 0 for profile in rules.values())


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
