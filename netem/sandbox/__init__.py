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
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import json
import os
import platform
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from netem.sandbox.mirror import apt_mirror

# What was verified to work here; `prepare` falls back to the newest when the mirror drops them.
PINNED_UML = "7.2um1"
PINNED_LIBC = "2.41-12+deb13u4"
SUITES = ("sid", "trixie")  # fetched from the host's mirror (`apt_mirror`)
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
STAMP_FORMAT = 1

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
# Exit code of `run` when the guest stopped without reporting one (crash, panic, OOM).
GUEST_DIED = 125
DEFAULT_MEM = "1G"  # a guest's memory
MAX_DISKS = 7  # image files a guest takes as block devices (ubdb..ubdh)
DEFAULT_TIMEOUT = 1800.0  # seconds a guest may run


class SandboxError(RuntimeError):
    """A step of preparing or running the guest failed; the message says which and what to do."""


class GuestTimeout(SandboxError):
    """The guest ran past its timeout and was killed."""

    def __init__(self, message: str, *, output: str, umid: str, workdir: Path) -> None:
        super().__init__(message)
        self.output = output
        self.umid = umid
        self.workdir = workdir


@dataclass(frozen=True)
class UmlKernel:
    """A prepared, verified UML kernel: the binary and the root that `modprobe -d` needs."""

    binary: Path
    module_root: Path
    kernel_version: str
    uml_package: str
    libc_package: str


@dataclass(frozen=True)
class GuestResult:
    """What a guest's job returned and printed (boot chatter and the power-off excluded)."""

    returncode: int
    output: str


def default_cache_dir() -> Path:
    """`$TESTBED_CACHE/uml`, else `~/.cache/testbed/uml`: outside the repository, shared by
    every checkout of one user."""
    root = os.environ.get("TESTBED_CACHE") or Path.home() / ".cache" / "testbed"
    return Path(root) / "uml"


# ---------------------------------------------------------------------------------------------
# The cache stamp: the one file that says a cache is complete.


def _kernel_dir_name(uml: str, libc: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", f"kernel-{uml}_{libc}")


def _kernel_from(kernel_dir: Path, kernel_version: str, uml: str, libc: str) -> UmlKernel:
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
        kernel = _kernel_from(
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


# ---------------------------------------------------------------------------------------------
# Choosing versions. sid moves: use the pins while the mirror has them, else the newest.


def version_ge(a: str, b: str) -> bool:
    """Debian version order, as dpkg defines it."""
    return subprocess.run(["dpkg", "--compare-versions", a, "ge", b]).returncode == 0


def _newest(versions: Sequence[str]) -> str:
    newest = versions[0]
    for version in versions[1:]:
        if not version_ge(newest, version):
            newest = version
    return newest


def choose_uml(available: Sequence[str]) -> tuple[str, str | None]:
    """The user-mode-linux version to use, and a note when it is not the pinned one."""
    if not available:
        raise SandboxError(
            "choosing versions: the mirror lists no user-mode-linux package in sid"
        )
    if PINNED_UML in available:
        return PINNED_UML, None
    newest = _newest(available)
    return newest, f"user-mode-linux {PINNED_UML} is gone from the mirror; using {newest}"


def choose_libc(
    available: Sequence[tuple[str, str]], minimum: str | None
) -> tuple[str, str | None]:
    """The libc6 version (from (version, suite) pairs) to run the UML binary with, and a note
    when it is not the pinned one: the pin if listed and new enough, else the newest of trixie
    that is, else the newest of sid that is."""
    def enough(version: str) -> bool:
        return minimum is None or version_ge(version, minimum)

    if any(v == PINNED_LIBC for v, _ in available) and enough(PINNED_LIBC):
        return PINNED_LIBC, None
    for suite in SUITES[::-1]:
        fit = [v for v, s in available if s == suite and enough(v)]
        if fit:
            chosen = _newest(fit)
            return chosen, f"libc6 {PINNED_LIBC} is not usable here; using {chosen} ({suite})"
    raise SandboxError(
        f"choosing versions: no libc6 in {' or '.join(SUITES)} satisfies >= {minimum}"
    )


def parse_madison(text: str) -> list[tuple[str, str]]:
    """(version, suite) pairs from `apt-cache madison` output."""
    pairs = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 3 and fields[2]:
            pairs.append((fields[1], fields[2].split()[1].split("/")[0]))
    return pairs


def libc_minimum(control: str) -> str | None:
    """The `libc6 (>= X)` bound from a package's control fields, if any."""
    found = re.search(r"^(?:Pre-)?Depends:.*?\blibc6 \(>= ([^)]+)\)", control, re.MULTILINE)
    return found.group(1) if found else None


# ---------------------------------------------------------------------------------------------
# prepare


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"sandbox: {message}", file=sys.stderr, flush=True)


def _need_tools(step: str, tools: Mapping[str, str], path: str | None = None) -> None:
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
    _need_tools("preparing the UML kernel", {
        "apt-get": "apt", "apt-cache": "apt", "dpkg-deb": "dpkg", "dpkg": "dpkg",
        "patchelf": "patchelf",
    })
    _need_tools("preparing the UML kernel (tools the guest uses)", GUEST_TOOLS, GUEST_PATH)
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
    kernel_dir = cache_dir / _kernel_dir_name(uml, libc)
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
    kernel = _kernel_from(kernel_dir, kernel_version, uml, libc)

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


# ---------------------------------------------------------------------------------------------
# run: the pure parts first.


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


def kernel_command_line(
    *, init: Path, uml_dir: Path, umid: str, mem: str = DEFAULT_MEM,
    disks: Sequence[Disk] = (),
) -> list[str]:
    """UML's arguments: the host's / as root over hostfs, the console on UML's stdout, and
    `disks` as block devices (`disk_device`)."""
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
        "con=null", "con0=null,fd:1", f"uml_dir={uml_dir}", f"umid={umid}", f"init={init}",
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


# ---------------------------------------------------------------------------------------------
# run: booting.


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
    kernel = kernel or prepare()
    _need_tools("booting the guest", GUEST_TOOLS, GUEST_PATH)
    _need_tools("booting the guest", {"setpriv": "util-linux"})
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


def describe(kernel: UmlKernel) -> str:
    """One line for humans: which kernel, from which packages, where."""
    return (
        f"UML kernel {kernel.kernel_version} (user-mode-linux {kernel.uml_package}, "
        f"libc6 {kernel.libc_package}) at {kernel.binary}"
    )



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
