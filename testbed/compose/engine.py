"""Docker Engines of the testbed's own, and the disk that carries the images into a guest.

A Compose project needs sch_netem from the kernel its containers share. Where the host's kernel
lacks it, the project runs inside the User-Mode Linux guest (`netem.sandbox`), whose kernel has
it, with a Docker Engine started there (`Engine`: its state on a disk, `--iptables=false`, since
the guest's nf_tables has no ip family; the project's containers talk on one bridge and need no
NAT). The images travel on that disk: `image_disk` keeps an ext4 image file in the cache whose
`docker/` is an engine's data root, brings its images up to date on the host at native speed
(loop-mounted, a private engine without bridge or iptables building with
scripts/compose-images.sh), and hands it to the guest as a block device, where the engine finds
the images in place: nothing is loaded or built in the guest. One guest at a time uses the disk
(a lock beside it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from netem.lab import process_identity
from netem.lifecycle import StartsOnEnter

ENGINE_WAIT = 60.0  # seconds for a new dockerd to answer
STOP_WAIT = 30.0  # seconds for a stopped dockerd to exit before it is killed
DISK_NAME = "engine-disk.img"
DISK_SIZE = 24 << 30  # bytes; the file is sparse: it takes what the images use (about 3 GB)
IMAGES_SCRIPT = Path("scripts") / "compose-images.sh"
RUN = Path("/run")
ENGINE_PREFIX, DISK_PREFIX = "tb-engine-", "tb-disk-"  # under RUN; `remove_stale` knows them
OWNER = ".owner"  # beside a state directory or mount point: who made it (`process_identity`)


class EngineError(RuntimeError):
    """A Docker Engine of ours that could not start, or a disk that could not be made."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "testbed" / "compose"


def docker(env: Mapping[str, str], *args: str, timeout: float = 120.0,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    """The docker command line against the engine `env` names (DOCKER_HOST)."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **env})
    if check and result.returncode != 0:
        raise EngineError(f"docker {' '.join(args)}: {result.stderr.strip()[-2000:]}")
    return result


class Engine(StartsOnEnter, close="stop"):
    """A dockerd of the testbed's own: its images and containers under `data_root`, its socket,
    pid file and containerd under a fresh directory in /run; nothing shared with an engine the
    host may run. `networking` False: no default bridge, no iptables rules, IP forwarding left
    as it is (an engine that only builds or only runs containers on a network of a project's
    own touches nothing of the host's); `iptables` False keeps the bridge but writes no rules
    (the guest's case)."""

    def __init__(self, data_root: Path, *, networking: bool = True, iptables: bool = True) -> None:
        self.data_root = data_root
        self.state = _owned_directory(ENGINE_PREFIX)
        self.socket = self.state / "docker.sock"
        flags = ["--data-root", str(data_root), "--exec-root", str(self.state / "exec"),
                 "-H", f"unix://{self.socket}", "--pidfile", str(self.state / "dockerd.pid")]
        if not networking:
            flags += ["--bridge=none", "--ip-forward=false"]
        if not networking or not iptables:
            flags += ["--iptables=false", "--ip6tables=false"]
        self.argv = ["dockerd", *flags]
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """What points the docker command line (and Compose) at this engine."""
        return {"DOCKER_HOST": f"unix://{self.socket}"}

    def start(self) -> None:
        if shutil.which("dockerd") is None:
            raise EngineError("dockerd is missing: install Docker Engine (Debian: docker.io)")
        log = (self.state / "dockerd.log").open("wb")
        self._process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        log.close()
        deadline = time.monotonic() + ENGINE_WAIT
        while docker(self.env, "info", check=False, timeout=10).returncode != 0:
            if self._process.poll() is not None or time.monotonic() > deadline:
                tail = (self.state / "dockerd.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise EngineError(f"dockerd did not answer within {ENGINE_WAIT:g} s:\n{tail}")
            time.sleep(0.2)  # dockerd offers nothing to wait on but its socket

    def stop(self) -> None:
        """Stop dockerd (its containers with it) and remove its state directory, with what
        dockerd may leave mounted in it (its default network namespace, bound at
        exec/netns/default, stayed after a swarm had run)."""
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        _remove(self.state)


def mounts_under(directory: Path) -> list[str]:
    """The mount points at or below `directory`, deepest first (the order to unmount them)."""
    prefix = str(directory.resolve())
    points = [re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal[1], 8)), line.split()[1])
              for line in Path("/proc/self/mounts").read_text().splitlines()]
    return sorted((p for p in points if p == prefix or p.startswith(prefix + "/")),
                  key=len, reverse=True)


@contextlib.contextmanager
def mounted(device: Path, *, loop: bool = False) -> Iterator[Path]:
    """`device` (a block device, or with `loop` an image file) mounted on a fresh directory;
    synced and unmounted on the way out, whatever happened."""
    point = _owned_directory(DISK_PREFIX)
    try:
        options = ["-o", "loop"] if loop else []
        result = subprocess.run(["mount", "-t", "ext4", *options, str(device), str(point)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise EngineError(f"mounting {device}: {result.stderr.strip()}")
        try:
            yield point
        finally:
            subprocess.run(["sync", "-f", str(point)], capture_output=True)
            subprocess.run(["umount", str(point)], capture_output=True, check=True)
    finally:
        point.rmdir()
        _owner_file(point).unlink(missing_ok=True)


def _owner_file(directory: Path) -> Path:
    return directory.with_name(directory.name + OWNER)


def _owned_directory(prefix: str) -> Path:
    """A fresh directory under RUN, with a file beside it naming this process as its owner."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=RUN))
    _owner_file(directory).write_text(process_identity(os.getpid()))
    return directory


def remove_stale() -> list[str]:
    """What a killed `testbed compose --up` left on this host, once the process that made it is
    gone: its engines (dockerd stopped, state removed), then its mounted disks (unmounted).
    Returns what was removed."""
    removed = []
    for prefix in (ENGINE_PREFIX, DISK_PREFIX):
        for directory in sorted(RUN.glob(f"{prefix}*")):
            if not directory.is_dir():
                continue
            owner = _owner_file(directory)
            identity = owner.read_text() if owner.exists() else ""
            if identity and process_identity(int(identity.split()[0])) == identity:
                continue  # its owner still runs: a live run
            if prefix == ENGINE_PREFIX:
                _kill_engine(directory)
            _remove(directory)
            removed.append(str(directory))
    return removed


def _remove(directory: Path) -> None:
    """Unmount what is mounted at or below `directory` (dockerd leaves the host's network
    namespace bound under its exec root), then remove it and its owner file."""
    for point in mounts_under(directory):
        subprocess.run(["umount", point], capture_output=True)
    shutil.rmtree(directory, ignore_errors=True)
    _owner_file(directory).unlink(missing_ok=True)


def _kill_engine(state: Path) -> None:
    """Stop the dockerd whose pid file is in `state`, if it still runs."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((state / "dockerd.pid").read_text())
        if "dockerd" in Path(f"/proc/{pid}/cmdline").read_text():
            os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_WAIT
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.2)  # another session's process: nothing to wait on but /proc
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def image_disk(root: Path, *, say=print, cache: Path | None = None) -> Iterator[Path]:
    """The disk carrying an engine's data root with the images that the checkout at `root`
    builds, brought up to date (made the first time); held for this process while the block
    runs (a second caller waits), so one guest at a time writes to it."""
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / DISK_NAME
    with (cache / f"{DISK_NAME}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            say(f"engine disk: making {path} (sparse, ext4)")
            part = path.with_suffix(f".part-{secrets.token_hex(3)}")
            with part.open("wb") as disk:
                disk.truncate(DISK_SIZE)
            made = subprocess.run(["mkfs.ext4", "-q", "-F", str(part)], capture_output=True,
                                  text=True)
            if made.returncode != 0:
                part.unlink()
                raise EngineError(f"mkfs.ext4 {part}: {made.stderr.strip()}")
            part.rename(path)
        say("engine disk: bringing the images up to date (scripts/compose-images.sh)")
        with mounted(path, loop=True) as point, Engine(point / "docker",
                                                        networking=False) as engine:
            built = subprocess.run([str(root / IMAGES_SCRIPT)], cwd=root, capture_output=True,
                                   text=True, env={**os.environ, **engine.env})
            if built.returncode != 0:
                raise EngineError(f"{IMAGES_SCRIPT} failed:\n{built.stderr[-3000:]}")
        yield path
