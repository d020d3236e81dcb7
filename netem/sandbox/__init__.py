"""A User-Mode Linux guest that has sch_netem, for hosts whose kernel lacks it.

UML is a Linux kernel that runs as an ordinary process. The guest's root file system is the
host's own (hostfs), so the host's Python, venv and files are all there; the guest has its own
network stack, module set and mounts (/proc, /sys, /run, /dev), so namespaces and qdiscs made
inside touch nothing on the host.

`prepare` fetches Debian's user-mode-linux package (sid; the bookworm and trixie builds panic at
boot on these CPUs) with a glibc new enough for it (trixie), patches the binary to use that glibc,
verifies that the kernel boots and can add a netem qdisc, and caches the result outside the
repository. `run` boots a guest per command. The packages come from the Debian mirror the host's
own apt uses (`netem.sandbox.mirror`). `python -m netem.sandbox` is the command line
(`netem.sandbox.cli`).

The modules: `versions` (which packages), `cache` (the stamp that says a cache is complete),
`fetch` (`prepare`), `guest` (what a guest is given and what it prints, pure), `boot` (`run`),
`errors`. The names below are the ones callers use.
"""

from netem.sandbox.boot import (
    DEFAULT_TIMEOUT,
    GUEST_DIED,
    GuestResult,
    remove_stale_workdirs,
    run,
)
from netem.sandbox.cache import (
    UmlKernel,
    cached_kernel,
    default_cache_dir,
    describe,
    read_stamp,
    write_stamp,
)
from netem.sandbox.errors import GuestTimeout, SandboxError
from netem.sandbox.fetch import prepare
from netem.sandbox.guest import (
    DEFAULT_MEM,
    REQUIRED_MODULES,
    ConsoleSplitter,
    Disk,
    disk_device,
    guest_markers,
    init_script,
    kernel_command_line,
    modprobe_helper_script,
)
from netem.sandbox.versions import (
    PINNED_LIBC,
    PINNED_UML,
    choose_libc,
    choose_uml,
    libc_minimum,
    parse_madison,
)

__all__ = [
    "DEFAULT_MEM",
    "DEFAULT_TIMEOUT",
    "GUEST_DIED",
    "PINNED_LIBC",
    "PINNED_UML",
    "REQUIRED_MODULES",
    "ConsoleSplitter",
    "Disk",
    "GuestResult",
    "GuestTimeout",
    "SandboxError",
    "UmlKernel",
    "cached_kernel",
    "choose_libc",
    "choose_uml",
    "default_cache_dir",
    "describe",
    "disk_device",
    "guest_markers",
    "init_script",
    "kernel_command_line",
    "libc_minimum",
    "modprobe_helper_script",
    "parse_madison",
    "prepare",
    "read_stamp",
    "remove_stale_workdirs",
    "run",
    "write_stamp",
]
