"""Each worker's /metrics endpoint, reachable from the host's own network namespace.

The workers live in namespaces whose bridge is in a namespace of its own, so nothing of a run
touches the host's routes (two runs on one subnet never clash). To let a browser, `curl` or a
Prometheus on the host scrape them anyway, a `MetricsRelay` listens on the host's loopback, one
port per worker, and forwards each connection to that worker's endpoint through a socket made
inside the worker's namespace (a socket stays in the namespace it was made in).
`targets()` is a Prometheus `file_sd_configs` document of the host-side addresses
(`target_groups`: the same document for any placement's addresses; a Compose run's worker 0
writes one of the containers).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Sequence

from netem.namespace import inside

TARGETS_FILE = "prometheus-targets.json"  # a run's file_sd document of its workers' endpoints
CONNECT_TIMEOUT = 5.0  # seconds to reach a worker's endpoint from its namespace
CHUNK = 1 << 16


def target_groups(targets: Sequence[str], labels: dict[str, str]) -> list[dict[str, object]]:
    """A Prometheus file_sd document: one target group per worker (`targets[rank]`, host:port),
    labelled with `labels` and its rank as `worker` (the workers' own metrics carry `rank` too;
    this one names the scrape target)."""
    return [{"targets": [target], "labels": {**labels, "worker": str(rank)}}
            for rank, target in enumerate(targets)]


class MetricsRelay:
    """Forwards `host:ports[r]` (ports[r] = 0: any free port) on the host to
    `addresses[r]:port` inside `namespaces[r]`, for every rank r. Close it to stop."""

    def __init__(self, namespaces: Sequence[str], addresses: Sequence[str], port: int, *,
                 host: str = "127.0.0.1", ports: Sequence[int] | None = None) -> None:
        if len(namespaces) != len(addresses):
            raise ValueError(f"addresses: expected one per namespace ({len(namespaces)}), "
                             f"got {len(addresses)}")
        ports = [0] * len(namespaces) if ports is None else list(ports)
        self.host = host
        self._targets = [(ns, (address, port)) for ns, address in zip(namespaces, addresses,
                                                                      strict=True)]
        self._listeners: list[socket.socket] = []
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        try:
            for wanted in ports:
                listener = socket.create_server((host, wanted), reuse_port=False)
                self._listeners.append(listener)
        except BaseException:
            self.close()
            raise
        self._threads = [threading.Thread(target=self._accept, args=(rank,), daemon=True,
                                          name=f"metrics-relay-{rank}")
                         for rank in range(len(self._listeners))]
        for thread in self._threads:
            thread.start()

    @property
    def ports(self) -> list[int]:
        """The host-side port of each rank."""
        return [listener.getsockname()[1] for listener in self._listeners]

    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}/metrics" for port in self.ports]

    def targets(self, labels: dict[str, str] | None = None) -> list[dict[str, object]]:
        """`target_groups` of the host-side addresses."""
        return target_groups([f"{self.host}:{port}" for port in self.ports], labels or {})

    def close(self) -> None:
        """Stop listening and cut every forwarded connection."""
        with self._lock:
            self._closed = True
            sockets = [*self._listeners, *self._open]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in getattr(self, "_threads", []):
            thread.join(CONNECT_TIMEOUT)

    def __enter__(self) -> MetricsRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self, rank: int) -> None:
        listener = self._listeners[rank]
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._forward, args=(rank, client), daemon=True,
                             name=f"metrics-relay-{rank}-conn").start()

    def _forward(self, rank: int, client: socket.socket) -> None:
        netns, address = self._targets[rank]
        try:
            with inside(netns):
                upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.settimeout(CONNECT_TIMEOUT)
            upstream.connect(address)
            upstream.settimeout(None)
        except OSError:
            client.close()  # the worker is not serving (yet, or any more): the scrape fails
            return
        with self._lock:
            if self._closed:
                client.close()
                upstream.close()
                return
            self._open |= {client, upstream}
        back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
        back.start()
        _pipe(client, upstream)
        back.join()
        with self._lock:
            self._open -= {client, upstream}
        client.close()
        upstream.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy until `source` ends, then end `sink`'s sending side."""
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
