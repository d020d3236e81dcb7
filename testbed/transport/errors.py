"""Errors of the transport. Each message names who (rank), whom (peer rank and address) and
what (connect, send, receive; how long was waited), so a failed run says where it broke."""

from __future__ import annotations


class TransportError(RuntimeError):
    """A transport operation failed (bad configuration, or a peer misbehaved)."""


class TransportTimeout(TransportError, TimeoutError):
    """A connect, accept, send or receive did not finish in time."""


class PeerClosed(TransportError, ConnectionError):
    """The peer closed or reset the connection."""


class ProtocolError(TransportError):
    """A TCP peer sent something that is not the message expected; the stream is closed."""
