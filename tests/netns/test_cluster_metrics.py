"""A run of the training job across namespaces with each collective, scraped as Prometheus would:
through the run's relay on the host's loopback, while the workers are live (at a step before a
timeline change, and once every worker is done and lingers). The values checked could be wrong:
gloo's drift is exactly zero; lossy's is zero until a link starts losing and then positive, and
the loss shows on that link's counters only, from the step of the change on; the ring's TCP
retransmits rise on lossy links; the straggler wait reflects a worker's injected delay.

Loss comes from the fallback (nftables), so this runs on the host kernel."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from testbed.cluster.runner import ClusterRun, WorkerState
from testbed.metrics.drift import drift_from, projection
from testbed.report import load_run, parameter_dumps

pytestmark = pytest.mark.netns
WORLD = 4
SCRAPE_TIMEOUT = 10.0
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} was not exported"
    return samples[key]


def count(samples: Samples, name: str, **labels: str) -> float:
    """A labelled counter: a series that was never incremented is not exported (0)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class Scraper:
    """Scrapes every worker once the slowest reached `at_step` (if given) and once all are
    done; the run calls it with the workers' state after every report."""

    def __init__(self, cluster: ClusterRun, at_step: int | None = None) -> None:
        self.cluster, self.at_step = cluster, at_step
        self.early: list[Samples] = []
        self.early_steps: list[int] = []
        self.final: list[Samples] = []

    def __call__(self, workers: list[WorkerState]) -> None:
        if (self.at_step is not None and not self.early
                and min(w.step for w in workers) >= self.at_step):
            self.early_steps = [w.step for w in workers]
            self.early = [scrape(url) for url in self.cluster.metrics_urls]
        if not self.final and all(w.lingering for w in workers):
            self.final = [scrape(url) for url in self.cluster.metrics_urls]


def run(tmp_path: Path, text: str, at_step: int | None = None) -> tuple[ClusterRun, Scraper]:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    cluster = ClusterRun(path, run_dir=tmp_path / "run")
    scraper = Scraper(cluster, at_step)
    result = cluster.run(scraper)
    assert result.success, result.error
    assert len(cluster.metrics_urls) == WORLD
    assert scraper.final, "the workers were never all done while serving"
    return cluster, scraper


def scenario(collective: str, *, loss: str = "0%", steps: int = 40, extra: str = "",
             drift_every: int = 5, metrics: str = "") -> str:
    return f"""
name: metrics-{collective.split(",")[0]}
seed: 11
workers: {WORLD}
topology: {{default: {{loss: {loss}}}, congestion: cubic}}
job: {{model: mlp, steps: {steps}, batch: 32, strategy: STRATEGY}}
collective: {{kind: {collective}}}
metrics: {{drift_every: {drift_every}, linger: 60s{metrics}}}
{extra}
"""


def every_rank(check: Callable[[int], None]) -> None:
    for rank in range(WORLD):
        check(rank)


def test_gloo_keeps_every_worker_exactly_on_the_mean(tmp_path: Path):
    _, scraper = run(tmp_path, scenario("gloo", loss="2%").replace("STRATEGY", "gradient"))
    for rank, samples in enumerate(scraper.final):
        r = str(rank)
        assert value(samples, "testbed_parameter_drift_ratio", rank=r, reference="mean") == 0.0
        assert value(samples, "testbed_parameter_drift_measurements_total", rank=r,
                     reference="mean") == 40 / 5
        assert value(samples, "testbed_steps_total", rank=r) == 40


CHANGE_AT, STEPS = 30, 60


def stale_steps(steps) -> set[int]:
    """The steps at which some worker missed a chunk of another owner's broadcast: its copy of
    that chunk kept the previous step's parameters."""
    return {step.step for step in steps if step.extra.get("broadcast_received", 1.0) < 1.0}


def test_lossy_drift_and_lost_datagrams_follow_a_link_that_starts_losing(tmp_path: Path):
    timeline = f"""timeline:
  - step: {CHANGE_AT}
    set_link: {{link: {{from: 0, to: 1}}, profile: {{loss: 30%}}}}"""
    text = scenario("lossy, deadline_initial: 0.3", steps=STEPS, extra=timeline, drift_every=1)
    cluster, scraper = run(tmp_path, text.replace("STRATEGY", "sharded"), at_step=10)
    run_record = load_run(cluster.run_dir)
    stale = stale_steps(run_record.steps)

    assert max(scraper.early_steps) < CHANGE_AT, (
        f"the early scrape came too late (steps {scraper.early_steps})")
    for rank, samples in enumerate(scraper.early):  # a clean network: every copy is exact
        r = str(rank)
        if not any(step <= max(scraper.early_steps) + 1 for step in stale):
            assert value(samples, "testbed_parameter_drift_ratio", rank=r,
                         reference="mean") == 0.0
        for peer in range(WORLD):
            if peer != rank:
                assert count(samples, "testbed_datagrams_lost_total", rank=r,
                             peer=str(peer)) == 0

    final = scraper.final
    assert value(final[1], "testbed_datagrams_lost_total", rank="1", peer="0") > 0
    for rank, peer in [(1, 2), (1, 3), (2, 0), (3, 0), (0, 1)]:  # the other links: nothing
        assert count(final[rank], "testbed_datagrams_lost_total", rank=str(rank),
                     peer=str(peer)) == 0, f"loss on link {peer}->{rank}, which was not changed"
    # The configured loss follows the timeline: 0 at the early scrape, 30% after the change.
    assert value(scraper.early[1], "testbed_link_loss_ratio", rank="1", peer="0",
                 direction="in") == 0.0
    assert value(final[1], "testbed_link_loss_ratio", rank="1", peer="0",
                 direction="in") == pytest.approx(0.3)
    assert value(final[1], "testbed_link_loss_ratio", rank="1", peer="2", direction="in") == 0.0

    # Drift is measured after every step, and it is exactly what the broadcasts explain: owners
    # send fresh parameters every step, so every copy is exact at a step where no worker missed
    # a broadcast chunk (drift 0), and a copy that kept a stale chunk is off the mean (drift
    # > 0). This holds step by step, whatever the random losses were.
    drift = {(step.rank, step.step): step.drift for step in run_record.steps
             if step.drift is not None}
    assert len(drift) == WORLD * STEPS, f"drift measured at {len(drift)} of {WORLD * STEPS}"
    wrong = {key: value for key, value in drift.items() if (value > 0) != (key[1] in stale)}
    assert not wrong, f"drift against stale copies (stale steps: {sorted(stale)}): {wrong}"
    # That some steps after the change were stale is near certain: owner 0 sends worker 1 at
    # least two parameter datagrams per step (shards are equal, so a sixth of what worker 1
    # receives in a clean step, three peers in two phases, is more than one datagram of at most
    # the MTU), so a step keeps every one with probability at most 0.7**2 = 0.49 at 30% loss,
    # and none of the 29 steps from the change on is stale with probability < 0.49**29 < 1e-9.
    # The shards' sizes are the same every step; what a clean step received varies only with
    # the datagrams that came after its deadline on a loaded host (a CI run saw one clean step
    # at 7.8 kB among 22-48 kB), so the median clean step shows the size.
    clean = [s.bytes_received for s in run_record.steps if s.rank == 1 and s.step < CHANGE_AT]
    assert np.median(clean) / (2 * (WORLD - 1)) > 1500, f"fewer datagrams than assumed: {clean}"
    assert stale & set(range(CHANGE_AT + 1, STEPS)), "no stale copy after 29 steps at 30% loss"
    assert max(drift[(1, step)] for step in stale) > 0

    # The step events say when: worker 1 lost no datagram before the change (a busy host may
    # make some late, not lost), and from it on missed chunks in many steps. Each step owner 0
    # sends worker 1 at least two gradient and two parameter datagrams, so a step misses one
    # with probability at least 1 - 0.7**4 = 0.76; fewer than a quarter of 28 such steps do
    # with probability below 1e-7 (binomial tail).
    mine = {step.step: step.extra for step in run_record.steps if step.rank == 1}
    (fault,) = run_record.faults
    assert fault.action == "set_link" and fault.fields["step"] == CHANGE_AT
    before = [mine[s].get("datagrams_lost", 0.0) for s in range(CHANGE_AT - 2)]
    after = [mine[s].get("chunks_missing", 0.0) > 0 for s in range(CHANGE_AT + 2, STEPS)]
    assert not any(before), f"datagrams lost before the change: {before}"
    assert sum(after) >= 0.25 * len(after), f"too few steps missed a chunk after it: {after}"
    # The live table's figure is the run's total, not the last step's.
    assert cluster.workers[1].datagrams_lost == sum(e.get("datagrams_lost", 0.0)
                                                    for e in mine.values()) > 0


# The drift check against parameter dumps: k numbers per sketch, and how far an estimate may be
# from the exact ratio in a step that counts as agreeing (see the test's docstring).
DUMP_K, DUMP_STEPS, AGREE = 4096, 40, (0.86, 1.163)


def exact_drift(dumps: dict[tuple[int, int], np.ndarray], step: int) -> dict[int, float]:
    """||theta_r - mean theta|| / ||mean theta|| of every rank at `step`, in float64."""
    vectors = {rank: dumps[rank, step].astype(np.float64) for rank in range(WORLD)}
    mean = np.mean(list(vectors.values()), axis=0)
    return {rank: float(np.linalg.norm(v - mean) / np.linalg.norm(mean))
            for rank, v in vectors.items()}


def disagreeing_steps(estimates: dict[tuple[int, int], float],
                      exact: dict[tuple[int, int], float]) -> list[int]:
    """The steps at which some rank's estimate is off: not exactly 0 where the copies are
    identical, or outside AGREE times the exact ratio where they differ."""
    bad = set()
    for (rank, step), truth in exact.items():
        estimate = estimates[rank, step]
        ok = estimate == 0.0 if truth == 0.0 else AGREE[0] <= estimate / truth <= AGREE[1]
        if not ok:
            bad.add(step)
    return sorted(bad)


def test_lossy_drift_matches_the_exact_distance_of_the_dumped_parameters(tmp_path: Path):
    """Every worker dumps the parameter vector it sketched at every step (30% loss on every
    link, so most steps leave some copy stale), and the drift it exported is checked against
    the vectors themselves:

    1. bit for bit against the estimator run on the dumps (`projection`, `drift_from`): the
       worker sketched what it dumped, exchanged the sketches exactly and exported the result
       unchanged (the final scrape's gauge is the last step's figure);
    2. against the exact ||theta_r - mean theta|| / ||mean theta||, within the estimator's
       error: exactly 0 where every copy is identical; elsewhere, in at least half the steps,
       every rank's estimate within [0.86, 1.163] of the exact ratio. Why that bound: with a
       CountSketch of k rows, Var(||S v||^2) <= 2 ||v||^4 / k for any v (docs/metrics.md), so by
       Chebyshev ||S v||^2 strays beyond (1 +- 0.15) ||v||^2 with probability <= 2 / (k 0.15^2)
       = 0.022 at k = 4096; a step whose four distances and reference norm all stay within it
       (probability >= 0.89; the steps' projections are independent) has every ratio within
       sqrt(0.85 / 1.15) .. sqrt(1.15 / 0.85). More than half of 40 steps failing that has
       probability below 1e-9 (binomial tail): a false failure is negligible.

    How it was checked to catch wrong answers: with `drift_from` made to return 1.2 times the
    relative drift, check 2 failed at all 40 steps (check 1 cannot see that: it runs the same
    estimator); with the worker taking its reference from the other ranks' sketches only,
    check 1 failed at the first step. The test also holds its own negative check: the same
    figures scaled by 1.25 or 0.8, or another rank's figures, must fail check 2 (they did at
    all 40 steps; the real ones were within 0.96-1.04 of the exact ratio)."""
    text = scenario("lossy, deadline_initial: 0.3", loss="30%", steps=DUMP_STEPS,
                    drift_every=1, metrics=f", drift_k: {DUMP_K}, dump_parameters: true")
    cluster, scraper = run(tmp_path, text.replace("STRATEGY", "sharded"))
    recorded = {(s.rank, s.step): s.drift for s in load_run(cluster.run_dir).steps}
    dumps = parameter_dumps(cluster.run_dir)
    assert set(dumps) == {(rank, step) for rank in range(WORLD) for step in range(DUMP_STEPS)}
    assert None not in recorded.values(), "a drift exchange was skipped"

    exact = {}
    for step in range(DUMP_STEPS):
        sketches = {rank: projection(torch.from_numpy(dumps[rank, step]), step, DUMP_K)
                    for rank in range(WORLD)}
        for rank, truth in exact_drift(dumps, step).items():
            exact[rank, step] = truth
            again = drift_from(sketches, sketches[rank]).relative
            assert recorded[rank, step] == pytest.approx(again, rel=1e-9, abs=0), (rank, step)
    for rank, samples in enumerate(scraper.final):
        assert value(samples, "testbed_parameter_drift_ratio", rank=str(rank),
                     reference="mean") == recorded[rank, DUMP_STEPS - 1]

    stale = sum(truth > 0 for truth in exact.values())
    assert stale > WORLD * DUMP_STEPS / 2, f"only {stale} stale copies: too few to judge"
    bad = disagreeing_steps(recorded, exact)
    assert len(bad) < DUMP_STEPS / 2, f"estimates off the exact drift at steps {bad}"
    # The check has the power to see wrong figures: mis-scaled ones, or another rank's.
    for wrong in ({key: 1.25 * v for key, v in recorded.items()},
                  {key: 0.8 * v for key, v in recorded.items()},
                  {(rank, step): recorded[(rank + 1) % WORLD, step] for rank, step in recorded}):
        assert len(disagreeing_steps(wrong, exact)) >= DUMP_STEPS / 2


def test_ring_retransmits_and_the_straggler_wait_show_in_the_metrics(tmp_path: Path):
    stragglers = """  overrides:
    - {worker: 3, straggler: {fixed: 50ms}}"""
    # 3% loss, not more: a ring waits on its slowest stream, and a segment lost again and again
    # doubles TCP's retransmission timeout each time. A ring of four over this fallback's loss,
    # 300 calls of this model's 4810 floats (benchmarks/results/ring-stalls.md), had 49 calls
    # over 1 s at 10%, the slowest 24.5 s (CI saw a 30 s stall here), and none at 3%, the
    # slowest 0.66 s; 3% of the ~2900 data segments of 30 steps leaves no retransmission with
    # odds below e^-80.
    text = scenario("ring, timeout: 120", loss="3%", steps=30).replace("STRATEGY", "gradient")
    text = text.replace(f"workers: {WORLD}", f"workers:\n  count: {WORLD}\n{stragglers}")
    _, scraper = run(tmp_path, text)
    final = scraper.final
    socket_retransmits = sum(
        value(s, "testbed_collective_tcp_retransmitted_segments_total", rank=str(r),
              collective="ring") for r, s in enumerate(final))
    assert socket_retransmits > 0
    namespace_retransmits = sum(
        value(s, "testbed_netns_tcp_retransmitted_segments_total", rank=str(r))
        for r, s in enumerate(final))
    assert namespace_retransmits >= socket_retransmits
    for rank, samples in enumerate(final):
        r = str(rank)
        assert value(samples, "testbed_parameter_drift_ratio", rank=r, reference="mean") == 0.0
        # A step's wait is observed once every worker's figures of it came through the run's
        # store (five steps a drift window); its TCP crosses lossy links, and a retransmission
        # timeout that grew can hold a window past the relay's FIGURES_WAIT (in CI at 10% loss:
        # one step of 24.6 s, 25 of 30 observed), so the count is five per drift measurement.
        steps = value(samples, "testbed_straggler_wait_seconds_count", rank=r)
        windows = value(samples, "testbed_parameter_drift_measurements_total", rank=r,
                        reference="mean")
        assert 1 <= windows <= 30 / 5 and steps == 5 * windows, (steps, windows)
        mean = value(samples, "testbed_straggler_wait_seconds_sum", rank=r) / steps
        if rank == 3:  # the straggler itself waits for nobody
            assert mean < 0.02, f"the straggler waited {mean:.3f} s per step"
            assert value(samples, "testbed_injected_delay_seconds_total",
                         rank=r) == pytest.approx(30 * 0.05)
        else:
            assert mean > 0.04, f"worker {rank} waited {mean:.3f} s for a 50 ms straggler"


def test_moshpit_averages_in_rounds_and_reports_them(tmp_path: Path):
    text = scenario("moshpit, group_size: 2", steps=20).replace(
        "STRATEGY", "average, average_every: 2")
    _, scraper = run(tmp_path, text)
    for rank, samples in enumerate(scraper.final):
        r = str(rank)
        # 10 averagings of d = 2 rounds (a 2x2 grid), none with a member missing.
        assert value(samples, "testbed_collective_rounds_total", rank=r,
                     collective="moshpit") == 20
        assert count(samples, "testbed_collective_incomplete_rounds_total", rank=r,
                     collective="moshpit") == 0
        assert value(samples, "testbed_parameter_drift_measurements_total", rank=r,
                     reference="mean") == 20 / 5
