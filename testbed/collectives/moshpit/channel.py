"""What one round of a Moshpit call speaks through: its place in the protocol, the peers alive
as it began, the links out and the inbox in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from testbed.collectives.membership import Member
from testbed.collectives.moshpit.inbox import Inbox
from testbed.collectives.moshpit.partition import Slot
from testbed.collectives.moshpit.protocol import Phase, encode_bucket
from testbed.collectives.moshpit.sending import Outbox
from testbed.transport.tcp import Message
from testbed.transport.wire import Kind


@dataclass(frozen=True)
class Channel:
    """Round `seq` of `step` at peer `rank`: every send may last until `deadline` (the call's
    end), and a phase's sends still going at its end are abandoned (`finish`)."""

    rank: int
    step: int
    seq: int
    alive: Mapping[int, Member]
    outbox: Outbox
    inbox: Inbox
    deadline: float

    def send(self, peer: int, kind: Kind, phase: Phase, digest: int,
             payload: torch.Tensor | bytes) -> Future[None] | None:
        return self.outbox.send(self.alive[peer], kind, self.step,
                                encode_bucket(phase, self.seq, digest), payload, self.deadline)

    def finish(self, sends: Mapping[int, Future[None] | None], until: float) -> None:
        self.outbox.finish(sends, until)

    def take(self, senders: Iterable[int], phase: Phase, until: float) -> dict[int, Message]:
        return self.inbox.take(senders, self.step, self.seq, phase, until)

    def open(self, phase: Phase, slots: Mapping[int, Slot]) -> None:
        self.inbox.open(self.step, self.seq, phase, slots)

    def wait(self, senders: Iterable[int], phase: Phase, until: float) -> None:
        self.inbox.wait(senders, self.step, self.seq, phase, until)

    def end(self, phase: Phase, senders: Iterable[int]) -> set[int]:
        return self.inbox.end(self.step, self.seq, phase, senders)
