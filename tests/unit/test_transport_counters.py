"""Kernel counters: the namespace's /proc figures under Prometheus-friendly names, and a
socket's own drop count, which tells host-caused loss (a full receive buffer) from the link's."""

from __future__ import annotations

import socket
import time

import torch

from testbed.transport import DatagramEndpoint, Kind, namespace_counters

RUN = 12


def test_namespace_counters_hold_the_udp_and_tcp_figures():
    """They follow what this namespace's stack does: a TCP connection on loopback sends at
    least its handshake and a segment of data, both ends being here."""
    before = namespace_counters()
    for name in ("udp_rcvbuf_errors", "udp_in_csum_errors", "tcp_retrans_segs", "tcp_out_segs",
                 "tcpext_tcp_lost_retransmit"):
        assert isinstance(before[name], int), name
    with (socket.create_server(("127.0.0.1", 0)) as server,
          socket.create_connection(server.getsockname()) as client):
        peer, _ = server.accept()
        with peer:
            client.sendall(b"x" * 100)
            assert peer.recv(100)
    after = namespace_counters()
    assert after["tcp_out_segs"] - before["tcp_out_segs"] >= 4  # SYN, SYN-ACK, ACK, data


def test_a_full_receive_buffer_is_counted_as_rcvbuf_drops():
    """An unpaced burst into a receiver that is not reading, with the smallest buffer: what the
    sequence numbers call lost is exactly what the kernel says it dropped for the socket."""
    with (
        DatagramEndpoint(1, RUN, ("127.0.0.1", 0), rcvbuf=1) as receiver,
        DatagramEndpoint(0, RUN, ("127.0.0.1", 0), peers={1: receiver.address}) as sender,
    ):
        receiver.add_peer(0, sender.address)
        burst = sender.send_tensor(1, Kind.GRADIENT, 0, 0, torch.zeros(100 * sender.chunk_numel()))
        receiver.poll()
        for attempt in range(20):  # a marker the still-full buffer drops is lost and counted too
            sender.send_tensor(1, Kind.CONTROL, 1, attempt, torch.zeros(1))
            marker = receiver.collect(Kind.CONTROL, 1, attempt, {0: 1}, time.monotonic() + 0.5)
            if not marker.missing:
                break
        assert not marker.missing, "no marker got through"
        lost = receiver.counters()[0].datagrams_lost
        drops = receiver.socket_counters().rcvbuf_drops
    assert burst == 100
    assert lost > 50, f"a {receiver.rcvbuf_bytes}-byte buffer held {100 - lost} of 100 datagrams"
    assert drops == lost
