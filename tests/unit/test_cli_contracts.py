"""The command line's contracts (docs/cli.md): --version, the JSON shapes of `--json`, and the
exit codes: 0 done, 1 what was run or checked failed, 2 bad input."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

from typer.testing import CliRunner

from netem.capabilities import CONSEQUENCES
from testbed.cli import app
from testbed.scenario import scenario_files

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"testbed {version('netem-testbed')}\n"


def test_scenario_check_json_and_exit_codes(tmp_path: Path):
    good = next(path for path in scenario_files() if path.stem == "quickstart")
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: 0\ntopology: {default: {delay: 5}}\n")
    result = runner.invoke(app, ["scenario", "check", "--json", str(good)])
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.output)
    assert entry == {"file": str(good), "ok": True, "name": "quickstart",
                     "summary": entry["summary"]} and entry["summary"].startswith("quickstart:")
    result = runner.invoke(app, ["scenario", "check", "--json", str(good), str(bad)])
    assert result.exit_code == 2
    ok, wrong = json.loads(result.output)
    assert ok["ok"] and not wrong["ok"]
    assert {(p["path"], p["line"]) for p in wrong["problems"]} == {
        ("workers.count", 1), ("topology.default.delay", 2)}
    assert all(p["message"] for p in wrong["problems"])


def test_doctor_json_and_requirements():
    result = runner.invoke(app, ["doctor", "--json"])
    data = json.loads(result.output)
    assert set(data["capabilities"]) == set(CONSEQUENCES) and data["missing"] == []
    for entry in data["capabilities"].values():
        assert set(entry) == {"available", "found", "consequence"}
    assert result.exit_code == 0
    unknown = runner.invoke(app, ["doctor", "--require", "netem,warp"])
    assert unknown.exit_code == 2 and "--require: unknown warp" in unknown.output
    # Whatever this host lacks, asking for it fails the doctor, naming it.
    lacking = [name for name, entry in data["capabilities"].items() if not entry["available"]]
    having = [name for name, entry in data["capabilities"].items() if entry["available"]]
    if having:
        assert runner.invoke(app, ["doctor", "--require", having[0]]).exit_code == 0
    if lacking:
        result = runner.invoke(app, ["doctor", "--json", "--require", ",".join(lacking)])
        assert result.exit_code == 1 and json.loads(result.output)["missing"] == lacking
