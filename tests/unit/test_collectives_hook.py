"""A user's DDP model trains through a collective of ours via `register_comm_hook`: its gradients
equal those of plain DDP (gloo all-reduce) on the same data."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from testbed.collectives import create

WORLD = 2


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def worker(rank: int, ports: list[int], with_hook: bool, results) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from testbed.collectives.hook import comm_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=WORLD)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        model = DistributedDataParallel(net, bucket_cap_mb=0.005)  # several buckets
        ring = None
        if with_hook:
            addresses = [("127.0.0.1", port) for port in ports[1:]]
            ring = create("ring", rank, WORLD, addresses=addresses, timeout=30)
            model.register_comm_hook(state=None, hook=comm_hook(ring))
        data = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
        model(data).pow(2).mean().backward()
        # As numpy arrays: tensors would travel as shared memory that dies with this process.
        results.put((rank, [p.grad.numpy().copy() for p in model.parameters()]))
        if ring is not None:
            ring.close()
    finally:
        dist.destroy_process_group()


def gradients(with_hook: bool) -> dict[int, list[torch.Tensor]]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = free_ports(WORLD + 1)
    processes = [context.Process(target=worker, args=(r, ports, with_hook, results))
                 for r in range(WORLD)]
    for process in processes:
        process.start()
    collected = {}
    for _ in range(WORLD):
        rank, arrays = results.get(timeout=60)
        collected[rank] = [torch.from_numpy(array) for array in arrays]
    for process in processes:
        process.join(30)
        assert process.exitcode == 0, f"worker exited with {process.exitcode}"
    return collected


def test_ddp_gradients_through_the_ring_hook_equal_plain_ddp():
    plain, hooked = gradients(with_hook=False), gradients(with_hook=True)
    for rank in range(WORLD):
        for ours, theirs in zip(hooked[rank], plain[rank], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    # Averaged, so every rank holds the same gradients although their data differ.
    for ours, other in zip(hooked[0], hooked[1], strict=True):
        assert torch.equal(ours, other)


def test_unknown_kind_and_option_name_what_is_allowed():
    allowed = r"collective\.kind: expected one of ring, gloo, moshpit"
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
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = free_ports(WORLD + 1)
    processes = [context.Process(target=gloo_and_ring_worker, args=(r, ports, results))
                 for r in range(WORLD)]
    for process in processes:
        process.start()
    collected = [results.get(timeout=60) for _ in range(WORLD)]
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    expected = torch.stack([
        torch.randn(50_001, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)
    ]).mean(0)
    for _, name, by_gloo, by_ring in collected:
        assert name == "gloo"
        torch.testing.assert_close(torch.from_numpy(by_gloo), expected)
        torch.testing.assert_close(torch.from_numpy(by_ring), torch.from_numpy(by_gloo))
