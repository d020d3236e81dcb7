"""Real User-Mode Linux guests: exit codes, output, environment, netem inside, and cleanup.

Each test boots at least one guest (about 1.5 s). The first one prepares the cache if needed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from netem import sandbox
from testbed.cli import app

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(
        os.environ.get("TESTBED_IN_GUEST") == "1", reason="guests are booted from the host only"
    ),
]
REPO = Path(__file__).resolve().parents[2]


def test_exit_code_and_output_come_back():
    result = sandbox.run(
        [sys.executable, "-c", "print('hello from the guest'); raise SystemExit(3)"],
        stream=False,
    )
    assert result.returncode == 3
    assert result.output == "hello from the guest\n"


def test_the_guest_kernel_has_netem():
    probe = (
        "import os\n"
        "from netem.capabilities import netem_available\n"
        "print('in guest:', os.environ['TESTBED_IN_GUEST'], 'netem:', netem_available())\n"
    )
    result = sandbox.run([sys.executable, "-c", probe], cwd=REPO, stream=False)
    assert result.returncode == 0, result.output
    assert result.output == "in guest: 1 netem: True\n"


def test_the_job_gets_exactly_its_environment_and_directory_and_shares_tmp(tmp_path):
    script = 'pwd; echo "$ONLY"; echo "${HOME-no home}"; echo written >result'
    result = sandbox.run(
        ["sh", "-c", script],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "ONLY": "this one"},
        stream=False,
    )
    assert result.returncode == 0, result.output
    assert result.output.splitlines() == [str(tmp_path), "this one", "no home"]
    assert (tmp_path / "result").read_text() == "written\n"


def test_output_streams_to_stdout(capfd):
    result = sandbox.run(["sh", "-c", "echo one; echo two >&2"], stream=True)
    out, _ = capfd.readouterr()
    assert out == "one\ntwo\n" == result.output


def test_a_guest_that_dies_without_an_exit_code_is_a_failure_with_a_reason():
    result = sandbox.run(["sh", "-c", "echo o >/proc/sysrq-trigger; sleep 60"], stream=False)
    assert result.returncode == sandbox.GUEST_DIED
    assert "without reporting the job's exit code" in result.output


def test_timeout_kills_the_guest_and_removes_its_files():
    with pytest.raises(sandbox.GuestTimeout) as caught:
        sandbox.run(["sh", "-c", "echo started; sleep 600"], timeout=5, stream=False)
    assert caught.value.output == "started\n"
    assert not caught.value.workdir.exists()
    assert _processes_with(f"umid={caught.value.umid}") == []


def test_every_guest_gets_its_own_files_and_they_are_removed():
    seen = [
        sandbox.run(["sh", "-c", "cat /proc/sys/kernel/modprobe"], stream=False).output.strip()
        for _ in range(2)
    ]
    workdirs = [Path(helper).parent for helper in seen]
    assert workdirs[0] != workdirs[1]
    assert not any(w.exists() for w in workdirs)


def test_cli_run_propagates_the_exit_code():
    result = CliRunner().invoke(app, ["sandbox", "run", "--", "sh", "-c", "echo hi; exit 7"])
    assert result.exit_code == 7, result.output
    assert "hi\n" in result.output


def test_the_standalone_entry_point_runs_a_guest():
    result = subprocess.run(
        [sys.executable, "-m", "netem.sandbox", "run", "--", "sh", "-c", "echo hi; exit 7"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 7, result.stdout + result.stderr
    assert result.stdout == "hi\n"


def test_cli_reports_a_bad_argument_and_restores_the_sigterm_handler():
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(app, ["sandbox", "run", "--mem", "2X", "--", "true"])
    assert result.exit_code == 2
    assert "mem: expected a size" in result.output
    assert signal.getsignal(signal.SIGTERM) is before


def test_cli_pytest_runs_where_netem_is(tmp_path):
    (tmp_path / "test_here.py").write_text(
        "from netem.capabilities import netem_available\n\n"
        "def test_netem():\n"
        "    assert netem_available()\n"
    )
    cli = [sys.executable, "-c", "from testbed.cli import app; app()"]
    result = subprocess.run(
        [*cli, "sandbox", "pytest", "-q", "-p", "no:cacheprovider", "test_here.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert len([line for line in result.stderr.splitlines() if "running pytest" in line]) == 1


def _processes_with(needle: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
