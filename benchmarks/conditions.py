"""Trace replay fidelity: a UDP sender above a traced link's peak receives, second by second,
the capacity the trace gives (benchmarks/results/conditions.md).

A scenario's traced link is replayed as `testbed run` replays it (`ClusterNetwork` and
`LinkReplay`, through the cluster's link state), in namespaces on this kernel (the fallback:
htb's rate) and with netem in the User-Mode Linux guest. A bulk train of MTU-sized datagrams
(`netem.probe.measure_rate`, offered at 1.25x the trace's peak) runs for the whole trace; its
frames' kernel arrival stamps are binned per second and set beside the trace's mean capacity
over the same second: the relative error per second, its mean and maximum, and the correlation
over the seconds. The link's queue is short (50 packets), so the queue's own delay (at most
50 frames at the lowest rate) does not shift capacity from one second into the next by much.

    python -m benchmarks.conditions            # both placements (the guest's via the sandbox)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.machine import in_guest
from benchmarks.report import Run
from netem.capabilities import netem_available
from netem.probe import measure_rate
from testbed.cluster.network import ClusterNetwork
from testbed.cluster.replay import LinkReplay
from testbed.scenario import load_scenario

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "conditions.md"
# A synthetic step trace: capacities a UML guest's one vCPU forwards (it sends about 75 Mbit/s
# of full frames), 3 s each, so every second but a step's first lies inside one capacity.
STEPS_MBIT = (30, 10, 20, 5, 25, 15)
STEP_SECONDS = 3
SCENARIO = """
name: conditions-replay
workers: 2
topology:
  links:
    - {{from: 0, to: 1, profile: {{limit: 50}}, trace: {{file: {trace}, resolution: {resolution}}}}}
job: {{model: mlp, steps: 5}}
"""


@dataclass
class Outcome:
    placement: str
    resolution: float
    seconds: list[float]  # each whole second of the trace
    expected: list[float]  # the trace's mean capacity over it, bits/s
    measured: list[float]  # frames that arrived in it, bits/s of frames
    changes: int
    late_p99: float

    @property
    def errors(self) -> np.ndarray:
        expected, measured = np.array(self.expected), np.array(self.measured)
        return np.abs(measured - expected) / expected


def step_trace(directory: Path) -> Path:
    rows = ["time,rate"] + [f"{i * STEP_SECONDS}s,{mbit}mbit"
                            for i, mbit in enumerate(STEPS_MBIT)]
    rows.append(f"{len(STEPS_MBIT) * STEP_SECONDS}s,")
    path = directory / "step.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def replay_once(placement: str, backend: str, resolution: float) -> Outcome:
    """Replay the step trace on 0 -> 1 and saturate it for the trace's length."""
    with tempfile.TemporaryDirectory(prefix="tb-conditions-") as tmp:
        trace = step_trace(Path(tmp))
        scenario = load_scenario(SCENARIO.format(trace=trace, resolution=resolution))
        plan = scenario.traces()[(0, 1)].schedule()
        length = plan.length
        with ClusterNetwork(scenario, backend=backend) as network:
            replay = LinkReplay(network, scenario.traces())
            origin_ns = time.time_ns()
            replay.start()
            try:
                result = measure_rate(network.namespace(0), network.namespace(1),
                                      network.hosts[1], duration=length,
                                      offered=1.25 * max(STEPS_MBIT) * 1e6)
            finally:
                replay.stop()
    seconds = np.arange(int(length))
    since = (result.arrivals_ns - origin_ns) / 1e9
    counts = np.histogram(since, bins=np.append(seconds, seconds[-1] + 1))[0]
    rates = plan.values[:, 0]
    per_second = round(1 / plan.resolution)
    expected = rates[: len(seconds) * per_second].reshape(len(seconds), per_second).mean(1)
    summary = replay.summary()
    return Outcome(placement, resolution, seconds.astype(float).tolist(), expected.tolist(),
                   (counts * result.frame_bytes * 8.0).tolist(), summary["changes"],
                   summary["late_p99_seconds"])


def guest_outcomes(resolutions: list[float]) -> list[Outcome]:
    items, _ = in_guest("benchmarks.conditions", "--resolutions", *map(str, resolutions))
    return [Outcome(**item) for item in items]


def report(outcomes: list[Outcome], run: Run) -> str:
    lines = run.header(
        "Conditions: trace replay fidelity",
        also=(" A UDP sender at 1.25x the trace's peak over a link replaying a step trace of "
              f"{', '.join(map(str, STEPS_MBIT))} Mbit/s, {STEP_SECONDS} s each, as a "
              "scenario's traced link is replayed (`ClusterNetwork` + `LinkReplay`): frames "
              "received per second against the trace's mean capacity over that second. "
              "`fallback-netns` is this kernel's htb rate in namespaces; `netem-in-UML` is "
              "netem in the User-Mode Linux guest (one vCPU). A step's first second holds the "
              "previous step's queue (50 packets) and is in the table like the others."))
    lines += ["| placement | resolution | seconds | mean error | max error | max error after "
              "each step's first second | correlation | changes | change late p99 |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        errors = o.errors
        steady = np.array([e for s, e in zip(o.seconds, errors, strict=True)
                           if int(s) % STEP_SECONDS])
        correlation = float(np.corrcoef(o.expected, o.measured)[0, 1])
        lines.append(f"| {o.placement} | {o.resolution * 1e3:g} ms | {len(o.seconds)} | "
                     f"{errors.mean():.1%} | {errors.max():.1%} | {steady.max():.1%} | "
                     f"{correlation:.3f} | {o.changes} | {o.late_p99 * 1e3:.2f} ms |")
    lines += ["", "Per second (Mbit/s, trace / measured):", ""]
    for o in outcomes:
        pairs = ", ".join(f"{e / 1e6:.1f}/{m / 1e6:.1f}"
                          for e, m in zip(o.expected, o.measured, strict=True))
        lines.append(f"- {o.placement}, {o.resolution * 1e3:g} ms: {pairs}")
    lines += ["", "Collectives against competing traffic on a shared 100 Mbit/s bottleneck: "
              "`python -m benchmarks.competing`, benchmarks/results/competing.md. Not measured: "
              "the fidelity on a public recorded trace (none of those checked has a licence "
              "that lets the project ship it; docs/conditions.md lists them)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolutions", type=float, nargs="+", default=[0.1, 0.01])
    parser.add_argument("--guest-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.guest_json is not None:  # inside the guest: netem only, handed back as JSON
        found = [replay_once("netem-in-UML", "netem", r) for r in args.resolutions]
        args.guest_json.write_text(json.dumps([asdict(o) for o in found]))
        return
    run = Run.start("benchmarks.conditions")
    outcomes = [replay_once("fallback-netns", "fallback", r) for r in args.resolutions]
    print(f"fallback done in {run.elapsed():.0f} s", file=sys.stderr, flush=True)
    if netem_available():
        outcomes += [replay_once("netem-netns", "netem", r) for r in args.resolutions]
    else:
        outcomes += guest_outcomes(args.resolutions)
    RESULTS.write_text(report(outcomes, run))
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
