"""The listener's side of a caller's hello: its bytes read as they come, without waiting,
and, once whole, checked (the run, the target rank, the expected peers, the key's proof)."""

from __future__ import annotations

import hmac
import time
from collections.abc import Collection

from testbed.transport.auth import MAC_SIZE, hello_proof
from testbed.transport.tcp.stream import HELLO, Stream
from testbed.transport.wire import FRAME_SIZE, FrameHeader, Kind, MalformedDatagram, decode_frame


class TurnedAway(Exception):
    """A caller whose hello is not one for this listener: what was wrong."""


class Greeting:
    """A connection accepted whose hello is still coming. Its bytes are read as they come,
    without waiting (`read`), and it is heard once whole (`hear`)."""

    def __init__(self, stream: Stream, nonce: bytes) -> None:
        self.stream, self.nonce = stream, nonce  # the stream's address is the caller's
        self.since = time.monotonic()
        self.buffer = bytearray()
        self.header: FrameHeader | None = None

    @property
    def caller(self) -> str:
        return f"{self.stream.address[0]}:{self.stream.address[1]}"

    def read(self) -> bool:
        """Take in what has come of the hello; True once all of it is here. Raises
        `TurnedAway` for a caller that closed, or whose header is no hello of this run."""
        wanted = FRAME_SIZE + (0 if self.header is None else self.header.length)
        try:
            data = self.stream.sock.recv(wanted - len(self.buffer))
        except BlockingIOError:
            return False
        except OSError as exc:
            problem = f"{exc.strerror} after {len(self.buffer)} bytes of its hello"
            raise TurnedAway(problem) from None
        if not data:
            raise TurnedAway(f"closed the connection after {len(self.buffer)} of {wanted} "
                              "bytes of its hello")
        self.buffer += data
        if self.header is None and len(self.buffer) == FRAME_SIZE:
            try:
                header = decode_frame(bytes(self.buffer), self.stream.run_id)
            except MalformedDatagram as exc:
                raise TurnedAway(f"not a message of this run ({exc})") from None
            if header.kind != Kind.HELLO:
                raise TurnedAway(f"{Kind(header.kind).name} instead of a hello")
            if header.length > HELLO.size + MAC_SIZE:
                raise TurnedAway(f"a hello of {header.length} bytes")
            self.header = header
        return self.header is not None and len(self.buffer) == FRAME_SIZE + self.header.length

    def hear(self, rank: int, expect: Collection[int] | None, key: bytes | None) -> None:
        """Check the whole hello: it proves `key` (if the run has one), it is for `rank`, from
        a peer in `expect`; the stream then names that peer. Raises `TurnedAway`."""
        assert self.header is not None
        payload, sender = bytes(self.buffer[FRAME_SIZE:]), self.header.sender
        target = HELLO.unpack_from(payload)[0] if len(payload) >= HELLO.size else None
        proof = payload[HELLO.size:]
        if target is None or len(proof) not in (0, MAC_SIZE):
            raise TurnedAway(f"a hello of {len(payload)} payload bytes")
        if key is None and proof:
            raise TurnedAway(f"rank {sender} proves a key; this listener has none")
        if key is not None and not proof:
            raise TurnedAway(f"rank {sender} has no key; this run's listener wants proof of one")
        if key is not None and not hmac.compare_digest(
                proof, hello_proof(key, self.nonce, self.header.run_id, sender, target)):
            raise TurnedAway(f"rank {sender}'s hello does not prove the run's key")
        if target != rank:
            raise TurnedAway(f"rank {sender} meant to reach rank {target}")
        if expect is not None and sender not in expect:
            raise TurnedAway(f"rank {sender}, not one of {sorted(expect)}")
        self.stream.peer = sender
        self.stream._counted(self.header)

