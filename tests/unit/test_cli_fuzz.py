"""Fuzzing the commands a newcomer points at files and flags (`scenario check`, `shape`,
`capture`, `compose`, `report`): whatever file (missing, a directory, binary, YAML of any
shape, a shipped scenario) and whatever flags come in, the answer is an exit code of the
contract (0 done, 1 failed, 2 bad input) and a message; never a traceback. Each command's
flags are read from the command itself, so a new flag is fuzzed too.

Nothing here touches this host: `shape` always runs with --dry-run, `compose` never with --up
(it would start Docker) and always with -o into a temporary directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer.main
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from testbed.cli import app
from testbed.scenario import scenario_files

COMMANDS = typer.main.get_command(app)
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
NEVER = {"--up"}  # compose --up runs the project on Docker
SHIPPED = [path.read_text() for path in scenario_files()]

words = st.one_of(st.text(max_size=10), st.sampled_from([
    "", "0", "-1", "5", "100000", "10ms", "5%", "100mbit", "100mbps", "1e14s", "auto", "netem",
    "fallback", "ingress", "groups", "workers", "none", "uml", "198.18.0.1", "198.18.0.0/24",
    "notanip", "10.0.0.300/24", "0->1", "all", "{samples: rtt.txt, unit: ms}",
    "{min_delay: 1ms}", "{", "quickstart", "/proc/1/ns/net"]))
documents = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=8),
              st.sampled_from(["10ms", "5%", "lossy", "0->1"])),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=8), children, max_size=3)),
    max_leaves=12)
contents = st.one_of(st.binary(max_size=64), st.text(max_size=64),
                     documents.map(lambda data: yaml.safe_dump(data)), st.sampled_from(SHIPPED))
# What a path given to a command is: (kind, what a file holds).
paths = st.tuples(st.sampled_from(["missing", "file", "directory", "run directory",
                                   "capture directory", "shipped name"]), contents)


def make(root: Path, index: int, kind: str, content: str | bytes) -> str:
    """A path of `kind` under `root` (a file holding `content`, or a directory with such a file
    where a run's events or a capture's manifest go)."""
    path = root / f"p{index}"
    data = content.encode() if isinstance(content, str) else content
    if kind == "shipped name":
        return "quickstart"
    if kind == "file":
        path.write_bytes(data)
    elif kind == "directory":
        path.mkdir()
    elif kind == "run directory":
        path.mkdir()
        (path / "events.jsonl").write_bytes(data)
    elif kind == "capture directory":
        (path / "capture").mkdir(parents=True)
        (path / "capture" / "capture.json").write_bytes(data)
    return str(path)


@st.composite
def flags(draw, command: str, forced: tuple[str, ...] = ()) -> list[str]:
    """Some of `command`'s options, each with a value where it takes one."""
    params = [p for p in _command(command).params if p.param_type_name == "option"]
    chosen = draw(st.lists(st.sampled_from(params), max_size=4, unique_by=lambda p: p.name))
    argv: list[str] = []
    for param in chosen:
        name = draw(st.sampled_from([*param.opts, *param.secondary_opts]))
        if name in NEVER or name in forced:
            continue
        argv += [name] if param.is_flag else [name, draw(words)]
    return argv


def _command(name: str):
    found = COMMANDS
    for part in name.split():
        found = found.commands[part]
    return found


def invoke(argv: list[str]) -> None:
    result = CliRunner().invoke(app, argv)
    assert "Traceback" not in result.output, (argv, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        argv, repr(result.exception), result.output)
    assert result.exit_code in (0, 1, 2), (argv, result.exit_code, result.output)


@FUZZ
@given(st.lists(paths, min_size=1, max_size=3), flags("scenario check"))
def test_scenario_check_answers_any_file_and_flag(given_paths, options):
    with tempfile.TemporaryDirectory() as root:
        files = [make(Path(root), i, kind, content)
                 for i, (kind, content) in enumerate(given_paths)]
        invoke(["scenario", "check", *files, *options])


@FUZZ
@given(words, flags("shape"))
def test_shape_dry_run_answers_any_flag(iface, options):
    invoke(["shape", iface or "eth0", *options, "--dry-run"])


@FUZZ
@given(paths, flags("capture"))
def test_capture_answers_any_run_directory_and_flag(path, options):
    with tempfile.TemporaryDirectory() as root:
        invoke(["capture", make(Path(root), 0, *path), *options])


@FUZZ
@given(paths, st.sampled_from(["missing", "directory", "file", "project"]), contents,
       st.sampled_from(["notes.txt", "docker-compose.yaml", "prometheus.yml", "scenario.yaml",
                        "docker-stack.yaml"]),
       flags("compose", forced=("--out", "-o")))
def test_compose_answers_any_scenario_directory_and_flag(path, out_kind, out_content, own,
                                                         options):
    """... and never writes over a file of the user's own in the project's directory."""
    with tempfile.TemporaryDirectory() as root:
        scenario = make(Path(root), 0, *path)
        out = Path(make(Path(root), 1, "file" if out_kind == "file" else "missing",
                        out_content))
        if out_kind == "project":  # written before: written again
            invoke(["compose", "quickstart", "-o", str(out)])
        elif out_kind == "directory":
            out.mkdir()
            (out / own).write_text("the user's own")
        invoke(["compose", scenario, "-o", str(out), *options])
        if out_kind == "directory":
            assert (out / own).read_text() == "the user's own"


@FUZZ
@given(st.lists(paths, min_size=1, max_size=2), st.booleans(), contents)
def test_report_answers_any_run_directory(given_paths, out_given, out_content):
    with tempfile.TemporaryDirectory() as root:
        runs = [make(Path(root), i, kind, content)
                for i, (kind, content) in enumerate(given_paths)]
        out = ["-o", make(Path(root), 9, "file", out_content)] if out_given else []
        invoke(["report", *runs, *out])
