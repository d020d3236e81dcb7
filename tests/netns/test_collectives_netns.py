"""Collectives across a lab of namespaces whose links lose packets (the host kernel's fallback
shaping): results stay exact over TCP and the loss shows up in the kernel's retransmits."""

from __future__ import annotations

import pytest
import torch
from concurrently import concurrently

from netem import LinkProfile, apply
from netem.probe import inside
from testbed.collectives.ring import Ring
from testbed.transport.tcp import Listener

pytestmark = pytest.mark.netns

WORLD = 4
PORT = 29500


def test_ring_is_exact_across_lossy_links_and_counts_retransmits(make_lab):
    lab = make_lab(WORLD)
    lossy = LinkProfile.parse(loss="5%")
    for host in lab.hosts:  # every link into every host loses 5%
        apply(host.switch_port, lossy, netns=lab.switch, backend="fallback")
    addresses = [(host.address, PORT) for host in lab.hosts]

    def start(rank: int) -> Ring:
        with inside(lab.hosts[rank].netns):
            listener = Listener(addresses[rank])
            return Ring(rank, WORLD, addresses=addresses, listener=listener, timeout=30)

    rings = concurrently(*(lambda r=r: start(r) for r in range(WORLD)))
    try:
        inputs = [torch.randn(1_000_000, generator=torch.Generator().manual_seed(r))
                  for r in range(WORLD)]
        expected = torch.stack(inputs).mean(0)
        for step in range(2):
            results = concurrently(*(
                lambda r=r, s=step: rings[r].allreduce(inputs[r], s) for r in range(WORLD)
            ))
            for result, _ in results:
                torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)
        retransmits = sum(stats.extra["tcp_retransmits"] for _, stats in results)
        assert retransmits > 0, "5% loss on every link, yet TCP retransmitted nothing"
    finally:
        for ring in rings:
            ring.close()
