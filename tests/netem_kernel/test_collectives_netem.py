"""Collectives across a lab of namespaces whose links are shaped with real netem (delay, jitter,
loss and a rate on every link into every host; the UML guest here: `testbed sandbox pytest -m
netem_kernel tests/netem_kernel/test_collectives_netem.py`). The ring and gloo stay exact over
TCP and the ring counts the kernel's retransmits; the lossy all-reduce estimates the mean from
the chunks that came; Moshpit reaches the exact mean after its d rounds.

The guest has one slow CPU (about 75 Mbit/s for full frames, 14 s to import torch): tensors are
small, workers are threads of this process (gloo's, which needs a process per rank, are forked
from it, torch already imported), and each test runs only a few steps."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from live import collect

from netem import LinkProfile
from netem.lab import Lab
from netem.namespace import inside
from testbed.collectives.gloo import Gloo
from testbed.collectives.lab import (
    addresses,
    close_all,
    lossy_workers,
    moshpit_peers,
    on_hosts,
    rings,
    shape_every_link,
)

pytestmark = pytest.mark.netem_kernel

WORLD, NUMEL = 4, 100_000
LINK = LinkProfile.parse(delay="5ms", jitter="1ms", loss="5%", rate="100mbit")
WAIT = 60.0  # seconds a worker may take before the test fails


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """One shaped lab for the module: building and shaping one takes about 9 s in the guest.
    Each test uses ports of its own, so none meets what an earlier one left in TIME_WAIT."""
    with Lab(WORLD) as built:
        shape_every_link(built, LINK, backend="netem")
        yield built


def inputs(numel: int = NUMEL) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(rank))
            for rank in range(WORLD)]


def gloo_worker(netns: str, rank: int, master: tuple[str, int], results) -> None:
    """One gloo rank in a forked process, in its host's namespace."""
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # not the address the host name resolves to
    torch.set_num_threads(1)
    with inside(netns):
        gloo = Gloo(rank, WORLD, master=master, timeout=WAIT)
        try:
            result, stats = gloo.allreduce(inputs()[rank], 0)
            results.put((rank, stats.collective, result.numpy()))
        finally:
            gloo.close()


def test_gloo_is_exact_across_netem_links(lab):
    """First in the file: forking is safest while this process has started few threads."""
    context = multiprocessing.get_context("fork")  # torch is imported already: 14 s saved each
    results = context.Queue()
    processes = [context.Process(target=gloo_worker, args=(host.netns, rank,
                                                           addresses(lab, 29500)[0], results))
                 for rank, host in enumerate(lab.hosts)]
    for process in processes:
        process.start()
    collected: dict[int, np.ndarray] = {}
    try:
        for rank, name, result in collect(results, processes, WAIT):
            assert name == "gloo"
            collected[rank] = result
        for process in processes:
            process.join(WAIT)
            assert process.exitcode == 0, f"a gloo worker exited with {process.exitcode}"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    expected = torch.stack(inputs()).mean(0)
    for result in collected.values():
        torch.testing.assert_close(torch.from_numpy(result), expected)


def test_ring_is_exact_across_netem_links_and_counts_retransmits(lab):
    workers = rings(lab, port=29510, timeout=WAIT)
    try:
        given = inputs()
        expected = torch.stack(given).mean(0)
        for step in range(2):
            results = on_hosts(lab, [lambda r=r, s=step: workers[r].allreduce(given[r], s)
                                     for r in range(WORLD)])
            for result, _ in results:
                torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)
        retransmits = sum(stats.extra["tcp_retransmits"] for _, stats in results)
        assert retransmits > 0, "5% loss on every link, yet TCP retransmitted nothing"
    finally:
        close_all(lab, workers)


def test_lossy_all_reduce_estimates_the_mean_across_netem_links(lab):
    # The learned deadline: one CPU runs every worker, so owners start their broadcasts far
    # apart; a broadcast's wait must reach past the slowest owner's gather, not end early.
    group = lossy_workers(lab, port=29520)
    try:
        mean = torch.randn(NUMEL, generator=torch.Generator().manual_seed(10))
        given = [mean + 0.1 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(r))
                 for r in range(1, WORLD + 1)]
        expected = torch.stack(given).mean(0)
        lost = [0.0] * WORLD
        for step in range(3):
            results = on_hosts(lab, [lambda r=r, s=step: group[r].allreduce(given[r], s)
                                     for r in range(WORLD)])
            for rank, (result, stats) in enumerate(results):
                error = (result - expected).norm() / expected.norm()
                alone = (given[rank] - expected).norm() / expected.norm()
                assert error < 0.8 * alone, f"step {step}: relative error {error:.3f}"
                # 5% of ~70 datagrams per shard and peer are lost: some always are. Where
                # they are, fewer workers' values make up the estimate (~0.94 on average).
                assert 0.75 < stats.coverage < 1.0, f"step {step}: coverage {stats.coverage}"
                lost[rank] += stats.extra["datagrams_lost"]
        assert all(count > 0 for count in lost), \
            f"sequence numbers must show the datagrams netem dropped: {lost}"
    finally:
        close_all(lab, group)


@pytest.mark.parametrize("ecn", [True, False])
def test_lossy_datagrams_sent_ecn_capable_are_marked_not_lost_on_an_ecn_link(ecn):
    """Links with 10% loss and netem's ecn: the lossy collective's datagrams, sent
    ECN-capable (its option ecn), all arrive, a tenth of them marked CE and counted so;
    without the option they are dropped as on any lossy link and none is marked. Two calls
    move about 300 datagrams per worker: at 10% none marked (or none lost) has odds below
    1e-13."""
    with Lab(2) as pair:
        shape_every_link(pair, LinkProfile.parse(loss="10%", ecn=True), backend="netem")
        group = lossy_workers(pair, port=29540, ecn=ecn)
        try:
            given = inputs()[:2]
            for step in range(2):
                on_hosts(pair, [lambda r=r, s=step: group[r].allreduce(given[r], s)
                                for r in range(2)])
            counters = [next(iter(worker.endpoint.counters().values())) for worker in group]
        finally:
            close_all(pair, group)
    marked = sum(c.datagrams_ce_marked for c in counters)
    lost = sum(c.datagrams_lost for c in counters)
    if ecn:
        assert marked > 0 and lost == 0, counters
    else:
        assert marked == 0 and lost > 0, counters


def test_moshpit_reaches_the_exact_mean_across_netem_links(lab):
    # Generous times: one slow CPU runs every peer; a late heartbeat must not count as a death.
    peers = moshpit_peers(lab, port=29530, group_size=2, timeout=10.0, heartbeat=0.5,
                          expiry=10.0)
    try:
        assert peers[0].grid.sides == (2, 2)
        for step in range(2):
            given = [tensor + step for tensor in inputs()]
            results = on_hosts(lab, [lambda r=r, s=step, g=given: peers[r].allreduce(g[r], s)
                                     for r in range(WORLD)])
            expected = torch.stack(given).mean(0)
            for result, stats in results:
                torch.testing.assert_close(result, expected)
                assert stats.peers_missing == () and stats.coverage == pytest.approx(1.0)
                assert [r.round_index for r in stats.rounds] == [0, 1]
    finally:
        close_all(lab, peers)
