"""`Lossy`, a worker's end of the lossy all-reduce: its sockets, its options, and what outlives
a call (the learned waits, the absent peers, the last updates a stand-in uses); each call is a
`call.Call`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from testbed.collectives.base import CollectiveBase, Update
from testbed.collectives.lossy.call import Call
from testbed.collectives.lossy.sinks import SeededLoss, open_key
from testbed.collectives.lossy.stats import LossyStats
from testbed.collectives.lossy.waiting import Waiting
from testbed.collectives.registry import PARITY_MEMORY, LossyOptions, Missed, ParityWhen
from testbed.transport.staging import Staged
from testbed.transport.tcp import Listener, StreamMesh
from testbed.transport.udp import DatagramEndpoint, Sink
from testbed.transport.wire import BUCKETS, Kind


class Lossy(CollectiveBase):
    """Worker `rank`'s end of the lossy all-reduce among `world` workers; its datagrams go to
    and from `addresses[rank]` (numeric addresses, one per rank)."""

    name = "lossy"

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        addresses: Sequence[tuple[str, int]],
        run_id: int = 0,
        mtu: int = 1500,
        rate: float | None = None,
        rcvbuf: int = 32 << 20,
        deadline_initial: float = 1.0,
        deadline_floor: float = 0.02,
        deadline_ceiling: float = 5.0,
        straggler_timeout: float = 5.0,
        settle: float | str | None = "auto",
        resync_every: int = 0,
        parity: int = 4,
        parity_when: ParityWhen = "loss",
        missed: Missed = "keep",
        resend: bool = True,
        ecn: bool = False,
        stream_addresses: Sequence[tuple[str, int]] | None = None,
        congestion: str | None = None,
        timeout: float = 30.0,
        rendezvous_timeout: float = 300.0,
        endpoint: DatagramEndpoint | None = None,
        listener: Listener | None = None,
        test_loss: SeededLoss | None = None,
        rejoining: bool = False,
        key: bytes | None = None,
    ) -> None:
        """`mtu` sizes the datagrams and `rate` (bits/s) paces them (None: unpaced). The
        `deadline_*` bound and seed the transfer deadline (seconds from a peer's first chunk of a
        phase); `straggler_timeout` is how long a peer's first chunk is waited for. With `settle`
        (seconds) ends a phase once every sender's stream has ended and nothing came for that long
        (the rest was lost; None waits to the deadline; "auto" learns it between 1 and 10 ms from
        what came late). With `parity` G > 0 every broadcast carries an XOR parity chunk per G
        chunks, from which a receiver rebuilds a chunk that is the only one of its group lost: with
        `parity_when` "loss" only to the peers that said (in their resend asks) that they lost some
        of this owner's broadcast within the last PARITY_MEMORY calls, so clean links carry none;
        "always" (and without `resend`, which the word comes with) to every peer. `missed` says what
        a copy holds where a parameter broadcast chunk was missed (`step`; MISSED): its stale value,
        or that plus the last update it received there, or plus its own optimizer's update of its
        local gradient. With `resend`, a worker asks each owner once for the broadcast chunks it
        lacks, and gets them again within the call. With `ecn` the datagrams are ECN-capable: a link
        with netem's `ecn` marks them CE instead of dropping them (counted as
        `datagrams_ce_marked`). The defaults (settle auto, parity 4 when loss is seen, resend) are
        the ones that kept training within the accuracy targets under 10-30% loss
        (docs/training.md). The workers meet over TCP at `stream_addresses` (default: `addresses`;
        TCP ports are apart from UDP's), with `congestion` control and `timeout` per message, before
        the first datagram, waiting up to `rendezvous_timeout` for all of them (ranks may arrive
        minutes apart: a DDP script broadcasts its model first); with `resync_every` N > 0, every
        step whose number + 1 is a multiple of N broadcasts there. These options are checked by
        `registry.LossyOptions`, as a scenario's are: what a scenario may not set, neither may a
        caller here.
        `endpoint` and `listener`, if given, are this rank's already bound sockets (then they
        are at `addresses[rank]` and `stream_addresses[rank]`) and are closed with this object.
        `test_loss` is for tests. A worker `rejoining` a running group (restarted after a
        preemption) skips the TCP meeting, which the others held at their start: its peers'
        sockets are bound already, and it has no TCP streams (so no resync). With `key` (the
        run's), every datagram carries a MAC and every TCP hello proves the key (a given
        `endpoint` or `listener` carries its own)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank: expected 0..{world - 1}, got {rank}")
        stream_addresses = addresses if stream_addresses is None else stream_addresses
        for name, given in (("addresses", addresses), ("stream_addresses", stream_addresses)):
            if len(given) != world:
                raise ValueError(f"{name}: expected one per rank ({world}), got {len(given)}")
        self.options = options = LossyOptions.checked(
            rate=rate, rcvbuf=rcvbuf, deadline_initial=deadline_initial,
            deadline_floor=deadline_floor, deadline_ceiling=deadline_ceiling,
            straggler_timeout=straggler_timeout, settle=settle, resync_every=resync_every,
            parity=parity, parity_when=parity_when, missed=missed, resend=resend, ecn=ecn,
            timeout=timeout, rendezvous_timeout=rendezvous_timeout)
        if rejoining and (problem := options.rejoin_problem("none")):
            raise ValueError(f"resync_every: {problem}")
        self.rank, self.world, self.timeout = rank, world, options.timeout
        self.test_loss = test_loss
        # Peers in the order of the rounds: at round i a worker sends to rank + i and hears
        # from rank - i, so reliable broadcasts pair up and never wait on each other.
        self.peers = [(rank + i) % world for i in range(1, world)]
        # missed "last_update": per other owner, the last per-step update received for each
        # element of its shard, and per chunk the steps missed since then.
        self.last_updates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step, self._in_step = -1, 0  # calls within one step are numbered (the bucket)
        self._calls = 0
        # per peer, the last call whose broadcast carries it parity (`loss_seen` moves it on)
        self._parity_until = dict.fromkeys(self.peers, 0)
        self._mesh: StreamMesh | None = None  # set below; None only if building it failed
        self._listener = listener
        self._sender: ThreadPoolExecutor | None = None  # a resync's sends, beside its receives
        self.endpoint = endpoint or DatagramEndpoint(
            rank, run_id, tuple(addresses[rank]), mtu=mtu, rate=options.rate,
            rcvbuf=options.rcvbuf, key=key, ecn=options.ecn)
        self.waiting = Waiting(self.endpoint, options)
        try:
            for peer in self.peers:
                self.endpoint.add_peer(peer, tuple(addresses[peer]))
            # The TCP mesh (which the resync uses) is also the rendezvous: once it is up, every
            # peer's datagram socket is bound, so no first datagram goes to a port nobody holds
            # yet (the kernel would drop it, and it would count as loss on the link).
            if not rejoining:
                self._listener = listener or Listener(tuple(stream_addresses[rank]),
                                                      congestion=congestion, key=key)
                self._mesh = StreamMesh.open(rank, self._listener, dict(enumerate(
                    stream_addresses)), run_id=run_id, timeout=options.rendezvous_timeout)
            if options.resync_every:
                self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"lossy-{rank}-send")
        except BaseException:
            self.close()
            raise

    def peer_moved(self, rank: int, host: str) -> None:
        """A restarted peer at another address: its datagrams go there and are taken only
        from there (the TCP mesh is not used once a peer restarted: no resync then)."""
        self.endpoint.move_peer(rank, host)

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, LossyStats]:
        """The average of `tensor` over the workers, as this worker got it: where a broadcast
        chunk was missed, its own value stands in (coverage says how much of that there is)."""
        staged = Staged(tensor)
        result, stats = self._exchange(staged.host, staged.host, step, None)
        return staged.back(result), stats

    def step(
        self, parameters: torch.Tensor, gradient: torch.Tensor, step: int, update: Update
    ) -> tuple[torch.Tensor, LossyStats]:
        """One sharded optimizer step on flat vectors: each owner averages its shard of
        `gradient`, calls `update(start, parameters[shard], averaged)` for its new parameters and
        broadcasts them. Returns this worker's new parameter vector (on the device of
        `parameters`; `update` is given host tensors): stale where it missed a broadcast
        chunk, which the next broadcast overwrites."""
        if parameters.shape != gradient.shape or parameters.dim() != 1:
            raise ValueError(f"step: needs flat parameters and gradient of one shape, got "
                             f"{tuple(parameters.shape)} and {tuple(gradient.shape)}")
        staged = Staged(parameters)
        result, stats = self._exchange(Staged(gradient).host, staged.host, step, update)
        return staged.back(result), stats

    def parity_peers(self) -> frozenset[int]:
        """The peers this call's broadcast carries parity to (`parity_when`)."""
        if self.options.parity_when == "always" or not self.options.resend:
            return frozenset(self.peers)
        return frozenset(peer for peer in self.peers if self._parity_until[peer] >= self._calls)

    def loss_seen(self, peers: Sequence[int]) -> None:
        """These peers lost some of this owner's broadcast in this call (or their word of it
        was lost): they get parity in the next PARITY_MEMORY calls."""
        for peer in peers:
            self._parity_until[peer] = self._calls + PARITY_MEMORY

    @property
    def mesh(self) -> StreamMesh | None:
        """The TCP streams to the peers (their counters reach the worker's metrics)."""
        return self._mesh

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)
        if self._mesh is not None:
            self._mesh.close()
        if self._listener is not None:
            self._listener.close()
        self.endpoint.close()

    def _exchange(
        self, contribution: torch.Tensor, fallback: torch.Tensor, step: int,
        update: Update | None,
    ) -> tuple[torch.Tensor, LossyStats]:
        """One call: `contribution`'s shards gathered at their owners, what the owners make of
        them (the mean, or `update` of `fallback`'s shard with it) broadcast into a copy of
        `fallback`."""
        if step != self._step:
            self._step, self._in_step = step, 0
        bucket = self._in_step % BUCKETS  # by step, not by call: a rejoining worker agrees
        self._in_step += 1
        self._calls += 1
        return Call(self, contribution, fallback, step, bucket, update).run()

    def _open(self, kind: Kind, step: int, bucket: int, sinks: Mapping[int, Sink | torch.Tensor],
              present: Mapping[int, np.ndarray] | None = None) -> dict[int, np.ndarray]:
        """Open (kind, step, bucket) with a sink per sender, under this worker's test loss
        model (`sinks.open_key`): every key of a call is opened here."""
        return open_key(self.endpoint, kind, step, bucket, sinks, receiver=self.rank,
                        test_loss=self.test_loss, present=present)
