"""A worker's /metrics endpoint served from inside its network namespace, scraped over the lab's
bridge: TCP retransmits caused by real loss on the link show in the namespace's kernel counter
and in the socket's own (TCP_INFO), and a reader in another namespace gets nothing rather than
the wrong namespace's figures.

Loss is an nftables `numgen random` drop in the receiver's prerouting hook, as in
test_transport_netns.py (the host kernel has no sch_netem)."""

from __future__ import annotations

import threading
import urllib.request

import pytest
import torch
from nft_drop import drop
from prometheus_client.parser import text_string_to_metric_families

from netem.namespace import inside
from testbed.metrics import WorkerMetrics
from testbed.transport import Kind, Listener, Stream

pytestmark = pytest.mark.netns
RUN = 4343
WAIT = 20.0


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_retransmits_of_a_lossy_link_are_exported_by_the_worker(make_lab):
    lab = make_lab(2)
    a, b = lab.hosts
    with inside(a.netns):  # the worker: its metrics server and its socket live in its namespace
        metrics = WorkerMetrics(0)
        port = metrics.serve(0, a.address)
    with inside(b.netns):
        listener = Listener((b.address, 0), congestion="cubic")
    with inside(a.netns):
        outgoing = Stream.connect(listener.address, rank=0, peer=1, run_id=RUN, timeout=WAIT,
                                  congestion="cubic")
    incoming = listener.accept(rank=1, run_id=RUN, timeout=WAIT)
    listener.close()
    try:
        # Read from this thread (the host's namespace): nothing, not the host's figures.
        assert metrics.registry.get_sample_value(
            "testbed_netns_tcp_retransmitted_segments_total", {"rank": "0"}) is None

        drop(lab, b, f"tcp dport {listener.address[1]}", 5)
        tensor = torch.randn(1_000_000)
        received: dict[str, torch.Tensor] = {}
        receiving = threading.Thread(target=lambda: received.setdefault(
            "tensor", incoming.recv_tensor(kind=Kind.PARAMETER, step=0, bucket=0, timeout=WAIT)))
        receiving.start()
        outgoing.send_tensor(tensor, kind=Kind.PARAMETER, step=0, bucket=0, timeout=WAIT)
        receiving.join(WAIT)
        assert torch.equal(received["tensor"], tensor)
        metrics.observe_counters(streams={1: outgoing.counters()})
        lab.run(b, ["nft", "delete", "table", "inet", "loss"], check=True)

        with inside(b.netns):  # scraped as Prometheus would, over the bridge
            url = f"http://{a.address}:{port}/metrics"
            with urllib.request.urlopen(url, timeout=WAIT) as response:
                samples = _samples(response.read().decode())
    finally:
        metrics.close()
        outgoing.close()
        incoming.close()

    socket_retransmits = samples[("testbed_tcp_retransmitted_segments_total",
                                  (("peer", "1"), ("rank", "0")))]
    namespace_retransmits = samples[("testbed_netns_tcp_retransmitted_segments_total",
                                     (("rank", "0"),))]
    assert socket_retransmits > 0
    assert socket_retransmits == outgoing.counters().tcp_retransmits
    # The namespace is fresh: everything it retransmitted is this run's, our socket's included.
    assert namespace_retransmits >= socket_retransmits
    assert samples[("testbed_transport_sent_bytes_total",
                    (("peer", "1"), ("protocol", "tcp"), ("rank", "0")))] > 4_000_000
