"""A command of the user's own as the job (`job: {command: [...]}`), run by `ClusterRun` across
namespaces on the host kernel (the fallback's loss): every worker's program gets the
torch.distributed environment, its output and exit land in the run directory, a straggler burst
pauses it, a kill ends it and a restart runs it again, its own metrics port is relayed, a
program that fails fails the run with its stderr's last line, and Ctrl-C leaves no process."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
from live import start_run

from netem.lab import lab_namespaces
from testbed.cluster.runner import ClusterRun
from testbed.report import load_run

pytestmark = pytest.mark.netns
WORLD = 3
BURST, KILL, RESTART = 2.0, 2.0, 4.0  # seconds into the run
PAUSE = 3.0  # the burst's duration

PROGRAM = """
import json, os, sys, time
from prometheus_client import Counter, start_http_server

# The counter first: a scrape as soon as the server listens must find it (on a loaded host
# one came between the two lines).
ticks = Counter("program_ticks", "ticks of the user's program")
start_http_server(int(os.environ["TESTBED_METRICS_PORT"]))
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "GLOO_SOCKET_IFNAME", "TESTBED_RANK", "TESTBED_ADDRESSES", "TESTBED_RUN_DIR",
        "TESTBED_SCENARIO", "TESTBED_RESTARTED", "MINE")
print(json.dumps({"env": {key: os.environ.get(key) for key in keys}, "cwd": os.getcwd()}),
      flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    ticks.inc()
    print(json.dumps({"t": time.time()}), flush=True)
    time.sleep(0.05)
if os.environ["RANK"] == os.environ.get("FAIL_RANK"):
    print("the program gave up: no quorum", file=sys.stderr)
    sys.exit(3)
"""


def scenario(tmp_path: Path, *, seconds: float, timeline: str = "", env: str = "") -> Path:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "program.py").write_text(PROGRAM)
    path = tmp_path / "scenario.yaml"
    path.write_text(f"""
name: command-job
workers: {WORLD}
topology: {{default: {{loss: 2%}}, congestion: bbr}}
job:
  command: [python, program.py, "{seconds}"]
  cwd: job
  env: {{MINE: "yes"{env}}}
  metrics_port: 9200
metrics: {{linger: 30s}}
{timeline}
""")
    return path


def lines(run: Path, rank: int) -> list[dict]:
    text = (run / "logs" / f"worker-{rank}.stdout").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_a_program_runs_everywhere_with_its_environment_paused_killed_and_restarted(
        tmp_path: Path):
    timeline = f"""timeline:
  - {{at: {BURST}s, straggler_burst: {{workers: [1], delay: {{fixed: 1s}}, duration: {PAUSE}s}}}}
  - {{at: {KILL}s, kill: 2}}
  - {{at: {RESTART}s, restart: 2}}"""
    path = scenario(tmp_path, seconds=8.0, timeline=timeline)
    cluster = ClusterRun(path, run_dir=tmp_path / "run")
    scraped: dict[int, str] = {}

    def scrape(workers) -> None:  # the program's own metrics, once from each while it runs
        for w in workers:
            if w.rank in scraped or w.status != "running" or w.started is None:
                continue
            try:
                with urllib.request.urlopen(cluster.program_metrics_urls[w.rank],
                                            timeout=10) as response:
                    scraped[w.rank] = response.read().decode()
            except OSError:  # not listening yet, or being killed: the next update tries again
                pass

    result = cluster.run(scrape)
    assert result.success, result.error
    run = tmp_path / "run"
    hosts = [f"198.18.0.{rank + 1}" for rank in range(WORLD)]
    for rank in range(WORLD):
        first = lines(run, rank)[0]
        env = first["env"]
        assert env | {"TESTBED_RESTARTED": None} == {
            "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": hosts[0], "MASTER_PORT": "29400",
            "GLOO_SOCKET_IFNAME": "eth0", "TESTBED_RANK": str(rank),
            "TESTBED_ADDRESSES": ",".join(hosts), "TESTBED_RUN_DIR": str(run.resolve()),
            "TESTBED_SCENARIO": str((run / "scenario.yaml").resolve()), "MINE": "yes",
            "TESTBED_RESTARTED": None}
        assert first["cwd"] == str((tmp_path / "job").resolve())

    # The burst paused worker 1 for its duration: one gap in its ticks of about PAUSE seconds
    # (the pause starts within 0.1 s of the burst and ends when it is due; a gap of a second
    # elsewhere would need a process unscheduled for a second on an idle core).
    def gaps(rank: int) -> list[float]:
        ticks = [line["t"] for line in lines(run, rank) if "t" in line]
        return [b - a for a, b in itertools.pairwise(ticks)]

    assert max(gaps(1)) >= PAUSE - 1.0, max(gaps(1))
    assert max(gaps(0)) < 1.0, max(gaps(0))

    # Worker 2 was killed and ran its program again from the start, told it was restarted.
    starts = [line for line in lines(run, 2) if "env" in line]
    assert len(starts) == 2 and starts[1]["env"]["TESTBED_RESTARTED"] == "1"
    summary = json.loads((run / "summary.json").read_text())
    runs = {c["rank"]: c for c in summary["commands"]}
    assert runs[2]["runs"] == 2 and runs[0]["runs"] == 1
    assert {c["exit_code"] for c in summary["commands"]} == {0}
    assert runs[0]["seconds"] >= 8.0
    assert [f.action for f in load_run(run).faults] == ["straggler_burst", "kill", "restart"]

    # The program's own /metrics, relayed from each worker's namespace.
    assert sorted(scraped) == list(range(WORLD))
    assert all("program_ticks_total" in text for text in scraped.values())
    targets = json.loads((run / "prometheus-targets.json").read_text())
    assert {t["labels"]["source"] for t in targets} == {"testbed", "program"}
    assert "<h2>Network</h2>" in (run / "index.html").read_text()


def test_a_program_that_fails_fails_the_run_with_its_last_words(tmp_path: Path):
    path = scenario(tmp_path, seconds=0.5, env=', FAIL_RANK: "1"')
    result = ClusterRun(path, run_dir=tmp_path / "run").run()
    assert not result.success
    assert "worker 1 failed (exit 1): the program gave up: no quorum" in result.error
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {c["rank"]: c["exit_code"] for c in summary["commands"]} == {0: 0, 1: 3, 2: 0}


def test_ctrl_c_ends_every_program_and_leaves_nothing(tmp_path: Path):
    path = scenario(tmp_path, seconds=600.0)
    orphans = set(lab_namespaces(orphans_only=True))
    logs = tmp_path / "run" / "logs"
    runner, _ = start_run(path, tmp_path / "run", "every program's first line (the run directory)",
                          lambda: all((logs / f"worker-{r}.stdout").exists() and
                                      (logs / f"worker-{r}.stdout").stat().st_size
                                      for r in range(WORLD)))
    try:
        programs = [int(p) for p in subprocess.run(["pgrep", "-f", "program.py 600.0"],
                                                   capture_output=True, text=True).stdout.split()]
        assert len(programs) == WORLD
        runner.send_signal(signal.SIGINT)
        assert runner.wait(60) == 130
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert not [pid for pid in programs if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"]
    assert set(lab_namespaces(orphans_only=True)) <= orphans, "the run left namespaces"
