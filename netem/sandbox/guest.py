"""What a guest is given and what it prints, as pure functions: its kernel command line, its
init script (PID 1: mounts, modules, the job, its exit code, power-off), its disks, and the
console split into the job's output and the boot's noise."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What the guest's init runs (from the host's file system), by Debian package.
GUEST_TOOLS = {"modprobe": "kmod", "ip": "iproute2", "tc": "iproute2", "stty": "coreutils"}
# Loaded at boot; a failure is reported on the console. `bridge` is what labs of namespaces use.
REQUIRED_MODULES = (
    "veth", "bridge", "sch_netem", "ifb", "act_mirred", "cls_u32",
    "sch_tbf", "sch_htb", "sch_prio", "sch_ingress",
)
# Loaded at boot when the kernel ships them (this one has nf_tables without the ip/inet
# families, so nft cannot shape here: netem can). Any other module loads on demand through
# the helper that `init_script` installs as the kernel's modprobe.
OPTIONAL_MODULES = ("nf_tables", "nft_numgen", "xt_statistic", "sch_fq", "tcp_bbr")
# The only line UML prints on its own at every boot (there is no block device): not news.
CONSOLE_NOISE = (b"Failed to initialize ubd device 0",)
DEFAULT_MEM = "1G"  # a guest's memory
MAX_DISKS = 7  # image files a guest takes as block devices (ubdb..ubdh)


def guest_markers(token: str) -> tuple[bytes, bytes]:
    """Lines the init script prints around the job, so the host can tell its output apart."""
    return f"@@sandbox-guest-{token}-start@@".encode(), f"@@sandbox-guest-{token}-end@@".encode()


def disk_device(index: int) -> str:
    """The guest's block device of the `index`-th disk given to `run` (0: /dev/ubdb; ubda is
    the root's place, which hostfs leaves empty)."""
    if not 0 <= index < MAX_DISKS:
        raise ValueError(f"disks: at most {MAX_DISKS}, got disk number {index}")
    return f"/dev/ubd{chr(ord('b') + index)}"


@dataclass(frozen=True)
class Disk:
    """An image file the guest sees as a block device. With `cow`, the guest's writes go to
    that copy-on-write file (UML makes it, sparse) and `image` is left as it was: throw the
    file away to forget them."""

    image: Path
    cow: Path | None = None

    def argument(self) -> str:
        """The ubd argument's value: `image`, or `cow,image`."""
        return str(self.image) if self.cow is None else f"{self.cow},{self.image}"


# How the guest kernel catches its processes' system calls: `auto` takes seccomp filters where
# the host lets UML install them (here: `import torch` in the guest 12.0 s instead of 14.8 s,
# docs/sandbox.md), else ptrace, UML's default and its only way before 6.16. Seccomp's filter
# does not wall a guest process off from the guest kernel's memory: the guest is a sandbox for
# the network, not a security boundary, and runs the host user's own code as root anyway.
SYSCALL_MODE = "auto"


def kernel_command_line(
    *, init: Path, uml_dir: Path, umid: str, mem: str = DEFAULT_MEM,
    disks: Sequence[Disk] = (),
) -> list[str]:
    """UML's arguments: the host's / as root over hostfs, the console on UML's stdout,
    `disks` as block devices (`disk_device`), and the guest's processes run under seccomp
    where the host allows it (`SYSCALL_MODE`)."""
    if not re.fullmatch(r"[1-9][0-9]*[KMG]?", mem):
        raise ValueError(f"mem: expected a size such as 512M or 1G, got {mem!r}")
    named = [("init", str(init)), ("uml_dir", str(uml_dir)), ("umid", umid)]
    for i, disk in enumerate(disks):
        named.append((f"disks[{i}].image", str(disk.image)))
        if disk.cow is not None:
            named.append((f"disks[{i}].cow", str(disk.cow)))
    for name, value in named:
        if not value or re.search(r"[\s,]", value):
            raise ValueError(f"{name}: must be non-empty without whitespace or commas, "
                             f"got {value!r}")
    return [
        f"mem={mem}", "quiet", "rootfstype=hostfs", "rootflags=/", "rw",
        "con=null", "con0=null,fd:1", f"seccomp={SYSCALL_MODE}", f"uml_dir={uml_dir}",
        f"umid={umid}", f"init={init}",
        *(f"{disk_device(i).removeprefix('/dev/')}={disk.argument()}"
          for i, disk in enumerate(disks)),
    ]


def init_script(
    *,
    argv: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    module_root: Path,
    modprobe_helper: Path,
    rc_file: Path,
    token: str,
    tty: bool = False,
) -> str:
    """The guest's PID 1: mount, load modules, run the job with exactly `env`, report its exit
    code in `rc_file`, power off. It must never exit: a dying init panics the kernel.

    The guest console is a terminal; with `tty` false the job writes into a pipe instead, as
    it would on a host whose output is captured (no colours, no progress bars).
    """
    if not argv:
        raise ValueError("argv: the guest needs a command to run")
    start, end = (m.decode() for m in guest_markers(token))
    q = shlex.quote
    assignments = " ".join(q(f"{k}={v}") for k, v in sorted(env.items()))
    job = f"(cd -- {q(cwd)} && exec env -i -- {assignments} {shlex.join(argv)}) </dev/null"
    report = f"echo $? >{q(str(rc_file))}"
    run_job = f"{job}\n{report}" if tty else f"{{ {job}\n{report}; }} 2>&1 | cat"
    required, optional = " ".join(REQUIRED_MODULES), " ".join(OPTIONAL_MODULES)
    return f"""#!/bin/sh
# Generated by netem.sandbox: PID 1 of a User-Mode Linux guest.
export PATH={GUEST_PATH}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs tmpfs /run
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/shm /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t devpts devpts /dev/pts
stty -onlcr </dev/console 2>/dev/null
echo {q(str(modprobe_helper))} >/proc/sys/kernel/modprobe
modprobe -a -q -d {q(str(module_root))} {required} ||
    echo "sandbox: could not load every module of: {required}"
modprobe -a -q -d {q(str(module_root))} {optional}
ip link set lo up
echo {start}
{run_job}
echo {end}
echo o >/proc/sysrq-trigger
while :; do sleep 1; done
"""


def modprobe_helper_script(module_root: Path) -> str:
    """What the guest kernel runs to load a module on demand (e.g. an nft expression)."""
    return f'#!/bin/sh\nexec modprobe -d {shlex.quote(str(module_root))} "$@"\n'


class ConsoleSplitter:
    """Splits the guest console into what to show (init's warnings, the job's output) and the
    rest (UML's boot noise, the power-off messages), as bytes arrive."""

    def __init__(self, token: str) -> None:
        self.start, self.end = guest_markers(token)
        self.state = "boot"
        self.pending = b""
        self.raw = bytearray()

    def feed(self, data: bytes) -> bytes:
        """Take console bytes; return those to show now. A possible marker prefix is held."""
        self.raw += data
        self.pending += data
        shown = b""
        if self.state == "boot":
            while self.state == "boot" and b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                if line.rstrip(b"\r") == self.start:
                    self.state = "job"
                elif not line.startswith(CONSOLE_NOISE):
                    shown += line + b"\n"
        if self.state == "job":
            if self.end in self.pending:
                before, _, self.pending = self.pending.partition(self.end)
                self.state = "done"
                return shown + before
            keep = _marker_prefix_length(self.pending, self.end)
            shown += self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep :]
        if self.state == "done":
            self.pending = b""
        return shown

    def finish(self) -> bytes:
        """What is still held when the console closes (only if the end marker never came)."""
        held, self.pending = self.pending, b""
        return b"" if self.state == "done" else held


def _marker_prefix_length(data: bytes, marker: bytes) -> int:
    for size in range(min(len(data), len(marker) - 1), 0, -1):
        if data.endswith(marker[:size]):
            return size
    return 0
