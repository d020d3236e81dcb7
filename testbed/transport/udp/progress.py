"""Where each sender got to: the furthest key of its datagrams and of its PROGRESS words. A
sender past its part of a key has sent it, so what of it has not come was lost (or is still
on its way), even if the chunks that would say so (its stream's tail) were lost too."""

from __future__ import annotations

import numpy as np

from testbed.transport.udp.reassembly import Key, ReceivedBatch
from testbed.transport.wire import HEADER_SIZE, Kind

# The kinds that make up a call's phases, in the order a call goes through them: where a sender
# got to (its datagrams and its PROGRESS words) is judged by (step, bucket, kind).
PHASES = (Kind.GRADIENT, Kind.PARAMETER, Kind.CONTROL, Kind.REPAIR)
NOWHERE = (-1, -1, -1, -1)  # a sender's progress before any datagram of its


class Progress:
    """Per sender, the furthest (step, bucket, kind, done) of its datagrams of a phase (done 0:
    it was sending that part) or its PROGRESS ones (done 1: it had sent it)."""

    def __init__(self) -> None:
        self._furthest: dict[int, tuple[int, int, int, int]] = {}

    def advance(self, sender: int, batch: ReceivedBatch, progress: np.ndarray) -> bool:
        """Take in where `sender`'s datagrams say it got to (a PROGRESS datagram's kind is its
        payload byte; `progress` marks those); whether it got further."""
        kinds = np.where(progress, batch.rows[:, HEADER_SIZE] if progress.any() else 0,
                         batch["kind"])
        phase = np.isin(kinds, PHASES)
        if not phase.any():
            return False
        steps, buckets, kinds = batch["step"][phase], batch["bucket"][phase], kinds[phase]
        done = progress[phase]
        last = np.lexsort((done, kinds, buckets, steps))[-1]
        furthest = (int(steps[last]), int(buckets[last]), int(kinds[last]), int(done[last]))
        if furthest <= self._furthest.get(sender, NOWHERE):
            return False
        self._furthest[sender] = furthest
        return True

    def past(self, sender: int, key: Key) -> bool:
        """`sender` is past its part of `key`: it said so, or sent a later key's."""
        return self._furthest.get(sender, NOWHERE) >= (key[1], key[2], key[0], 1)
