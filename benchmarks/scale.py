"""Scale benchmark: the cluster's network and workers for 4, 16 and 32 workers.

For each worker count: the time `ClusterNetwork` takes to build (namespaces, veths, every
directed link shaped) and to close, and how long `set_links` takes to change the loss of every
link at once and of one link (the timeline's changes, target 100 ms). Then a real run
(`ClusterRun`: one `python -m testbed.cluster.worker` per namespace) of a few MLP steps: time from
launch until every worker reported its first step, until the end, and each worker's peak memory
(VmHWM from /proc). Links are loss-only (the host kernel has no sch_netem: the fallback shapes
them). Writes benchmarks/results/scale.md.

    .venv/bin/python -m benchmarks.scale [--workers 4,16,32] [--train 4,16] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks import machine
from benchmarks.report import Run
from netem.profile import LinkProfile
from testbed.cluster.network import ClusterNetwork
from testbed.cluster.runner import ClusterRun, WorkerState
from testbed.scenario import Scenario

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "scale.md"
DEFAULT = {"loss": "1%"}  # every link: loss only, so the host's fallback can shape it
CHANGE_REPEATS = 3  # set_links calls per measurement; the median is reported
SAMPLE = 0.1  # seconds between looks at the workers' memory


@dataclass
class NetworkFigures:
    """One worker count's network timings, in seconds."""

    workers: int
    plain_start: float  # every link on the catch-all rule (no timeline)
    plain_close: float
    announced_start: float  # a timeline changes every link: a source rule per link from the start
    all_links: float  # set_links of every link, in place (median)
    one_link: float  # set_link of one link, in place (median)
    announced_close: float
    unannounced_all_links: float | None = None  # first all-links change without a timeline


@dataclass
class TrainFigures:
    """One worker count's run: seconds from launch, peak memory per worker in MiB."""

    workers: int
    steps: int
    collective: str
    network_up: float  # the first worker process appeared (the network is built by then)
    all_started: float  # every worker process running
    first_step: float  # every worker reported its first step
    end: float  # ClusterRun.run returned (workers stopped, network closed, report rendered)
    success: bool
    peak_mib: list[float] = field(default_factory=list)
    error: str | None = None
    failed: int = 0  # workers that did not finish
    why: str | None = None  # the last line (and place) of the first failed worker's log
    pss_mib: list[float] = field(default_factory=list)


def scenario(workers: int, *, announced: bool, steps: int = 10,
             collective: str = "ring") -> dict[str, Any]:
    """A loss-only scenario; `announced` adds a timeline event (never reached here) that changes
    every link, which is how a scenario makes its links' later changes go in place."""
    data: dict[str, Any] = {
        "name": f"scale-{workers}",
        "workers": workers,
        "topology": {"default": dict(DEFAULT)},
        "job": {"model": "mlp", "steps": steps},
        "collective": {"kind": collective},
    }
    if announced:
        data["timeline"] = [{"at": 3600, "set_link": {"profile": {"loss": "2%"}}}]
    return data


def timed(call: Any, *args: Any) -> float:
    begun = time.perf_counter()
    call(*args)
    return time.perf_counter() - begun


def measure_network(workers: int, *, unannounced: bool) -> NetworkFigures:
    """Build, change and close the network of `workers` workers (plain, then announced)."""
    network = ClusterNetwork(Scenario.model_validate(scenario(workers, announced=False)))
    plain_start = timed(network.start)
    try:
        first = (timed(network.set_links, _all_links(workers, "2%")) if unannounced else None)
    finally:
        plain_close = timed(network.close)
    network = ClusterNetwork(Scenario.model_validate(scenario(workers, announced=True)))
    announced_start = timed(network.start)
    try:
        all_links, one_link = [], []
        for repeat in range(CHANGE_REPEATS):
            all_links.append(network.set_links(_all_links(workers, f"{2 + repeat}%")))
            one_link.append(network.set_link(0, 1, LinkProfile.parse(loss=f"{5 + repeat}%")))
    finally:
        announced_close = timed(network.close)
    return NetworkFigures(workers, plain_start, plain_close, announced_start,
                          statistics.median(all_links), statistics.median(one_link),
                          announced_close, first)


def _all_links(workers: int, loss: str) -> dict[tuple[int, int], LinkProfile]:
    profile = LinkProfile.parse(loss=loss)
    return {(s, d): profile for s in range(workers) for d in range(workers) if s != d}


class MemoryWatch:
    """Peak memory of the worker processes of one run (`ClusterRun.worker_pids`): RSS (VmHWM)
    and PSS (smaps_rollup: pages shared with the zygote and the other workers count by share).
    Also notes when the first and the last of them appeared."""

    def __init__(self, run: ClusterRun, workers: int) -> None:
        self.run = run
        self.workers = workers
        self.peak: dict[int, int] = {}  # pid -> kB
        self.pss: dict[int, int] = {}  # pid -> kB
        self.first_seen: float | None = None
        self.all_seen: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="memory-watch")

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(SAMPLE):
            # The moment comes before the memory is read: reading 16 workers' smaps takes
            # long enough on a busy host that a time taken after it lagged their first step.
            now, pids = time.monotonic(), self.run.worker_pids().values()
            if pids and self.first_seen is None:
                self.first_seen = now
            if len(pids) >= self.workers and self.all_seen is None:
                self.all_seen = now
            for pid in pids:
                peak = machine.status_kb("VmHWM", pid)
                pss = machine.status_kb("Pss", pid, "smaps_rollup")
                if peak is not None:
                    self.peak[pid] = max(peak, self.peak.get(pid, 0))
                if pss is not None:
                    self.pss[pid] = max(pss, self.pss.get(pid, 0))


def measure_training(workers: int, steps: int, collective: str, root: Path) -> TrainFigures:
    """One `ClusterRun` of `steps` MLP steps, timed from launch (before the network exists)."""
    path = root / f"scale-{workers}.yaml"
    path.write_text(yaml.safe_dump(scenario(workers, announced=False, steps=steps,
                                            collective=collective)))
    run_dir = root / f"run-{workers}"
    run = ClusterRun(path, run_dir=run_dir)
    first_step: list[float] = []

    def on_update(states: list[WorkerState]) -> None:
        if not first_step and all(state.step >= 0 for state in states):
            first_step.append(time.monotonic())

    launched = time.monotonic()
    with MemoryWatch(run, workers) as watch:
        result = run.run(on_update)
    end = time.monotonic()

    failed = [w.rank for w in result.workers if w.status != "done"]
    why = None
    if failed:  # the run directory is temporary: keep the reason
        log = run_dir / "logs" / f"worker-{failed[0]}.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        where = [line.strip() for line in lines if line.startswith('  File "')][-1:]
        why = f"worker {failed[0]}: {lines[-1] if lines else 'no log'} {' '.join(where)}"

    def since(moment: float | None) -> float:
        return float("nan") if moment is None else moment - launched

    return TrainFigures(
        workers, steps, collective, since(watch.first_seen), since(watch.all_seen),
        since(first_step[0] if first_step else None), end - launched, result.success,
        sorted(kb / 1024 for kb in watch.peak.values()), result.error, len(failed), why,
        sorted(kb / 1024 for kb in watch.pss.values()),
    )


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (f"{min(values):.0f} / {statistics.median(values):.0f} / {max(values):.0f} "
            f"(n={len(values)})")


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    return "n/a" if value != value else (f"{value * 1000:.0f} ms" if value < 1 else
                                         f"{value:.2f} s")


def report(network: list[NetworkFigures], training: list[TrainFigures], run: Run) -> str:
    backend = ClusterNetwork(Scenario.model_validate(scenario(2, announced=False))).backend
    lines = [
        *run.header("Scale: the cluster's network and workers at 4, 16 and 32 workers",
                    also=f" Shaping backend: {backend}."),
        "### The network (`ClusterNetwork`, every link `loss: 1%`)",
        "",
        "`set-up` is `start()`: the lab's namespaces, veths and bridge, every receiver's switch "
        "port shaped, each namespace's TCP congestion control; `teardown` is `close()`. "
        "*plain*: no timeline, so each receiver has only its catch-all rule; *announced*: the "
        "scenario's timeline changes every link later, so every link has a source rule of its "
        "own from the start and changes go in place. `all links` is one "
        f"`set_links` changing the loss of all N(N-1) links, `one link` a `set_link` of 0->1 "
        f"(median of {CHANGE_REPEATS}; target 100 ms). `first all-links, unannounced` is the "
        "same change on the plain network: every receiver's rules are rebuilt.",
        "",
        "| workers | set-up plain | teardown plain | set-up announced | all links | one link "
        "| teardown announced | first all-links, unannounced |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {f.workers} | {_s(f.plain_start)} | {_s(f.plain_close)} | {_s(f.announced_start)} "
        f"| {_s(f.all_links)} | {_s(f.one_link)} | {_s(f.announced_close)} "
        f"| {_s(f.unannounced_all_links)} |"
        for f in network
    ]
    if training:
        lines += [
            "",
            "### A run (`ClusterRun`, MLP on digits, every link `loss: 1%`)",
            "",
            "Seconds from calling `ClusterRun.run` (before the network exists): `processes` "
            f"until the run had started every worker process (looked at every {SAMPLE} s), "
            "`first step` until every worker "
            "had reported its first step (target for 16 workers: 30 s), `end` until `run` "
            "returned (workers done, network closed, report rendered). Peak memory is each "
            f"worker's peak (sampled every {SAMPLE} s), min / median / max in MiB: RSS (VmHWM) "
            "and PSS (the workers are forked from one zygote; PSS counts the pages they share "
            "with it and each other by share, so it is what each one costs the machine).",
            "",
            "| workers | steps | collective | processes | first step | end | ok "
            "| peak RSS per worker (MiB) | peak PSS per worker (MiB) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for t in training:
            ok = "yes" if t.success else f"no: {t.failed} of {t.workers} failed; {t.why}"
            lines.append(f"| {t.workers} | {t.steps} | {t.collective} | {_s(t.all_started)} "
                         f"| {_s(t.first_step)} | {_s(t.end)} | {ok} | {_spread(t.peak_mib)} "
                         f"| {_spread(t.pss_mib)} |")
    lines += ["", "### Targets", "", *targets(network, training), "", WHY]
    return "\n".join(lines) + "\n"


def targets(network: list[NetworkFigures], training: list[TrainFigures]) -> list[str]:
    """Each target of the issue with the figure it is judged on (a count not measured: none)."""
    found = []
    for f in network:
        if f.workers == 32:
            found.append(f"- Network set-up of 32 workers under 3 s: {_s(f.plain_start)}: "
                         f"{_verdict(f.plain_start < 3)} (announced, every link a rule of its "
                         f"own: {_s(f.announced_start)}).")
        found.append(f"- A change of all {f.workers * (f.workers - 1)} links of {f.workers} "
                     f"workers within 100 ms: {_s(f.all_links)}, one link {_s(f.one_link)}: "
                     f"{_verdict(f.all_links < 0.1)}.")
    for t in training:
        if t.workers == 16:
            found.append(f"- 16 workers training within 30 s of launch: first step of all at "
                         f"{_s(t.first_step)}: {_verdict(t.first_step < 30)}.")
    return found


def _verdict(met: bool) -> str:
    return "met" if met else "**not met**"


WHY = """Where the time goes (found with cProfile and timers around each phase; the figures
above are this run's): pyroute2 makes a socket in another namespace by forking a helper, and
`netns.create` forks too, which is slow in a process that has imported torch. The lab adds
namespaces with `ip netns add` (spawned, not forked) and makes its netlink and ethtool sockets
from a thread that entered the namespace (`netem.namespace.netlink_in`), as the shaping backend
does. `ClusterNetwork` builds hosts and shapes ports in 8 threads, records what it installed (a
change reads nothing back) and puts the fallback's loss changes of all receivers into one
`nft -f` transaction. The announced layout's set-up is pyroute2 encoding some 3 netlink requests
per link (htb class, fifo leaf, u32 filter), CPU-bound in Python. A fresh worker's start would
be mostly `import torch`; the workers are forked from one zygote that imported torch and
scikit-learn's loader once (`testbed/cluster/zygote.py`), so a worker's start is its own set-up
(data, model, collective), and the pages it shares with the zygote count once (PSS)."""


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=_counts, default=[4, 16, 32],
                        help="worker counts for the network (default 4,16,32)")
    parser.add_argument("--train", type=_counts, default=[4, 16],
                        help="worker counts for a training run (default 4,16; '' for none)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--collective", default="ring", choices=["ring", "lossy"])
    parser.add_argument("--unannounced", type=_counts, default=[4, 16],
                        help="worker counts for the first all-links change without a timeline "
                        "(it rebuilds every receiver: slow at 32)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    run = Run.start("benchmarks.scale")
    network = []
    for workers in args.workers:
        figures = measure_network(workers, unannounced=workers in args.unannounced)
        print(figures, file=sys.stderr, flush=True)
        network.append(figures)
    training = []
    with tempfile.TemporaryDirectory(prefix="tb-scale-") as tmp:
        for workers in args.train:
            figures = measure_training(workers, args.steps, args.collective, Path(tmp))
            print(figures, file=sys.stderr, flush=True)
            training.append(figures)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(network, training, run))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
