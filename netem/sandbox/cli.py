"""`python -m netem.sandbox`: the UML guest from the command line, with nothing but argparse.

    python -m netem.sandbox prepare [--quiet]
    python -m netem.sandbox run [--timeout SECONDS] [--mem SIZE] -- CMD ARGS...
    python -m netem.sandbox pytest ARGS...
    python -m netem.sandbox mirror

Each command is a function that returns an exit code, so that another command line offers the
same commands under its own name (`prog`, which starts its messages).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from netem import sandbox
from netem.capabilities import netem_available
from netem.sandbox.mirror import apt_mirror

PROG = "python -m netem.sandbox"
PYTEST_MEM = "4G"  # tests may run whole labs of workers in the guest (its pages are lazy)
PYTEST_TIMEOUT = 3600.0  # seconds a guest's pytest may take

_T = TypeVar("_T")


def guarded(call: Callable[[], _T], *, prog: str = PROG) -> _T:
    """`call()`, with the sandbox's errors turned into a message and an exit code (124 on
    timeout, like `timeout`; 2 for a bad argument; else 1) instead of a traceback, and SIGTERM
    (a CI timeout, `kill`) into an exit that unwinds like Ctrl-C, so that the guest and its
    files go too."""
    caller = os.getpid()

    def on_sigterm(*_: object) -> None:
        # A forked helper holding a copy of this stack just ends, leaving the clean-ups to us.
        if os.getpid() != caller:
            os._exit(143)
        sys.exit(143)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return call()
    except sandbox.GuestTimeout as exc:
        _say(prog, str(exc))
        raise SystemExit(124) from None
    except ValueError as exc:  # a bad argument, e.g. mem
        _say(prog, str(exc))
        raise SystemExit(2) from None
    except sandbox.SandboxError as exc:
        _say(prog, str(exc))
        raise SystemExit(1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def prepare_command(*, quiet: bool = False, prog: str = PROG) -> int:
    """Fetch, patch and verify the UML kernel once; later calls return at once from the cache."""
    kernel = guarded(lambda: sandbox.prepare(quiet=quiet), prog=prog)
    if not quiet:
        print(sandbox.describe(kernel))
    return 0


def run_command(
    argv: Sequence[str],
    *,
    timeout: float = sandbox.DEFAULT_TIMEOUT,
    mem: str = sandbox.DEFAULT_MEM,
    prog: str = PROG,
) -> int:
    """Run a command as root in a fresh guest, here in this directory; return its exit code."""
    return guarded(lambda: sandbox.run(argv, timeout=timeout, mem=mem), prog=prog).returncode


def pytest_command(args: Sequence[str], *, prog: str = PROG) -> int:
    """Run `python -m pytest ARGS` where netem exists: here if this kernel has it, else in a
    guest. Says which in one line."""
    argv = [sys.executable, "-m", "pytest", *args]
    if netem_available():
        _say(prog, "this kernel has netem: running pytest on the host")
        return subprocess.run(argv).returncode
    kernel = guarded(sandbox.prepare, prog=prog)
    _say(prog, f"this kernel has no netem: running pytest in a guest ({sandbox.describe(kernel)})")
    result = guarded(
        lambda: sandbox.run(argv, kernel=kernel, mem=PYTEST_MEM, timeout=PYTEST_TIMEOUT),
        prog=prog,
    )
    return result.returncode


def mirror_command(*, prog: str = PROG) -> int:
    """Print the Debian mirror the sandbox fetches from (the host's, or $TESTBED_APT_MIRROR)."""
    try:
        print(apt_mirror())
    except LookupError as exc:
        _say(prog, str(exc))
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A User-Mode Linux guest whose kernel has netem, for hosts whose kernel "
        "has none (docs/sandbox.md).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    prepare = commands.add_parser(
        "prepare", help="fetch, patch and verify the UML kernel (once; then instant)"
    )
    prepare.add_argument("--quiet", "-q", action="store_true",
                         help="Print only warnings and errors.")
    run = commands.add_parser("run", help="run a command as root in a fresh guest, here")
    run.add_argument("--timeout", type=float, default=sandbox.DEFAULT_TIMEOUT,
                     help="Kill the guest after so many seconds (default: %(default)g).")
    run.add_argument("--mem", default=sandbox.DEFAULT_MEM,
                     help="Guest memory, e.g. 512M or 2G (default: %(default)s).")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                     help="The command to run, after --.")
    # pytest's own options pass through untouched, --help included.
    commands.add_parser("pytest", add_help=False, help="run pytest where netem is")
    commands.add_parser("mirror", help="print the Debian mirror the sandbox fetches from")

    args, rest = parser.parse_known_args(argv)
    if args.command == "pytest":
        return pytest_command(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "prepare":
        return prepare_command(quiet=args.quiet)
    if args.command == "mirror":
        return mirror_command()
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        run.error("the command to run is missing (put it after --)")
    return run_command(command, timeout=args.timeout, mem=args.mem)


def _say(prog: str, message: str) -> None:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
