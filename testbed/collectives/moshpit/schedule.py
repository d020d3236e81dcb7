"""A Moshpit call's deadlines: when each round's roll call, reduce-scatter and all-gather stop
waiting, so that the call ends within its `timeout`."""

from __future__ import annotations

import time

# A call returns within `timeout` + MARGIN: past its last wait it only abandons the sends still
# going and counts; the margin is for thread wake-ups on a loaded host.
MARGIN = 0.25


class Schedule:
    """How a call's time is shared out, on this peer's clock. The call ends by `end`
    (`start` + timeout). Its first roll call may wait for members up to half of it: peers that
    began the call later (they computed longer, or their previous call took longer) are waited
    for there, so they meet the others instead of running out of step with them. The second
    half is one window per round: round r's reduce-scatter and all-gather end by the end of its
    window, and from round 1 on its roll call waits up to half a window past the window's start
    (a member held up in the round before, waiting for a peer that failed, comes by then).
    The reduce-scatter may wait half of what is left of the window, the all-gather the rest."""

    def __init__(self, start: float, timeout: float, rounds: int) -> None:
        self.end = start + timeout
        self.half = start + timeout / 2
        self.window = timeout / 2 / max(1, rounds)

    def roll_call(self, position: int) -> float:
        """When the roll call of the call's `position`-th round stops waiting."""
        return self.half + (position + 0.5) * self.window if position else self.half

    def scatter(self, position: int) -> float:
        now = time.monotonic()
        return now + max(0.0, self.gather(position) - now) / 2

    def gather(self, position: int) -> float:
        return self.half + (position + 1) * self.window
