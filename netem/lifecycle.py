"""Resources that a `with` statement starts and closes.

A resource built in steps (namespaces and a bridge, a daemon) must not outlive a start that
failed halfway: entering calls its `start`, a start that raises (Ctrl-C included) closes what
it had begun before the error goes on, and leaving closes it. A class whose closing method has
another name says so where it names the base: `class Engine(StartsOnEnter, close="stop")`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self


class StartsOnEnter:
    """`with` calls `start`, and closes the object at the end, or at once if `start` raises;
    closing must therefore be idempotent and undo a partial start."""

    _close_method: ClassVar[str] = "close"

    def __init_subclass__(cls, *, close: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if close is not None:
            cls._close_method = close

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        getattr(self, self._close_method)()
