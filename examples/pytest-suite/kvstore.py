"""A small key-value service over UDP, the code under test of this example suite.

The server keeps a dict; each request is one datagram of JSON with an id, and the server answers
each id once (a retried request whose first copy arrived gets the stored answer again, so a
`put` is never applied twice). The client gives every attempt `timeout` seconds, backs off
between attempts, and gives up when the request's `deadline` has passed.

    python kvstore.py serve --port 7000             # prints "listening" once it is bound
    python kvstore.py load ADDRESS --port 7000 --requests 100 --deadline 5
                                                    # prints one line of JSON: what happened
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass


class Unavailable(TimeoutError):
    """No answer before the request's deadline."""


def serve(port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    print("listening", flush=True)
    store: dict[str, str] = {}
    answered: dict[str, bytes] = {}  # request id -> answer, for retries
    while True:
        data, peer = sock.recvfrom(65536)
        try:
            request = json.loads(data)
            key = request["id"]
        except (ValueError, KeyError, TypeError):
            continue
        if key not in answered:
            if request.get("op") == "put":
                store[request["key"]] = request["value"]
                answer = {"id": key, "ok": True}
            else:
                answer = {"id": key, "ok": True, "value": store.get(request.get("key", ""))}
            answered[key] = json.dumps(answer).encode()
        sock.sendto(answered[key], peer)


@dataclass
class Client:
    address: str
    port: int
    timeout: float = 0.2  # per attempt: well above the round trip, below the deadline
    deadline: float = 5.0  # per request
    backoff: float = 1.5  # each attempt's timeout grows by this much, up to 1 s

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.retries = 0
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-{time.monotonic_ns()}"

    def put(self, key: str, value: str) -> None:
        self._call({"op": "put", "key": key, "value": value})

    def get(self, key: str) -> str | None:
        return self._call({"op": "get", "key": key}).get("value")

    def _call(self, request: dict) -> dict:
        request_id = f"{self._prefix}-{next(self._ids)}"
        payload = json.dumps({**request, "id": request_id}).encode()
        give_up = time.monotonic() + self.deadline
        timeout = self.timeout
        for attempt in itertools.count():
            left = give_up - time.monotonic()
            if left <= 0:
                raise Unavailable(f"no answer to {request['op']} within {self.deadline} s "
                                  f"({attempt} attempts)")
            if attempt:
                self.retries += 1
            self.sock.sendto(payload, (self.address, self.port))
            answer = self._answer(request_id, min(timeout, left))
            if answer is not None:
                return answer
            timeout = min(timeout * self.backoff, 1.0)
        raise AssertionError("unreachable")

    def _answer(self, request_id: str, timeout: float) -> dict | None:
        """The answer to this request within `timeout` (stale answers to earlier attempts of
        other requests are skipped)."""
        until = time.monotonic() + timeout
        while (left := until - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return None
            answer = json.loads(data)
            if answer.get("id") == request_id:
                return answer
        return None


def load(address: str, port: int, requests: int, deadline: float) -> dict:
    """`requests` puts, each read back; what happened, as a dict."""
    client = Client(address, port, deadline=deadline)
    latencies, failed, wrong = [], 0, 0
    for number in range(requests):
        begun = time.monotonic()
        try:
            client.put(f"key-{number}", f"value-{number}")
            wrong += client.get(f"key-{number}") != f"value-{number}"
        except Unavailable:
            failed += 1
            continue
        latencies.append((time.monotonic() - begun) / 2)  # a put and a get
    return {
        "requests": requests,
        "failed": failed,
        "wrong": wrong,
        "retries": client.retries,
        "latency_p50_ms": statistics.median(latencies) * 1e3 if latencies else None,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("serve")
    server.add_argument("--port", type=int, default=7000)
    client = commands.add_parser("load")
    client.add_argument("address")
    client.add_argument("--port", type=int, default=7000)
    client.add_argument("--requests", type=int, default=100)
    client.add_argument("--deadline", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.port)
    else:
        print(json.dumps(load(args.address, args.port, args.requests, args.deadline)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
