"""A command of the user's own as a worker's job (scenario `job: {command: [...]}`).

The worker process (`testbed worker` in a namespace run, `testbed node` in a container) runs the
command as its child, in a process group of its own, with the torch.distributed environment a
script written for torchrun expects, and supervises it:

- the network and the timeline act on it as on a training job (the links are shaped where the
  wire is; a `kill` ends the worker and its command at once, a `restart` runs the command again
  with the same rank); a straggler burst pauses the command (SIGSTOP) for its duration and
  resumes it (SIGCONT), as container chaos tools do;
- the worker's own /metrics export the network (link profiles, the namespace's TCP and UDP
  counters); the command's own metrics port, if the scenario names one, is scraped too;
- its stdout and stderr go to `logs/worker-N.stdout` and `.stderr` in the run directory (a
  restart appends); its start and exit (code, seconds) are events of the run, and an exit other
  than 0 fails the worker, with the last lines of its stderr in the worker's log.

The environment (docs/your-code.md): RANK, WORLD_SIZE, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
MASTER_ADDR (worker 0's address on the scenario's network), MASTER_PORT, GLOO_SOCKET_IFNAME (the
interface on that network), and TESTBED_RANK, TESTBED_ADDRESSES (every worker's address, by
rank), TESTBED_RUN_DIR, TESTBED_SCENARIO, TESTBED_WORKER_SPEC (the worker's spec as JSON: what
`testbed.ddp` reads to place the scenario's collective), TESTBED_METRICS_PORT (if the scenario
names the command's metrics port), TESTBED_RESTARTED=1 for a worker the timeline restarted;
with `job.gpus`, CUDA_VISIBLE_DEVICES (the worker's GPUs, by nvidia-smi's indexes:
CUDA_DEVICE_ORDER=PCI_BUS_ID; not in a container whose GPUs were reserved for it, which sees
those only); with NCCL (`job.nccl`, by default with `job.gpus`), NCCL_SOCKET_IFNAME (the
interface on the scenario's network) and NCCL_SOCKETS_ONLY, so that NCCL's traffic crosses
the shaped links rather than NVLink, PCIe or shared memory; then the scenario's `job.env`.
`python` is the interpreter that runs the testbed: its directory comes first on PATH.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from netem.namespace import interface_with
from testbed.scenario.job_files import command_path

POLL = 0.1  # seconds between looks at the control file while the command runs
STOP_GRACE = 5.0  # seconds the command gets to end after SIGTERM before SIGKILL
TAIL_LINES = 10  # lines of the command's stderr shown when it fails
# In a worker's environment: its container's GPUs were reserved for it (Compose), so the GPUs
# it sees are its own, numbered from 0.
GPUS_RESERVED = "TESTBED_GPUS_RESERVED"
# NCCL's transports that bypass the network between workers on one host: peer-to-peer (NVLink,
# PCIe), shared memory, InfiniBand, NVLink SHARP; off, NCCL talks over sockets.
NCCL_SOCKETS_ONLY = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                     "NCCL_NVLS_ENABLE": "0"}


def environment(spec: Any, job: Any, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The command's environment: `base` (default: this process's), the torch.distributed
    variables, the testbed's, then the scenario's `job.env`."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = command_path(env.get("PATH"))
    env.update({
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(spec.world),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": spec.hosts[0],
        "MASTER_PORT": str(job.master_port),
        "TESTBED_RANK": str(spec.rank),
        "TESTBED_ADDRESSES": ",".join(spec.hosts),
        "TESTBED_RUN_DIR": str(spec.run_dir),
        "TESTBED_SCENARIO": str(spec.scenario),
        "TESTBED_WORKER_SPEC": spec.to_json(),
    })
    if spec.rejoin:
        env["TESTBED_RESTARTED"] = "1"
    iface = interface_with(spec.hosts[spec.rank])
    if iface is not None:  # gloo otherwise picks whatever the host name resolves to
        env["GLOO_SOCKET_IFNAME"] = iface
    devices = job.worker_gpus(spec.rank)
    if devices is not None and env.get(GPUS_RESERVED) != "1":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the indexes nvidia-smi and Docker use
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    if job.uses_nccl:
        env.update(NCCL_SOCKETS_ONLY)
        if iface is not None:  # "=": this interface, not every one its name begins
            env["NCCL_SOCKET_IFNAME"] = f"={iface}"
    if job.metrics_port is not None:
        env["TESTBED_METRICS_PORT"] = str(job.metrics_port)
    env.update(job.env)
    return env


def working_directory(job: Any, spec: Any) -> Path:
    """Where the command runs: `job.cwd` relative to the scenario's own directory."""
    base = Path(spec.base_dir) if spec.base_dir else Path(spec.scenario).resolve().parent
    return base / job.cwd if job.cwd else base


class Command:
    """The user's command, run and supervised by one worker: see the module's docstring.
    `say(**fields)` reports to the runner, `event(type, **fields)` writes the run's events."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], logs: Path,
                 rank: int) -> None:
        self.argv, self.cwd, self.env, self.rank = argv, cwd, env, rank
        self.stdout_path = logs / f"worker-{rank}.stdout"
        self.stderr_path = logs / f"worker-{rank}.stderr"
        self.process: subprocess.Popen[bytes] | None = None
        self._paused = False

    def start(self) -> int:
        """Start the command (in a process group of its own); returns its pid."""
        if not self.cwd.is_dir():
            raise FileNotFoundError(f"job.cwd: {self.cwd} is not a directory")
        self.stdout_path.parent.mkdir(parents=True, exist_ok=True)
        with self.stdout_path.open("ab") as out, self.stderr_path.open("ab") as err:
            try:
                self.process = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env,
                                                stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                                process_group=0)
            except OSError as error:
                raise FileNotFoundError(f"job.command: cannot run {self.argv[0]!r} in "
                                        f"{self.cwd}: {error.strerror or error}") from None
        return self.process.pid

    def wait(self, paused_until: Callable[[], float | None]) -> int:
        """Until the command ends, pause and resume it as `paused_until()` (a wall-clock time,
        or None) says; returns its exit code (a signal's as 128 + its number)."""
        assert self.process is not None
        while True:
            try:
                code = self.process.wait(timeout=POLL)
                break
            except subprocess.TimeoutExpired:
                until = paused_until()
                pause = until is not None and time.time() < until
                if pause != self._paused:
                    self._signal(signal.SIGSTOP if pause else signal.SIGCONT)
                    self._paused = pause
        return code if code >= 0 else 128 - code

    def stop(self) -> None:
        """End the command if it still runs: SIGTERM (resumed first), SIGKILL after a grace."""
        if self.process is None or self.process.poll() is not None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait()

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        """The last lines the command wrote to its stderr."""
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return []
        return text.rstrip("\n").splitlines()[-lines:]

    def _signal(self, signum: int) -> None:
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)


def run_command(spec: Any, scenario: Any, *, say: Callable[..., None], writer: Any, control: Any,
                on_start: Callable[[], None], stderr: IO[str] = sys.stderr) -> int:
    """Worker `spec.rank`'s command job from start to exit; returns 0 if the command exited
    0, else 1 (its stderr's last lines go to `stderr`, the worker's log)."""
    job = scenario.command
    command = Command(job.command, working_directory(job, spec),
                      environment(spec, job), Path(spec.run_dir) / "logs", spec.rank)
    on_start()
    started = time.monotonic()
    try:
        pid = command.start()
        writer.event("command", rank=spec.rank, phase="start", argv=job.command, pid=pid)
        say(rank=spec.rank, ready=True, command_pid=pid)
        code = command.wait(control.paused_until)
    finally:
        command.stop()
    seconds = time.monotonic() - started
    writer.event("command", rank=spec.rank, phase="exit", code=code, seconds=seconds)
    say(rank=spec.rank, done=True, exit_code=code, seconds=seconds)
    if code == 0:
        writer.end(success=True)
        return 0
    tail = command.tail()
    print(f"worker {spec.rank}: the command exited with code {code}; the last lines of its "
          f"stderr ({command.stderr_path}):", file=stderr)
    print("\n".join(tail) or "(nothing)", file=stderr)
    writer.end(success=False, error=f"the command exited with code {code}"
               + (f": {tail[-1]}" if tail else ""))
    return 1
