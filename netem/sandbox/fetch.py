"""`prepare`: the UML kernel fetched from the host's Debian mirror, patched to run with the
glibc fetched beside it, verified by booting a guest that adds a netem qdisc, and stamped in
the cache; once, then instant."""

from __future__ import annotations

import contextlib
import fcntl
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from netem.sandbox.boot import need_tools, run
from netem.sandbox.cache import (
    UmlKernel,
    default_cache_dir,
    kernel_dir_name,
    kernel_from,
    read_stamp,
    write_stamp,
)
from netem.sandbox.errors import SandboxError
from netem.sandbox.guest import GUEST_PATH, GUEST_TOOLS
from netem.sandbox.mirror import apt_mirror
from netem.sandbox.versions import SUITES, choose_libc, choose_uml, libc_minimum, parse_madison

KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"sandbox: {message}", file=sys.stderr, flush=True)


def _check(step: str, argv: Sequence[str], **kwargs) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-8:])
        raise SandboxError(f"{step}: `{shlex.join(argv)}` failed ({result.returncode}):\n{tail}")
    return result.stdout


@contextlib.contextmanager
def _locked(cache_dir: Path, quiet: bool) -> Iterator[None]:
    with open(cache_dir / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(quiet, f"waiting for another prepare of {cache_dir}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def prepare(cache_dir: Path | None = None, quiet: bool = False) -> UmlKernel:
    """The verified UML kernel, fetching and verifying it first if the cache lacks it.

    Warm (stamp present): returns at once, without network. Cold: about 40 MB from the host's
    Debian mirror. Concurrent calls wait for each other on a lock file in the cache.
    """
    cache_dir = (cache_dir or default_cache_dir()).resolve()
    kernel = read_stamp(cache_dir)
    if kernel is not None:
        return kernel
    if platform.machine() != "x86_64":
        raise SandboxError(
            f"preparing the UML kernel: Debian ships user-mode-linux for x86_64 (amd64) only, "
            f"this machine is {platform.machine()}"
        )
    need_tools("preparing the UML kernel", {
        "apt-get": "apt", "apt-cache": "apt", "dpkg-deb": "dpkg", "dpkg": "dpkg",
        "patchelf": "patchelf",
    })
    need_tools("preparing the UML kernel (tools the guest uses)", GUEST_TOOLS, GUEST_PATH)
    if not KEYRING.is_file():
        raise SandboxError(
            f"preparing the UML kernel: {KEYRING} is missing "
            "(apt-get install debian-archive-keyring)"
        )
    try:
        mirror = apt_mirror()
    except LookupError as exc:
        raise SandboxError(f"preparing the UML kernel: {exc}") from None
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir, quiet):
        kernel = read_stamp(cache_dir)  # another prepare may have finished while we waited
        if kernel is None:
            kernel = _build(cache_dir, quiet, mirror)
    return kernel


def _build(cache_dir: Path, quiet: bool, mirror: str) -> UmlKernel:
    started = time.monotonic()
    (cache_dir / "stamp.json").unlink(missing_ok=True)
    work = cache_dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    (work / "lists" / "partial").mkdir(parents=True)
    (work / "archives" / "partial").mkdir(parents=True)
    sources = work / "sources.list"
    sources.write_text("".join(
        f"deb [signed-by={KEYRING}] {mirror} {suite} main\n" for suite in SUITES
    ))
    apt_options = [
        f"-oDir::Etc::SourceList={sources}", "-oDir::Etc::SourceParts=/dev/null",
        "-oDir::Etc::Preferences=/dev/null", "-oDir::Etc::PreferencesParts=/dev/null",
        f"-oDir::State::Lists={work / 'lists'}", f"-oDir::Cache={work}",
        f"-oDir::Cache::Archives={work / 'archives'}", "-oDir::State::Status=/dev/null",
        "-oAcquire::Languages=none", "-oAPT::Architecture=amd64", "-oAPT::Sandbox::User=root",
    ]

    _say(quiet, f"updating a private package list ({', '.join(SUITES)}) from {mirror}")
    _check(
        f"apt-get update (is {mirror} reachable?)", ["apt-get", *apt_options, "-qq", "update"]
    )

    def apt_cache(*args: str) -> str:
        return _check("choosing versions", ["apt-cache", *apt_options, *args])

    sid_umls = [v for v, s in parse_madison(apt_cache("madison", "user-mode-linux")) if s == "sid"]
    uml, uml_note = choose_uml(sid_umls)
    control = apt_cache("show", f"user-mode-linux={uml}")
    libc, libc_note = choose_libc(
        parse_madison(apt_cache("madison", "libc6")), libc_minimum(control)
    )
    for note in (uml_note, libc_note):
        if note:
            print(f"sandbox: {note}", file=sys.stderr, flush=True)

    _say(quiet, f"downloading user-mode-linux {uml} and libc6 {libc}")
    debs = work / "debs"
    debs.mkdir()
    _check(
        "apt-get download",
        ["apt-get", *apt_options, "-qq", "download", f"user-mode-linux={uml}", f"libc6={libc}"],
        cwd=debs,
    )
    kernel_dir = cache_dir / kernel_dir_name(uml, libc)
    shutil.rmtree(kernel_dir, ignore_errors=True)
    root = kernel_dir / "root"
    root.mkdir(parents=True)
    _say(quiet, f"extracting into {kernel_dir}")
    for deb in sorted(debs.glob("*.deb")):
        _check("extracting a package", ["dpkg-deb", "-x", str(deb), str(root)])
    libdir = root / "usr" / "lib" / "x86_64-linux-gnu"
    binary = root / "usr" / "bin" / "linux.uml"
    _check("patching linux.uml to use the downloaded glibc", [
        "patchelf", "--set-interpreter", str(libdir / "ld-linux-x86-64.so.2"),
        "--set-rpath", str(libdir), str(binary),
    ])
    versions = sorted(p.name for p in (root / "usr" / "lib" / "uml" / "modules").iterdir())
    if len(versions) != 1:
        raise SandboxError(f"extracting: expected one kernel module tree, found {versions}")
    (kernel_version,) = versions
    modules = kernel_dir / "modroot" / "lib" / "modules"
    modules.mkdir(parents=True)
    (modules / kernel_version).symlink_to(
        Path("..", "..", "..", "root", "usr", "lib", "uml", "modules", kernel_version)
    )
    kernel = kernel_from(kernel_dir, kernel_version, uml, libc)

    _say(quiet, "verification boot: adding a netem qdisc inside the guest")
    check = run(
        ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
        kernel=kernel, cwd="/", timeout=300, stream=False,
    )
    if check.returncode != 0:
        raise SandboxError(
            f"verification boot: the guest could not add a netem qdisc "
            f"(exit {check.returncode}); its output:\n{check.output.strip()}\n"
            "The cache was left incomplete; `python -m netem.sandbox prepare` retries."
        )
    write_stamp(cache_dir, kernel)
    shutil.rmtree(work)
    for old in cache_dir.glob("kernel-*"):
        if old != kernel_dir:
            shutil.rmtree(old, ignore_errors=True)
    _say(quiet, f"ready: UML kernel {kernel_version} in {time.monotonic() - started:.0f} s")
    return kernel

