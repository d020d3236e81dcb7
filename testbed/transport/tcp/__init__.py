"""TCP streams for the reliable paths (ring all-reduce, Moshpit groups, control): framed
messages (a FRAME_SIZE header, then `length` payload bytes), connected point to point or as a
mesh, with a deadline on every operation and errors that say who, whom and what.

Every socket has TCP_NODELAY (a collective's messages are latency-bound) and can choose its
congestion control (TCP_CONGESTION): cubic and bbr react to loss an order of magnitude apart,
so a scenario names one and the run records it (`Stream.congestion`). Retransmits of the
process's own connections come from TCP_INFO (`Stream.tcp_info().total_retrans`).

A connection starts with the caller's hello: whom it meant to reach, and, where the run has a
key, proof of it: the listener sends a fresh nonce on accepting, and the caller answers with a
MAC of it (`auth.hello_proof`), which a passive observer cannot replay on another connection.
The listener reads every caller's hello as its bytes come, side by side, so a caller that sends
half a hello (or nothing) holds up no other.

The package, one module per concern: `stream` (a framed connection, the caller's hello),
`greeting` (the listener's side of a hello: reading and checking it), `listener` (accepting
connections), `mesh` (streams to every peer), `sockets` (the socket itself: TCP_NODELAY,
congestion control).
"""

from testbed.transport.tcp.listener import HELLO_TIMEOUT, Listener
from testbed.transport.tcp.mesh import StreamMesh
from testbed.transport.tcp.stream import Message, Stream

__all__ = ["HELLO_TIMEOUT", "Listener", "Message", "Stream", "StreamMesh"]
