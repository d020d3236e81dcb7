"""Moshpit averaging among peers in threads, over real TCP sockets on loopback: the exact mean
after d rounds, group means after one, peers that leave, stop answering or come back, and the
heartbeats that decide who is alive. Waits are bounded polls on a condition, never sleeps."""

from __future__ import annotations

import json
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import pytest
import torch
from live import wait_for

from testbed.collectives.base import Collective
from testbed.collectives.grid import Grid
from testbed.collectives.lab import run_concurrently
from testbed.collectives.membership import Member, Membership, host_store
from testbed.collectives.moshpit import (
    MARGIN,
    Moshpit,
    MoshpitStats,
    Phase,
    demo_input,
    run_demo_peer,
)
from testbed.collectives.moshpit.inbox import GRACE, Inbox

NUMEL = 100_000
WAIT = 10.0  # seconds any bounded poll may take before the test fails


def poll(condition: Callable[[], bool], what: str) -> None:
    wait_for(what, condition, bool, WAIT, every=0.01)


@pytest.fixture
def store() -> Iterator[tuple[str, int]]:
    """A TCPStore served by the test, so any rank (0 included) may leave and rejoin."""
    served = host_store(("127.0.0.1", 0))
    yield ("127.0.0.1", served.port)
    del served


@pytest.fixture
def swarm(store) -> Iterator[Callable[..., dict[int, Moshpit]]]:
    """Start peers (all at once, as their rendezvous waits for each other); all are closed at
    the end."""
    made: list[Moshpit] = []

    def start(world: int, ranks: Iterable[int] | None = None, **options) -> dict[int, Moshpit]:
        options = {"group_size": 2, "timeout": 1.0, "heartbeat": 0.1, "expiry": 2.0, **options}
        ranks = list(range(world) if ranks is None else ranks)
        peers = run_concurrently(*(partial(Moshpit, rank, world, store=store, serve_store=False,
                                       **options) for rank in ranks))
        made.extend(peers)
        return dict(zip(ranks, peers, strict=True))

    yield start
    for peer in made:
        peer.close()


def reduce_all(
    peers: dict[int, Moshpit], inputs: torch.Tensor, step: int
) -> dict[int, tuple[torch.Tensor, MoshpitStats]]:
    ranks = list(peers)
    results = run_concurrently(*(partial(peers[r].allreduce, inputs[r], step) for r in ranks))
    return dict(zip(ranks, results, strict=True))


def reference(grid: Grid, inputs: torch.Tensor, rounds: Iterable[int],
              absent: Iterable[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """What each peer should hold after `rounds` of group means without the `absent` peers,
    and its coverage (its share of the world's contributions over the share with none
    absent)."""
    values = inputs.double()
    share = torch.full((grid.world,), 1 / grid.world, dtype=torch.float64)
    ideal = 1 / grid.world
    for round_index in rounds:
        for group in grid.groups(round_index):
            present = [rank for rank in group if rank not in set(absent)]
            values[present] = values[present].mean(0)
            share[present] = share[present].sum()
        ideal *= grid.sides[round_index % grid.dims]
    return values.float(), share / ideal


@pytest.mark.parametrize(("world", "group_size", "sides"), [(4, 2, (2, 2)), (8, 4, (4, 2))])
def test_exact_global_mean_after_d_rounds(swarm, world, group_size, sides):
    peers = swarm(world, group_size=group_size)
    assert peers[0].grid.sides == sides
    assert isinstance(peers[0], Collective)
    inputs = torch.randn(world, NUMEL)
    before = inputs.clone()

    results = reduce_all(peers, inputs, step=0)

    mean = inputs.mean(0)
    for rank, (result, stats) in results.items():
        torch.testing.assert_close(result, mean)
        assert stats.coverage == pytest.approx(1.0)
        assert stats.peers_missing == ()
        assert [r.round_index for r in stats.rounds] == list(range(len(sides)))
        assert all(r.present == r.group and r.coverage == 1.0 for r in stats.rounds)
        assert all(r.roll_call_seconds > 0 and r.scatter_seconds > 0
                   and r.roll_call_seconds + r.scatter_seconds < r.seconds
                   for r in stats.rounds), stats.rounds  # the phases in the round's order
        assert stats.bytes_sent > NUMEL * 4 / 2 and stats.bytes_received > NUMEL * 4 / 2, rank
    torch.testing.assert_close(inputs, before, rtol=0, atol=0)  # the inputs are untouched


def test_one_round_averages_exactly_within_groups(swarm):
    peers = swarm(4)
    inputs = torch.randn(4, NUMEL)

    results = run_concurrently(*(partial(peers[r].average_round, inputs[r], 1) for r in range(4)))

    grid = peers[0].grid
    expected, _ = reference(grid, inputs, [1])
    for rank, (result, stats) in enumerate(results):
        torch.testing.assert_close(result, expected[rank])
        (round_stats,) = stats.rounds
        assert round_stats.axis == 1 and round_stats.group == tuple(grid.group(rank, 1))
        assert stats.coverage == pytest.approx(1.0)


def test_a_peer_that_left_is_not_waited_for(swarm):
    timeout = 2.0
    peers = swarm(4, timeout=timeout)
    peers.pop(3).close()
    poll(lambda: all(3 not in peer.membership.alive() for peer in peers.values()),
         "the others see rank 3 gone")
    inputs = torch.randn(4, NUMEL)

    start = time.monotonic()
    results = reduce_all(peers, inputs, step=0)
    elapsed = time.monotonic() - start

    assert elapsed < timeout, "a peer that said it left was waited for"
    expected, coverage = reference(peers[0].grid, inputs, [0, 1], absent=[3])
    for rank, (result, stats) in results.items():
        torch.testing.assert_close(result, expected[rank])
        assert stats.coverage == pytest.approx(coverage[rank].item())
        in_its_groups = any(3 in r.group for r in stats.rounds)
        assert stats.peers_missing == ((3,) if in_its_groups else ()), rank


def test_a_peer_that_stops_answering_is_left_out_then_rejoins_the_rounds(swarm):
    timeout = 0.5
    peers = swarm(4, timeout=timeout)
    silent = peers[3]  # alive to the membership (it beats) but never takes part in step 0
    inputs = torch.randn(4, NUMEL)
    others = {rank: peer for rank, peer in peers.items() if rank != 3}

    start = time.monotonic()
    results = reduce_all(others, inputs, step=0)
    elapsed = time.monotonic() - start

    assert elapsed < 10 * timeout, f"blocked for {elapsed:.1f} s"
    assert 3 in peers[0].membership.alive()
    expected, coverage = reference(silent.grid, inputs, [0, 1], absent=[3])
    for rank, (result, stats) in results.items():
        torch.testing.assert_close(result, expected[rank])
        assert stats.coverage == pytest.approx(coverage[rank].item())
        assert (3 in stats.peers_missing) == any(3 in r.group for r in stats.rounds)
        assert all(3 not in r.present for r in stats.rounds)
    # What the others sent it for step 0 is stale now: step 1 with everyone is exact again.
    results = reduce_all(peers, inputs, step=1)
    for result, stats in results.values():
        torch.testing.assert_close(result, inputs.mean(0))
        assert stats.peers_missing == ()


def test_leave_and_rejoin_pulls_state_and_takes_part(swarm):
    peers = swarm(4)
    inputs = torch.randn(4, NUMEL)
    reduce_all(peers, inputs, step=0)
    peers.pop(2).close()
    poll(lambda: all(2 not in peer.membership.alive() for peer in peers.values()),
         "the others see rank 2 gone")
    inputs = torch.randn(4, NUMEL)
    step1 = reduce_all(peers, inputs, step=1)
    assert all(2 in stats.peers_missing for _, stats in (step1[0], step1[3]))

    peers[2] = swarm(4, ranks=[2])[2]  # a new process of rank 2 would do the same
    state = peers[2].pull_state()

    neighbour = peers[2].grid.group(2, 0)[1]  # rank 3, its group in round 0
    assert state is not None
    torch.testing.assert_close(state, step1[neighbour][0], rtol=0, atol=0)
    incarnation = peers[2].incarnation
    poll(lambda: all(peer.membership.alive().get(2, Member(2, -1, ("", 0))).incarnation
                     == incarnation for peer in peers.values()),
         "the others see rank 2's new incarnation")
    inputs = torch.randn(4, NUMEL)
    for result, stats in reduce_all(peers, inputs, step=2).values():
        torch.testing.assert_close(result, inputs.mean(0))
        assert stats.peers_missing == ()


def test_a_restarted_peer_is_waited_for_though_its_predecessor_closed():
    """A closed connection means its sender is gone after GRACE; but once the membership shows
    the sender's new incarnation, the old close (even one that comes later) says nothing of the
    new process, which is waited for until the deadline like any live peer. (Before: a peer
    whose round reached the restarted one first gave up on it at once.)"""
    inbox, old = Inbox(), object()
    inbox.connected(2, old)
    inbox.disconnected(2, old)
    closed = time.monotonic()
    assert inbox.take([2], 0, 0, Phase.READY, closed + WAIT) == {}  # gone after GRACE
    assert time.monotonic() - closed < WAIT

    inbox.restarted(2)
    inbox.disconnected(2, old)  # the predecessor's close, noticed late
    start = time.monotonic()
    assert inbox.take([2], 0, 0, Phase.READY, start + 2 * GRACE) == {}
    assert time.monotonic() - start >= 2 * GRACE  # waited to the deadline, not GRACE


def test_pull_state_is_none_before_anyone_averaged(swarm):
    peers = swarm(2)
    assert peers[1].pull_state() is None


def test_heartbeats_decide_who_is_alive(store):
    observer = Membership(0, 3, store, heartbeat=0.05, expiry=0.3)
    crashed = Membership(1, 3, store, heartbeat=3600)  # beats once, then never again: a crash
    beating = Membership(2, 3, store, heartbeat=0.05)
    try:
        observer.register(Member(0, 10, ("127.0.0.1", 1)))
        crashed.register(Member(1, 11, ("127.0.0.1", 2)))
        beating.register(Member(2, 12, ("127.0.0.1", 3)))
        poll(lambda: set(observer.alive()) == {0, 1, 2}, "everyone registered is alive")
        assert observer.alive()[2] == Member(2, 12, ("127.0.0.1", 3))

        poll(lambda: 1 not in observer.alive(), "the silent member expires")
        assert 2 in observer.alive(), "a member that beats must not expire"
        beating.close()
        poll(lambda: 2 not in observer.alive(), "a member that left is gone")
    finally:
        for membership in (observer, crashed, beating):
            membership.close()


def test_member_decoding_rejects_garbage():
    member = Member(3, 77, ("198.18.0.4", 4242))
    assert Member.decode(3, member.encode()) == member
    for text in ("", "left", "1 2", "x 198.18.0.4 1", "1 h p"):
        assert Member.decode(3, text) is None


def test_close_is_idempotent_and_leaves_nothing_behind(swarm):
    peers = swarm(2)
    reduce_all(peers, torch.randn(2, 1000), step=0)
    address = peers[0].address

    for peer in peers.values():
        peer.close()
        peer.close()

    assert [t.name for t in threading.enumerate() if t.name.startswith("moshpit")] == []
    with pytest.raises(ConnectionRefusedError), socket.create_connection(address, timeout=1):
        pass
    with pytest.raises(RuntimeError, match="closed"):
        peers[0].allreduce(torch.zeros(3), 1)


def test_what_the_wire_cannot_carry_is_refused_before_sending(swarm):
    peers = swarm(2)
    with pytest.raises(ValueError, match="dtype"):
        peers[0].allreduce(torch.zeros(3, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="step"):
        peers[0].allreduce(torch.zeros(3), -1)


def test_demo_peer_prints_a_line_per_step(capsys):
    assert run_demo_peer(0, 1, ("127.0.0.1", 0), serve_store=True, steps=2, numel=10,
                         heartbeat=0.1) == 0

    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        expected = demo_input(0, line["step"], 10)
        assert line["head"] == pytest.approx(expected[:4].tolist())
        assert math.isclose(line["sum"], expected.double().sum().item(), rel_tol=1e-6)
        assert line["missing"] == [] and line["coverage"] == 1.0


def test_converges_while_a_different_fifth_of_the_peers_fails_every_round(swarm):
    """Ten peers, and in every round a different random two of them (20%) fail: alive to the
    membership (they beat) but silent, the way a preempted or hung peer is. The others average
    without them and never wait for them past the roll call; the peers' values converge to the
    mean of the initial ones, which group means without the failed peers conserve."""
    world, failing, rounds, timeout = 10, 2, 12, 0.5
    peers = swarm(world, group_size=4, timeout=timeout)
    grid = peers[0].grid
    assert grid.sides == (5, 2)
    inputs = torch.randn(world, 1000, generator=torch.Generator().manual_seed(5))
    rng = random.Random(5)

    def spread(values: torch.Tensor) -> float:  # the widest disagreement on any element
        return (values.max(0).values - values.min(0).values).max().item()

    values, spreads, failed = inputs.clone(), [spread(inputs)], set()
    for round_index in range(rounds):
        previous, failed = failed, set(rng.sample(range(world), failing))
        while failed == previous:
            failed = set(rng.sample(range(world), failing))
        present = [rank for rank in range(world) if rank not in failed]
        results = run_concurrently(*(partial(peers[rank].average_round, values[rank], round_index)
                                     for rank in present))
        expected, _ = reference(grid, values, [round_index], absent=failed)
        for rank, (result, stats) in zip(present, results, strict=True):
            (this_round,) = stats.rounds
            group = grid.group(rank, round_index)
            assert this_round.present == tuple(p for p in group if p not in failed), \
                f"round {round_index}, rank {rank}: failed {sorted(failed)}"
            assert this_round.missing == tuple(p for p in group if p in failed)
            # Waiting for a failed peer beyond the roll call would cost another phase timeout.
            assert this_round.seconds < 2 * timeout, \
                f"round {round_index}: rank {rank} blocked {this_round.seconds:.2f} s"
            torch.testing.assert_close(result, expected[rank])
            values[rank] = result
        spreads.append(spread(values))

    mean = inputs.mean(0)
    torch.testing.assert_close(values.mean(0), mean, rtol=0, atol=1e-5)  # nothing lost or added
    assert spreads[-1] < spreads[0] / 10, f"spread by round: {spreads}"
    assert spreads[-1] < spreads[rounds // 2] / 2, f"stalled in the second half: {spreads}"
    assert (values - mean).abs().max() < spreads[0] / 10, "the consensus left the initial mean"


def test_a_call_ends_by_its_deadline_when_a_peer_hangs_mid_call(swarm):
    """Rank 3 hangs in the middle of a call (after its reduce-scatter of round 0, as it would
    open its all-gather), its connections open and its heartbeat beating, so nothing tells the
    others it is gone: every other call still ends within `timeout` + MARGIN, with exactly what
    came. Rank 2 has 3's contribution to its own slice but never 3's averaged slice (its own
    values stand there), rank 1 meets no one in round 1, and rank 0 averages with rank 2."""
    timeout = 1.0
    peers = swarm(4, timeout=timeout)
    inputs = torch.randn(4, NUMEL, generator=torch.Generator().manual_seed(9))
    hang, hung = threading.Event(), threading.Event()
    inbox = peers[3]._inbox
    opened = inbox.open

    def open_then_hang(step, seq, phase, slots):
        if phase is Phase.GATHER:
            hung.set()
            hang.wait(30)
        return opened(step, seq, phase, slots)

    inbox.open = open_then_hang
    stuck = threading.Thread(target=peers[3].allreduce, args=(inputs[3], 0), daemon=True)
    stuck.start()
    try:
        results = reduce_all({rank: peers[rank] for rank in range(3)}, inputs, step=0)
        assert hung.is_set()
    finally:
        hang.set()
        stuck.join(30)

    for rank, (_, stats) in results.items():
        assert stats.seconds <= timeout + MARGIN, f"rank {rank}: {stats.seconds:.3f} s"
    first = slice(0, NUMEL // 2)  # rank 2's slice in round 0 (rank 3 has the other half)
    pair = (inputs[0] + inputs[1]) / 2
    two = inputs[2].clone()
    two[first] = (inputs[2][first] + inputs[3][first]) / 2
    torch.testing.assert_close(results[0][0], (pair + two) / 2)
    torch.testing.assert_close(results[2][0], (pair + two) / 2)
    torch.testing.assert_close(results[1][0], pair)
    assert 3 in results[1][1].peers_missing and 3 in results[2][1].peers_missing
    assert results[0][1].peers_missing == ()
