"""Streams from one worker to each of its peers, formed in any start order."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping

from testbed.transport.counters import StreamCounters
from testbed.transport.tcp.listener import Listener
from testbed.transport.tcp.stream import Stream


class StreamMesh:
    """Streams from `rank` to each of its peers: it connects to lower ranks and accepts higher
    ones, so any start order works as long as every listener is bound before the addresses
    are handed out. Outgoing connections use the listener's congestion control and key."""

    def __init__(self, rank: int, streams: dict[int, Stream]) -> None:
        self.rank, self.streams = rank, streams

    @classmethod
    def open(
        cls,
        rank: int,
        listener: Listener,
        addresses: Mapping[int, tuple[str, int]],
        *,
        run_id: int,
        peers: Collection[int] | None = None,
        timeout: float = 30.0,
    ) -> StreamMesh:
        """Connect to `peers` (default: every rank in `addresses` but this one)."""
        peers = set(addresses) - {rank} if peers is None else set(peers) - {rank}
        deadline = time.monotonic() + timeout
        congestion = listener.congestion
        streams: dict[int, Stream] = {}
        try:
            for peer in sorted(p for p in peers if p < rank):
                streams[peer] = Stream.connect(
                    addresses[peer], rank=rank, peer=peer, run_id=run_id,
                    timeout=deadline - time.monotonic(), congestion=congestion,
                    key=listener.key,
                )
            waiting = {p for p in peers if p > rank}
            while waiting:
                stream = listener.accept(rank=rank, run_id=run_id, expect=waiting,
                                         timeout=deadline - time.monotonic())
                waiting.discard(stream.peer)
                streams[stream.peer] = stream
        except BaseException:
            for stream in streams.values():
                stream.close()
            raise
        return cls(rank, streams)

    def __getitem__(self, peer: int) -> Stream:
        return self.streams[peer]

    def counters(self) -> dict[int, StreamCounters]:
        return {peer: stream.counters() for peer, stream in sorted(self.streams.items())}

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()

    def __enter__(self) -> StreamMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

