"""The process each worker of a run executes: `testbed worker SPEC.json` (`run_worker`).

The runner starts it inside the worker's network namespace. It trains its share of the
scenario's job over the scenario's collective, exports its metrics on `/metrics`, appends a
step event per step to the run directory (`testbed.report`), swaps a parameter sketch and its
compute times with the other workers every `metrics.drift_every` steps (parameter drift and the
straggler wait, off the training path: `testbed.cluster.exchange`), applies the straggler
bursts the runner appends to its control file, and
prints one JSON line per step on stdout for the runner's live display, then a final
`{"done": true, ...}` line, after which it keeps /metrics up for `metrics.linger` seconds (the
runner ends that sooner, once every worker is done). A worker restarted after a preemption
(`rejoin`) first pulls the current parameters from a live peer (Moshpit from its group; any
other collective through the run's store, where a live worker answers between its steps; under
strategy diloco the outer state, `Job.state`, always through the store) and
resumes after the step the most advanced live worker finished; the others start step 0
together, after a barrier. Exit 0 on success, 1 on a training error (the traceback
on stderr), 143 on SIGTERM; the collective, the metrics server and the event file are closed in
every case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.cluster.exchange import FigureRelay, PeerExchange

PORTS = {"collective": 29500, "stream": 29501, "store": 29502, "drift": 29503, "metrics": 9100}
START_WAIT = 300.0  # seconds the workers wait for each other to be ready for step 0
PULL_WAIT = 60.0  # seconds a rejoining worker waits for a live one to send its parameters


class SpecError(ValueError):
    """A worker spec that cannot be used; the message names the field."""


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker needs to know: the scenario (a path; `steps` overrides its job's), its
    rank in `world`, every worker's address (`hosts`, by rank), the base `ports`, the run
    directory and the run's id. With `port_stride`, rank r listens on base + r * stride, so
    several workers can share one address (a single-host run on loopback). `key_file`: where
    the run's secret is (a file only its owner may read), if the run authenticates (never the
    secret itself: this spec is written beside the logs). `run_store`: the
    address of the run's store (None: worker 0's). `base_dir`: what paths in the scenario are
    relative to (None: the scenario file's directory; the runner gives workers a copy of the
    file, so it names the original's). `rejoin`: a worker restarted after a preemption, which
    joins the run where the others are. `mtu`: the interface's, where it is below the
    scenario's (an overlay network's; None: the scenario's)."""

    scenario: str
    rank: int
    world: int
    hosts: list[str]
    run_dir: str
    run_id: int = 0
    steps: int | None = None
    ports: dict[str, int] = field(default_factory=lambda: dict(PORTS))
    port_stride: int = 0
    metrics_address: str = "0.0.0.0"
    run_store: str | None = None
    base_dir: str | None = None
    rejoin: bool = False
    key_file: str | None = None
    mtu: int | None = None

    def __post_init__(self) -> None:
        if self.world < 1:
            raise SpecError(f"world: expected at least 1, got {self.world}")
        if not 0 <= self.rank < self.world:
            raise SpecError(f"rank: expected 0..{self.world - 1}, got {self.rank}")
        if len(self.hosts) != self.world:
            raise SpecError(f"hosts: expected one address per rank ({self.world}), "
                            f"got {len(self.hosts)}")
        unknown = sorted(set(self.ports) - set(PORTS))
        if unknown:
            raise SpecError(f"ports: unknown {', '.join(unknown)}; allowed: {', '.join(PORTS)}")
        if self.steps is not None and self.steps < 1:
            raise SpecError(f"steps: expected at least 1 or null, got {self.steps}")

    def port(self, name: str, rank: int | None = None) -> int:
        """Port `name` of `rank` (default: this worker)."""
        base = {**PORTS, **self.ports}[name]
        return base + (self.rank if rank is None else rank) * self.port_stride

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise SpecError(f"not JSON: {error}") from None
        if not isinstance(data, dict):
            raise SpecError("expected a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            allowed = ", ".join(sorted(names))
            raise SpecError(f"{', '.join(unknown)}: not a field; allowed: {allowed}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING and f.name not in data)
        if missing:
            raise SpecError(f"{', '.join(missing)}: required")
        try:
            return cls(**data)
        except TypeError as error:
            raise SpecError(str(error)) from None


def placement(spec: WorkerSpec, scenario: Any) -> Any:
    """Where this worker is, for its collective's registry entry to place it (with the run's
    key, read from `spec.key_file`, where the run authenticates)."""
    from testbed.collectives.registry import Placement
    from testbed.transport.auth import read_key

    return Placement(rank=spec.rank, world=spec.world, hosts=spec.hosts, port=spec.port,
                     run_id=spec.run_id, mtu=spec.mtu or scenario.topology.mtu,
                     congestion=scenario.congestion(spec.rank), rejoining=spec.rejoin,
                     key=read_key(Path(spec.key_file)) if spec.key_file else None)


class WorkerControl:
    """What a running worker is told through its control file (JSON lines appended by the
    runner, or by a Compose node's own timeline), read before every step (`poll`):

    - straggler bursts, `{"delay": <straggler spec>, "steps": n}` or `{..., "until": <epoch
      seconds>}`, which add to the compute of the steps they last (`delay`);
    - link changes, `{"link": {"peer": p, "profile": {...} | null}}`: the profile now on the
      link from peer p into this worker, handed to `on_link(peer, profile)` (the worker's
      metrics), so the configured link follows the fault timeline;
    - faults, `{"fault": {"action": a, "target": t, "time": <epoch seconds>}}`: an event of the
      timeline that took effect, handed to `on_fault(action, target, time)` (the worker's
      metrics), so the dashboards can mark it.

    A restarted worker takes the latest profile of each link and every fault from what the file
    holds (a fault keeps its own time, so one read twice is the same fact), but no burst: bursts
    are not replayed."""

    def __init__(self, path: Path, seed: int, rank: int,
                 on_link: Callable[[int, Any], None] | None = None,
                 on_fault: Callable[[str, str, float], None] | None = None) -> None:
        self.path, self.seed, self.rank = path, seed, rank
        self.on_link = on_link or (lambda peer, profile: None)
        self.on_fault = on_fault or (lambda action, target, when: None)
        self._offset = 0
        self._received = 0
        self._active: list[tuple[Any, int | None, float | None]] = []
        self._read(bursts=False)

    def poll(self) -> None:
        """Apply what was appended since the last look."""
        self._read(bursts=True)

    def paused_until(self) -> float | None:
        """For a command job, which has no steps: the wall-clock time until which the bursts
        in force pause it (None: none is in force). Reads the file first."""
        self.poll()
        now = time.time()
        self._active = [burst for burst in self._active if burst[2] is None or burst[2] > now]
        return max((until for _, _, until in self._active if until is not None), default=None)

    def delay(self) -> float:
        """Seconds the bursts in force add to this step's compute."""
        now, total, still = time.time(), 0.0, []
        for draws, steps, until in self._active:
            if (steps is not None and steps <= 0) or (until is not None and now >= until):
                continue
            total += draws.next()
            still.append((draws, None if steps is None else steps - 1, until))
        self._active = still
        return total

    def _read(self, *, bursts: bool) -> None:
        from netem.profile import LinkProfile
        from testbed.train.stragglers import StragglerDelay, StragglerSpec

        for line in self._new_lines():
            message = json.loads(line)
            if "link" in message:
                link = message["link"]
                profile = link["profile"]
                self.on_link(int(link["peer"]),
                             None if profile is None else LinkProfile.model_validate(profile))
            elif "fault" in message:
                fault = message["fault"]
                self.on_fault(fault["action"], fault["target"], float(fault["time"]))
            elif bursts:
                self._received += 1
                draws = StragglerDelay(StragglerSpec.parse(message["delay"]),
                                       self.seed + self._received, self.rank)
                self._active.append((draws, message.get("steps"), message.get("until")))

    def _new_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as control:
                control.seek(self._offset)
                data = control.read()
        except FileNotFoundError:
            return []
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits
        self._offset += len(complete)
        return [line for line in complete.decode().splitlines() if line.strip()]


def run_worker(spec_path: str | Path) -> int:
    """`testbed worker SPEC.json`: run the worker the spec describes; returns the exit code (0
    done, 1 the training failed, 2 a bad spec, 143 SIGTERM)."""
    try:
        spec = WorkerSpec.from_json(Path(spec_path).read_text())
    except (OSError, SpecError) as error:
        print(f"worker spec {spec_path}: {error}", file=sys.stderr)
        return 2
    me = os.getpid()

    def on_sigterm(*_: object) -> None:
        if os.getpid() != me:  # a forked helper holding a copy of this stack just ends
            os._exit(143)
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    return Worker(spec).run()


class Worker:
    """`on_start()` runs when training starts (after the start barrier, or on rejoining) and
    `before_step(step)` before each step: where a Compose node drives its own fault timeline."""

    def __init__(self, spec: WorkerSpec, *, on_start: Callable[[], None] | None = None,
                 before_step: Callable[[int], None] | None = None) -> None:
        self.spec = spec
        self.on_start = on_start or (lambda: None)
        self.before_step = before_step or (lambda step: None)
        self._collective: Any = None

    def peer_moved(self, rank: int, host: str) -> None:
        """Peer `rank` came back at another address (a restarted Swarm task): the collective
        sends to it there and takes its datagrams from there (called between steps)."""
        if self._collective is not None:
            self._collective.peer_moved(rank, host)

    def run(self) -> int:
        entered = time.time()
        from testbed import collectives
        from testbed.metrics import WorkerMetrics
        from testbed.metrics.traffic import TrafficCollector, status_path
        from testbed.report import RunWriter
        from testbed.scenario import load_scenario

        spec = self.spec
        scenario = load_scenario(Path(spec.scenario), steps=spec.steps, base_dir=spec.base_dir)
        writer = RunWriter.open(spec.run_dir, rank=spec.rank)
        startup = {"entered": entered - writer.started, "loaded": writer.now()}
        metrics = WorkerMetrics(spec.rank)
        if any(flow.dst == spec.rank for flow in scenario.traffic):
            metrics.registry.register(TrafficCollector(status_path(spec.run_dir, spec.rank),
                                                       spec.rank))
        collective = None
        evaluation: dict[str, float] | None = None
        started = time.monotonic()
        try:
            metrics.serve(spec.port("metrics") if scenario.metrics.port else 0,
                          spec.metrics_address)
            for peer in range(spec.world):
                if peer != spec.rank:
                    metrics.set_link_profile(peer, scenario.link_profile(peer, spec.rank))
            if scenario.command is not None:
                return self._run_command(scenario, writer, metrics)
            collective = collectives.place(scenario.collective.kind, placement(spec, scenario),
                                           scenario.collective.options())
            compressor = scenario.collective.compressor
            if compressor.kind != "none":  # a layer over it (docs/compression.md)
                from testbed.collectives.compression import wrap

                # Strategy gradient's payload ends with its micro-batch count: kept exact.
                tail = 1 if scenario.job.strategy == "gradient" else 0
                collective = wrap(collective, compressor.kind, dense_tail=tail,
                                  **compressor.parameters())
            self._collective = collective
            startup["connected"] = writer.now()
            evaluation = self._train(scenario, collective, writer, metrics, PeerExchange(spec),
                                     startup)
            say(rank=spec.rank, done=True, evaluation=evaluation,
                 seconds=time.monotonic() - started)
            if scenario.metrics.linger:  # the runner's SIGTERM ends it once all are done
                say(rank=spec.rank, lingering=True)
                time.sleep(scenario.metrics.linger)
        except SystemExit as stop:
            if evaluation is not None:  # ended while lingering: the work is done
                return 0
            writer.end(success=False, error="terminated")
            return int(stop.code or 143)
        except Exception as error:
            traceback.print_exc()
            writer.end(success=False, error=f"{type(error).__name__}: {error}")
            return 1
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up runs to its end
            if collective is not None:
                collective.close()
            metrics.close()
            writer.close()
        return 0

    def _run_command(self, scenario: Any, writer: Any, metrics: Any) -> int:
        """A command of the user's own instead of training (`testbed.cluster.command`); it
        lingers like a training job once the command exited 0."""
        from testbed.cluster.command import run_command

        spec = self.spec
        control = WorkerControl(control_path(spec.run_dir, spec.rank), scenario.seed, spec.rank,
                                on_link=metrics.set_link_profile,
                                on_fault=metrics.record_fault)
        code = run_command(spec, scenario, say=say, writer=writer, control=control,
                           on_start=self.on_start)
        if code == 0 and scenario.metrics.linger:  # the runner's SIGTERM ends it sooner
            say(rank=spec.rank, lingering=True)
            with contextlib.suppress(SystemExit):
                time.sleep(scenario.metrics.linger)
        return code

    def _train(self, scenario: Any, collective: Any, writer: Any, metrics: Any,
               exchange: PeerExchange, startup: dict[str, float]) -> dict[str, float]:
        """Train to the last step. `startup`: when this worker (on the run's clock) entered
        `run`, had its scenario loaded and its collective placed (connected, where it
        connects); recorded as a `startup` event with when its job was built and it was ready."""
        from torch.nn.utils import parameters_to_vector

        from testbed.train.job import Job

        spec, config = self.spec, scenario.train_config(self.spec.rank)
        job = Job(config, collective, spec.rank, spec.world,
                  slowdown=scenario.slowdown(spec.rank))
        collective.set_shapes([tuple(p.shape) for p in job.parameters])
        startup["built"] = writer.now()
        if spec.rejoin:  # where the others are, with their parameters (DiLoCo: outer state)
            start = exchange.progress() + 1
            # Moshpit: the parameters from its group
            state = collective.pull_state() if job.state_is_parameters else None
            if state is None:  # through the run's store, from a live worker
                answer = exchange.request_parameters(PULL_WAIT)
                state = None if answer is None else answer[1]
                if answer is not None:
                    start = max(start, answer[0] + 1)
            if state is not None:
                job.restore(state)
            writer.event("rejoin", rank=spec.rank, step=start, pulled=state is not None)
        else:  # every worker starts step 0 together, whatever its set-up took
            start = 0
            exchange.barrier("start", START_WAIT)
            say(rank=spec.rank, ready=True)
        startup["ready"] = writer.now()
        writer.event("startup", rank=spec.rank, rejoin=spec.rejoin,
                     **{stage: round(t, 3) for stage, t in startup.items()})
        self.on_start()
        # Progress is posted, and requests for parameters watched, only where a worker may
        # come back to read them.
        rejoinable = any(event.action == "restart" for event in scenario.timeline)
        control = WorkerControl(control_path(spec.run_dir, spec.rank), config.seed, spec.rank,
                                on_link=metrics.set_link_profile,
                                on_fault=metrics.record_fault)
        every = scenario.metrics.drift_every
        figures = StepFigures(scenario, spec.rank, metrics, writer)
        relay = FigureRelay(spec, figures.received, rejoinable=rejoinable)
        computes: dict[int, float] = {}
        try:
            for step in range(start, config.steps):
                self.before_step(step)
                control.poll()
                record = job.step(step, extra_delay=control.delay())
                if rejoinable:
                    relay.post_progress(step)
                    if relay.parameters_wanted:
                        relay.answer_parameters(step, job.state())
                computes[step] = record.compute_seconds
                if config.eval_every and (step + 1) % config.eval_every == 0:
                    record.evaluation = job.evaluate()
                if every and (step + 1) % every == 0:
                    vector = parameters_to_vector(job.parameters).detach().cpu()
                    relay.post_figures(step, figures.row(step, vector, computes))
                    computes.clear()
                    if scenario.metrics.dump_parameters:
                        writer.parameters(step, vector.numpy())
                metrics.record_step(record)
                metrics.observe_transport(collective)
                writer.step(record)
                stats = record.stats
                say(rank=spec.rank, step=step, loss=record.loss,
                     step_seconds=record.step_seconds,
                     coverage=stats.coverage if stats else None,
                     datagrams_lost=(stats.extra.get("datagrams_lost") if stats else None),
                     drift=figures.latest)
        finally:
            relay.close()  # the last figures recorded before the end is written
        writer.end(success=True)
        return job.evaluate()


class StepFigures:
    """The figures the workers swap every `metrics.drift_every` steps (through `FigureRelay`,
    off the training path): a sketch of each one's parameters and its compute time of each step
    since the last swap. From every worker's, the drift (a `drift` event and the metrics) and,
    for each step all workers ran, how long this one waited for the slowest."""

    def __init__(self, scenario: Any, rank: int, metrics: Any, writer: Any) -> None:
        from testbed.metrics.drift import DEFAULT_K

        self.k, self.every = scenario.metrics.drift_k or DEFAULT_K, scenario.metrics.drift_every
        self.rank, self.metrics, self.writer = rank, metrics, writer
        self.latest: float | None = None  # the last drift measured, for the live display

    def row(self, step: int, vector: Any, computes: dict[int, float]) -> Any:
        """This worker's figures of `step`: the sketch of `vector`, then its compute times."""
        import torch

        from testbed.metrics.drift import projection

        window = range(step - self.every + 1, step + 1)
        mine = torch.tensor([computes.get(s, math.nan) for s in window], dtype=torch.float64)
        return torch.cat([projection(vector, step, self.k), mine])

    def received(self, step: int, rows: dict[int, Any] | None) -> None:
        """Every worker's figures of `step` came (None: some worker's did not)."""
        import torch

        from testbed.metrics.drift import drift_from

        if rows is None:
            return
        k = self.k
        times = torch.stack([row[k:] for _, row in sorted(rows.items())])  # (world, every)
        for column in times.T[times.isfinite().all(dim=0)]:
            self.metrics.record_peer_compute(dict(enumerate(column.tolist())))
        measured = drift_from({rank: row[:k] for rank, row in rows.items()}, rows[self.rank][:k])
        self.metrics.record_drift(measured)
        self.writer.drift(step, measured.relative)
        self.latest = measured.relative


def control_path(run_dir: str | Path, rank: int) -> Path:
    """Where the runner (or a Compose node, for itself) appends what worker `rank` is told:
    straggler bursts, link changes, faults (`WorkerControl`)."""
    return Path(run_dir) / "logs" / f"control-{rank}.jsonl"


def post_burst(run_dir: str | Path, event: Any, only: int | None = None) -> None:
    """A timeline's straggler burst, to each of its workers' control files (`only`: to this
    worker's, if the burst names it); a `duration` becomes a wall-clock `until`."""
    burst = event.straggler_burst
    message = {
        "delay": burst.delay.model_dump(exclude_none=True),
        "steps": burst.steps,
        "until": time.time() + burst.duration if burst.duration else None,
    }
    for rank in burst.workers:
        if only is None or rank == only:
            _post(run_dir, rank, message)


def post_links(run_dir: str | Path, record: dict[str, Any], profile_of: Callable[[int, int], Any],
               only: int | None = None) -> None:
    """The links a timeline record changed (its `pairs`), to each receiver's control file
    (`only`: to this worker's) with `profile_of(src, dst)`, what the link carries now."""
    for src, dst in record.get("pairs", ()):
        if only is None or dst == only:
            profile = profile_of(src, dst)
            _post(run_dir, dst, {"link": {"peer": src, "profile": profile.model_dump()}})


def post_fault(run_dir: str | Path, record: dict[str, Any], when: float,
               ranks: Iterable[int]) -> None:
    """A timeline record that took effect at `when` (Unix seconds), to the control files of
    `ranks` (their metrics export it for Grafana's annotations). A record with an `error` is
    a fault that did not happen: not posted."""
    if "error" in record:
        return
    message = {"fault": {"action": record["action"], "target": fault_target(record),
                         "time": when}}
    for rank in ranks:
        _post(run_dir, rank, message)


def fault_target(record: dict[str, Any]) -> str:
    """What a timeline record acted on, in the timeline's words: its link (`0<->1`,
    `east->west`, `all links`), its groups (`east|west`) or its workers (`3`, `1,2`)."""
    if "link" in record:
        return str(record["link"])
    return ",".join(str(worker) for worker in record.get("workers", ()))


def _post(run_dir: str | Path, rank: int, message: dict[str, Any]) -> None:
    """One line on worker `rank`'s control file (`WorkerControl` reads it)."""
    path = control_path(run_dir, rank)
    path.parent.mkdir(exist_ok=True)
    with path.open("a") as control:
        control.write(json.dumps(message) + "\n")


def say(**fields: Any) -> None:
    """One JSON line on stdout in one write: several workers share the zygote's pipe, and a
    line written in pieces (as `print` does with PYTHONUNBUFFERED set) can be cut into by
    another's (a write of up to PIPE_BUF bytes is never split)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in fields.items()}
    os.write(sys.stdout.fileno(), (json.dumps(clean) + "\n").encode())


