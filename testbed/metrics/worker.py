"""`WorkerMetrics`: what one training worker exports on its own /metrics endpoint.

Every metric is named `testbed_...`, in base units (seconds, bytes), counters end in `_total`,
durations are histograms, fractions are ratios 0..1, and every metric carries the worker's
`rank` beside labels of low cardinality only (`peer`, `collective`, `protocol`, `phase`,
`reason`, `split`, `direction`, `reference`, `figure`, `action`, `target`). docs/metrics.md
lists them all.

The metrics are fed from what the testbed already has:

- `record_step(record)` once per step with the job's `StepRecord` (and its `AllReduceStats`);
- `observe_counters(datagrams=, sockets=, streams=)` with the transport's cumulative counters
  (`DatagramEndpoint.counters()`/`socket_counters()`, `StreamMesh.counters()`), from the
  worker's own thread, e.g. once per step: they become Prometheus counters by their increments,
  and a counter that went down (a new endpoint) counts again from its new value;
- `record_drift(drift)` with a `Drift` from `testbed.metrics.drift`;
- `set_link_profile(peer, profile)` whenever a link's netem profile is applied;
- `record_fault(action, target, when)` for each event of the fault timeline the worker learns
  of (Grafana's fault annotations read it);
- the namespace's kernel counters (TCP retransmitted segments, UDP buffer errors) are read at
  scrape time (`NamespaceCollector`).

Each `WorkerMetrics` has its own `CollectorRegistry`, so several workers in one process (tests,
threads in namespaces) never collide.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import Metric

from testbed.metrics.drift import Drift
from testbed.metrics.namespace import PREFIX, NamespaceCollector
from testbed.transport.counters import (
    UNKNOWN_PEER,
    DatagramCounters,
    SocketCounters,
    StreamCounters,
)

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from netem.profile import LinkProfile
    from testbed.collectives.base import AllReduceStats, CollectiveBase
    from testbed.train.job import StepRecord

# Seconds: a loopback step is milliseconds, a WAN step with a lost chunk's deadline seconds.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
REFERENCES = ("mean", "owners", "group")
DIRECTIONS = ("in", "out")

# The figures strategy diloco adds to the stats of a step that applied outer updates
# (testbed.train.diloco).
OUTER_FIGURES = ("outer_step", "outer_updates", "pseudo_gradient_norm", "outer_wait_seconds",
                 "fragment")
# AllReduceStats.extra figures with a metric of their own; any other goes to
# testbed_collective_figure{figure=NAME}. datagrams_lost/late and rcvbuf_drops are the
# transport's counters (observe_counters), not counted twice.
_EXTRA_HANDLED = frozenset({
    "deadline_seconds", "broadcast_deadline_seconds", "shard_coverage", "broadcast_received",
    "chunks_missing", "resync", "rounds", "rounds_incomplete", "tcp_retransmits",
    "datagrams_lost", "datagrams_late", "rcvbuf_drops", "compression_ratio",
    "compressed_bytes", "compression_error", "feedback_residual",
    *OUTER_FIGURES,
})


class _Registry(CollectorRegistry):
    """A registry whose exposition leaves out the `_created` series of counters and histograms
    (Prometheus' text format would make each a gauge of its own; the process start says the
    same), without prometheus_client's process-wide switch."""

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            if metric.type in ("counter", "histogram"):
                created = metric.name + "_created"
                metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


def peer_label(peer: int) -> str:
    """The `peer` label of a rank; datagrams from addresses that are no known peer: unknown."""
    return "unknown" if peer == UNKNOWN_PEER else str(peer)


def straggler_wait(compute_seconds_by_rank: Mapping[int, float], rank: int) -> float:
    """How long worker `rank` waited for the slowest peer in a synchronous step: the slowest
    worker's compute time minus its own (the step starts together on every worker, since all
    leave the previous synchronous all-reduce together)."""
    return max(0.0, max(compute_seconds_by_rank.values()) - compute_seconds_by_rank[rank])


class WorkerMetrics:
    """Worker `rank`'s metrics, in a registry of its own; `serve` exports them over HTTP.

    `namespace_proc`: where to read the network namespace's counters (default: the namespace
    of the thread that builds this object; `False` exports none)."""

    def __init__(self, rank: int, *, namespace_proc: Path | bool | None = None) -> None:
        self.rank_number = rank
        self.rank = str(rank)
        self.registry: CollectorRegistry = _Registry(auto_describe=True)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last: dict[tuple[Counter, tuple[str, ...]], float] = {}
        self.namespace: NamespaceCollector | None = None
        if namespace_proc is not False:
            proc = namespace_proc if isinstance(namespace_proc, Path) else None
            self.namespace = NamespaceCollector(self.rank, proc)
            self.registry.register(self.namespace)

        c, g, h = self._counter, self._gauge, self._histogram
        # Steps, compute, stragglers, DropCompute.
        self.steps = c("steps", "Training steps this worker completed")
        self.step_number = g("step", "Number of the last step this worker completed")
        self.step_duration = h("step_duration_seconds", "Duration of a whole training step")
        self.compute_duration = h(
            "compute_duration_seconds",
            "Compute time of a step: forward, backward and injected straggler delay")
        self.wait_duration = h(
            "wait_duration_seconds",
            "Time of a step after compute: the collective (waiting for slower peers, then "
            "communicating) and the optimizer update")
        self.straggler_wait = h(
            "straggler_wait_seconds",
            "How long a step waited for the slowest peer: the slowest worker's compute time "
            "minus this worker's (observed on steps whose peers' compute times are known)")
        self.injected_delay = c("injected_delay_seconds",
                                "Straggler delay injected into this worker's compute")
        self.micro_batches = c("micro_batches", "Micro-batches computed")
        self.micro_batches_dropped = c("micro_batches_dropped",
                                       "Micro-batches dropped by DropCompute")
        self.threshold = g("dropcompute_threshold_seconds",
                           "DropCompute's compute-time threshold in force (absent: none yet)")
        # Learning.
        self.loss = g("loss", "Mean cross-entropy in nats: split=train the step's "
                      "micro-batches, split=eval the last held-out evaluation", "split")
        self.perplexity = g("perplexity", "exp(loss): per character for char-lm, per sample "
                            "over the classes otherwise", "split")
        self.accuracy = g("accuracy_ratio", "Held-out accuracy (char-lm: next character) of "
                          "the last evaluation", "split")
        # Collective, per call.
        self.collective_calls = c("collective_calls", "All-reduce calls of the training step",
                                  "collective")
        self.collective_duration = h("collective_duration_seconds",
                                     "Duration of an all-reduce call", "collective")
        self.collective_sent = c("collective_sent_bytes", "Bytes the collective sent, frame "
                                 "headers included", "collective")
        self.collective_received = c("collective_received_bytes", "Bytes the collective "
                                     "received, frame headers included", "collective")
        self.coverage = g("collective_coverage_ratio", "Fraction of the (peer, element) "
                          "contributions in the last result (1: exact)", "collective")
        self.peers_missing = g("collective_peers_missing", "Peers left out of the last call",
                               "collective")
        self.peer_missing = c("collective_peer_missing", "Calls that left this peer out",
                              "collective", "peer")
        self.deadline = g("collective_deadline_seconds", "Deadline of the last call's phase "
                          "(lossy; 0: a TCP broadcast)", "collective", "phase")
        self.shard_coverage = g("collective_shard_coverage_ratio", "Fraction of the "
                                "contributions to this owner's shard that came in time (lossy)",
                                "collective")
        self.broadcast_received = g("collective_broadcast_received_ratio", "Fraction of the "
                                    "other owners' broadcast chunks that came (lossy)",
                                    "collective")
        self.chunks_missing = c("collective_chunks_missing", "Chunks from this peer that had "
                                "not come by the deadline, both phases (lossy)",
                                "collective", "peer")
        self.resyncs = c("collective_resyncs", "Calls whose broadcast went over TCP (lossy "
                         "resync)", "collective")
        self.rounds = c("collective_rounds", "Averaging rounds (moshpit)", "collective")
        self.rounds_incomplete = c("collective_incomplete_rounds", "Averaging rounds with a "
                                   "group member missing (moshpit)", "collective")
        self.collective_retransmits = c(
            "collective_tcp_retransmitted_segments", "TCP segments retransmitted by the "
            "collective's own sockets (TCP_INFO; ring)", "collective")
        # Compression (a compressor over the collective, docs/compression.md).
        self.compression_ratio = g("compression_ratio", "Payload bytes of this worker's "
                                   "compressed contribution over its fp32 bytes, last call "
                                   "(1: uncompressed)", "collective")
        self.compressed_bytes = c("compressed_bytes", "Payload bytes of this worker's "
                                  "compressed contributions (values, indices, scales, sketches; "
                                  "before framing: collective_sent_bytes counts the wire)",
                                  "collective")
        self.compression_error = g("compression_error_ratio", "Relative error of the last "
                                   "compression, ||C(x) - x|| / ||x|| of what this worker "
                                   "compressed", "collective")
        self.feedback_residual = g("compression_feedback_residual", "What EF21M error feedback "
                                   "holds back, ||v - g|| (gradient units)", "collective")
        self.figure = g("collective_figure", "Last value of another figure the collective "
                        "reports (AllReduceStats.extra)", "collective", "figure")
        # DiLoCo's outer steps (strategy diloco: one per fragment synchronised, streaming).
        self.outer_steps = c("outer_steps", "Outer updates applied (DiLoCo; Streaming DiLoCo: "
                             "one per fragment synchronised)")
        self.outer_sent = c("outer_sent_bytes", "Bytes the outer all-reduces of the "
                            "pseudo-gradients sent")
        self.outer_step_sent = g("outer_step_sent_bytes", "Bytes the last outer all-reduce "
                                 "sent, per outer update")
        self.pseudo_gradient_norm = g("pseudo_gradient_norm", "L2 norm of the last mean "
                                      "pseudo-gradient (parameter units)")
        self.outer_wait = h("outer_wait_seconds", "How long the inner loop waited for outer "
                            "all-reduces, per step that applied outer updates (0: overlapped)")
        # Transport, per peer (cumulative counters fed by observe_counters).
        self.sent_bytes = c("transport_sent_bytes", "Bytes sent to this peer (UDP payload or "
                            "TCP messages, wire headers included)", "peer", "protocol")
        self.received_bytes = c("transport_received_bytes", "Bytes received from this peer",
                                "peer", "protocol")
        self.datagrams = {
            name: c(metric, doc, "peer") for name, metric, doc in (
                ("datagrams_sent", "datagrams_sent", "Datagrams handed to the kernel"),
                ("datagrams_received", "datagrams_received",
                 "Valid datagrams received, first copies, late ones included"),
                ("datagrams_lost", "datagrams_lost",
                 "Datagrams the peer's sequence numbers say never came"),
                ("datagrams_late", "datagrams_late",
                 "Datagrams that came after their step was closed"),
                ("datagrams_ce_marked", "datagrams_ce_marked",
                 "Datagrams received marked CE: a link with ecn marked them instead of "
                 "dropping them (sent ECN-capable: collective option ecn)"),
                ("datagrams_malformed", "datagrams_malformed",
                 "Datagrams dropped as malformed (peer=unknown: from no known address)"),
                ("datagrams_foreign", "datagrams_foreign",
                 "Datagrams dropped as not this run's peers': another run, a source address "
                 "not the sender's, a MAC that does not prove the run's key"),
                ("datagrams_replayed", "datagrams_replayed",
                 "Datagrams dropped as duplicates or replays"),
                ("send_errors", "datagram_send_errors", "Datagrams the kernel refused to send"),
            )
        }
        self.rejected = c("datagrams_rejected", "Datagrams dropped, by reason", "reason")
        self.rcvbuf_drops = c("udp_receive_buffer_drops", "Datagrams the kernel dropped for "
                              "this worker's UDP socket, its receive buffer full (SO_MEMINFO)")
        self.receive_errors = c("udp_receive_errors", "Errors reading the UDP socket")
        self.rcvbuf = g("udp_receive_buffer_bytes", "Receive buffer the kernel granted the "
                        "UDP socket")
        self.sndbuf = g("udp_send_buffer_bytes", "Send buffer the kernel granted the UDP socket")
        self.messages_sent = c("stream_messages_sent", "Messages sent over TCP", "peer")
        self.messages_received = c("stream_messages_received", "Messages received over TCP",
                                   "peer")
        self.socket_retransmits = c("tcp_retransmitted_segments", "TCP segments the socket to "
                                    "this peer retransmitted (TCP_INFO tcpi_total_retrans)",
                                    "peer")
        # Drift.
        self.drift = g("parameter_drift", "Estimated L2 distance of this worker's parameters "
                       "from the reference (parameter units)", "reference")
        self.drift_ratio = g("parameter_drift_ratio", "Estimated parameter drift divided by "
                             "the reference's L2 norm", "reference")
        self.reference_norm = g("parameter_reference_norm", "Estimated L2 norm of the "
                                "reference parameters", "reference")
        self.drift_measurements = c("parameter_drift_measurements",
                                    "Drift measurements taken", "reference")
        # Links.
        self.link_profile = Info("testbed_link_profile", "netem profile applied to the link "
                                 "(direction=in: from peer to this worker)",
                                 ("rank", "peer", "direction"), registry=self.registry)
        self.link = {
            name: g(metric, doc, "peer", "direction") for name, metric, doc in (
                ("delay", "link_delay_seconds", "Configured mean one-way delay"),
                ("jitter", "link_jitter_seconds", "Configured delay jitter"),
                ("loss", "link_loss_ratio", "Configured mean loss (random or Gilbert-Elliott)"),
                ("duplicate", "link_duplicate_ratio", "Configured duplication"),
                ("corrupt", "link_corrupt_ratio", "Configured corruption"),
                ("reorder", "link_reorder_ratio", "Configured reordering"),
                ("rate", "link_rate_bytes_per_second", "Configured rate (+Inf: unlimited)"),
            )
        }
        # The fault timeline.
        self.fault_time = g("fault_event_timestamp_seconds", "Unix time at which the last "
                            "timeline event of this action on this target took effect",
                            "action", "target")

    # Building metrics: every one carries the rank first.
    def _counter(self, name: str, documentation: str, *labels: str) -> Counter:
        return Counter(PREFIX + name, documentation, ("rank", *labels), registry=self.registry)

    def _gauge(self, name: str, documentation: str, *labels: str) -> Gauge:
        return Gauge(PREFIX + name, documentation, ("rank", *labels), registry=self.registry)

    def _histogram(self, name: str, documentation: str, *labels: str) -> Histogram:
        return Histogram(PREFIX + name, documentation, ("rank", *labels),
                         registry=self.registry, buckets=DURATION_BUCKETS)

    def _advance(self, counter: Counter, labels: tuple[str, ...], total: float) -> None:
        """Bring `counter` up to a cumulative `total`; a total below the last one (the source
        was replaced and counts from 0 again) counts its whole value. The series exists from
        the first observation, at 0 if nothing happened yet, so queries see a zero rate
        rather than no data."""
        key = (counter, labels)
        with self._lock:
            last = self._last.get(key, 0.0)
            self._last[key] = total
        increment = total - last if total >= last else total
        child = counter.labels(self.rank, *labels)
        if increment > 0:
            child.inc(increment)

    # Feeding.
    def record_step(
        self,
        record: StepRecord,
        stats: AllReduceStats | None = None,
        *,
        peer_compute_seconds: Mapping[int, float] | None = None,
    ) -> None:
        """One step of the job (call it once per step, e.g. as `train(on_step=...)`). `stats`
        defaults to the record's. `peer_compute_seconds`, every worker's compute time of this
        step by rank (exchanged like the drift sketch), gives the straggler wait."""
        rank = self.rank
        self.steps.labels(rank).inc()
        self.step_number.labels(rank).set(record.step)
        self.step_duration.labels(rank).observe(record.step_seconds)
        self.compute_duration.labels(rank).observe(record.compute_seconds)
        self.wait_duration.labels(rank).observe(record.wait_seconds)
        if peer_compute_seconds:
            self.record_peer_compute({**peer_compute_seconds,
                                      self.rank_number: record.compute_seconds})
        self.injected_delay.labels(rank).inc(max(0.0, record.injected_delay_seconds))
        self.micro_batches.labels(rank).inc(record.micro_batches)
        self.micro_batches_dropped.labels(rank).inc(record.micro_batches_dropped)
        if record.threshold_seconds is not None:
            self.threshold.labels(rank).set(record.threshold_seconds)
        self._learning("train", {"loss": record.loss})
        if record.evaluation:
            self._learning("eval", record.evaluation)
        stats = stats if stats is not None else record.stats
        if stats is not None:
            self.record_collective(stats)

    def record_peer_compute(self, compute_seconds_by_rank: Mapping[int, float]) -> None:
        """Every worker's compute time of one synchronous step (this one's included), e.g. as
        swapped with the drift sketch: observes how long this worker waited for the slowest."""
        self.straggler_wait.labels(self.rank).observe(
            straggler_wait(compute_seconds_by_rank, self.rank_number))

    def _learning(self, split: str, figures: Mapping[str, float]) -> None:
        if "loss" in figures:
            loss = float(figures["loss"])
            self.loss.labels(self.rank, split).set(loss)
            perplexity = figures.get("perplexity")
            if perplexity is None:
                perplexity = math.exp(loss) if loss < 700 else math.inf
            self.perplexity.labels(self.rank, split).set(perplexity)
        if "accuracy" in figures:
            self.accuracy.labels(self.rank, split).set(figures["accuracy"])

    def record_collective(self, stats: AllReduceStats) -> None:
        """One all-reduce call (record_step calls it with the step's stats)."""
        rank, name = self.rank, stats.collective
        self.collective_calls.labels(rank, name).inc()
        self.collective_duration.labels(rank, name).observe(stats.seconds)
        self.collective_sent.labels(rank, name).inc(max(0, stats.bytes_sent))
        self.collective_received.labels(rank, name).inc(max(0, stats.bytes_received))
        self.coverage.labels(rank, name).set(stats.coverage)
        self.peers_missing.labels(rank, name).set(len(stats.peers_missing))
        for peer in stats.peers_missing:
            self.peer_missing.labels(rank, name, peer_label(peer)).inc()
        extra = stats.extra
        for key, phase in (("deadline_seconds", "gather"),
                           ("broadcast_deadline_seconds", "broadcast")):
            if key in extra:
                self.deadline.labels(rank, name, phase).set(extra[key])
        if "shard_coverage" in extra:
            self.shard_coverage.labels(rank, name).set(extra["shard_coverage"])
        if "broadcast_received" in extra:
            self.broadcast_received.labels(rank, name).set(extra["broadcast_received"])
        missing: Mapping[int, int] = getattr(stats, "missing", None) or {}
        for peer, count in missing.items():
            if count > 0:
                self.chunks_missing.labels(rank, name, peer_label(peer)).inc(count)
        if extra.get("resync"):
            self.resyncs.labels(rank, name).inc()
        if "rounds" in extra:
            self.rounds.labels(rank, name).inc(extra["rounds"])
        if "rounds_incomplete" in extra:
            self.rounds_incomplete.labels(rank, name).inc(extra["rounds_incomplete"])
        if "tcp_retransmits" in extra:  # cumulative since the collective's sockets opened
            self._advance(self.collective_retransmits, (name,), extra["tcp_retransmits"])
        if "compression_ratio" in extra:
            self.compression_ratio.labels(rank, name).set(extra["compression_ratio"])
            self.compressed_bytes.labels(rank, name).inc(max(0.0, extra["compressed_bytes"]))
            self.compression_error.labels(rank, name).set(extra["compression_error"])
        if "feedback_residual" in extra:
            self.feedback_residual.labels(rank, name).set(extra["feedback_residual"])
        for key, value in extra.items():
            if key not in _EXTRA_HANDLED:
                self.figure.labels(rank, name, key).set(value)
        if "outer_step" in extra:
            self._outer(stats)

    def _outer(self, stats: AllReduceStats) -> None:
        """The outer updates of one step (strategy diloco): their count, bytes, the mean
        pseudo-gradient's norm and how long the inner loop waited for them."""
        rank, extra = self.rank, stats.extra
        updates = extra["outer_updates"]
        self.outer_steps.labels(rank).inc(updates)
        self.outer_sent.labels(rank).inc(max(0, stats.bytes_sent))
        self.outer_step_sent.labels(rank).set(max(0, stats.bytes_sent) / updates)
        self.pseudo_gradient_norm.labels(rank).set(extra["pseudo_gradient_norm"])
        self.outer_wait.labels(rank).observe(extra["outer_wait_seconds"])

    def observe_counters(
        self,
        *,
        datagrams: Mapping[int, DatagramCounters] | None = None,
        sockets: SocketCounters | None = None,
        streams: Mapping[int, StreamCounters] | None = None,
    ) -> None:
        """The transport's cumulative counters of this worker's one UDP endpoint and one TCP
        mesh, as they are now (call from the thread that drives them: the transport is not
        locked). Each Prometheus counter grows by what the transport's grew since last time."""
        for peer, counts in (datagrams or {}).items():
            label = peer_label(peer)
            for field_name, counter in self.datagrams.items():
                self._advance(counter, (label,), getattr(counts, field_name))
            self._advance(self.sent_bytes, (label, "udp"), counts.bytes_sent)
            self._advance(self.received_bytes, (label, "udp"), counts.bytes_received)
        if sockets is not None:
            self._advance(self.rcvbuf_drops, (), sockets.rcvbuf_drops)
            self._advance(self.receive_errors, (), sockets.receive_errors)
            self.rcvbuf.labels(self.rank).set(sockets.rcvbuf_bytes)
            self.sndbuf.labels(self.rank).set(sockets.sndbuf_bytes)
            for reason, count in sockets.rejected.items():
                self._advance(self.rejected, (str(reason),), count)
        for peer, counts in (streams or {}).items():
            label = peer_label(peer)
            self._advance(self.messages_sent, (label,), counts.messages_sent)
            self._advance(self.messages_received, (label,), counts.messages_received)
            self._advance(self.sent_bytes, (label, "tcp"), counts.bytes_sent)
            self._advance(self.received_bytes, (label, "tcp"), counts.bytes_received)
            self._advance(self.socket_retransmits, (label,), counts.tcp_retransmits)

    def observe_transport(self, collective: CollectiveBase) -> None:
        """`observe_counters` with what a collective exposes: its `endpoint` (a
        DatagramEndpoint, lossy) and its `mesh` (a StreamMesh), where it has them."""
        endpoint, mesh = collective.endpoint, collective.mesh
        self.observe_counters(
            datagrams=endpoint.counters() if endpoint is not None else None,
            sockets=endpoint.socket_counters() if endpoint is not None else None,
            streams=mesh.counters() if mesh is not None else None,
        )

    def record_drift(self, drift: Drift, reference: str = "mean") -> None:
        """A drift measurement (`testbed.metrics.drift.drift_from`); `reference` is what it was
        measured against: mean (all workers), owners (the shard owners' values) or group."""
        if reference not in REFERENCES:
            raise ValueError(f"reference: expected one of {', '.join(REFERENCES)}, "
                             f"got {reference!r}")
        self.drift.labels(self.rank, reference).set(drift.absolute)
        self.drift_ratio.labels(self.rank, reference).set(drift.relative)
        self.reference_norm.labels(self.rank, reference).set(drift.reference_norm)
        self.drift_measurements.labels(self.rank, reference).inc()

    def set_link_profile(
        self, peer: int, profile: LinkProfile | None, direction: str = "in"
    ) -> None:
        """The netem profile now applied to the link between `peer` and this worker
        (`direction` in: peer -> this worker, out: this worker -> peer); None: unshaped."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction: expected in or out, got {direction!r}")
        labels = (self.rank, peer_label(peer), direction)
        if profile is None:
            for metric in (self.link_profile, *self.link.values()):
                with contextlib.suppress(KeyError):  # never set
                    metric.remove(*labels)
            return
        self.link_profile.labels(*labels).info({"profile": str(profile)})
        values = {
            "delay": profile.delay, "jitter": profile.jitter, "loss": profile.mean_loss,
            "duplicate": profile.duplicate, "corrupt": profile.corrupt,
            "reorder": profile.reorder,
            "rate": math.inf if profile.rate is None else profile.rate / 8,
        }
        for name, value in values.items():
            self.link[name].labels(*labels).set(value)

    def record_fault(self, action: str, target: str, when: float) -> None:
        """An event of the fault timeline took effect at `when` (Unix seconds): `action` as the
        timeline names it (`set_link`, `kill`, ...), `target` what it acted on (a link, groups,
        workers). A gauge of the time, not a counter: a worker learns of some events only when
        it (re)starts, and the time stays the event's, so Grafana can place the event exactly
        (its annotations take the value as the time)."""
        self.fault_time.labels(self.rank, action, target).set(when)

    # Serving.
    def serve(self, port: int = 0, addr: str = "0.0.0.0") -> int:
        """Export /metrics over HTTP at `addr`:`port` (0: a free port); returns the port. Call
        it from inside the worker's network namespace: the server listens there, and its
        threads read that namespace's kernel counters."""
        if self._server is not None:
            raise RuntimeError(f"rank {self.rank}: metrics already served on port "
                               f"{self._server.server_port}")
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return self._server.server_port

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server is not None else None

    def close(self) -> None:
        """Stop the HTTP server; idempotent. The registry stays readable."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> WorkerMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

