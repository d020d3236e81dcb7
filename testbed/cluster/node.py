"""A worker in a container of its own (Docker Compose): `testbed node SCENARIO --rank N ...`.

In a namespace run the runner shapes every link on the switch and drives the fault timeline;
a container has only its own network namespace, so each node does its part of both:

- It shapes the links *into* it, on its own interface's ingress (redirected to an ifb), one
  rule per source peer (`IngressLinks`: the run's `LinkState`, shaped for this worker's end):
  what a link carries is decided where the packets arrive, as in the namespace runs.
- It runs the whole fault timeline itself (`Timeline`), acting on its incoming links, its own
  straggler bursts, and its own preemption: a `kill` naming it ends the process with SIGKILL,
  and the Compose restart policy (`on-failure`, set for the workers the timeline restarts)
  brings the container back; it then waits for the `restart` event to be due and rejoins.
  `at` times count from the run's origin, posted in the run's store by the first worker to
  start training; `step` events fire before the node's own step. Every event it saw take
  effect goes to its own control file, for its metrics (`post_fault`), as the namespace
  runner posts them to every worker.
- Worker 0 serves the run's store (so the generator refuses a scenario that preempts it),
  creates the run directory (`/runs/<scenario>-<UTC time>`, named in the store for the others),
  writes the timeline's records, and, once every worker ended, the summary and the report.
- Under Docker Swarm the workers have no fixed addresses: `--hosts` names their services
  (`endpoint_mode: dnsrr`, so a name resolves to its task, not to a load-balancing VIP that
  hides the sender), resolved at the start (`resolve_hosts`), and the interface to shape is the
  one holding this worker's own address (`--iface auto`). A restarted task comes back at a new
  address: it posts it in the run's store, and every node, before its next step, moves that
  peer's rule on its ingress and tells its collective (`Worker.peer_moved`).

Everything else is the namespace worker's (`testbed.cluster.worker.Worker`).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import netem
from netem.profile import LinkProfile
from testbed.cluster.exchange import serve_run_store
from testbed.cluster.relay import TARGETS_FILE, target_groups
from testbed.cluster.replay import LinkReplay
from testbed.cluster.shaped import ShapedNetwork
from testbed.cluster.timeline import Timeline
from testbed.cluster.worker import (
    PORTS,
    Worker,
    WorkerSpec,
    post_burst,
    post_fault,
    post_links,
)
from testbed.scenario.links import LinkState, Pair
from testbed.scenario.model import Scenario
from testbed.scenario.timeline import Event

STORE_WAIT = 300.0  # seconds a node waits for worker 0's store and run directory
# Where `testbed compose` mounts the run's secret (read-only) where the scenario authenticates.
KEY_FILE = Path("/run/secrets/testbed-key")
END_WAIT = 600.0  # seconds worker 0 waits for the others' ends before writing the summary
POLL = 0.2  # seconds between looks at the store while waiting for a restart to be due
RUN_KEY, ORIGIN_KEY, ID_KEY = "compose/run", "compose/origin", "compose/run_id"
# Each node's address under its rank, and how many times one was posted (a peer that moved).
ADDRESS_KEY, POSTED_KEY = "compose/address/{}", "compose/addresses_posted"
AUTO_IFACE = "auto"  # --iface: the interface that holds this worker's own address


def service_name(rank: int) -> str:
    """Worker `rank`'s Compose service (and its name on the project's network)."""
    return f"worker-{rank}"


class IngressLinks(ShapedNetwork):
    """The links into worker `rank`, shaped on `iface`'s ingress, per source address. Holds
    every link's state (the timeline reads any) and changes the kernel only for links into this
    worker; until `start`, changes are only remembered."""

    def __init__(self, scenario: Scenario, rank: int, hosts: list[str], iface: str,
                 backend: str = "auto") -> None:
        super().__init__(LinkState.of(scenario))
        self.rank, self.hosts, self.iface, self.backend = rank, hosts, iface, backend
        self._started = False

    def rules(self) -> dict[str | None, LinkProfile]:
        """What each peer's packets get on the way in; anyone else passes untouched."""
        return self._by_address(self.links.into(self.rank))

    def _shaped_rules(self) -> dict[str | None, LinkProfile]:
        """`rules` as the kernel is given them: each link with its seed (`LinkState.shaped`)."""
        return self._by_address(self.links.shaped_into(self.rank))

    def _by_address(self, profiles: dict[int, LinkProfile]) -> dict[str | None, LinkProfile]:
        rules: dict[str | None, LinkProfile] = {None: LinkProfile()}
        for src, profile in profiles.items():
            rules[self.hosts[src]] = profile
        return rules

    def move(self, peer: int, host: str) -> None:
        """Peer `peer` sends from `host` now: its rule follows it (the rules are rebuilt, as
        their sources changed), under the lock the timeline's changes take."""
        with self._lock:
            self.hosts[peer] = host
            if self._started:
                rules = self._shaped_rules()
                netem.change(self.iface, rules, direction="ingress", backend=self.backend)  # type: ignore[arg-type]

    def start(self) -> float:
        begun = time.perf_counter()
        netem.apply(self.iface, self._shaped_rules(), direction="ingress", backend=self.backend)  # type: ignore[arg-type]
        self._started = True
        return time.perf_counter() - begun

    def close(self) -> None:
        if self._started:
            netem.clear(self.iface)
            self._started = False

    def shape(self, touched: set[Pair]) -> float:
        if not self._started or all(dst != self.rank for _, dst in touched):
            return 0.0
        begun = time.perf_counter()
        netem.change(self.iface, self._shaped_rules(), direction="ingress", backend=self.backend)  # type: ignore[arg-type]
        return time.perf_counter() - begun


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _lookup(name: str) -> set[str]:
    """The IPv4 addresses `name` resolves to now (none: not yet)."""
    try:
        found = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return set()
    return {str(entry[4][0]) for entry in found}


def local_interfaces() -> dict[str, tuple[str, int]]:
    """This namespace's IPv4 addresses: address -> (its interface, the interface's MTU)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        links = {link["index"]: (link.get_attr("IFLA_IFNAME"), link.get_attr("IFLA_MTU"))
                 for link in ipr.get_links()}
        return {message.get_attr("IFA_ADDRESS"): links[message["index"]]
                for message in ipr.get_addr(family=socket.AF_INET)
                if message["index"] in links}


def resolve_hosts(hosts: list[str], rank: int, *, wait: float = STORE_WAIT,
                  lookup: Callable[[str], set[str]] = _lookup,
                  local: Callable[[], Mapping[str, Any]] = local_interfaces) -> list[str]:
    """Every worker's address, by rank: an address stays as it is; a name (a Swarm service's)
    is resolved, waiting until it names exactly one address (a task's name appears once the
    task runs; two would be a departing task's and its successor's). This worker's own name
    may still list its previous task's address: its own is the one on a local interface.
    Raises ValueError naming the hosts that did not resolve within `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        found = {r: {h} if is_address(h) else lookup(h) for r, h in enumerate(hosts)}
        if not is_address(hosts[rank]):
            found[rank] &= set(local())
        pending = {r: sorted(a) for r, a in found.items() if len(a) != 1}
        if not pending:
            return [found[r].pop() for r in range(len(hosts))]
        if time.monotonic() > deadline:
            listing = ", ".join(f"{hosts[r]} ({', '.join(a) or 'no address'})"
                                for r, a in pending.items())
            raise ValueError(f"--hosts: not resolved to one address each within {wait:g} s: "
                             f"{listing}")
        time.sleep(POLL)  # names appear as Swarm starts the tasks: nothing to wait on


def preempting(scenario: Scenario) -> dict[int, list[Event]]:
    """Worker -> the timeline's kill and restart events naming it, in timeline order."""
    found: dict[int, list[Event]] = {}
    for event in scenario.timeline:
        for rank in (event.kill or event.restart or ()) if event.action in ("kill", "restart") \
                else ():
            found.setdefault(rank, []).append(event)
    return found


def restarted_workers(scenario: Scenario) -> set[int]:
    """The workers the timeline restarts: the only ones a restart policy brings back (and,
    under Swarm, the only ones that can come back at another address)."""
    return {rank for rank, events in preempting(scenario).items()
            if any(event.action == "restart" for event in events)}


class Node:
    """Worker `rank` of a Compose run: see the module's docstring."""

    def __init__(self, scenario_path: Path, rank: int, hosts: list[str], runs: Path, *,
                 iface: str = "eth0", steps: int | None = None, backend: str = "auto",
                 base_dir: Path | None = None, key_file: Path = KEY_FILE) -> None:
        from testbed.scenario import load_scenario
        from testbed.transport.auth import read_key

        self.scenario_path, self.rank, self.runs = scenario_path, rank, runs
        # As given (addresses, or names under Swarm), and resolved (`_resolve`, at the start).
        self.given, self.hosts = list(hosts), list(hosts)
        self.named = not all(is_address(host) for host in hosts)
        self.base_dir = base_dir
        self.mtu: int | None = None  # the shaped interface's, where below the scenario's
        self.scenario = load_scenario(scenario_path, steps=steps)
        self.steps = steps
        self._restarts = bool(restarted_workers(self.scenario))
        if len(hosts) != self.scenario.count:
            raise ValueError(f"--hosts: the scenario has {self.scenario.count} workers, "
                             f"got {len(hosts)} addresses")
        self.key_file: Path | None = None
        if self.scenario.authenticates("compose"):
            try:
                read_key(key_file)  # here, so a missing or open key fails before anything runs
            except FileNotFoundError:
                raise ValueError(f"security.authenticate: this run authenticates, but its key "
                                 f"is not at {key_file}; regenerate the project with `testbed "
                                 "compose`, which writes and mounts it") from None
            self.key_file = key_file
        self.network = IngressLinks(self.scenario, rank, list(hosts), iface, backend)
        self._store: Any = None
        self._worker: Worker | None = None
        self._posted = 0  # addresses posted in the store, as this node last read them
        self._client: Any = None
        self._writer: Any = None  # worker 0's: the run's own records
        self._timeline: Timeline | None = None
        # The traced links into this worker: each worker replays its own (docs/conditions.md).
        self._replay = LinkReplay(self.network, {
            pair: trace for pair, trace in self.scenario.traces().items() if pair[1] == rank})
        self._traffic: Any = None  # CrossTraffic: the ends of the flows it sends or receives
        self._conditions_ended = False  # its timeline, flows and replay (`_end_conditions`)
        self._rejoin = False
        self.run_dir = runs

    def run(self) -> int:
        from torch.distributed import TCPStore

        self._resolve()
        self.network.start()  # first: a kernel that cannot shape them ends every worker at once
        try:
            if self.rank == 0:
                self._store = serve_run_store("0.0.0.0", PORTS["drift"])
            self._client = TCPStore(self.hosts[0], PORTS["drift"], is_master=False,
                                    timeout=datetime.timedelta(seconds=STORE_WAIT))
            if self.named:  # where the others find this worker, if it moved
                self._client.set(ADDRESS_KEY.format(self.rank), self.hosts[self.rank])
                self._client.add(POSTED_KEY, 1)
            rejoin = self._client.check([f"start/{self.rank}"])
            run_dir = self.run_dir = self._run_dir()
            spec = WorkerSpec(scenario=str(self.scenario_path), rank=self.rank,
                              world=self.scenario.count, hosts=self.hosts, run_dir=str(run_dir),
                              run_id=int(self._client.get(ID_KEY)), steps=self.steps,
                              base_dir=None if self.base_dir is None else str(self.base_dir),
                              rejoin=rejoin, mtu=self.mtu,
                              key_file=None if self.key_file is None else str(self.key_file))
            self._rejoin = rejoin
            if rejoin:
                self._wait_for_restart()
            self._worker = Worker(spec, on_start=self._start_timeline,
                                  before_step=self._before_step)
            code = self._worker.run()
            self._end_conditions()  # before worker 0's summary, so it holds their records
            if self.rank == 0:
                self._finish(run_dir, code)
            return code
        finally:
            try:
                self._end_conditions()
            finally:
                self.network.close()

    def _end_conditions(self) -> None:
        """End this node's timeline, background flows and replay (once), recording what the
        flows and the replay did in the worker's own events file."""
        if self._conditions_ended:
            return
        self._conditions_ended = True
        if self._timeline is not None:
            self._timeline.stop()
        if self._traffic is not None:
            self._traffic.stop()
            self._record("cross_traffic", rank=self.rank, flows=self._traffic.summary())
        try:
            self._replay.stop()
        finally:
            if self._replay.origin is not None:
                self._record("replay", rank=self.rank, **self._replay.summary())

    def _record(self, kind: str, **fields: Any) -> None:
        """An event of this node's in its worker's events file (each node writes its own,
        where the timeline's records are worker 0's alone)."""
        if self.run_dir == self.runs:  # no run directory yet: nothing ran to record
            return
        from testbed.report import RunWriter

        with RunWriter.open(self.run_dir, rank=self.rank) as records:  # two at most: at the end
            records.event(kind, **fields)

    def _resolve(self) -> None:
        """The workers' addresses (names resolved), the interface to shape (`auto`: the one
        holding this worker's address) and its MTU, which caps the datagrams' size where it
        is below the scenario's (an overlay network's VXLAN takes 50 bytes)."""
        self.hosts = resolve_hosts(self.given, self.rank)
        self.network.hosts = list(self.hosts)
        interfaces = local_interfaces()
        if self.network.iface == AUTO_IFACE:
            if self.hosts[self.rank] not in interfaces:
                raise ValueError(f"--iface auto: no interface here holds this worker's address "
                                 f"{self.hosts[self.rank]}")
            self.network.iface = interfaces[self.hosts[self.rank]][0]
        mtu = next((mtu for name, mtu in interfaces.values() if name == self.network.iface),
                   None)
        if mtu is not None and mtu < self.scenario.topology.mtu:
            self.mtu = mtu

    def _follow_moves(self) -> None:
        """Peers whose task restarted at another address (posted in the store): their rules on
        this worker's ingress and its collective follow them; worker 0 records each move."""
        posted = self._client.add(POSTED_KEY, 0)
        if posted == self._posted:
            return
        self._posted = posted
        for peer in range(self.scenario.count):
            key = ADDRESS_KEY.format(peer)
            if peer == self.rank or not self._client.check([key]):
                continue
            host = self._client.get(key).decode()
            if host != self.hosts[peer]:
                if self._writer is not None:
                    self._writer.event("moved", rank=peer, previous=self.hosts[peer], host=host)
                self.hosts[peer] = host
                self.network.move(peer, host)
                if self._worker is not None:
                    self._worker.peer_moved(peer, host)

    # -- the run directory and its records

    def _run_dir(self) -> Path:
        from testbed.report import RunWriter

        if self.rank == 0 and not self._client.check([RUN_KEY]):
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
            run_dir = self.runs / f"{self.scenario.name}-{stamp}"
            self._writer = RunWriter.create(run_dir, scenario=self.scenario_path.read_text(),
                                            name=self.scenario.name, compose=True)
            self._writer.event("cluster", hosts=self.hosts, backend=self.network.backend,
                               compose=True, iface=self.network.iface,
                               seeds=self.network.links.seeds(),
                               **({"names": self.given} if self.named else {}),
                               **({"mtu": self.mtu} if self.mtu is not None else {}))
            self._client.set(ID_KEY, str(int.from_bytes(os.urandom(4), "big")))
            self._client.set(RUN_KEY, run_dir.name)
            self._write_targets(run_dir.name)
            return run_dir
        run_dir = self.runs / self._client.get(RUN_KEY).decode()
        if self.rank == 0:
            self._writer = RunWriter.open(run_dir)
        return run_dir

    def _write_targets(self, run: str) -> None:
        """This run's scrape targets for the project's Prometheus (`runs/TARGETS_FILE`): every
        worker as `--hosts` gave it (an address, or under Swarm a name that Prometheus resolves
        at each scrape, so a restarted task is found at its new address), labelled with the
        run, so each run's series are its own. Replaced whole, so Prometheus never reads half
        of it."""
        ports = {"testbed": PORTS["metrics"]}
        if self.scenario.command is not None and self.scenario.command.metrics_port is not None:
            ports["program"] = self.scenario.command.metrics_port  # a command job's own
        labels = {"scenario": self.scenario.name, "run": run}
        groups = [group for source, port in ports.items() for group in target_groups(
            [f"{host}:{port}" for host in self.given],
            {**labels, "source": source})]
        part = self.runs / f".{TARGETS_FILE}.part"
        part.write_text(json.dumps(groups, indent=2) + "\n")
        part.replace(self.runs / TARGETS_FILE)

    def _finish(self, run_dir: Path, code: int) -> None:
        """Worker 0, at its end: wait for every worker's end, then the summary and report."""
        from testbed.cluster.runner import render
        from testbed.report import load_run

        deadline = time.monotonic() + END_WAIT
        while time.monotonic() < deadline:
            ended = {e.rank for e in load_run(run_dir).ends if e.rank is not None}
            if ended >= set(range(self.scenario.count)) - self._never_back():
                break
            time.sleep(POLL)  # polling other containers' files: no event to wait on
        self._writer.finish(success=None if code == 0 else False)
        render(run_dir)

    def _never_back(self) -> set[int]:
        """Workers killed by the timeline and not restarted: they write no end."""
        return {rank for rank, events in preempting(self.scenario).items()
                if events[-1].action == "kill"}

    # -- the timeline

    def _start_timeline(self) -> None:
        """Training starts: the timeline's zero is the run's origin (the first to get here
        posts it; a rejoining node joins a timeline that is running already)."""
        self._client.compare_set(ORIGIN_KEY, "", repr(time.time()))
        origin = float(self._client.get(ORIGIN_KEY))
        own = preempting(self.scenario).get(self.rank, [])
        passed = time.time() - origin
        events = [event for event in self.scenario.timeline
                  if not (event.action in ("kill", "restart") and event in own
                          and self._is_past(event, passed))]
        # Rejoining, the timeline runs at once what was due while this node was away: its
        # links must catch up, but those faults happened before, not now.
        replayed = {index for index, event in enumerate(events)
                    if self._rejoin and self._is_past(event, passed)}

        def on_event(record: dict[str, Any]) -> None:
            if self._writer is not None:
                self._writer.fault(**record)
            post_links(self.run_dir, record, self.network.links.effective, only=self.rank)
            if record["index"] not in replayed:
                post_fault(self.run_dir, record, origin + record["t"], [self.rank])

        self._timeline = Timeline(events, self.network, on_event, clock=time.time,
                                  on_kill=self._kill, on_restart=self._restart,
                                  on_straggler_burst=self._burst)
        self._timeline.start(origin=origin)
        if self._replay:
            self._replay.on_change = lambda pairs, _: post_links(
                self.run_dir, {"pairs": pairs}, self.network.links.effective, only=self.rank)
            self._replay.start(elapsed=time.time() - origin)
        self._start_traffic(origin)

    def _start_traffic(self, origin: float) -> None:
        """The ends of the background flows that leave or enter this worker, on the run's
        clock (a client whose server, in another container, is not up yet tries again)."""
        from testbed.cluster.traffic import CrossTraffic  # its metrics' package imports torch

        traffic = CrossTraffic(
            self.scenario.flows(), run_dir=Path(self.run_dir),
            address_of=lambda rank: self.hosts[rank], ranks={self.rank},
            on_interval=lambda name, interval: self._record(
                "traffic", flow=name, seconds=interval.seconds, bytes=interval.bytes,
                lost=interval.lost))
        if traffic:
            self._traffic = traffic.start(elapsed=time.time() - origin)

    def _is_past(self, event: Event, passed: float) -> bool:
        if event.at is not None:
            return event.at <= passed
        return event.step is not None and event.step <= self._progress()

    def _progress(self) -> int:
        keys = [f"progress/{rank}" for rank in range(self.scenario.count) if rank != self.rank]
        return max((int(self._client.get(key)) for key in keys if self._client.check([key])),
                   default=-1)

    def _before_step(self, step: int) -> None:
        if self.named and self._restarts:
            self._follow_moves()
        if self._timeline is not None:
            self._timeline.on_step(step)

    def _kill(self, ranks: list[int]) -> None:
        if self.rank in ranks:  # a preempted machine: gone at once, no clean-up
            os.kill(os.getpid(), signal.SIGKILL)

    def _restart(self, ranks: list[int]) -> None:
        """Nothing to do: the Compose restart policy brings the worker back, and it rejoins by
        itself once its restart is due (`_wait_for_restart`)."""

    def _burst(self, event: Event) -> None:
        post_burst(self.run_dir, event, only=self.rank)

    def _wait_for_restart(self) -> None:
        """A restarted container: back when the timeline's restart of this worker is due."""
        restarts = [e for e in preempting(self.scenario).get(self.rank, [])
                    if e.action == "restart"]
        deadline = time.monotonic() + STORE_WAIT
        while restarts and time.monotonic() < deadline:
            origin = float(self._client.get(ORIGIN_KEY) or 0)
            if any(self._is_past(event, time.time() - origin) for event in restarts):
                return
            time.sleep(POLL)  # the others' progress lives in the store: no event to wait on


def run_node(scenario: Path, rank: int, hosts: list[str], runs: Path, *, steps: int | None = None,
             iface: str = "eth0", base_dir: Path | None = None,
             key_file: Path = KEY_FILE) -> int:
    """`testbed node`: run worker `rank` of a Compose run; returns the exit code (0 done, 1 the
    training failed, 2 bad input or links it cannot shape here, 143 SIGTERM)."""
    from testbed.scenario import ScenarioError

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return Node(scenario, rank, hosts, runs, iface=iface, steps=steps,
                    base_dir=base_dir, key_file=key_file).run()
    except (netem.UnsupportedByKernel, netem.ShapingError) as error:
        print(f"worker {rank}: cannot shape its links here: {error}", file=sys.stderr)
    except (ScenarioError, ValueError) as error:
        print(f"worker {rank}: {error}", file=sys.stderr)
    return 2
