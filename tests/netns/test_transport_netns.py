"""The transport between two lab hosts (namespaces on a bridge) on the host kernel: link loss
measured from sequence gaps, receive-buffer overflow counted apart from it, TCP retransmits read
from TCP_INFO, and a datagram too large for the link refused at once.

Loss comes from an nftables `numgen random` drop in the receiver's prerouting hook (no sch_netem
here); its rule counter says exactly how many datagrams the "link" took. Small datagrams (the
warm-up and end markers) are exempt, so the test never waits on a lost marker. Sockets are made
inside each host's namespace by this process (`inside`), so one thread drives both ends; a
marker's arrival means everything the same sender sent before it was read (one path, in order).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from nft_drop import drop

from netem.lab import Host, Lab
from netem.namespace import inside
from testbed.transport import (
    DatagramEndpoint,
    Kind,
    Listener,
    Stream,
    TransportError,
    expected_chunks,
    namespace_counters,
)

pytestmark = pytest.mark.netns
RUN = 4242
WAIT = 20.0
MARKER = 100  # UDP length (header included) below which the drop rule lets a datagram pass


def dropped(lab: Lab, host: Host) -> int:
    listing = lab.run(host, ["nft", "-j", "list", "table", "inet", "loss"], check=True).stdout
    rules = [item["rule"] for item in json.loads(listing)["nftables"] if "rule" in item]
    (counter,) = [e["counter"] for e in rules[0]["expr"] if "counter" in e]
    return counter["packets"]


def endpoints(lab: Lab, **receiver_options) -> tuple[DatagramEndpoint, DatagramEndpoint]:
    """Rank 0 on host 0 sends to rank 1 on host 1; the link's neighbour entry is resolved."""
    a, b = lab.hosts
    with inside(b.netns):
        receiver = DatagramEndpoint(1, RUN, (b.address, 0), **receiver_options)
    with inside(a.netns):
        sender = DatagramEndpoint(0, RUN, (a.address, 0), peers={1: receiver.address})
    receiver.add_peer(0, sender.address)
    # ARP first: a burst into an unresolved neighbour overflows its queue (another loss)
    sender.send_tensor(1, Kind.CONTROL, 0, 0, torch.zeros(1))
    warm = receiver.collect(Kind.CONTROL, 0, 0, {0: 1}, time.monotonic() + WAIT)
    assert not warm.missing, "the warm-up datagram did not arrive"
    return sender, receiver


def end_marker(sender: DatagramEndpoint, receiver: DatagramEndpoint) -> None:
    """Send markers until one arrives (a full receive buffer may drop some: they count as
    lost and as rcvbuf drops alike)."""
    for attempt in range(20):
        sender.send_tensor(1, Kind.CONTROL, 1, attempt, torch.zeros(1))
        marker = receiver.collect(Kind.CONTROL, 1, attempt, {0: 1}, time.monotonic() + 0.5)
        if not marker.missing:
            return
    pytest.fail("no end marker arrived")


def test_link_loss_is_measured_from_sequence_gaps(make_lab):
    lab = make_lab(2)
    sender, receiver = endpoints(lab, rcvbuf=64 << 20)
    numel = receiver.chunk_numel()
    drop(lab, lab.hosts[1], f"udp dport {receiver.address[1]} udp length > {MARKER}", 20)
    tensor = torch.randn(5000 * numel)

    sent = sender.send_tensor(1, Kind.GRADIENT, 5, 0, tensor)
    end_marker(sender, receiver)
    got = receiver.collect(Kind.GRADIENT, 5, 0, expected_chunks([0], tensor.numel(), numel),
                           time.monotonic())

    link = dropped(lab, lab.hosts[1])
    counters = receiver.counters()[0]
    assert sent == 5000
    assert counters.datagrams_lost == link == len(got.missing), "gaps are not the link's drops"
    assert abs(link / sent - 0.20) < 0.03, f"{link / sent:.3f} lost"
    assert receiver.socket_counters().rcvbuf_drops == 0
    sender.close()
    receiver.close()


def test_receive_buffer_overflow_is_counted_apart_from_link_loss(make_lab):
    lab = make_lab(2)
    sender, receiver = endpoints(lab, rcvbuf=1)  # the kernel's minimum: a few datagrams
    with inside(lab.hosts[1].netns):
        before = namespace_counters()["udp_rcvbuf_errors"]

    burst = sender.send_tensor(1, Kind.GRADIENT, 5, 0, torch.zeros(200 * receiver.chunk_numel()))
    receiver.poll()  # the receiver was not reading during the burst
    end_marker(sender, receiver)

    with inside(lab.hosts[1].netns):
        namespace = namespace_counters()["udp_rcvbuf_errors"] - before
    lost = receiver.counters()[0].datagrams_lost
    host = receiver.socket_counters().rcvbuf_drops
    assert burst == 200 and lost > 100
    assert host == lost == namespace, "every gap should be a receive-buffer drop, nothing else"
    sender.close()
    receiver.close()


def test_tcp_retransmits_over_a_lossy_link_come_from_tcp_info(make_lab):
    lab = make_lab(2)
    a, b = lab.hosts
    with inside(b.netns):
        listener = Listener((b.address, 0), congestion="cubic")
    with inside(a.netns):
        before = namespace_counters()["tcp_retrans_segs"]
        outgoing = Stream.connect(listener.address, rank=0, peer=1, run_id=RUN, timeout=WAIT,
                                  congestion="cubic")
    incoming = listener.accept(rank=1, run_id=RUN, timeout=WAIT)
    listener.close()
    drop(lab, b, f"tcp dport {listener.address[1]}", 5)  # after the handshake: no SYN timeout
    tensor = torch.randn(1_000_000)
    result: dict[str, torch.Tensor] = {}
    receiving = threading.Thread(target=lambda: result.setdefault("tensor", incoming.recv_tensor(
        kind=Kind.PARAMETER, step=0, bucket=0, timeout=WAIT)))
    receiving.start()
    outgoing.send_tensor(tensor, kind=Kind.PARAMETER, step=0, bucket=0, timeout=WAIT)
    receiving.join(WAIT)

    info = outgoing.tcp_info()
    with inside(a.netns):
        namespace = namespace_counters()["tcp_retrans_segs"] - before
    assert torch.equal(result["tensor"], tensor)
    assert outgoing.congestion == incoming.congestion == "cubic"
    assert dropped(lab, b) > 0
    assert info.total_retrans > 0
    assert outgoing.counters().tcp_retransmits == info.total_retrans
    assert namespace >= info.total_retrans  # the namespace-wide figure covers our socket
    outgoing.close()
    incoming.close()


def test_a_datagram_too_large_for_the_link_is_refused_at_once(make_lab):
    lab = make_lab(2)  # MTU 1500
    a, b = lab.hosts
    with inside(a.netns):
        sender = DatagramEndpoint(0, RUN, (a.address, 0), mtu=9000, peers={1: (b.address, 9)})
    with pytest.raises(TransportError, match=r"too large .* is mtu=9000 right for this path"):
        sender.send_tensor(1, Kind.GRADIENT, 0, 0, torch.zeros(10_000))
    sender.close()
