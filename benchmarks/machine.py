"""The sentence that opens every results file: the command that wrote it, when it started, how
long it took, and the machine it ran on; what /proc says of a process's memory; and a
benchmark's part that runs in the User-Mode Linux guest."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def in_guest(module: str, *arguments: str) -> tuple[list[Any], str]:
    """`python -m MODULE ARGUMENTS --guest-json FILE` in a User-Mode Linux guest (the
    sandbox's kernel, which has netem): what it wrote to FILE, and the guest in words for the
    results file. A failed guest run ends the benchmark with the guest's output."""
    from netem import sandbox

    kernel = sandbox.prepare(quiet=True)
    with tempfile.TemporaryDirectory(prefix="tb-guest-") as tmp:
        out = Path(tmp) / "guest.json"
        result = sandbox.run([sys.executable, "-m", module, *arguments, "--guest-json", str(out)],
                             cwd=REPO, stream=False, kernel=kernel)
        if result.returncode != 0:
            raise SystemExit(f"the guest run failed ({result.returncode}):\n{result.output}")
        items = json.loads(out.read_text())
    return items, (f"user-mode-linux {kernel.uml_package} with libc6 {kernel.libc_package}, "
                   "one vCPU")


def command(module: str) -> str:
    """This run's command as typed at the repository root: the interpreter (`.venv/bin/python`
    for the project's venv; another one by its own path), `-m MODULE` and the arguments."""
    interpreter = Path(sys.executable)
    if interpreter.is_relative_to(REPO):
        interpreter = interpreter.relative_to(REPO)
    return " ".join([str(interpreter), "-m", module, *sys.argv[1:]])


def cpu() -> str:
    """The CPU's model name from /proc/cpuinfo, or the machine's architecture without one."""
    return next((line.split(":", 1)[1].strip()
                 for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.machine())


def written_by(command: str, started: datetime.datetime, elapsed_seconds: float) -> str:
    """'Written by `COMMAND`, started YYYY-MM-DD HH:MM UTC, took N.N min. Machine: CPU, `nproc`
    N, Linux RELEASE, Python VERSION.' (`started` in UTC), and glibc's MALLOC_* settings if
    any are set."""
    allocator = sorted(f"{name}={value}" for name, value in os.environ.items()
                       if name.startswith("MALLOC_"))  # glibc's tunables change memory figures
    return (f"Written by `{command}`, started {started:%Y-%m-%d %H:%M} UTC, took "
            f"{elapsed_seconds / 60:.1f} min. Machine: {cpu()}, `nproc` {os.cpu_count()}, "
            f"Linux {platform.release()}, Python {platform.python_version()}."
            + (f" With {', '.join(allocator)} in the environment." if allocator else ""))


def status_kb(field: str, pid: int | str = "self", file: str = "status") -> int | None:
    """A kB field of /proc/PID/FILE (`status`: `VmRSS`, `VmHWM`; `smaps_rollup`: `Pss`); None
    if the process or field is gone."""
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
