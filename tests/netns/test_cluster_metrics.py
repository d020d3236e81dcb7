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

import pytest
from prometheus_client.parser import text_string_to_metric_families

from testbed.cluster.runner import ClusterRun, WorkerState
from testbed.report import load_run

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
             drift_every: int = 5) -> str:
    return f"""
name: metrics-{collective.split(",")[0]}
seed: 11
workers: {WORLD}
topology: {{default: {{loss: {loss}}}, congestion: cubic}}
job: {{model: mlp, steps: {steps}, batch: 32, strategy: STRATEGY}}
collective: {{kind: {collective}}}
metrics: {{drift_every: {drift_every}, linger: 60s}}
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
    assert not wrong, (
        f"drift against stale copies (steps missing a chunk: {sorted(stale)}): {wrong}"
    )
    # That some steps after the change were stale is near certain: owner 0 sends worker 1 at
    # least two parameter datagrams per step (shards are equal, so a sixth of what worker 1
    # receives in a clean step, three peers in two phases, is more than one datagram of at most
    # the MTU), so a step keeps every one with probability at most 0.7**2 = 0.49 at 30% loss,
    # and none of the 29 steps from the change on is stale with probability < 0.49**29 < 1e-9.
    clean = [s.bytes_received for s in run_record.steps if s.rank == 1 and s.step < CHANGE_AT]
    assert min(clean) / (2 * (WORLD - 1)) > 1500, f"fewer datagrams than assumed: {clean}"
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


def test_ring_retransmits_and_the_straggler_wait_show_in_the_metrics(tmp_path: Path):
    stragglers = """  overrides:
    - {worker: 3, straggler: {fixed: 50ms}}"""
    text = scenario("ring", loss="10%", steps=30).replace("STRATEGY", "gradient")
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
        steps = value(samples, "testbed_straggler_wait_seconds_count", rank=r)
        mean = value(samples, "testbed_straggler_wait_seconds_sum", rank=r) / steps
        assert steps == 30
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
