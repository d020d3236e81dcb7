"""The lossy all-reduce (after Weintraub, Banner and Orda, "Distributed Training under Packet
Loss"): gradients and parameters travel as datagrams, and nobody waits for what was lost.

The flat tensor is cut into `world` shards (`torch.tensor_split`, as the ring does); rank k owns
shard k. One call has two phases:

1. gather: every worker sends its slice of shard k to owner k as datagrams. The owner waits
   until all of them came or its adaptive deadline passed, then takes per chunk the mean of the
   contributions that came (its own always does): `estimate.ChunkAccumulator`.
2. broadcast: the owner sends its result to every worker as datagrams: the averaged shard
   (`allreduce`) or the fresh parameters its optimizer made from it (`step`), with each
   chunk's contribution count appended so receivers know their coverage. A worker that misses
   a chunk keeps its own value there (its gradient, or its stale parameters) until a later
   broadcast overwrites it: copies lag where broadcasts were lost, they never diverge. Options
   narrow that: XOR parity chunks that rebuild a lost chunk (`parity`), a request for what
   did not come (`resend`), and for parameters a best estimate in place of the stale value
   (`missed`).

Chunks land where they belong as they are read, with no per-peer copies: gradient chunks are
added into the owner's running sums, broadcast chunks are written into the owner's slice of the
result and their counts into a small side buffer. Each phase sends to all peers at once, their
chunks interleaved, so no link gets more than its rate from the others together.

Every `resync_every`-th step the broadcast goes over TCP instead, so all copies equal the
owners' again.

How long a phase waits for a peer depends on where the peer is, so that a peer that computed
longer is not mistaken for a lossy link, nor a lost stream for a slow peer. Every datagram says
which (step, bucket, phase) it belongs to, and a waiting worker says where it is (a PROGRESS
datagram, repeated while it waits). A peer not yet seen at this phase is behind: it is waited
for, up to `straggler_timeout` (training is synchronous: the step waits for the slowest worker,
as gloo would). A peer seen at or past it sent its stream: from its first chunk (or from when
it was seen there) the stream has the phase's transfer deadline (`estimate.AdaptiveDeadline`,
learned from how long recent streams took from first to last chunk), and what has not come by
then was lost. A peer that showed nothing within the timeout is absent: later calls do not
wait for it until a datagram of its arrives again (a preempted or partitioned peer costs one
timeout, not one per step). A call that has everything in hand ends at once.

The package, one module per concern: `collective` (`Lossy`: its sockets, its options, what
outlives a call), `call` (one call, phase by phase: the algorithm), `waiting` (how long a phase
waits for each peer), `sinks` (where a phase's chunks land, and the test loss model), `stats`
(what a call did: `LossyStats`).
"""

from testbed.collectives.lossy.collective import Lossy
from testbed.collectives.lossy.sinks import SeededLoss
from testbed.collectives.lossy.stats import CALL_PHASES, LossyStats
from testbed.collectives.registry import MISSED

__all__ = ["CALL_PHASES", "MISSED", "Lossy", "LossyStats", "SeededLoss"]
