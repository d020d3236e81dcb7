"""What goes wrong in the sandbox: one error for every step (the message says which and what
to do), and the timeout that also hands back what the guest had printed."""

from __future__ import annotations

from pathlib import Path


class SandboxError(RuntimeError):
    """A step of preparing or running the guest failed; the message says which and what to do."""


class GuestTimeout(SandboxError):
    """The guest ran past its timeout and was killed."""

    def __init__(self, message: str, *, output: str, umid: str, workdir: Path) -> None:
        super().__init__(message)
        self.output = output
        self.umid = umid
        self.workdir = workdir
