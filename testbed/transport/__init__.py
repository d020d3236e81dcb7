"""The wire under the collectives: UDP datagrams (lossy, paced, counted) and TCP streams
(reliable, framed). docs/transport.md describes the wire format and the counters.

Names are loaded on first use, so `testbed.transport.wire` and `.counters` import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "wire": (
        "HEADER_SIZE", "FRAME_SIZE", "MAGIC", "VERSION", "Codec", "FrameHeader", "Header", "Kind",
        "MalformedDatagram", "Reason", "chunk_numel", "decode", "decode_frame", "encode",
        "payload_capacity",
    ),
    "counters": (
        "UNKNOWN_PEER", "DatagramCounters", "SocketCounters", "StreamCounters", "TcpInfo",
        "namespace_counters", "socket_drops", "tcp_info",
    ),
    "errors": ("PeerClosed", "ProtocolError", "TransportError", "TransportTimeout"),
    "tensors": ("as_bytes", "codec_of", "dtype_of"),
    "udp": ("Chunk", "Collected", "DatagramEndpoint", "Landing", "Sink", "TokenBucket",
            "chunk_count", "expected_chunks", "place"),
    "tcp": ("Listener", "Message", "Stream", "StreamMesh"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
