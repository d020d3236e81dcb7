"""A CUDA DDP model trains through the testbed's communication hook (tier gpu): the hook's
future holds the averaged bucket on the bucket's device, the replicas stay identical through
the ring (and equal plain DDP's), and within float rounding of each other through the lossy
all-reduce, whose calls here lose nothing. Two processes, sharing one GPU where there is only
one."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
from loopback import free_ports, group, spawn

from testbed.collectives import create
from testbed.collectives.hook import comm_hook

pytestmark = pytest.mark.gpu
WORLD = 2
STEPS = 5
# A fixed deadline: nothing is lost on loopback, and a busy host cannot make a learned one cut
# chunks off.
OPTIONS = {"ring": {"timeout": 60}, "lossy": {"deadline_initial": 5.0, "deadline_floor": 5.0}}


def ddp_worker(rank: int, ports: list[int], kind: str | None, results) -> None:
    """One rank of a CUDA DDP model trained STEPS steps, its gradients through collective
    `kind` (None: DDP's own all-reduce over gloo); puts its parameters and the lowest
    coverage of its calls."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=WORLD)
    collective, coverage = None, [1.0]
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                                  torch.nn.Linear(256, 4)).to(device)
        model = DistributedDataParallel(net, device_ids=[device], bucket_cap_mb=0.01)
        if kind is not None:
            streams = {"stream_addresses": [("127.0.0.1", p) for p in ports[1 + WORLD:]]}
            collective = create(kind, rank, WORLD, **OPTIONS[kind],
                                addresses=[("127.0.0.1", p) for p in ports[1:1 + WORLD]],
                                **(streams if kind == "lossy" else {}))
            model.register_comm_hook(state=None, hook=comm_hook(
                collective, on_stats=lambda stats: coverage.append(stats.coverage)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            x = torch.randn(64, 32, generator=data).to(device)
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        torch.cuda.synchronize(device)
        results.put((rank, [p.detach().cpu().numpy().copy() for p in net.parameters()],
                     min(coverage)))
    finally:
        if collective is not None:
            collective.close()
        dist.destroy_process_group()


def trained(kind: str | None) -> dict[int, tuple[list[torch.Tensor], float]]:
    ports = free_ports(1) + free_ports(WORLD, socket.SOCK_DGRAM if kind == "lossy" else
                                       socket.SOCK_STREAM)
    if kind == "lossy":
        ports += free_ports(WORLD)
    return {rank: ([torch.from_numpy(array) for array in arrays], coverage)
            for rank, arrays, coverage in spawn(ddp_worker, WORLD, ports, kind)}


@pytest.fixture(scope="module")
def plain() -> dict[int, tuple[list[torch.Tensor], float]]:
    return trained(None)


def test_through_the_ring_the_replicas_stay_identical_and_equal_plain_ddp(plain):
    hooked = trained("ring")
    for rank in range(WORLD):
        for ours, theirs in zip(hooked[rank][0], plain[rank][0], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for ours, other in zip(hooked[0][0], hooked[1][0], strict=True):
        assert torch.equal(ours, other)


def test_through_the_lossy_all_reduce_the_replicas_stay_within_rounding(plain):
    hooked = trained("lossy")
    for rank in range(WORLD):
        parameters, coverage = hooked[rank]
        assert coverage == 1.0  # loopback loses nothing here: the bound is float rounding
        for ours, theirs in zip(parameters, plain[rank][0], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for ours, other in zip(hooked[0][0], hooked[1][0], strict=True):
        torch.testing.assert_close(ours, other, rtol=0, atol=1e-6)


def test_the_hooks_future_holds_the_bucket_on_its_device():
    buckets = [torch.randn(5000, device="cuda") for _ in range(WORLD)]
    with group("ring", WORLD) as rings:
        hooks = [comm_hook(ring) for ring in rings]
        futures = [hook(None, SimpleNamespace(buffer=lambda b=bucket: b))
                   for hook, bucket in zip(hooks, buckets, strict=True)]
        averaged = [future.wait() for future in futures]
    for result in averaged:
        assert result.device == buckets[0].device
        torch.testing.assert_close(result, (buckets[0] + buckets[1]) / 2)
