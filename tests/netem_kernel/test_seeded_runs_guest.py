"""A scenario run twice with one seed: its lossy link makes the same decisions both times.

Two workers train a small MLP over the ring (TCP) for a few steps; the link 0->1 loses 5% and
is captured (`capture: {links: ["0->1"]}`). The run's seed gives the link its netem seed
(`derive_seed(seed, 0, 1)`), so the qdisc draws the same numbers in the same order in both runs.

The traffic itself is not the same packet for packet: TCP's timers, acknowledgements and
retransmissions follow the host's timing (and the losses). So the runs are compared by the loss
decision sequence: the k-th frame the link took in (its sent capture, in order: every IPv4 frame
from worker 0 to worker 1, which is what the link's own netem class takes) was dropped or
delivered (found in the received capture). With loss the only random feature, netem draws one
number per frame, so the k-th decisions of both runs are the k-th draw of one seeded sequence:
equal over every frame both runs sent. (That another seed gives other decisions is
`test_seed.py`'s.)

Runs where the kernel has sch_netem and takes a seed (the UML guest here:
`testbed sandbox pytest -m netem_kernel tests/netem_kernel/test_seeded_runs_guest.py`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from netem.capture.flows import frame_keys
from netem.capture.pcap import read_frames
from netem.profile import derive_seed
from testbed.cluster.runner import ClusterRun
from testbed.report import load_run

pytestmark = pytest.mark.netem_kernel

SEED = 11
SCENARIO = f"""
name: seeded
seed: {SEED}
workers: 2
topology:
  links: [{{from: 0, to: 1, profile: {{loss: 5%}}}}]
job: {{model: mlp, steps: 30, batch: 16}}
collective: {{kind: ring}}
capture: {{links: ["0->1"]}}
"""
KEY_BYTES = 80  # of each frame from its IP header on: IP id, ports, TCP sequence and options


def dropped(capture: Path) -> list[bool]:
    """For each frame the link took in, in order, whether it was dropped (never received)."""
    sent = frame_keys(read_frames(capture / "0-1.sent.pcap"), KEY_BYTES)
    arrived = Counter(row.tobytes() for row in frame_keys(
        read_frames(capture / "0-1.received.pcap"), KEY_BYTES))
    decisions = []
    for row in sent:
        key = row.tobytes()
        lost = arrived[key] == 0
        if not lost:
            arrived[key] -= 1  # the k-th of equal frames sent is the k-th received
        decisions.append(lost)
    return decisions


def seeded_run(scenario: Path, run_dir: Path) -> list[bool]:
    """Run the scenario; the link's drop decisions."""
    result = ClusterRun(scenario, run_dir=run_dir, backend="netem").run()
    assert result.success, result.error
    cluster = next(event for event in load_run(run_dir).other if event.get("type") == "cluster")
    assert cluster["backend"] == "netem"
    assert cluster["seeds"] == {"0->1": derive_seed(SEED, 0, 1)}  # the one lossy link's
    return dropped(run_dir / "capture")


def test_the_same_seed_drops_the_same_frames_of_the_link(tmp_path: Path, measured):
    scenario = tmp_path / "seeded.yaml"
    scenario.write_text(SCENARIO)
    first = seeded_run(scenario, tmp_path / "first")
    again = seeded_run(scenario, tmp_path / "again")
    both = min(len(first), len(again))
    measured(f"0->1 took {len(first)} and {len(again)} frames, dropped {sum(first)} and "
             f"{sum(again)}; the first {both} decisions compared")
    # 30 steps of a 4810-parameter model over a 2-worker ring: hundreds of segments each way.
    assert both >= 300, (len(first), len(again))
    assert sum(first[:both]) >= 5, sum(first[:both])  # 5% of hundreds: a few at the very least
    differ = [k for k in range(both) if first[k] != again[k]]
    assert not differ, f"{len(differ)} of {both} decisions differ, the first at frame {differ[0]}"
