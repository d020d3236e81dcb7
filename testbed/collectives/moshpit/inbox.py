"""Moshpit's receiving side, filed: what peers send, by (sender, step, round, phase), until a
round takes it, and the slots a round opens for its payloads."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from testbed.collectives.moshpit.partition import Slot
from testbed.collectives.moshpit.protocol import Phase, decode_bucket
from testbed.transport.tcp import Message, Stream
from testbed.transport.wire import FrameHeader

# Seconds a peer whose connection closed is still waited for: a live peer that abandoned a send
# reconnects at its next one; a dead one does not.
GRACE = 0.2

Key = tuple[int, int, int, Phase]  # (sender, step, round in the step, phase)


class Inbox:
    """What peers send, by (sender, step, round, phase): whole messages filed until a round
    takes them (READY, state, empty or refused payloads), and the slots a round opens for the
    payloads of its reduce-scatter and all-gather, which land as they are read. Messages of
    rounds older than the current one, and payloads of its phases that ended, are dropped, so a
    late peer can neither fill memory nor be mistaken for a later round; answers to state
    requests are kept only while awaited. A peer whose latest connection closed is waited for
    GRACE seconds more, not until a deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._messages: dict[Key, Message] = {}
        self._slots: dict[Key, Slot] = {}
        self._filled: set[Key] = set()  # slots whose payload landed whole
        self._floor = (0, 0)
        self._ended: set[Phase] = set()  # phases of the floor's round that ended
        self._streams: dict[int, Stream] = {}  # per sender, its latest connection
        self._closed_at: dict[int, float] = {}  # per sender whose latest connection closed
        self._awaiting: int | None = None  # the nonce of the state request in flight
        self._stopped = False

    def put(self, sender: int, message: Message) -> None:
        phase, seq, _ = decode_bucket(message.header.bucket)
        step = message.header.step
        with self._cond:
            late = (step != self._awaiting if phase is Phase.STATE else (step, seq) < self._floor)
            if not late:
                self._messages[(sender, step, seq, phase)] = message
                self._cond.notify_all()

    def enter(self, step: int, seq: int) -> None:
        """A new round starts: forget what is older."""
        with self._cond:
            self._floor = (step, seq)
            self._ended.clear()
            for key in [k for k in self._messages if k[3] is not Phase.STATE]:
                if key[1:3] < self._floor:
                    del self._messages[key]
            self._filled = {key for key in self._filled if key[1:3] >= self._floor}
            self._cond.notify_all()

    def await_state(self, nonce: int | None) -> None:
        with self._cond:
            self._awaiting = nonce
            for key in [k for k in self._messages if k[3] is Phase.STATE]:
                del self._messages[key]

    def connected(self, sender: int, stream: Stream) -> None:
        with self._cond:
            self._streams[sender] = stream
            self._closed_at.pop(sender, None)

    def restarted(self, sender: int) -> None:
        """`sender` is a new process (a new incarnation in the membership): its predecessor's
        connection, closed or still closing, says nothing of it, so it is waited for as any live
        peer until it connects."""
        with self._cond:
            self._streams.pop(sender, None)  # the old connection's close is ignored from now
            self._closed_at.pop(sender, None)
            self._cond.notify_all()

    def disconnected(self, sender: int, stream: Stream) -> None:
        with self._cond:
            if self._streams.get(sender) is stream:
                self._closed_at[sender] = time.monotonic()
                self._cond.notify_all()

    def open(self, step: int, seq: int, phase: Phase, slots: Mapping[int, Slot]) -> None:
        """Land the senders' payloads of (step, seq, phase) in their slots from now on."""
        with self._cond:
            for sender, slot in slots.items():
                self._slots[(sender, step, seq, phase)] = slot
            self._cond.notify_all()

    def end(self, step: int, seq: int, phase: Phase, senders: Iterable[int]) -> set[int]:
        """Close (step, seq, phase): nothing lands any more. The senders whose payload landed
        whole."""
        with self._cond:
            keys = {sender: (sender, step, seq, phase) for sender in senders}
            for key in keys.values():
                self._slots.pop(key, None)
            self._ended.add(phase)
            self._cond.notify_all()
            return {sender for sender, key in keys.items() if key in self._filled}

    def slot(self, sender: int, header: FrameHeader) -> Slot | None:
        """Where a payload of (step, seq, phase) from `sender` goes, once its round opened it;
        None if it never will (a round or phase that is over, or this peer closing). Blocks
        meanwhile: the payload waits in the connection, not in memory."""
        phase, seq, _ = decode_bucket(header.bucket)
        key = (sender, header.step, seq, phase)
        with self._cond:
            while True:
                slot = self._slots.get(key)
                if slot is not None:
                    return slot
                if self._stopped or (header.step, seq) < self._floor or (
                        (header.step, seq) == self._floor and phase in self._ended):
                    return None
                self._cond.wait()

    def land(self, key: Key, slot: Slot, offset: int, piece: memoryview) -> bool:
        """Land a block in `slot` if its phase still lasts; False once it ended."""
        with self._cond:
            if self._slots.get(key) is not slot:
                return False
            slot.land(offset, piece)
            return True

    def fill(self, key: Key, slot: Slot) -> None:
        """The whole payload landed in `slot` in time."""
        with self._cond:
            if self._slots.get(key) is slot:
                self._filled.add(key)
                self._cond.notify_all()

    def take(self, senders: Iterable[int], step: int, seq: int, phase: Phase,
             deadline: float) -> dict[int, Message]:
        """The filed messages of (step, seq, phase) from `senders` that came by `deadline`."""
        wanted, got = set(senders), {}

        def done(sender: int) -> bool:
            message = self._messages.pop((sender, step, seq, phase), None)
            if message is not None:
                got[sender] = message
            return message is not None

        self._await(wanted, deadline, done)
        return got

    def wait(self, senders: Iterable[int], step: int, seq: int, phase: Phase,
             deadline: float) -> None:
        """Until every sender's payload of (step, seq, phase) landed whole, or a message of
        it that does not fit came instead (an empty one: this peer was left out), or
        `deadline`."""
        self._await(set(senders), deadline, lambda sender: (
            (sender, step, seq, phase) in self._filled
            or (sender, step, seq, phase) in self._messages))

    def stop(self) -> None:
        """This peer closes: nothing is waited for any more."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _await(self, wanted: set[int], deadline: float, done: Callable[[int], bool]) -> None:
        """Wait on the condition until `done` holds for each of `wanted`, its sender's
        connection has been closed for GRACE seconds, or `deadline`."""
        with self._cond:
            while True:
                wanted = {sender for sender in wanted if not done(sender)}
                now = time.monotonic()
                limits = [min(deadline, self._closed_at.get(sender, math.inf) + GRACE)
                          for sender in wanted]
                until = max((limit for limit in limits if limit > now), default=None)
                if until is None or self._stopped:
                    return
                self._cond.wait(until - now)
