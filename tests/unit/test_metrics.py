"""The worker's Prometheus metrics: scraped over real HTTP and parsed with prometheus_client's
own parser; the naming rules checked on every family; drift estimated from a shared projection
against the true L2 distance."""

from __future__ import annotations

import itertools
import math
import re
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from netem.profile import LinkProfile
from testbed.collectives.base import AllReduceStats, CollectiveBase
from testbed.collectives.lossy import LossyStats
from testbed.metrics import (
    PREFIX,
    NamespaceCollector,
    WorkerMetrics,
    drift_from,
    gather_over,
    projection,
    reference_from_shards,
    straggler_wait,
)
from testbed.metrics.drift import BLOCK
from testbed.metrics.traffic import TrafficCollector, write_status
from testbed.train.job import StepRecord
from testbed.transport.counters import (
    UNKNOWN_PEER,
    DatagramCounters,
    SocketCounters,
    StreamCounters,
    namespace_counters,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
LOW_CARDINALITY = {"rank", "peer", "collective", "protocol", "phase", "reason", "split",
                   "direction", "reference", "figure", "le", "profile", "action", "target",
                   "flow", "kind"}
# Units that are not Prometheus' base units, as a part of a name between underscores.
NOT_BASE_UNITS = re.compile(r"_(milliseconds|microseconds|nanoseconds|ms|us|ns|minutes|hours|"
                            r"kilobytes|megabytes|kb|mb|bits|percent)(_|$)")


def lossy_stats(step: int, *, coverage: float = 0.9) -> LossyStats:
    return LossyStats(
        "lossy", step, seconds=0.02, bytes_sent=12_000, bytes_received=11_000,
        coverage=coverage, peers_missing=(2,),
        extra={"deadline_seconds": 0.05, "broadcast_deadline_seconds": 0.04,
               "shard_coverage": 0.95, "broadcast_received": 0.9, "chunks_missing": 3.0,
               "datagrams_late": 1.0, "datagrams_lost": 2.0, "rcvbuf_drops": 0.0,
               "resync": float(step % 2)},
        missing={0: 1, 2: 2}, late={0: 1}, lost={2: 2},
    )


def step_record(step: int, stats: AllReduceStats | None, **changes) -> StepRecord:
    values = dict(rank=1, step=step, loss=2.3, compute_seconds=0.05, wait_seconds=0.03,
                  step_seconds=0.08, injected_delay_seconds=0.01, micro_batches=3,
                  micro_batches_dropped=1, threshold_seconds=0.04, stats=stats)
    values.update(changes)
    return StepRecord(**values)


def datagrams(scale: int) -> dict[int, DatagramCounters]:
    return {
        0: DatagramCounters(datagrams_sent=10 * scale, bytes_sent=14_000 * scale,
                            datagrams_received=9 * scale, bytes_received=12_600 * scale,
                            datagrams_lost=scale, datagrams_late=scale // 2),
        2: DatagramCounters(datagrams_sent=10 * scale, bytes_sent=14_000 * scale,
                            datagrams_received=8 * scale, bytes_received=11_200 * scale,
                            datagrams_lost=2 * scale),
        UNKNOWN_PEER: DatagramCounters(datagrams_malformed=scale),
    }


def fed(rank: int = 1) -> WorkerMetrics:
    """A worker's metrics after two lossy steps, a ring call, a moshpit call, transport
    counters, two link profiles, a drift measurement and three faults, and receiving two
    background flows."""
    metrics = WorkerMetrics(rank)
    traffic = Path(tempfile.mkdtemp()) / "traffic.json"
    write_status(traffic, {
        "bulk": {"peer": 0, "kind": "tcp", "active": True, "received_bytes": 1e6,
                 "lost_datagrams": 0},
        "video": {"peer": 2, "kind": "udp", "active": False, "received_bytes": 2e5,
                  "lost_datagrams": 3}})
    metrics.registry.register(TrafficCollector(traffic, rank))
    metrics.record_step(step_record(0, lossy_stats(0)), peer_compute_seconds={0: 0.07, 2: 0.04})
    metrics.record_step(step_record(1, lossy_stats(1), loss=2.1,
                                    evaluation={"loss": 2.0, "accuracy": 0.4, "perplexity": 7.4}))
    metrics.record_step(step_record(2, None, threshold_seconds=None))  # a local step
    metrics.record_collective(AllReduceStats("ring", 2, seconds=0.3, bytes_sent=800,
                                             bytes_received=800, extra={"tcp_retransmits": 5.0}))
    metrics.record_collective(AllReduceStats("ring", 3, seconds=0.3, bytes_sent=800,
                                             bytes_received=800, extra={"tcp_retransmits": 7.0}))
    metrics.record_collective(AllReduceStats(
        "moshpit", 3, seconds=0.1, coverage=0.75, peers_missing=(3,),
        extra={"rounds": 2.0, "rounds_incomplete": 1.0, "new_figure_seconds": 0.5}))
    for scale in (1, 3):
        metrics.observe_counters(
            datagrams=datagrams(scale),
            sockets=SocketCounters(rcvbuf_drops=scale, rcvbuf_bytes=8 << 20,
                                   sndbuf_bytes=1 << 20, rejected={"bad_magic": scale}),
            streams={0: StreamCounters(messages_sent=scale, bytes_sent=100 * scale,
                                       messages_received=scale, bytes_received=90 * scale,
                                       tcp_retransmits=2 * scale)},
        )
    metrics.set_link_profile(0, LinkProfile.parse(delay="20ms", jitter="5ms", loss="5%",
                                                  rate="100mbit"))
    metrics.set_link_profile(2, LinkProfile.parse(gilbert_elliott={"p": "1%", "r": "25%"}),
                             direction="out")
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    sketches = {r: projection(x + 0.01 * r, step=2) for r in range(3)}
    metrics.record_drift(drift_from(sketches, sketches[rank]))
    metrics.record_fault("set_link", "0<->1", 1_700_000_000.5)
    metrics.record_fault("kill", "2", 1_700_000_010.25)
    metrics.record_fault("set_link", "0<->1", 1_700_000_020.0)  # the same link again: later
    return metrics


def scrape(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families, sample_name: str, **labels: str) -> float:
    name = sample_name
    for suffix in ("_total", "_bucket", "_count", "_sum", "_info"):
        name = name.removesuffix(suffix)
    family = families.get(name) or families[sample_name]
    matches = [s.value for s in family.samples
               if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (sample_name, labels, family.samples)
    return matches[0]


def test_scraped_over_http_with_the_values_fed() -> None:
    metrics = fed()
    port = metrics.serve(0, "127.0.0.1")
    try:
        assert metrics.port == port
        families = scrape(port)
    finally:
        metrics.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    rank = {"rank": "1"}
    # Steps, compute, stragglers, DropCompute.
    assert families["testbed_steps"].type == "counter"
    assert value(families, "testbed_steps_total", **rank) == 3
    assert value(families, "testbed_step", **rank) == 2
    assert value(families, "testbed_step_duration_seconds_count", **rank) == 3
    assert value(families, "testbed_step_duration_seconds_sum", **rank) == pytest.approx(0.24)
    buckets = [(float(s.labels["le"]), s.value) for s in
               families["testbed_step_duration_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == (math.inf, 3)
    assert dict(buckets)[0.05] == 0 and dict(buckets)[0.1] == 3
    assert value(families, "testbed_straggler_wait_seconds_count", **rank) == 1
    assert value(families, "testbed_straggler_wait_seconds_sum", **rank) == pytest.approx(0.02)
    assert value(families, "testbed_micro_batches_total", **rank) == 9
    assert value(families, "testbed_micro_batches_dropped_total", **rank) == 3
    assert value(families, "testbed_injected_delay_seconds_total", **rank) == pytest.approx(0.03)
    assert value(families, "testbed_dropcompute_threshold_seconds", **rank) == 0.04
    # Learning.
    assert value(families, "testbed_loss", split="train", **rank) == 2.3  # the last step's
    assert value(families, "testbed_loss", split="eval", **rank) == 2.0
    assert value(families, "testbed_perplexity", split="eval", **rank) == 7.4
    assert value(families, "testbed_perplexity", split="train", **rank) == pytest.approx(
        math.exp(2.3))
    assert value(families, "testbed_accuracy_ratio", split="eval", **rank) == 0.4
    # The collective.
    lossy = {"collective": "lossy", **rank}
    assert value(families, "testbed_collective_calls_total", **lossy) == 2
    assert value(families, "testbed_collective_duration_seconds_count", **lossy) == 2
    assert value(families, "testbed_collective_sent_bytes_total", **lossy) == 24_000
    assert value(families, "testbed_collective_coverage_ratio", **lossy) == 0.9
    assert value(families, "testbed_collective_peer_missing_total", peer="2", **lossy) == 2
    assert value(families, "testbed_collective_chunks_missing_total", peer="2", **lossy) == 4
    assert value(families, "testbed_collective_deadline_seconds", phase="broadcast",
                 **lossy) == 0.04
    assert value(families, "testbed_collective_resyncs_total", **lossy) == 1
    ring = {"collective": "ring", **rank}
    assert value(families, "testbed_collective_tcp_retransmitted_segments_total", **ring) == 7
    assert value(families, "testbed_collective_rounds_total", collective="moshpit") == 2
    assert value(families, "testbed_collective_figure", collective="moshpit",
                 figure="new_figure_seconds") == 0.5
    # Transport counters: the last cumulative values, per peer.
    assert value(families, "testbed_datagrams_lost_total", peer="2", **rank) == 6
    assert value(families, "testbed_datagrams_late_total", peer="0", **rank) == 1
    assert value(families, "testbed_datagrams_malformed_total", peer="unknown", **rank) == 3
    assert value(families, "testbed_transport_sent_bytes_total", peer="0", protocol="udp",
                 **rank) == 42_000
    assert value(families, "testbed_transport_received_bytes_total", peer="0", protocol="tcp",
                 **rank) == 270
    assert value(families, "testbed_tcp_retransmitted_segments_total", peer="0", **rank) == 6
    assert value(families, "testbed_udp_receive_buffer_drops_total", **rank) == 3
    assert value(families, "testbed_datagrams_rejected_total", reason="bad_magic", **rank) == 3
    # Links.
    assert value(families, "testbed_link_profile_info", peer="0", direction="in",
                 profile="delay=20ms jitter=5ms loss=5% rate=100mbit", **rank) == 1
    assert value(families, "testbed_link_loss_ratio", peer="0", direction="in") == 0.05
    assert value(families, "testbed_link_loss_ratio", peer="2", direction="out") == (
        pytest.approx(0.01 / 0.26))
    assert value(families, "testbed_link_delay_seconds", peer="0", direction="in") == 0.02
    assert value(families, "testbed_link_rate_bytes_per_second", peer="0",
                 direction="in") == 12_500_000
    assert value(families, "testbed_link_rate_bytes_per_second", peer="2",
                 direction="out") == math.inf
    # Drift: x + 0.01 r for r = 0, 1, 2 -> rank 1 is the mean.
    assert value(families, "testbed_parameter_drift", reference="mean", **rank) < 0.01
    assert value(families, "testbed_parameter_drift_ratio", reference="mean", **rank) < 1e-4
    assert value(families, "testbed_parameter_drift_measurements_total", reference="mean") == 1
    # Faults: the time of the last event per action and target.
    assert value(families, "testbed_fault_event_timestamp_seconds", action="set_link",
                 target="0<->1", **rank) == 1_700_000_020.0
    assert value(families, "testbed_fault_event_timestamp_seconds", action="kill",
                 target="2", **rank) == 1_700_000_010.25
    # The namespace's kernel counters, read at scrape time in this namespace.
    retransmits = value(families, "testbed_netns_tcp_retransmitted_segments_total", **rank)
    assert retransmits == int(retransmits) and retransmits <= read_retransmits()


def test_every_family_follows_the_naming_rules_and_is_documented() -> None:
    metrics = fed()
    documented = set(re.findall(r"`(testbed_[a-z_]+)`", DOCS.read_text()))
    families = list(metrics.registry.collect())
    assert len(families) > 40
    for family in families:
        name = family.name
        assert name.startswith(PREFIX), name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        assert not NOT_BASE_UNITS.search(name), f"{name}: use base units (seconds, bytes)"
        exposed = {"counter": f"{name}_total", "info": f"{name}_info"}.get(family.type, name)
        assert exposed in documented, f"{exposed} is not in docs/metrics.md"
        if family.type == "counter":
            assert not name.endswith("_total")  # the client adds it to the samples
            assert all(s.name == f"{name}_total" for s in family.samples), family.samples
        if family.type == "histogram":
            assert name.endswith("_seconds"), f"{name}: histograms here are durations"
        if family.type == "gauge":
            assert not name.endswith("_total"), f"{name}: _total is for counters"
        for sample in family.samples:
            assert set(sample.labels) <= LOW_CARDINALITY, (name, sample.labels)
            assert sample.labels["rank"] == "1"
            peer = sample.labels.get("peer")
            assert peer is None or peer == "unknown" or peer.isdigit(), sample
            if name.endswith("_ratio") and not name.startswith("testbed_parameter_drift"):
                assert 0.0 <= sample.value <= 1.0, sample
    names = {f.name for f in families}
    for required in ("testbed_parameter_drift", "testbed_parameter_drift_ratio",
                     "testbed_netns_tcp_retransmitted_segments",
                     "testbed_tcp_retransmitted_segments",
                     "testbed_straggler_wait_seconds", "testbed_compute_duration_seconds",
                     "testbed_micro_batches_dropped", "testbed_datagrams_sent",
                     "testbed_datagrams_received", "testbed_datagrams_lost",
                     "testbed_datagrams_late", "testbed_datagrams_malformed",
                     "testbed_transport_sent_bytes", "testbed_collective_duration_seconds",
                     "testbed_step_duration_seconds", "testbed_loss", "testbed_perplexity",
                     "testbed_accuracy_ratio", "testbed_steps", "testbed_link_profile"):
        assert required in names, required
    # And the document lists nothing that does not exist.
    exposed_names = {({"counter": f"{f.name}_total", "info": f"{f.name}_info"}
                      .get(f.type, f.name)) for f in families}
    assert documented <= exposed_names, documented - exposed_names


def test_cumulative_counters_only_go_up_and_survive_a_reset() -> None:
    metrics = WorkerMetrics(0, namespace_proc=False)
    get = metrics.registry.get_sample_value
    labels = {"rank": "0", "peer": "1"}
    metrics.observe_counters(datagrams={1: DatagramCounters(datagrams_lost=5)})
    metrics.observe_counters(datagrams={1: DatagramCounters(datagrams_lost=5)})
    assert get("testbed_datagrams_lost_total", labels) == 5
    metrics.observe_counters(datagrams={1: DatagramCounters(datagrams_lost=8)})
    assert get("testbed_datagrams_lost_total", labels) == 8
    # A new endpoint counts from 0 again: its 2 are new losses, not a decrease.
    metrics.observe_counters(datagrams={1: DatagramCounters(datagrams_lost=2)})
    assert get("testbed_datagrams_lost_total", labels) == 10
    assert get("testbed_netns_tcp_retransmitted_segments_total", {"rank": "0"}) is None


def test_observe_transport_reads_what_a_collective_exposes() -> None:
    class Endpoint:
        def counters(self):
            return {1: DatagramCounters(datagrams_sent=4, bytes_sent=4000)}

        def socket_counters(self):
            return SocketCounters(rcvbuf_drops=1)

    class Datagrams(CollectiveBase):
        name = "lossy"
        endpoint = Endpoint()

    class Quiet(CollectiveBase):  # a collective without sockets of ours: nothing
        name = "gloo"

    metrics = WorkerMetrics(0, namespace_proc=False)
    metrics.observe_transport(Datagrams())
    metrics.observe_transport(Quiet())
    get = metrics.registry.get_sample_value
    assert get("testbed_datagrams_sent_total", {"rank": "0", "peer": "1"}) == 4
    assert get("testbed_udp_receive_buffer_drops_total", {"rank": "0"}) == 1


def test_link_profile_replaced_and_removed() -> None:
    metrics = WorkerMetrics(0, namespace_proc=False)
    get = metrics.registry.get_sample_value
    metrics.set_link_profile(1, LinkProfile.parse(loss="5%"))
    metrics.set_link_profile(1, LinkProfile.parse(loss="10%"))
    info = [s for f in metrics.registry.collect() if f.name == "testbed_link_profile"
            for s in f.samples]
    assert [s.labels["profile"] for s in info] == ["loss=10%"]
    assert get("testbed_link_loss_ratio", {"rank": "0", "peer": "1", "direction": "in"}) == 0.1
    metrics.set_link_profile(1, None)
    metrics.set_link_profile(2, None)  # never set: nothing to remove
    assert get("testbed_link_loss_ratio", {"rank": "0", "peer": "1", "direction": "in"}) is None
    with pytest.raises(ValueError, match="direction"):
        metrics.set_link_profile(1, LinkProfile(), direction="sideways")
    with pytest.raises(ValueError, match="reference"):
        metrics.record_drift(drift_from({0: torch.ones(4)}, torch.ones(4)), reference="median")


def test_two_workers_in_one_process_do_not_collide() -> None:
    a, b = WorkerMetrics(0), WorkerMetrics(1)
    ports = [a.serve(0, "127.0.0.1"), b.serve(0, "127.0.0.1")]
    try:
        a.record_step(step_record(0, None, rank=0))
        families = [scrape(port) for port in ports]
        with pytest.raises(RuntimeError, match="already served"):
            a.serve(0, "127.0.0.1")
    finally:
        a.close()
        b.close()
        a.close()  # idempotent
    assert value(families[0], "testbed_steps_total", rank="0") == 1
    assert not [s for s in families[1]["testbed_steps"].samples]


def read_retransmits() -> int:
    """Tcp RetransSegs of this namespace, read from /proc apart from the code under test."""
    lines = [line.split() for line in Path("/proc/self/net/snmp").read_text().splitlines()
             if line.startswith("Tcp:")]
    header, values = lines
    return int(values[header.index("RetransSegs")])


def test_namespace_tcp_retransmits_are_read_from_this_namespace() -> None:
    before = read_retransmits()
    counters = namespace_counters()
    collector = NamespaceCollector("0")
    read = collector.read()
    after = read_retransmits()
    assert before <= counters["tcp_retrans_segs"] <= after  # the kernel's figure, here
    assert read is not None and before <= read["tcp_retrans_segs"] <= after
    # Given a process's /proc/PID/net, any thread reads that namespace.
    assert NamespaceCollector("0", Path("/proc/self/net")).read() is not None
    # The scrape thread is in the namespace the collector was made in: it reports.
    got: list[dict | None] = []
    thread = threading.Thread(target=lambda: got.append(collector.read()))
    thread.start()
    thread.join()
    assert got[0] is not None
    # A collector made in another namespace reports nothing rather than this one's figures.
    collector.namespace = -1
    assert collector.read() is None
    assert all(not family.samples for family in collector.collect())


# Drift.

def test_projection_estimates_the_l2_distance() -> None:
    """Johnson-Lindenstrauss: with k = 64 the estimate is within 30% of the true distance for
    every seed, and unbiased in the mean."""
    ratios = []
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        n = 50_000 + 1000 * seed
        x = torch.randn(n, generator=generator)
        y = x + torch.randn(n, generator=generator) * 0.01 * (seed + 1)
        if seed % 4 == 3:  # a concentrated difference: a few stale chunks
            y = x.clone()
            y[1000:1400] += 1.0
        true = float(torch.linalg.vector_norm(x.double() - y.double()))
        estimate = float(torch.linalg.vector_norm(projection(x, seed, 64)
                                                  - projection(y, seed, 64)))
        ratios.append(estimate / true)
    assert all(0.7 < r < 1.3 for r in ratios), ratios
    assert sum(ratios) / len(ratios) == pytest.approx(1.0, abs=0.1)


def test_drift_to_the_mean_and_relative() -> None:
    generator = torch.Generator().manual_seed(7)
    n, world = 30_000, 4
    base = torch.randn(n, generator=generator)
    workers = [base + 0.05 * torch.randn(n, generator=generator) for _ in range(world)]
    mean = torch.stack(workers).mean(0)
    sketches = {r: projection(w, 11) for r, w in enumerate(workers)}
    for r, w in enumerate(workers):
        drift = drift_from(sketches, sketches[r])
        true = float(torch.linalg.vector_norm(w - mean))
        assert drift.absolute == pytest.approx(true, rel=0.3)
        assert drift.reference_norm == pytest.approx(float(torch.linalg.vector_norm(mean)),
                                                     rel=0.3)
        assert drift.relative == pytest.approx(drift.absolute / drift.reference_norm)
        assert 0 < drift.relative < 0.1


def test_identical_parameters_drift_exactly_zero() -> None:
    x = torch.randn(3 * BLOCK + 17, generator=torch.Generator().manual_seed(3))
    sketches = {r: projection(x.clone(), 5) for r in range(3)}
    drift = drift_from(sketches, sketches[0])
    assert drift.absolute == 0.0 and drift.relative == 0.0 and drift.reference_norm > 0
    zero = drift_from({0: torch.zeros(8)}, torch.zeros(8))
    assert (zero.absolute, zero.relative) == (0.0, 0.0)
    assert drift_from({0: torch.zeros(8)}, torch.ones(8)).relative == math.inf


def test_projection_is_shared_linear_and_step_seeded() -> None:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2 * BLOCK + 12_345, generator=generator)
    whole = projection(x, 9, 32)
    assert torch.equal(whole, projection(x.clone(), 9, 32))  # every worker draws the same
    assert not torch.allclose(whole, projection(x, 10, 32))  # a new projection each step
    assert whole.dtype == torch.float64 and whole.shape == (32,)
    # Owners sketch their own shards (not on block boundaries); the sum is the whole's sketch.
    cuts = [0, BLOCK + 5, 70_001, x.numel()]
    shards = [projection(x[a:b], 9, 32, offset=a) for a, b in itertools.pairwise(cuts)]
    assert torch.allclose(reference_from_shards(shards), whole, rtol=0, atol=1e-9)
    # Shapes do not matter, only the flat order.
    assert torch.equal(projection(x[:1000].reshape(10, 100), 9, 32), projection(x[:1000], 9, 32))
    with pytest.raises(ValueError, match="k"):
        projection(x, 0, 0)
    with pytest.raises(ValueError, match="different k"):
        drift_from({0: whole}, projection(x, 9, 16))


class _ExactCollective:
    """All workers' rows, averaged as an exact all-reduce would (one worker's end of it)."""

    def __init__(self, rank: int, world: int, rows: dict[int, torch.Tensor], coverage: float):
        self.rank, self.world, self.rows, self.coverage = rank, world, rows, coverage

    def allreduce(self, tensor: torch.Tensor, step: int):
        self.rows[self.rank] = tensor
        mean = torch.stack(list(self.rows.values())).mean(0)
        return mean, AllReduceStats("fake", step, coverage=self.coverage)


def test_gather_over_an_exact_collective() -> None:
    world, generator = 3, torch.Generator().manual_seed(5)
    x = torch.randn(5000, generator=generator)
    sketches = {r: projection(x + 0.1 * r, 1, 16) for r in range(world)}
    rows: dict[int, torch.Tensor] = {}
    for r in range(world - 1):  # the others' rows are in, as if they called first
        rows[r] = torch.zeros(world, 16)
        rows[r][r] = sketches[r].float()
    gathered = gather_over(_ExactCollective(world - 1, world, rows, 1.0), sketches[world - 1], 1)
    assert gathered is not None and sorted(gathered) == list(range(world))
    for r in range(world):
        assert torch.allclose(gathered[r], sketches[r], rtol=1e-5)
    lossy = _ExactCollective(0, world, {}, 0.9)
    assert gather_over(lossy, sketches[0], 1) is None


def test_straggler_wait_is_the_slowest_compute_minus_mine() -> None:
    computes = {0: 0.05, 1: 0.20, 2: 0.10}
    assert straggler_wait(computes, 0) == pytest.approx(0.15)
    assert straggler_wait(computes, 1) == 0.0
