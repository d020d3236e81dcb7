"""The lossy all-reduce over real UDP (and TCP for resyncs) on loopback. Loss comes from the
deterministic test loss model `SeededLoss` (the receiver discards a seeded subset of chunks), so
the expected numbers can be computed exactly; tests/netns loses real packets. That the per-chunk
mean is an unbiased estimate is tests/unit/test_estimate.py's concern."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from testbed.collectives import create
from testbed.collectives.base import Collective
from testbed.collectives.lab import run_concurrently
from testbed.collectives.lossy import Lossy, SeededLoss
from testbed.collectives.registry import PARITY_MEMORY
from testbed.transport.tcp import Listener
from testbed.transport.tensors import codec_of
from testbed.transport.udp import DatagramEndpoint, chunk_count
from testbed.transport.wire import Kind

RUN = 7
LR = 0.1
KEY = bytes(range(32))


BARE = {"settle": 0.01, "parity": 0, "resend": False}
# The defaults' parity and resend (whose two extra exchanges wait for every peer), with no
# settle: tests that expect every chunk must not have a busy host cut one off.
REPAIRING = {"settle": None, "parity": 4, "resend": True}
WITH_AND_WITHOUT_REPAIR = pytest.mark.parametrize("options", [{}, REPAIRING],
                                                  ids=["bare", "parity-resend"])


def lossy_group(
    world: int, *, resync_every: int = 0, deadline: float = 5.0, key: bytes | None = None,
    **options
) -> list[Lossy]:
    """`world` workers on loopback, sockets bound first so the addresses are free ports (with
    `key`, the run's: datagrams MACed, TCP hellos proving it). The deadline is fixed (floor =
    initial): a busy host must not make a learned one cut off chunks in tests that expect
    every one of them; it costs nothing when none is missing. The bare mechanism unless
    `options` say otherwise: a fixed 10 ms settle, no parity, no resend (each has tests of
    its own), so a seeded loss model's chunks stay missed where the tests expect them."""
    endpoints = [DatagramEndpoint(rank, RUN, ("127.0.0.1", 0), key=key) for rank in range(world)]
    # TCP listeners of their own, bound first too: the UDP ports' numbers may be taken in TCP.
    listeners = [Listener(("127.0.0.1", 0), key=key) for _ in range(world)]
    return run_concurrently(*(
        lambda rank=rank: Lossy(
            rank, world, addresses=[e.address for e in endpoints], endpoint=endpoints[rank],
            run_id=RUN, resync_every=resync_every, deadline_initial=deadline,
            deadline_floor=deadline, stream_addresses=[x.address for x in listeners],
            listener=listeners[rank], **{**BARE, **options},
        )
        for rank in range(world)
    ))


def close_all(group: list[Lossy]) -> None:
    for collective in group:
        collective.close()


def seeded(world: int, numel: int, offset: int = 0) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(offset + rank))
            for rank in range(world)]


def bounds(numel: int, world: int) -> list[slice]:
    sizes = [len(part) for part in torch.tensor_split(torch.arange(numel), world)]
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [slice(end - size, end) for size, end in zip(sizes, ends, strict=True)]


def kept(loss: SeededLoss, kind: Kind, step: int, sender: int, receiver: int, numel: int,
         chunk_numel: int, payload: int | None = None) -> torch.Tensor:
    """Per element of a `numel`-element shard: whether the model let its chunk through (the
    chunk count is that of the `payload`-element tensor that carried it, if other)."""
    payload = numel if payload is None else payload
    count = max(1, -(-payload // chunk_numel))
    lost = torch.from_numpy(loss.lost(kind, step, 0, sender, receiver, count))
    return (~lost).repeat_interleave(chunk_numel)[:numel]


@pytest.mark.parametrize("key", [None, KEY], ids=["open", "keyed"])
@pytest.mark.parametrize(("world", "numel"), [(3, 300_001), (4, 3)])
def test_without_loss_every_worker_gets_the_exact_mean(world, numel, key):
    group = lossy_group(world, key=key)
    try:
        assert all(isinstance(collective, Collective) for collective in group)
        inputs = seeded(world, numel)
        originals = [tensor.clone() for tensor in inputs]
        results = run_concurrently(*(
            lambda r=r: group[r].allreduce(inputs[r].view(-1, 1), step=0) for r in range(world)
        ))
        expected = torch.stack(originals).mean(0).view(-1, 1)
        for (result, stats), given, original in zip(results, inputs, originals, strict=True):
            torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)
            assert torch.equal(given, original), "the input must not be modified"
            assert stats.collective == "lossy" and stats.coverage == 1.0
            assert stats.peers_missing == () and not any(stats.missing.values())
            assert torch.all(stats.chunk_coverage == 1.0)
            assert stats.extra["broadcast_received"] == 1.0 and stats.extra["resync"] == 0.0
    finally:
        close_all(group)


PHASES = ("prepare", "gather_send", "gather_wait", "reduce", "broadcast_send",
          "broadcast_wait", "repair", "finish")


def test_a_call_says_where_its_time_went_and_counts_its_datagrams():
    world, numel = 3, 100_003
    group = lossy_group(world)
    try:
        results = run_concurrently(*(
            lambda r=r: group[r].allreduce(seeded(world, numel)[r], step=0)
            for r in range(world)))
        for _, stats in results:
            assert tuple(stats.phases) == PHASES
            # the phases are laps of one clock started with the call: they fit in its time,
            # and a thread cannot run longer than the wall clock (1 ms: reading two clocks)
            assert sum(wall for wall, _ in stats.phases.values()) <= stats.seconds
            assert all(0 <= cpu <= wall + 1e-3 for wall, cpu in stats.phases.values())
        # Every shard goes to its owner from each other worker and back from the owner to each:
        # that many data datagrams are read within the calls (loopback loses none). Control
        # words (where a worker got to, a resend's requests) come on top, and one sent as a
        # peer's call ended is read by its next call: no more is read than was sent.
        chunk = group[0].endpoint.chunk_numel(codec_of(torch.float32))
        data = sum(2 * (world - 1) * chunk_count(len(shard), chunk)
                   for shard in torch.tensor_split(torch.zeros(numel), world))
        read = sum(stats.datagrams_received for _, stats in results)
        assert data <= read <= sum(stats.datagrams_sent for _, stats in results)
    finally:
        close_all(group)


def test_owners_average_each_chunk_over_the_contributions_that_came():
    world, numel = 3, 100_000
    loss = SeededLoss(0.3, seed=1, kinds=frozenset({Kind.GRADIENT}))
    group = lossy_group(world, test_loss=loss)
    try:
        inputs = seeded(world, numel)
        results = run_concurrently(*(
            lambda r=r: group[r].allreduce(inputs[r], step=0) for r in range(world)
        ))
        chunk_numel = group[0].endpoint.chunk_numel()
        expected = torch.empty(numel)
        for owner, shard in enumerate(bounds(numel, world)):
            total, count = inputs[owner][shard].clone(), torch.ones(shard.stop - shard.start)
            for sender in set(range(world)) - {owner}:
                came = kept(loss, Kind.GRADIENT, 0, sender, owner, len(total), chunk_numel)
                total += torch.where(came, inputs[sender][shard], 0.0)
                count += came
            expected[shard] = total / count
            stats = results[owner][1]
            per_chunk = count[::chunk_numel] / world
            torch.testing.assert_close(stats.chunk_coverage, per_chunk.double())
            assert stats.extra["shard_coverage"] == pytest.approx(count.mean().item() / world)
        for result, stats in results:  # broadcasts lose nothing: everyone has the estimate
            torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)
            assert 0.75 < stats.coverage < 0.85, "30% of 2 in 3 contributions lost"
            assert stats.extra["chunks_missing"] > 0 and stats.peers_missing == ()
    finally:
        close_all(group)


def sgd(start: int, parameters: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    return parameters - LR * gradient


def sharded_steps(group: list[Lossy], parameters: list[torch.Tensor], gradients, step: int):
    return run_concurrently(*(
        lambda r=r: group[r].step(parameters[r], gradients[r], step, sgd)
        for r in range(len(group))
    ))


def test_missed_broadcast_chunks_stay_stale_until_the_next_broadcast_overwrites_them():
    world, numel = 3, 60_000
    loss = SeededLoss(0.3, seed=2, kinds=frozenset({Kind.PARAMETER}))
    group = lossy_group(world, test_loss=loss)
    try:
        start = torch.randn(numel, generator=torch.Generator().manual_seed(99))
        gradients = seeded(world, numel)
        fresh = start - LR * torch.stack(gradients).mean(0)
        results = sharded_steps(group, [start] * world, gradients, step=0)
        chunk_numel = group[0].endpoint.chunk_numel()
        for receiver, (parameters, stats) in enumerate(results):
            for owner, shard in enumerate(bounds(numel, world)):
                if owner == receiver:  # an owner's own shard is always fresh
                    torch.testing.assert_close(parameters[shard], fresh[shard])
                    continue
                size = shard.stop - shard.start
                came = kept(loss, Kind.PARAMETER, 0, owner, receiver, size, chunk_numel,
                            payload=size + -(-size // chunk_numel))
                assert not came.all() and came.any()
                torch.testing.assert_close(parameters[shard],
                                           torch.where(came, fresh[shard], start[shard]))
            assert stats.extra["broadcast_received"] < 1.0
            # stale chunks carry no contribution of this step
            assert stats.coverage == pytest.approx(
                1 / 3 + 2 / 3 * stats.extra["broadcast_received"], abs=0.02)
        # Drift is bounded: a stale copy is one update behind, no more.
        drift = max((parameters - fresh).abs().max().item() for parameters, _ in results)
        assert drift <= (fresh - start).abs().max().item() + 1e-6

        for collective in group:
            collective.test_loss = None
        owners = [fresh - LR * torch.stack(gradients).mean(0)]
        results = sharded_steps(group, [p for p, _ in results], gradients, step=1)
        for parameters, stats in results:
            torch.testing.assert_close(parameters, owners[0])
            assert stats.coverage == 1.0
    finally:
        close_all(group)


@pytest.mark.parametrize("key", [None, KEY], ids=["open", "keyed"])
def test_a_periodic_resync_over_tcp_makes_every_copy_the_owners(key):
    world, numel = 3, 30_000
    loss = SeededLoss(0.3, seed=3, kinds=frozenset({Kind.PARAMETER}))
    group = lossy_group(world, test_loss=loss, resync_every=2, key=key)
    try:
        parameters = [torch.zeros(numel)] * world
        gradients = seeded(world, numel)
        for step, resync in ((0, False), (1, True)):
            results = sharded_steps(group, parameters, gradients, step)
            parameters = [p for p, _ in results]
            expected = -LR * (step + 1) * torch.stack(gradients).mean(0)
            for copy, stats in results:
                assert stats.extra["resync"] == float(resync)
                assert torch.allclose(copy, expected, atol=1e-6) == resync
    finally:
        close_all(group)


def test_a_silent_peer_is_named_waited_for_once_then_not_until_it_speaks_again():
    """Worker 2 sends nothing: the others wait `straggler_timeout` for its first chunk, name it
    missing, and go on with what they have; the next call does not wait for it (it is absent),
    and once its datagrams come again it is waited for and included again."""
    world, numel, timeout = 3, 10_000, 1.0
    group = lossy_group(world, deadline=0.2, straggler_timeout=timeout)
    try:
        inputs = seeded(world, numel)
        for step in (0, 1):
            results = run_concurrently(*(
                lambda r=r, step=step: group[r].allreduce(inputs[r], step=step)
                for r in range(world - 1)
            ))
            shards = bounds(numel, world)
            for rank, (result, stats) in enumerate(results):
                assert stats.peers_missing == (2,)
                assert stats.extra["deadline_seconds"] == 0.2
                assert stats.extra["peers_absent"] == 1.0
                # The silent worker's shard stands as this worker's own value; the others'
                # shards are the mean of the two that spoke.
                torch.testing.assert_close(result[shards[2]], inputs[rank][shards[2]])
                torch.testing.assert_close(result[: shards[2].start],
                                           (inputs[0] + inputs[1])[: shards[2].start] / 2)
                assert stats.coverage == pytest.approx((2 / 3 * 2 / 3) + 1 / 3 * 1 / 3,
                                                       abs=1e-3)
                if step == 0:  # waited for its first chunk
                    assert stats.seconds >= timeout, stats.seconds
                else:  # absent: not waited for
                    assert stats.seconds < timeout, stats.seconds
        # Worker 2 comes back (it is late for steps 0 and 1, whose datagrams count as late):
        # from then on everyone waits for it again.
        for step in (0, 1):  # what the others sent it is there already: no wait
            group[2].allreduce(inputs[2], step=step)
        results = run_concurrently(*(
            lambda r=r: group[r].allreduce(inputs[r], step=2) for r in range(world)
        ))
        for result, stats in results:
            assert stats.coverage == 1.0 and stats.peers_missing == ()
            torch.testing.assert_close(result, sum(inputs) / world)
    finally:
        close_all(group)


@WITH_AND_WITHOUT_REPAIR
def test_a_peer_that_computes_longer_than_the_deadline_is_waited_for_not_lost(options):
    """The transfer deadline counts from a peer's first chunk: a peer that starts its call
    long after the others (it computed longer) is still waited for, and its chunks count. The
    deadline (0.25 s, held there) is far below the lag and far above a loopback stream's time
    even on a loaded host."""
    world, numel, lag = 3, 30_000, 1.5
    group = lossy_group(world, deadline=0.25, deadline_ceiling=0.25, straggler_timeout=10.0,
                        **options)
    try:
        inputs = seeded(world, numel)
        release = threading.Event()

        def late_worker():
            assert release.wait(30)
            return group[2].allreduce(inputs[2], step=0)

        def on_time(rank):
            if rank == 0:
                threading.Timer(lag, release.set).start()
            return group[rank].allreduce(inputs[rank], step=0)

        results = run_concurrently(lambda: on_time(0), lambda: on_time(1), late_worker)
        for result, stats in results:
            assert stats.coverage == 1.0, stats
            torch.testing.assert_close(result, sum(inputs) / world)
        assert results[0][1].seconds >= lag
    finally:
        close_all(group)


@WITH_AND_WITHOUT_REPAIR
def test_workers_stay_in_step_when_some_pause(options):
    """Workers 1 and 2 pause for longer than any learned deadline in the middle of a run:
    worker 0 waits for them rather than running ahead on its own, so every call of every
    worker has every contribution (a worker ahead would take the others for lost, and they
    would use its buffered chunks without waiting: a gap that never closes). The transfer
    deadline is held at 0.25 s, far below the pause, and far above what a stream of a few
    datagrams on loopback takes even on a loaded host (a thread unscheduled for a quarter of a
    second mid-stream would be needed to lose a chunk); no settle, so no shorter wait ends a
    phase (nothing is lost here: it would cost nothing)."""
    world, numel, pause = 3, 3000, 1.5
    group = lossy_group(world, deadline=0.25, deadline_ceiling=0.25, straggler_timeout=5.0,
                        **{"settle": None, **options})
    coverage = {rank: [] for rank in range(world)}
    try:
        inputs = seeded(world, numel)

        def run(rank):
            for step in range(20):
                if rank and step == 10:
                    time.sleep(pause)  # the work itself: these two compute longer once
                coverage[rank].append(group[rank].allreduce(inputs[rank], step=step)[1].coverage)

        run_concurrently(*(lambda r=r: run(r) for r in range(world)))
        assert all(c == [1.0] * 20 for c in coverage.values()), coverage
    finally:
        close_all(group)


def test_a_worker_that_missed_steps_meets_the_others_at_the_step_it_rejoins():
    """Calls are told apart by step (and their order within it), not by how many calls a
    worker made: one that was away for steps 0-4 (preempted, restarted) exchanges with the
    others from the step it comes back at."""
    world, numel = 3, 5_000
    group = lossy_group(world, deadline=1.0, straggler_timeout=0.5)
    try:
        inputs = seeded(world, numel)
        for step in range(5):
            run_concurrently(*(lambda r=r, step=step: group[r].allreduce(inputs[r], step=step)
                               for r in range(world - 1)))
        # Step 5: it is back (whether the others notice in time is a race); step 6: whole.
        for step in (5, 6):
            results = run_concurrently(*(
                lambda r=r, step=step: group[r].allreduce(inputs[r], step=step)
                for r in range(world)
            ))
        for result, stats in results:
            assert stats.coverage == 1.0 and stats.peers_missing == (), stats
            torch.testing.assert_close(result, sum(inputs) / world)
    finally:
        close_all(group)


def test_the_factory_builds_it_and_names_its_options():
    endpoint = DatagramEndpoint(0, RUN, ("127.0.0.1", 0))
    collective = create("lossy", 0, 1, addresses=[endpoint.address], endpoint=endpoint)
    try:
        result, stats = collective.allreduce(torch.arange(5.0), step=0)
        assert torch.equal(result, torch.arange(5.0)) and stats.coverage == 1.0
    finally:
        collective.close()
    with pytest.raises(ValueError, match=r"collective\.deadline: not an option of 'lossy'; "
                                         r"allowed: addresses, run_id, mtu, rate"):
        create("lossy", 0, 2, deadline="adaptive")


def test_drift_stays_bounded_over_1000_steps_at_30_percent_loss_without_resync():
    """Sharded SGD, each worker pulling towards its own target, for 1000 steps with 30% of the
    chunks of every gradient and every parameter broadcast lost, and no resync: a copy misses
    an owner's update where a broadcast was lost, but the next one that comes through
    overwrites it, so the copies' drift from the owners' parameters stays bounded (it does not
    accumulate) while the owners converge to the mean target."""
    world, numel, steps = 3, 3000, 1000
    group = lossy_group(world, resync_every=0, test_loss=SeededLoss(0.3, seed=4))
    try:
        common = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        targets = [common + 0.1 * torch.randn(numel, generator=torch.Generator().manual_seed(r))
                   for r in range(1, world + 1)]
        goal = torch.stack(targets).mean(0)
        shards = bounds(numel, world)
        copies = [torch.zeros(numel)] * world

        def update(start: int, parameters: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
            return parameters - 0.5 * gradient

        drift, received = [], []
        for step in range(steps):
            results = run_concurrently(*(
                lambda r=r, s=step, p=copies[r]: group[r].step(p, p - targets[r], s, update)
                for r in range(world)
            ))
            copies = [parameters for parameters, _ in results]
            owners = torch.cat([copies[owner][shard] for owner, shard in enumerate(shards)])
            drift.append(max((copy - owners).norm().item() for copy in copies)
                         / owners.norm().item())
            received.extend(stats.extra["broadcast_received"] for _, stats in results)
            assert all(stats.extra["resync"] == 0.0 for _, stats in results)

        assert 0.6 < sum(received) / len(received) < 0.8, "30% of the broadcasts are lost"
        first, second = max(drift[: steps // 2]), max(drift[steps // 2:])
        assert second <= 0.05, f"drift over the last {steps // 2} steps: up to {second:.3f}"
        assert second <= first, f"drift grows: {first:.3f} then {second:.3f}"
        assert max(drift[-100:]) <= 2 * max(drift[steps // 2: steps // 2 + 100]), \
            "drift grows within the second half"
        distance = (owners - goal).norm() / goal.norm()
        assert distance < 0.05, f"the owners are {distance:.3f} of the goal's norm away from it"
    finally:
        close_all(group)


def broadcast_came(loss: SeededLoss, step: int, owner: int, receiver: int, size: int,
                   chunk_numel: int, group: int) -> torch.Tensor:
    """Per element of an owner's `size`-element shard: whether a receiver holds its broadcast
    chunk after the seeded loss and the parity repair (the shard travels with its counts; a
    chunk lost alone in its group of `group` comes back if the group's parity chunk came)."""
    chunks = -(-(size + -(-size // chunk_numel)) // chunk_numel)
    groups = -(-chunks // group)
    came = ~loss.lost(Kind.PARAMETER, step, 0, owner, receiver, chunks + groups)
    data = came[:chunks].copy()
    for g in range(groups):
        members = range(g * group, min((g + 1) * group, chunks))
        lost = [c for c in members if not came[c]]
        if len(lost) == 1 and came[chunks + g]:
            data[lost[0]] = True
    return torch.from_numpy(data).repeat_interleave(chunk_numel)[:size]


@pytest.mark.parametrize("group", [1, 3])
def test_parity_rebuilds_a_chunk_lost_alone_in_its_group_bit_for_bit(group):
    world, numel = 3, 60_000
    loss = SeededLoss(0.3, seed=5, kinds=frozenset({Kind.PARAMETER}))
    group_ = lossy_group(world, test_loss=loss, parity=group, parity_when="always")
    try:
        start = torch.randn(numel, generator=torch.Generator().manual_seed(99))
        gradients = seeded(world, numel)
        results = sharded_steps(group_, [start] * world, gradients, step=0)
        chunk_numel = group_[0].endpoint.chunk_numel()
        rebuilt = 0
        for receiver, (parameters, stats) in enumerate(results):
            for owner, shard in enumerate(bounds(numel, world)):
                if owner == receiver:
                    continue
                size = shard.stop - shard.start
                where = broadcast_came(loss, 0, owner, receiver, size, chunk_numel, group)
                fresh = results[owner][0][shard]  # what the owner made and sent, exactly
                assert torch.equal(parameters[shard], torch.where(where, fresh, start[shard]))
            rebuilt += stats.extra["chunks_rebuilt"]
        assert rebuilt > 0, "30% loss, yet no chunk was rebuilt"
    finally:
        close_all(group_)


@pytest.mark.parametrize("parity_when", ["loss", "always"])
def test_parity_goes_to_the_peers_that_lose_some_of_the_broadcast(parity_when):
    """Only worker 2 loses broadcast datagrams (30%, seeded). With parity_when "loss", owners
    0 and 1 send parity to worker 2 alone from the second call on (it says it lost some, every
    call) and worker 2 to nobody: its peers lose nothing, and its short form ends their wait at
    its data (a wait for the parity would last the 5 s deadline). Worker 2 stops losing after
    call 3: parity to it goes on for PARITY_MEMORY calls, then stops. With "always", every
    peer gets parity every call. Either way the resend makes every result the exact mean."""
    world, numel, lossy_calls = 3, 30_000, 3
    calls = lossy_calls + PARITY_MEMORY + 2
    group = lossy_group(world, parity=4, resend=True, parity_when=parity_when)
    group[2].test_loss = SeededLoss(0.3, seed=9, kinds=frozenset({Kind.PARAMETER}))
    try:
        for step in range(calls):
            inputs = seeded(world, numel, offset=10 * step)
            results = run_concurrently(*(
                lambda r=r, x=inputs, s=step: group[r].allreduce(x[r], step=s)
                for r in range(world)))
            expected = torch.stack(inputs).mean(0)
            for result, _ in results:
                torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)
            if step == lossy_calls - 1:
                group[2].test_loss = None
            given = [stats.extra["parity_peers"] for _, stats in results]
            if parity_when == "always":
                assert given == [2, 2, 2], (step, given)
                continue
            to_2 = 1 <= step < lossy_calls + PARITY_MEMORY
            assert given == [int(to_2), int(to_2), 0], (step, given)
            assert all(stats.extra["broadcast_seconds"] < 5.0 for _, stats in results[:2])
    finally:
        close_all(group)


def test_a_missed_chunk_takes_the_last_update_received_there():
    """Step 0 loses nothing: every copy learns each chunk's update (fresh - start). Step 1
    loses 30% of the broadcasts: where a chunk is missed, the copy moves on by that update
    instead of staying stale."""
    world, numel = 3, 30_000
    loss = SeededLoss(0.3, seed=6, kinds=frozenset({Kind.PARAMETER}))
    group = lossy_group(world, missed="last_update")
    try:
        start = torch.randn(numel, generator=torch.Generator().manual_seed(98))
        gradients = seeded(world, numel)
        mean = torch.stack(gradients).mean(0)
        first = [p for p, _ in sharded_steps(group, [start] * world, gradients, step=0)]
        for copy in first:
            torch.testing.assert_close(copy, start - LR * mean)
        for collective in group:
            collective.test_loss = loss
        second = sharded_steps(group, first, [2 * g for g in gradients], step=1)
        owners = first[0] - 2 * LR * mean
        guess = first[0] + (first[0] - start)  # the last update, once more
        chunk_numel = group[0].endpoint.chunk_numel()
        for receiver, (parameters, _) in enumerate(second):
            for owner, shard in enumerate(bounds(numel, world)):
                if owner == receiver:
                    continue
                size = shard.stop - shard.start
                where = broadcast_came(loss, 1, owner, receiver, size, chunk_numel, 1 << 30)
                assert not where.all()
                torch.testing.assert_close(parameters[shard],
                                           torch.where(where, owners[shard], guess[shard]))
    finally:
        close_all(group)


def test_a_missed_chunk_takes_the_update_of_the_local_gradient():
    world, numel = 3, 30_000
    loss = SeededLoss(0.3, seed=7, kinds=frozenset({Kind.PARAMETER}))
    group = lossy_group(world, test_loss=loss, missed="local")
    try:
        start = torch.randn(numel, generator=torch.Generator().manual_seed(97))
        gradients = seeded(world, numel)
        owners = start - LR * torch.stack(gradients).mean(0)
        results = sharded_steps(group, [start] * world, gradients, step=0)
        chunk_numel = group[0].endpoint.chunk_numel()
        for receiver, (parameters, _) in enumerate(results):
            local = start - LR * gradients[receiver]  # sgd: what its own gradient makes
            for owner, shard in enumerate(bounds(numel, world)):
                if owner == receiver:
                    continue
                size = shard.stop - shard.start
                where = broadcast_came(loss, 0, owner, receiver, size, chunk_numel, 1 << 30)
                torch.testing.assert_close(parameters[shard],
                                           torch.where(where, owners[shard], local[shard]))
    finally:
        close_all(group)


@pytest.mark.parametrize(("option", "value", "message"), [
    ("parity", -1, "parity: expected 0"),
    ("missed", "guess", "missed: expected one of keep, last_update, local"),
    ("settle", "fast", "settle: expected seconds > 0, 'auto'"),
])
def test_bad_options_are_named(option, value, message):
    with pytest.raises(ValueError, match=message):
        Lossy(0, 1, addresses=[("127.0.0.1", 0)], **{option: value})


def test_a_resend_brings_every_missed_broadcast_chunk_back():
    """30% of the broadcasts' datagrams are discarded, none of the repairs: each worker asks
    each owner for what it lacks, gets it again within the call, and holds the owners'
    parameters exactly."""
    world, numel = 3, 30_000
    loss = SeededLoss(0.3, seed=8, kinds=frozenset({Kind.PARAMETER}))
    group = lossy_group(world, test_loss=loss, resend=True)
    try:
        start = torch.randn(numel, generator=torch.Generator().manual_seed(96))
        results = sharded_steps(group, [start] * world, seeded(world, numel), step=0)
        owners = torch.cat([results[owner][0][shard]
                            for owner, shard in enumerate(bounds(numel, world))])
        for parameters, stats in results:
            assert torch.equal(parameters, owners)
            assert stats.extra["chunks_resent"] > 0
            assert stats.coverage == 1.0
    finally:
        close_all(group)
