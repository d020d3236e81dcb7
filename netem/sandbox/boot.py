"""`run`: a command as root in a fresh guest, booted as a process of this host, its console
read until the guest powers off, the guest killed and its files removed whatever happens
(timeout, Ctrl-C, exit); and the removal of work directories a killed caller left."""

from __future__ import annotations

import codecs
import contextlib
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from netem.sandbox.cache import UmlKernel
from netem.sandbox.errors import GuestTimeout, SandboxError
from netem.sandbox.guest import (
    DEFAULT_MEM,
    GUEST_PATH,
    GUEST_TOOLS,
    ConsoleSplitter,
    Disk,
    init_script,
    kernel_command_line,
    modprobe_helper_script,
)

# Exit code of `run` when the guest stopped without reporting one (crash, panic, OOM).
GUEST_DIED = 125
DEFAULT_TIMEOUT = 1800.0  # seconds a guest may run


@dataclass(frozen=True)
class GuestResult:
    """What a guest's job returned and printed (boot chatter and the power-off excluded)."""

    returncode: int
    output: str


def need_tools(step: str, tools: Mapping[str, str], path: str | None = None) -> None:
    """Fail with the Debian packages to install when a tool (name -> package) is not on `path`
    (default: this process's PATH)."""
    missing = {t: p for t, p in tools.items() if shutil.which(t, path=path) is None}
    if missing:
        names = ", ".join(missing)
        packages = " ".join(sorted(set(missing.values())))
        raise SandboxError(
            f"{step}: {names} not found. Install them (`apt-get install {packages}`; "
            "in this repository, scripts/bootstrap.sh installs everything)."
        )


def run(
    argv: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    mem: str = DEFAULT_MEM,
    stream: bool = True,
    kernel: UmlKernel | None = None,
    disks: Sequence[Disk] = (),
) -> GuestResult:
    """Run `argv` as root in a fresh UML guest and return its exit code and output.

    `env` defaults to this process's environment; the guest adds TESTBED_IN_GUEST=1. With
    `stream`, output is written to stdout as it arrives. `disks` are image files the guest
    sees as block devices (`disk_device(i)`: /dev/ubdb, ...), written through to the files
    (or their copy-on-write files): the job must unmount what it mounted from them before it
    ends (the guest powers off at once). The guest is killed (whole process group) and its
    files removed on timeout (`GuestTimeout`), Ctrl-C, and normal exit.
    """
    if kernel is None:
        from netem.sandbox.fetch import prepare  # not at the top: it verifies through run

        kernel = prepare()
    need_tools("booting the guest", GUEST_TOOLS, GUEST_PATH)
    need_tools("booting the guest", {"setpriv": "util-linux"})
    _raise_map_count()
    token = secrets.token_hex(4)
    umid = f"tb-{os.getpid()}-{token}"
    workdir = Path(tempfile.mkdtemp(prefix="tb-uml-"))
    try:
        return _boot(argv, cwd, env, timeout, mem, stream, kernel, token, umid, workdir,
                     disks)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _boot(
    argv: Sequence[str],
    cwd: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None,
    timeout: float,
    mem: str,
    stream: bool,
    kernel: UmlKernel,
    token: str,
    umid: str,
    workdir: Path,
    disks: Sequence[Disk] = (),
) -> GuestResult:
    guest_env = dict(os.environ if env is None else env, TESTBED_IN_GUEST="1")
    init, helper, rc_file = workdir / "init", workdir / "modprobe", workdir / "rc"
    helper.write_text(modprobe_helper_script(kernel.module_root))
    init.write_text(init_script(
        argv=argv, cwd=os.fspath(cwd or os.getcwd()), env=guest_env,
        module_root=kernel.module_root, modprobe_helper=helper, rc_file=rc_file, token=token,
        tty=stream and sys.stdout.isatty(),
    ))
    for script in (init, helper):
        script.chmod(0o700)
    (workdir / "uml").mkdir()
    command = [
        # If this process dies without cleaning up (SIGKILL), the kernel kills the guest too.
        "setpriv", "--pdeathsig", "KILL", "--",
        str(kernel.binary),
        *kernel_command_line(init=init, uml_dir=workdir / "uml", umid=umid, mem=mem,
                             disks=disks),
    ]
    host_env = dict(os.environ)
    if os.access("/dev/shm", os.W_OK):  # UML maps guest memory from a file in TMPDIR
        host_env["TMPDIR"] = "/dev/shm"
    console = ConsoleSplitter(token)
    shown = bytearray()
    show = _Shower(stream)
    proc = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=host_env, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        for chunk in _read_until_eof(proc, deadline):
            part = console.feed(chunk)
            shown += part
            show(part)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        tail = console.finish()
        shown += tail
        show(tail)
        show.close()
        if proc.poll() is None:
            _kill_group(proc)
            raise GuestTimeout(
                f"the guest {umid} ran longer than {timeout:g} s and was killed",
                output=shown.decode(errors="replace"), umid=umid, workdir=workdir,
            )
    finally:
        _kill_group(proc)
        proc.stdout.close()
    output = shown.decode(errors="replace")
    try:
        return GuestResult(int(rc_file.read_text()), output)
    except (OSError, ValueError):
        console_text = console.raw.decode(errors="replace").strip()
        message = (
            f"sandbox: the guest stopped (UML exit {proc.returncode}) without reporting "
            "the job's exit code: it crashed, panicked, powered off or ran out of memory "
            f"(mem={mem}). Its console:\n{console_text}\n"
        )
        if stream:
            print(message, file=sys.stderr, flush=True)
        return GuestResult(GUEST_DIED, output + message)


def _read_until_eof(proc: subprocess.Popen[bytes], deadline: float) -> Iterator[bytes]:
    """Console chunks until EOF or the deadline. EOF comes when UML and all its processes exit;
    if UML is gone but a straggler holds the pipe, the group is killed to end it."""
    fd = proc.stdout.fileno()
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            if proc.poll() is not None:
                _kill_group(proc)
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        yield chunk


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class _Shower:
    """Writes console bytes to stdout as text, keeping multi-byte characters split across
    chunks intact."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, data: bytes) -> None:
        if self.enabled and data:
            sys.stdout.write(self.decoder.decode(data))
            sys.stdout.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stdout.write(self.decoder.decode(b"", final=True))
            sys.stdout.flush()


def remove_stale_workdirs() -> list[Path]:
    """Delete guest work directories whose guest is gone (left when the caller was SIGKILLed)."""
    tmp = Path(tempfile.gettempdir())
    candidates = sorted(tmp.glob("tb-uml-*"))
    if not candidates:
        return []
    running = b"\0".join(
        _read_bytes(cmdline) for cmdline in Path("/proc").glob("[0-9]*/cmdline")
    )
    stale = [path for path in candidates if os.fsencode(path) not in running]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended while we looked
        return b""


MAP_COUNT = 262_144  # memory mappings a process may have, at least, while a guest runs
MAP_COUNT_FILE = Path("/proc/sys/vm/max_map_count")


def _raise_map_count() -> None:
    """UML maps its guest's memory page by page into its own host process: a guest running
    containers (`testbed compose --up`) went past the host's default 65,530 mappings and died
    ("UML ran out of memory on the host side"). Raise the host's limit where it is lower and
    this process may (root); elsewhere leave it."""
    try:
        if int(MAP_COUNT_FILE.read_text()) < MAP_COUNT:
            MAP_COUNT_FILE.write_text(f"{MAP_COUNT}\n")
    except (OSError, ValueError):
        pass
