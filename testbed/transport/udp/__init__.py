"""UDP datagrams for the lossy paths: tensors cut into MTU-sized chunks, paced, and collected
per (kind, step, bucket) until everything expected arrived or a deadline passed.

Datagrams move in batches: `sendmmsg` hands a paced run of a tensor's chunks to the kernel in
one call, `recvmmsg` reads up to a ring's worth at once, and each batch's headers are checked,
sequenced and routed with numpy (`testbed.transport.mmsg`). A chunk lands where its collector
said it belongs (a `Sink`: a tensor, or e.g. a running sum) as it is read, so nothing but the
destination holds its data.

One thread drives an endpoint. Whenever it waits (for pacing tokens while sending, for chunks
while collecting) it reads its socket, so datagrams from peers that send while this worker does
are taken in instead of overflowing the kernel's receive buffer. A key is opened (`open`, or
`collect` itself) before its chunks are due: chunks of keys nobody opened yet wait in the
endpoint until somebody does; chunks of a key already collected are late: counted, dropped.

Loss is measured from sequence numbers: every (sender incarnation, destination) stream numbers
its datagrams from 0, so gaps at the receiver are datagrams lost on the way, whatever took them.
The part the host took (the socket's receive buffer was full) is the kernel's per-socket drop
count (`SocketCounters.rcvbuf_drops`); the rest was the network.

Nothing a datagram says about itself is taken on its word. Before a datagram reaches a stream,
a key or a sum, its header has been checked (`wire.rejections`), its source address is the one
registered for the sender it names (`sources.SourceTable`), and, with the run's key, its MAC
proves the key (`auth.DatagramMac`); each batch at once, and what fails is counted by reason
against the peer whose address it came from. docs/transport.md states what this stops.

The package, one module per concern: `endpoint` (the socket's owner: sending, reading, the
keys' lifecycle), `sockets` (the socket itself), `pacing` (the token bucket), `replay` (each
sender's stream: replays and loss), `progress` (where each sender got to), `reassembly` (what
an opened key got), `landing` (where its chunks land).
"""

from testbed.transport.udp.endpoint import DatagramEndpoint
from testbed.transport.udp.landing import (
    Chunk,
    Landing,
    Sink,
    chunk_count,
    expected_chunks,
    place,
)
from testbed.transport.udp.pacing import TokenBucket
from testbed.transport.udp.progress import PHASES
from testbed.transport.udp.reassembly import Collected

__all__ = [
    "PHASES",
    "Chunk",
    "Collected",
    "DatagramEndpoint",
    "Landing",
    "Sink",
    "TokenBucket",
    "chunk_count",
    "expected_chunks",
    "place",
]
