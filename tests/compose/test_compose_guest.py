"""`docker compose up` with real netem where the host kernel has none: the shipped quickstart
(5 ms of delay, 1% loss on every link) through `testbed compose quickstart --up --sandbox uml`,
the one command docs/compose.md gives. Its Compose project runs in the User-Mode Linux guest on
a Docker Engine of the guest's own, whose images come on the engine disk.

Checked: every worker container shaped the links into it with netem leaves (read back from the
kernel in its namespace), link 0->1 measured on the wire (the probe's loss and delay within
their tolerances: a correct link fails one with probability about 4e-8, docs/probes.md),
Prometheus scraped every worker while the run was live under the run's own label, every worker
ended with 0 and the run succeeded, and nothing is left: no container, network or volume of the
project in the guest's engine, and on the host no engine, mount, namespace or guest of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.compose.engine import DISK_NAME

pytestmark = pytest.mark.compose
MEASURED = ("loss", "delay mean", "jitter (stdev)")


def test_the_quickstart_runs_in_the_guest_with_real_netem(docker_engine, tmp_path: Path,
                                                          measured):
    project = tmp_path / "project"
    command = subprocess.Popen(
        [sys.executable, "-m", "testbed.cli", "compose", "quickstart", "-o", str(project),
         "--up", "--sandbox", "uml", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = command.communicate(timeout=3000)
    finally:
        command.kill()
    print(stderr[-6000:])  # the guest's console: the links and what the probe measured
    assert stdout.strip(), f"no report (exit {command.returncode})"
    report = json.loads(stdout)
    assert command.returncode == 0 and report["success"], report
    assert report["where"] == "guest"

    hosts = [f"172.28.0.{10 + rank}" for rank in range(4)]
    for rank in range(4):
        shaped = report["links"][f"worker-{rank}"]
        assert shaped["backend"] == "netem" and shaped["direction"] == "ingress", shaped
        peers = {host: rule for host, rule in shaped["rules"].items() if host != "default"}
        assert set(peers) == set(hosts) - {hosts[rank]}, shaped
        assert set(peers.values()) == {"delay=5ms loss=1%"}, shaped

    checks = {check["quantity"]: check for check in report["measured"]["checks"]}
    for quantity in MEASURED:
        measured(f"link {report['measured']['link']} in the guest: {quantity}: "
                 f"{checks[quantity]['shown']}, passed {checks[quantity]['passed']}")
    for quantity in MEASURED:
        assert checks[quantity]["passed"] is True, checks[quantity]
    assert checks["delay mean"]["configured"] == pytest.approx(0.005)

    assert report["prometheus"]["workers"] == ["0", "1", "2", "3"], report["prometheus"]
    assert report["prometheus"]["runs"] == [Path(report["run_dir"]).name]
    assert {state["exit_code"] for state in report["workers"].values()} == {0}
    summary = json.loads((Path(report["run_dir"]) / "summary.json").read_text())
    assert summary["success"] is True
    assert report["left"] == {"container": [], "network": [], "volume": []}, report

    # On the host: the guest and its engine are gone, the disk is not mounted, no namespace
    # of the run's containers is named.
    mounts = Path("/proc/mounts").read_text()
    assert DISK_NAME not in mounts and "tb-disk-" not in mounts, mounts
    assert not [p for p in Path("/run").glob("tb-engine-*")], "an engine's state is left"
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tbc-" not in names, names
    # Its guest only (named after the process that booted it): other guests, such as the guest
    # tier's running beside this one, are not this run's.
    ours = f"umid=tb-{command.pid}-"
    uml = subprocess.run(["pgrep", "-af", ours], capture_output=True, text=True).stdout
    assert not uml.strip(), f"the run's guest still runs: {uml}"


KILLED = """
import os, sys, time
from pathlib import Path
from testbed.compose.engine import Engine, mounted

with mounted(Path(sys.argv[1]), loop=True) as point, Engine(point / "docker",
                                                            networking=False) as engine:
    print(engine.state, point, flush=True)
    time.sleep(600)  # SIGKILLed here, as a killed `testbed compose --up` would be
"""


def test_clean_removes_the_engine_and_the_disk_mount_of_a_killed_compose_up(docker_engine,
                                                                            tmp_path: Path):
    """A SIGKILLed `--up` leaves its private dockerd (a session of its own) and its disk
    mounted; `testbed clean` stops the one and unmounts the other, and only once their owner
    is gone."""
    import signal

    from typer.testing import CliRunner

    from testbed.cli import app

    disk = tmp_path / "disk.img"
    with disk.open("wb") as image:
        image.truncate(256 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(disk)], check=True)
    owner = subprocess.Popen([sys.executable, "-c", KILLED, str(disk)], stdout=subprocess.PIPE,
                             text=True)
    try:
        state, point = owner.stdout.readline().split()  # the engine answered: both are up
        assert point in Path("/proc/mounts").read_text()
        alive = CliRunner().invoke(app, ["clean"])  # its owner runs: a live run
        assert Path(state).is_dir() and point in Path("/proc/mounts").read_text(), alive.output
        dockerd = int((Path(state) / "dockerd.pid").read_text())
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert Path(f"/proc/{dockerd}").exists(), "dockerd went with its owner"
    cleaned = CliRunner().invoke(app, ["clean"])
    assert "removed 2 engine(s) and disk mount(s)" in cleaned.output, cleaned.output
    assert not Path(state).exists() and point not in Path("/proc/mounts").read_text()
    assert not Path(f"/proc/{dockerd}").exists() or "zombie" in Path(
        f"/proc/{dockerd}/status").read_text().lower()
