"""A user's DDP model trains through a collective of ours via `register_comm_hook`: its gradients
equal those of plain DDP (gloo all-reduce) on the same data: exactly through the ring, within
float rounding through the lossy all-reduce when nothing is lost."""

from __future__ import annotations

import socket

import pytest
import torch
from loopback import free_ports, spawn

from testbed.collectives import create

WORLD = 2
# A generous fixed deadline: nothing is lost on loopback, so it costs nothing, and a busy host
# cannot make a learned one cut off chunks.
OPTIONS = {"ring": {"timeout": 30}, "lossy": {"deadline_initial": 5.0, "deadline_floor": 5.0}}


def worker(rank: int, ports: list[int], choice: tuple[str, str | None, dict] | None,
           results) -> None:
    """One rank of a DDP model whose gradients go through `choice` (a collective kind, and a
    compressor with its options, or None), or through DDP's own all-reduce (None)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from testbed.collectives.compression import wrap
    from testbed.collectives.hook import comm_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=WORLD)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        model = DistributedDataParallel(net, bucket_cap_mb=0.005)  # several buckets
        collective = None
        if choice is not None:
            kind, compressor, options = choice
            addresses = [("127.0.0.1", port) for port in ports[1:1 + WORLD]]
            streams = {"stream_addresses": [("127.0.0.1", port) for port in ports[1 + WORLD:]]}
            collective = create(kind, rank, WORLD, addresses=addresses, **OPTIONS[kind],
                                **(streams if kind == "lossy" else {}))
            if compressor is not None:
                collective = wrap(collective, compressor, **options)
            model.register_comm_hook(state=None, hook=comm_hook(collective))
        data = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
        model(data).pow(2).mean().backward()
        # As numpy arrays: tensors would travel as shared memory that dies with this process.
        results.put((rank, [p.grad.numpy().copy() for p in model.parameters()]))
        if collective is not None:
            collective.close()
    finally:
        dist.destroy_process_group()


def gradients(kind: str | None, compressor: str | None = None,
              **options: object) -> dict[int, list[torch.Tensor]]:
    """Every rank's gradients through collective `kind` (compressed if given; plain DDP if
    `kind` is None)."""
    # The gloo store's port, then one port per rank: TCP for the ring, UDP for lossy (and TCP
    # ones for lossy's streams: a free UDP port's number may be taken in TCP).
    ports = free_ports(1) + free_ports(WORLD, socket.SOCK_DGRAM if kind == "lossy" else
                                       socket.SOCK_STREAM)
    if kind == "lossy":
        ports += free_ports(WORLD)
    choice = None if kind is None else (kind, compressor, options)
    return {rank: [torch.from_numpy(array) for array in arrays]
            for rank, arrays in spawn(worker, WORLD, ports, choice)}


@pytest.fixture(scope="module")
def plain() -> dict[int, list[torch.Tensor]]:
    return gradients(kind=None)


@pytest.mark.parametrize("kind", ["ring", "lossy"])
def test_ddp_gradients_through_a_hook_equal_plain_ddp(kind, plain):
    hooked = gradients(kind)
    for rank in range(WORLD):
        for ours, theirs in zip(hooked[rank], plain[rank], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    # Averaged, so every rank holds the same gradients although their data differ.
    for ours, other in zip(hooked[0], hooked[1], strict=True):
        assert torch.equal(ours, other)


def test_unknown_kind_and_option_name_what_is_allowed():
    allowed = r"collective\.kind: expected one of ring, gloo, moshpit, lossy"
    with pytest.raises(ValueError, match=allowed):
        create("carrier-pigeon", 0, 2)
    with pytest.raises(ValueError, match=r"collective\.adresses: not an option of 'ring'; "
                                         r"allowed: addresses, run_id, timeout"):
        create("ring", 0, 2, adresses=[])


def gloo_and_ring_worker(rank: int, ports: list[int], results) -> None:
    torch.set_num_threads(1)
    data = torch.randn(50_001, generator=torch.Generator().manual_seed(rank))
    gloo = create("gloo", rank, WORLD, master=("127.0.0.1", ports[0]), timeout=30)
    ring = create("ring", rank, WORLD, addresses=[("127.0.0.1", p) for p in ports[1:]],
                  timeout=30)
    try:
        (by_gloo, stats), (by_ring, _) = gloo.allreduce(data, 0), ring.allreduce(data, 0)
        results.put((rank, stats.collective, by_gloo.numpy(), by_ring.numpy()))
    finally:
        ring.close()
        gloo.close()


def test_gloo_equals_ring_and_the_true_mean():
    collected = spawn(gloo_and_ring_worker, WORLD, free_ports(WORLD + 1))
    expected = torch.stack([
        torch.randn(50_001, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)
    ]).mean(0)
    for _, name, by_gloo, by_ring in collected:
        assert name == "gloo"
        torch.testing.assert_close(torch.from_numpy(by_gloo), expected)
        torch.testing.assert_close(torch.from_numpy(by_ring), torch.from_numpy(by_gloo))


def overlap_worker(rank: int, ports: list[int], results) -> None:
    """DDP over the ring, two backward passes (DDP rebuilds its buckets after the first: the
    second has several), the second pass's first call held until DDP has handed the hook the
    next bucket: a hook that waited for its call before returning would never get it (the
    gate's wait runs out and the worker fails). The gradients are compared with the mean of
    both ranks' own, computed here from their data."""
    import threading

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from testbed.collectives.hook import comm_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=WORLD)
    ring = create("ring", rank, WORLD, addresses=[("127.0.0.1", p) for p in ports[1:]],
                  timeout=30)
    next_bucket = threading.Event()

    class Gated:
        name, rank, world = "ring", ring.rank, ring.world

        def allreduce(self, tensor, step):
            if step == 1 and not next_bucket.wait(20):  # the second pass's first call
                raise TimeoutError("the next bucket never came while a call waited")
            return ring.allreduce(tensor, step)

        def close(self):
            ring.close()

    def network() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Tanh(),
                                   torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                   torch.nn.Linear(512, 4))

    def data(of: int) -> torch.Tensor:
        return torch.randn(16, 32, generator=torch.Generator().manual_seed(of))

    try:
        net = network()
        model = DistributedDataParallel(net, bucket_cap_mb=0.5)
        inner = comm_hook(Gated())

        def hook(state, bucket):
            future = inner(state, bucket)
            if inner.calls.number == 3:  # handed the second pass's second bucket
                next_bucket.set()
            return future

        model.register_comm_hook(state=None, hook=hook)
        for _ in range(2):
            model(data(rank)).pow(2).mean().backward()
        expected = []
        for other in range(WORLD):
            alone = network()
            for _ in range(2):
                alone(data(other)).pow(2).mean().backward()
            expected.append([p.grad for p in alone.parameters()])
        for ours, *theirs in zip(model.parameters(), *expected, strict=True):
            torch.testing.assert_close(ours.grad, sum(theirs) / WORLD, rtol=1e-5, atol=1e-6)
        results.put((rank, inner.calls.number))
    finally:
        ring.close()
        dist.destroy_process_group()


def test_the_hook_overlaps_buckets_and_gives_ddps_gradients():
    """The asynchronous hook: DDP gets the next bucket's hook call while the previous bucket's
    all-reduce is still running, and the gradients are the mean of the ranks' own."""
    collected = dict(spawn(overlap_worker, WORLD, free_ports(1) + free_ports(WORLD)))
    assert all(calls >= 3 for calls in collected.values()), collected


def test_stats_print_as_one_short_line():
    from testbed.collectives.lossy import LossyStats

    stats = LossyStats("lossy", 3, seconds=0.0123, bytes_sent=123_456, coverage=0.98,
                       peers_missing=(2,), chunk_coverage=torch.ones(100_000))
    assert repr(stats) == ("LossyStats(lossy step 3: 12.3 ms, coverage 0.98, 123,456 B sent, "
                           "0 B received, peers missing [2])")
