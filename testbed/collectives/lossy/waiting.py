"""How long a phase of a lossy call waits for each peer, learned from the calls before it: a
peer behind is waited for up to the straggler timeout, a stream for its phase's transfer
deadline, a peer that showed nothing is absent until a datagram of its comes again, and a phase
whose streams all ended closes after a quiet settle (the package's docstring says why)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from testbed.collectives.estimate import AdaptiveDeadline, AdaptiveSettle
from testbed.collectives.lossy.stats import datagrams_received
from testbed.collectives.registry import LossyOptions
from testbed.transport.udp import PHASES, DatagramEndpoint
from testbed.transport.wire import Kind


class Waiting:
    """One worker's waits at `endpoint`: a transfer deadline per exchange (gather, broadcast,
    repair), a settle per phase kind, and the peers it takes for absent."""

    def __init__(self, endpoint: DatagramEndpoint, options: LossyOptions) -> None:
        self.endpoint = endpoint
        self.straggler_timeout, self.settle = options.straggler_timeout, options.settle
        self.gather_deadline, self.broadcast_deadline, self.repair_deadline = (
            AdaptiveDeadline(floor=options.deadline_floor, ceiling=options.deadline_ceiling,
                             initial=options.deadline_initial)
            for _ in range(3)
        )
        # Per phase, the settle learned from late datagrams (settle "auto").
        self._settles = {kind: AdaptiveSettle() for kind in PHASES}
        # Peers that sent nothing in time, with their received-datagram count then: they are
        # not waited for until that count moves.
        self._absent: dict[int, int] = {}

    @property
    def absent(self) -> int:
        """How many peers are taken for absent now."""
        return len(self._absent)

    def notice_returns(self, received: Mapping[int, int]) -> None:
        """An absent peer whose datagrams came again (even late ones) is waited for again."""
        for peer, then in list(self._absent.items()):
            if received.get(peer, 0) > then:
                del self._absent[peer]

    def collect(
        self, kind: Kind, step: int, bucket: int, keep: Mapping[int, np.ndarray],
        started: float, transfer: float, learner: AdaptiveDeadline,
        patience: float | None = None,
    ) -> dict[int, np.ndarray]:
        """Wait for the opened (kind, step, bucket), saying where this worker is meanwhile: a
        present sender that is behind up to `patience` (default `straggler_timeout`) after
        `started`, an absent one not at all, and each stream for `transfer` seconds from its
        first chunk (or from when its sender was seen past it). Per sender, which of its chunks
        came and count (`keep`). Teaches `learner` how long the streams took; marks who sent
        nothing."""
        patience = self.straggler_timeout if patience is None else patience
        start_by = {sender: started if sender in self._absent
                    else started + patience for sender in keep}
        learned = self._settles[kind]
        collected = self.endpoint.collect(
            kind, step, bucket, None, started + patience + transfer,
            settle=learned.seconds if self.settle == "auto" else self.settle,
            transfer=transfer, start_by=start_by, announce=True)
        first = collected.first_arrivals
        present = [s for s in first if s not in self._absent]
        late = sum(collected.late_from.get(s, 0) for s in present)
        learned.observe(late)
        if present:
            took = max(collected.last_arrivals[s] - first[s] for s in present)
            learner.observe(took, late)
        silent = [s for s in keep if s not in first and s not in collected.reached]
        if silent:
            received = datagrams_received(self.endpoint.counters())
            for sender in silent:
                self._absent.setdefault(sender, received.get(sender, 0))
        return {sender: collected.arrived[sender] & kept for sender, kept in keep.items()}
