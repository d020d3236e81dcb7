"""The kernel's counters of the worker's own network namespace, read at scrape time.

`testbed.transport.counters.namespace_counters` reads /proc/thread-self/net, i.e. the
namespace of the thread that reads. The HTTP server's threads are started by `WorkerMetrics.serve`
and inherit the namespace of the thread that called it, which is the worker's when the worker
runs inside its namespace. So that a scrape never reports another namespace's figures (a
server started before the worker entered its namespace, a test thread calling `collect`), the
collector remembers the namespace it was made in and reports nothing from a thread in another
one; `proc=Path("/proc/PID/net")` reads a given process's namespace from anywhere instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from testbed.transport.counters import namespace_counters

PREFIX = "testbed_"

# (key of namespace_counters, metric name without _total, help)
NAMESPACE_COUNTERS = (
    ("tcp_retrans_segs", "netns_tcp_retransmitted_segments",
     "TCP segments retransmitted in the worker's network namespace (/proc/net/snmp "
     "Tcp RetransSegs)"),
    ("tcp_out_segs", "netns_tcp_sent_segments",
     "TCP segments sent in the worker's network namespace, retransmissions excluded "
     "(Tcp OutSegs)"),
    ("tcpext_tcp_lost_retransmit", "netns_tcp_lost_retransmits",
     "Retransmitted TCP segments that were lost again (TcpExt TCPLostRetransmit)"),
    ("tcpext_tcp_timeouts", "netns_tcp_timeouts",
     "TCP retransmission timeouts (TcpExt TCPTimeouts)"),
    ("udp_in_datagrams", "netns_udp_received_datagrams",
     "UDP datagrams delivered to sockets in the namespace (Udp InDatagrams)"),
    ("udp_out_datagrams", "netns_udp_sent_datagrams",
     "UDP datagrams sent from the namespace (Udp OutDatagrams)"),
    ("udp_rcvbuf_errors", "netns_udp_receive_buffer_errors",
     "UDP datagrams dropped because a socket's receive buffer was full (Udp RcvbufErrors)"),
    ("udp_in_errors", "netns_udp_receive_errors",
     "UDP datagrams that could not be delivered (Udp InErrors)"),
)


def _namespace_id() -> int | None:
    try:
        return os.stat("/proc/thread-self/ns/net").st_ino
    except OSError:
        return None


class NamespaceCollector(Collector):
    """Counters of /proc/net/snmp and /proc/net/netstat for one worker, labelled by its rank."""

    def __init__(self, rank: str, proc: Path | None = None) -> None:
        self.rank = rank
        self.proc = proc
        self.namespace = _namespace_id() if proc is None else None

    def read(self) -> dict[str, int] | None:
        """The namespace's counters, or None when this thread is in another namespace or the
        files cannot be read."""
        if self.proc is None and _namespace_id() != self.namespace:
            return None
        try:
            return namespace_counters(self.proc or Path("/proc/thread-self/net"))
        except (OSError, ValueError):
            return None

    def describe(self) -> Iterator[Metric]:
        for _, name, documentation in NAMESPACE_COUNTERS:
            yield CounterMetricFamily(PREFIX + name, documentation, labels=["rank"])

    def collect(self) -> Iterator[Metric]:
        counters = self.read()
        for key, name, documentation in NAMESPACE_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, documentation, labels=["rank"])
            if counters is not None and key in counters:
                family.add_metric([self.rank], counters[key])
            yield family
