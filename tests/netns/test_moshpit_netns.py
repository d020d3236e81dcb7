"""Moshpit between processes in network namespaces (one peer per lab host, rank 0 serving the
TCPStore): they reach the exact mean, and when peers die mid-run (SIGKILL) or hang (SIGSTOP:
connections open, nothing read, no heartbeat) the others finish every step without them, no
call longer than its deadline (`timeout`) plus the documented margin.

Each peer is `testbed moshpit-peer`, printing one JSON line per step with the
head and the sum of its result; its inputs are `demo_input(rank, step)`, so the test
recomputes what every line should say."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from live import unless_ended, wait_for

from netem import LinkProfile
from netem.lab import Lab
from testbed.collectives.grid import Grid
from testbed.collectives.lab import shape_every_link
from testbed.collectives.moshpit import MARGIN, demo_input

pytestmark = pytest.mark.netns
WORLD, STEPS, NUMEL, TIMEOUT = 4, 12, 100_000, 1.0
STORE_PORT = 29500  # free: the namespace is new
WAIT = 60.0  # four processes importing torch on two cores, then the steps
ROOT = Path(__file__).resolve().parents[2]


def start_peer(lab: Lab, rank: int, out: Path, *, world: int = WORLD, group_size: int = 2,
               timeout: float = TIMEOUT, numel: int = NUMEL,
               interval: float = 0.1, heartbeat: float = 0.1) -> subprocess.Popen[str]:
    host = lab.hosts[rank]
    argv = [
        sys.executable, "-m", "testbed.cli", "moshpit-peer", "--rank", str(rank),
        "--world", str(world), "--store", f"{lab.hosts[0].address}:{STORE_PORT}",
        "--listen", host.address, "--group-size", str(group_size), "--timeout", str(timeout),
        "--heartbeat", str(heartbeat), "--steps", str(STEPS), "--numel", str(numel),
        "--interval", str(interval), *(["--serve-store"] if rank == 0 else []),
    ]
    with (out / f"{rank}.jsonl").open("w") as stdout, (out / f"{rank}.err").open("w") as stderr:
        return lab.popen(host, argv, stdout=stdout, stderr=stderr, cwd=ROOT)


def lines(out: Path, rank: int) -> list[dict]:
    text = (out / f"{rank}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def expected(step: int, absent: list[int], world: int = WORLD, group_size: int = 2,
             numel: int = NUMEL) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's result of `step` and its coverage, with the `absent` ranks left out."""
    grid = Grid.for_world(world, group_size)
    values = torch.stack([demo_input(rank, step, numel) for rank in range(world)]).double()
    share = torch.full((world,), 1 / world, dtype=torch.float64)
    for round_index in range(grid.dims):
        for group in grid.groups(round_index):
            present = [rank for rank in group if rank not in absent]
            values[present] = values[present].mean(0)
            share[present] = share[present].sum()
    return values, share


def check(line: dict, values: torch.Tensor, coverage: float) -> None:
    assert line["head"] == pytest.approx(values[:4].tolist(), rel=1e-5, abs=1e-6), line["step"]
    assert line["sum"] == pytest.approx(values.sum().item(), abs=1e-2), line["step"]
    assert line["coverage"] == pytest.approx(coverage), line["step"]


def test_peers_in_namespaces_reach_the_mean_and_survive_a_kill(make_lab, tmp_path):
    lab = make_lab(WORLD)
    victim = 3
    peers = {rank: start_peer(lab, rank, tmp_path) for rank in range(WORLD)}
    try:
        stepped = unless_ended(lambda: len(lines(tmp_path, victim)) >= 3, peers[victim],
                               (tmp_path / f"{victim}.err").read_text)
        # steps 0..2 done: kill it mid-run
        wait_for("the peers through three steps", stepped, bool, WAIT, every=0.05)
        peers[victim].send_signal(signal.SIGKILL)
        peers[victim].wait()
        for rank, peer in peers.items():
            if rank != victim:
                assert peer.wait(timeout=WAIT) == 0, (tmp_path / f"{rank}.err").read_text()
    finally:
        for peer in peers.values():
            if peer.poll() is None:
                peer.kill()
                peer.wait()

    results = {rank: lines(tmp_path, rank) for rank in range(WORLD)}
    for step in (0, 1):  # before the kill: everyone, the exact mean
        values, _ = expected(step, absent=[])
        for rank in range(WORLD):
            check(results[rank][step], values[0], 1.0)
            assert results[rank][step]["missing"] == []
    values, share = expected(STEPS - 1, absent=[victim])
    grid = Grid.for_world(WORLD, 2)
    for rank in range(WORLD):
        if rank == victim:
            continue
        assert [line["step"] for line in results[rank]] == list(range(STEPS))
        assert max(line["seconds"] for line in results[rank]) <= TIMEOUT + MARGIN
        last = results[rank][-1]
        check(last, values[rank], share[rank].item())
        grouped_with_victim = any(victim in grid.group(rank, r) for r in range(grid.dims))
        assert (victim in last["missing"]) == grouped_with_victim


def test_calls_keep_their_deadline_when_two_of_eight_peers_die_mid_call(make_lab, tmp_path):
    """Eight peers on a 4x2 grid, every link 100 Mbit/s, 1M values, calls back to back (about
    1 s each here: eight processes moving 4 MB each on two cores): once the victims are past
    step 2, rank 5 is killed (SIGKILL: its connections close) and rank 2 hangs (SIGSTOP: its
    connections stay open, nothing more is read, its heartbeat stops), each in the middle of a
    call. Every call of every survivor ends within the deadline (`timeout`) plus MARGIN, all
    finish every step, and the last one, once both are out of the membership, is exactly the
    mean without them. (Before the call had one deadline, a phase waited `timeout` each, so a
    call could take several times it.)

    The deadline is 8 s: a phase may take an eighth of it (a round's window is a quarter, see
    Schedule), 1 s, five times what it takes here. With 3 s (0.37 s a phase) a fresh CI machine
    ran a call at 2.6 s and left a peer slow by that much out of step 1's exact mean. The
    heartbeat is 0.25 s (expiry 1 s) so that a peer descheduled for half a second stays in."""
    world, group_size, timeout, numel = 8, 4, 8.0, 1_000_000
    lab = make_lab(world)
    shape_every_link(lab, LinkProfile.parse(rate="100mbit"), backend="fallback")
    killed, hung = 5, 2
    peers = {rank: start_peer(lab, rank, tmp_path, world=world, group_size=group_size,
                              timeout=timeout, numel=numel, interval=0.0, heartbeat=0.25)
             for rank in range(world)}

    def stepped() -> bool:
        if min(len(lines(tmp_path, rank)) for rank in (killed, hung)) >= 3:
            return True
        for rank, peer in peers.items():
            assert peer.poll() is None, (tmp_path / f"{rank}.err").read_text()
        return False

    try:
        wait_for("the peers through three steps", stepped, bool, 2 * WAIT, every=0.05)
        peers[killed].send_signal(signal.SIGKILL)
        peers[hung].send_signal(signal.SIGSTOP)
        for rank, peer in peers.items():
            if rank not in (killed, hung):
                assert peer.wait(timeout=2 * WAIT) == 0, (tmp_path / f"{rank}.err").read_text()
    finally:
        for peer in peers.values():
            if peer.poll() is None:
                peer.kill()
                peer.wait()

    results = {rank: lines(tmp_path, rank) for rank in range(world)}
    for step in (0, 1):  # before the victims went: everyone, the exact mean
        values, _ = expected(step, [], world, group_size, numel)
        for rank in range(world):
            check(results[rank][step], values[0], 1.0)
    values, share = expected(STEPS - 1, [killed, hung], world, group_size, numel)
    slowest = {}
    for rank in set(range(world)) - {killed, hung}:
        assert [line["step"] for line in results[rank]] == list(range(STEPS))
        slowest[rank] = max(line["seconds"] for line in results[rank])
        check(results[rank][-1], values[rank], share[rank].item())
    assert max(slowest.values()) <= timeout + MARGIN, slowest
