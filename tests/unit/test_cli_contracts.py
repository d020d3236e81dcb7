"""The command line's contracts (docs/cli.md): --version, the JSON shapes of `--json`, and the
exit codes: 0 done, 1 what was run or checked failed, 2 bad input; every profile field as a
`testbed shape` flag; the fallback's loss said not to be repeatable."""

from __future__ import annotations

import dataclasses
import json
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from netem.capabilities import CONSEQUENCES
from testbed.cli import app
from testbed.scenario import load_scenario, scenario_files

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
                     "summary": entry["summary"], "traces": [], "traffic": {}}
    assert entry["summary"].startswith("quickstart:")
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


def test_shape_takes_every_field_of_a_profile_and_the_dry_run_shows_it(tmp_path: Path):
    samples = tmp_path / "rtt.txt"
    samples.write_text("\n".join(str(20 + k % 5) for k in range(100)))
    result = runner.invoke(app, [
        "shape", "p1", "--backend", "netem", "--from", "198.18.0.1", "--delay", "10ms",
        "--distribution", f"{{samples: {samples}, unit: ms}}", "--loss", "5%", "--ecn",
        "--rate", "10mbit", "--overhead", "-4", "--cell-size", "48", "--cell-overhead", "5",
        "--slot", "{min_delay: 1ms, max_delay: 5ms, max_packets: 10}", "--seed", "42",
        "--dry-run"])
    assert result.exit_code == 0, result.output
    (leaf,) = [line for line in result.output.splitlines() if "handle 102: netem" in line]
    assert leaf.endswith("distribution rtt loss random 5% ecn rate 10mbit -4 48 5 slot 1ms 5ms "
                         "packets 10 seed 42")
    for flags, named in ((["--slot", "{min_delay: 1ms"], "--slot: not a YAML mapping"),
                         (["--slot", "1ms"], "slot:"), (["--cell-overhead", "4"], "cell_size"),
                         (["--ecn"], "ecn needs a loss model"), (["--seed", "-1"], "seed:")):
        wrong = runner.invoke(app, ["shape", "p1", "--backend", "netem", *flags, "--dry-run"])
        assert wrong.exit_code == 2 and named in wrong.output, (flags, wrong.output)


def test_the_fallbacks_loss_is_said_not_to_be_repeatable():
    from netem.capabilities import Capabilities
    from testbed.cli.render import NOT_REPEATABLE, capabilities_table, summary_table

    here = Capabilities(**dict.fromkeys(CONSEQUENCES, True))
    assert capabilities_table(here, CONSEQUENCES).caption is None
    without = dataclasses.replace(here, netem=False)
    assert NOT_REPEATABLE in capabilities_table(without, CONSEQUENCES).caption
    scenario = load_scenario("workers: 2\njob: {command: ['true']}\n")
    result = SimpleNamespace(seconds=1.0, workers=[])
    netem, fallback = (summary_table(SimpleNamespace(scenario=scenario, shaped_by=backend),
                                     result).caption for backend in ("netem", "fallback"))
    assert netem is None and NOT_REPEATABLE in fallback


def test_a_dry_run_shows_the_netem_backend_whatever_this_kernel_has(monkeypatch):
    """The README's example works on a host without netem: a dry run does not probe the
    kernel; --backend fallback shows the other backend's commands."""
    import netem.backend
    import netem.capabilities

    def never_probed() -> bool:
        raise AssertionError("a dry run probed the kernel")

    monkeypatch.setattr(netem.backend, "netem_available", never_probed)
    monkeypatch.setattr(netem.capabilities, "netem_available", never_probed, raising=False)
    result = runner.invoke(app, ["shape", "eth0", "--loss", "5%", "--delay", "20ms",
                                 "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "netem limit 1000 delay 20ms loss random 5%" in result.output
    assert "showing the netem backend (--backend fallback shows the other)" in result.output
    fallback = runner.invoke(app, ["shape", "eth0", "--loss", "5%", "--backend", "fallback",
                                   "--dry-run"])
    assert fallback.exit_code == 0 and "numgen random" in fallback.output


@pytest.mark.parametrize(("flags", "said"), [
    ([], "nothing to shape: give what the link does (--delay, --loss, --rate, ...)"),
    (["--from", "198.18.0.1"], "nothing to shape"),
    (["--loss", "1%", "--from", "notanip"], "--from: source 'notanip' is not an IPv4 address "
     "or network, e.g. 198.18.0.1 or 198.18.0.0/24"),
    (["--rate", "100mbps"], "ambiguous"),
])
def test_shape_refuses_what_it_cannot_do_naming_the_flag(flags, said):
    result = runner.invoke(app, ["shape", "eth0", *flags, "--dry-run"])
    assert result.exit_code == 2 and said in result.output, result.output
    assert "htb rate" not in result.output


def test_files_where_directories_go_and_the_reverse_are_bad_input(tmp_path: Path):
    afile = tmp_path / "afile"
    afile.write_text("x: 1\n")
    binary = tmp_path / "photo.yaml"
    binary.write_bytes(bytes(range(256)))
    cases = [(["capture", str(afile)], f"RUN_DIR: {afile} is not a directory"),
             (["scenario", "check", str(binary)], "not a text file (UTF-8)"),
             (["compose", "quickstart", "-o", str(afile)], f"out: {afile} is a file"),
             (["report", str(afile)], "not a directory")]
    for argv, said in cases:
        result = runner.invoke(app, argv)
        assert result.exit_code == 2 and said in result.output, (argv, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_compose_writes_into_a_new_empty_or_its_own_directory_only(tmp_path: Path):
    own = tmp_path / "mine"
    own.mkdir()
    (own / "docker-compose.yaml").write_text("services: {mine: {image: x}}\n")
    result = runner.invoke(app, ["compose", "quickstart", "-o", str(own)])
    assert result.exit_code == 2 and "holds files of its own (docker-compose.yaml)" in (
        result.output)
    assert (own / "docker-compose.yaml").read_text() == "services: {mine: {image: x}}\n"
    project = tmp_path / "project"
    for _ in range(2):  # new, then written before: written again
        result = runner.invoke(app, ["compose", "quickstart", "-o", str(project)])
        assert result.exit_code == 0, result.output
