"""Moshpit All-Reduce (after Ryabinin et al., "Moshpit SGD"), over TCP within one deadline.

Peers sit on the virtual grid of `testbed.collectives.grid`; round r averages within the group
that shares every coordinate but axis r mod d, so with no failures d rounds give the exact
global mean. Each round has three phases:

1. roll call: every member sends READY (its coverage and the members it believes alive) to the
   others; the round's members are those who answered and whom every answerer counts on, so
   all members normally agree on them (a digest of the list travels with every later message;
   a peer with another list is left out instead of being misread).
2. reduce-scatter: the vector is split into one slice per member; each member sends slice i to
   member i and averages its own slice over the contributions that came in time.
3. all-gather: each member sends its averaged slice to the others.

A call ends by `timeout` after it began: its first roll call may wait up to half of that for
members that are behind, and the other half is one window per round for its data (and from
the second round on, half a window for its roll call); a send still going when its phase ends
is abandoned. A peer whose connection closed (it died, or gave up on this one) is waited for
only a short grace more. Payloads land where they belong as they are read, block by block
(added into this peer's own slice, or copied over a member's slice), so a call holds its
result and a block per connection, not a copy of what it receives.
Membership, rendezvous and heartbeats go through torch.distributed's TCPStore
(`testbed.collectives.membership`); a restarted peer pulls the current parameters from a live
neighbour (`pull_state`). docs/moshpit.md has the details.

Its modules: `peer` (the `Moshpit` collective: joining, a call's rounds, leaving),
`matchmaking` (the roll call that forms a round's group), `allreduce` (the reduce-scatter and
all-gather within it), `partition` (the vector's slices and where payloads land), `schedule`
(a call's deadlines), `protocol` (the header's tags, the READY payload), `channel` (what a
round speaks through), `sending` and `receiving` (the connections, a thread each), `inbox`
(what came, filed until a round takes it), `stats`, and `demo` (the `testbed moshpit-peer`
process).
"""

from __future__ import annotations

from testbed.collectives.moshpit.demo import demo_input, run_demo_peer
from testbed.collectives.moshpit.peer import Moshpit
from testbed.collectives.moshpit.protocol import Phase
from testbed.collectives.moshpit.schedule import MARGIN
from testbed.collectives.moshpit.stats import MoshpitStats, RoundStats

__all__ = ["MARGIN", "Moshpit", "MoshpitStats", "Phase", "RoundStats", "demo_input",
           "run_demo_peer"]
