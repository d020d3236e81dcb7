"""Run blocking calls at once in threads, for tests whose peers live in one process."""

from __future__ import annotations

import threading
from collections.abc import Callable

WAIT = 30.0  # seconds a call may take before the test fails instead of hanging


def concurrently(*calls: Callable[[], object], wait: float = WAIT) -> list[object]:
    """The calls' results in order, or the first exception one of them raised."""
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(wait)
        assert not thread.is_alive(), f"a call did not finish within {wait} s"
    if errors:
        raise errors[0]
    return results
