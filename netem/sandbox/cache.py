"""Where prepared kernels live, and the stamp: the one file that says a cache is complete.

The cache is outside the repository and shared by every checkout of one user. A kernel is
usable only while the stamp names the current pins and its files are still in place.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from netem.sandbox.versions import PINNED_LIBC, PINNED_UML

STAMP_FORMAT = 1


@dataclass(frozen=True)
class UmlKernel:
    """A prepared, verified UML kernel: the binary and the root that `modprobe -d` needs."""

    binary: Path
    module_root: Path
    kernel_version: str
    uml_package: str
    libc_package: str


def default_cache_dir() -> Path:
    """`$TESTBED_CACHE/uml`, else `~/.cache/testbed/uml`: outside the repository, shared by
    every checkout of one user."""
    root = os.environ.get("TESTBED_CACHE") or Path.home() / ".cache" / "testbed"
    return Path(root) / "uml"


def kernel_dir_name(uml: str, libc: str) -> str:
    """The directory, under the cache, of the kernel built from these two packages."""
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", f"kernel-{uml}_{libc}")


def kernel_from(kernel_dir: Path, kernel_version: str, uml: str, libc: str) -> UmlKernel:
    """The kernel whose files `prepare` laid out in `kernel_dir`."""
    return UmlKernel(
        binary=kernel_dir / "root" / "usr" / "bin" / "linux.uml",
        module_root=kernel_dir / "modroot",
        kernel_version=kernel_version,
        uml_package=uml,
        libc_package=libc,
    )


def write_stamp(cache_dir: Path, kernel: UmlKernel) -> None:
    """Record a verified kernel. Written last, atomically: its presence means complete."""
    stamp = {
        "format": STAMP_FORMAT,
        "pin": [PINNED_UML, PINNED_LIBC],
        "user_mode_linux": kernel.uml_package,
        "libc6": kernel.libc_package,
        "kernel_version": kernel.kernel_version,
        "kernel_dir": str(kernel.module_root.parent),
    }
    partial = cache_dir / "stamp.json.partial"
    partial.write_text(json.dumps(stamp, indent=2) + "\n")
    partial.replace(cache_dir / "stamp.json")


def read_stamp(cache_dir: Path) -> UmlKernel | None:
    """The cached kernel if the stamp is current and its files are still there, else None.

    A stamp from other pins, or from a cache that was moved (the binary's interpreter is an
    absolute path), does not count.
    """
    try:
        stamp = json.loads((cache_dir / "stamp.json").read_text())
        if stamp["format"] != STAMP_FORMAT or stamp["pin"] != [PINNED_UML, PINNED_LIBC]:
            return None
        kernel_dir = Path(stamp["kernel_dir"])
        kernel = kernel_from(
            kernel_dir, stamp["kernel_version"], stamp["user_mode_linux"], stamp["libc6"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if kernel_dir.parent != cache_dir.resolve():
        return None
    modules = kernel.module_root / "lib" / "modules" / kernel.kernel_version
    if not (os.access(kernel.binary, os.X_OK) and (modules / "modules.dep").is_file()):
        return None
    return kernel


def cached_kernel(cache_dir: Path | None = None) -> UmlKernel | None:
    """The prepared kernel, without preparing anything (no network, no lock)."""
    return read_stamp(cache_dir or default_cache_dir())


def describe(kernel: UmlKernel) -> str:
    """One line for humans: which kernel, from which packages, where."""
    return (
        f"UML kernel {kernel.kernel_version} (user-mode-linux {kernel.uml_package}, "
        f"libc6 {kernel.libc_package}) at {kernel.binary}"
    )
