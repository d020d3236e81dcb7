"""Moshpit's receiving side: peers' connections accepted, each read by a thread of its own that
lands a round's payloads where they belong, block by block, and files the rest in the inbox."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from testbed.collectives.moshpit.inbox import Inbox
from testbed.collectives.moshpit.partition import BLOCK_BYTES
from testbed.collectives.moshpit.protocol import Phase, decode_bucket
from testbed.collectives.moshpit.sending import shutdown
from testbed.transport.errors import TransportError, TransportTimeout
from testbed.transport.tcp import Listener, Message, Stream
from testbed.transport.wire import FRAME_SIZE, FrameHeader, Kind

ACCEPT_WAIT = 60.0  # seconds per accept call; `close` wakes the loop by connecting to it
log = logging.getLogger(__name__)


class Receiver:
    """Accepts peers' connections on `listener` (from now on) and reads each on a thread of its
    own; a joining peer's request for parameters goes to `answer_state` (peer, request)."""

    def __init__(self, rank: int, run_id: int, listener: Listener, inbox: Inbox,
                 answer_state: Callable[[int, Message], None]) -> None:
        self.rank, self.run_id = rank, run_id
        self._listener, self._inbox, self._answer_state = listener, inbox, answer_state
        self._lock = threading.Lock()  # readers, received bytes, stopped
        self._readers: list[tuple[Stream, threading.Thread]] = []
        self._bytes_received = 0
        self._stopped = False
        self._acceptor = threading.Thread(target=self._accept, name=f"moshpit-{rank}-accept",
                                          daemon=True)
        self._acceptor.start()

    def bytes_received(self) -> int:
        with self._lock:
            return self._bytes_received

    def stop(self) -> None:
        """Take no new connection from now on."""
        with self._lock:
            self._stopped = True

    def close(self) -> None:
        """Stop accepting, close the listener, and stop and join every reader."""
        self._listener.shutdown()  # the accept loop returns on OSError
        self._acceptor.join()
        self._listener.close()
        for stream, _ in self._readers:
            shutdown(stream)
        for _, thread in self._readers:
            thread.join()

    def _accept(self) -> None:
        """Accept peers' connections; each gets a thread that files what it receives."""
        while not self._stopped:
            try:
                stream = self._listener.accept(rank=self.rank, run_id=self.run_id,
                                               timeout=ACCEPT_WAIT)
            except TransportTimeout as exc:  # nobody new for a while (it names any turned away)
                log.debug("%s", exc)
                continue
            except (TransportError, OSError):  # the listener was closed under us
                return
            with self._lock:
                if self._stopped:
                    stream.close()
                    return
                thread = threading.Thread(target=self._receive, args=(stream,), daemon=True,
                                          name=f"moshpit-{self.rank}-from-{stream.peer}")
                self._readers = [(s, t) for s, t in self._readers if t.is_alive()]
                self._readers.append((stream, thread))
            thread.start()

    def _receive(self, stream: Stream) -> None:
        """File what a peer sends, until its connection closes: a round's payloads land where
        they belong, the rest is filed whole."""
        peer, block = stream.peer, bytearray()
        self._inbox.connected(peer, stream)
        try:
            while True:
                header = stream.recv_header()
                with self._lock:
                    self._bytes_received += FRAME_SIZE
                phase = decode_bucket(header.bucket)[0]
                trusted = header.sender == peer  # a peer speaking for another is not
                if phase in (Phase.SCATTER, Phase.GATHER) and header.length:
                    block = block or bytearray(BLOCK_BYTES)
                    self._land(stream, header, trusted, memoryview(block))
                    continue
                payload = bytearray(header.length)
                stream.recv_payload(memoryview(payload))
                with self._lock:
                    self._bytes_received += header.length
                if not trusted:
                    continue
                if phase is Phase.STATE and header.kind == Kind.CONTROL:
                    self._answer_state(peer, Message(header, payload))
                else:
                    self._inbox.put(peer, Message(header, payload))
        except TransportError:  # closed, reset, or not speaking our protocol
            pass
        finally:
            self._inbox.disconnected(peer, stream)
            stream.close()

    def _land(self, stream: Stream, header: FrameHeader, trusted: bool,
              block: memoryview) -> None:
        """Read a round's payload block by block into its slot, once its round opened one
        (meanwhile it waits in the connection); one that has no slot, or does not fit it
        (another list of members), is read and dropped, and filed empty: not waited for."""
        phase, seq, _ = decode_bucket(header.bucket)
        key = (stream.peer, header.step, seq, phase)
        slot = self._inbox.slot(stream.peer, header) if trusted else None
        refused = slot is not None and not slot.fits(header)
        if refused:
            slot = None
        for offset in range(0, header.length, BLOCK_BYTES):
            piece = block[:min(BLOCK_BYTES, header.length - offset)]
            stream.recv_payload(piece)
            with self._lock:
                self._bytes_received += len(piece)
            if slot is not None and not self._inbox.land(key, slot, offset, piece):
                slot = None  # its phase ended: the rest is read and dropped
        if slot is not None:
            self._inbox.fill(key, slot)
        elif refused:
            self._inbox.put(stream.peer, Message(header, bytearray()))
