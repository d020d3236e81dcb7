"""Test tiers. `netns` needs root on the host kernel; `netem_kernel` needs sch_netem (the UML
guest provides it: `testbed sandbox pytest -m netem_kernel`). A tier whose requirements are
missing fails under CI and is skipped, with the reason, elsewhere. `gpu` needs CUDA, which the
CI machines lack: it is skipped with its reason wherever CUDA is missing, CI included."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from netem.lab import Lab
from testbed.pytest_plugin.requirements import in_ci
from testbed.report import describe_runs

IN_CI = in_ci()
_measured_key: pytest.StashKey[list[str]] = pytest.StashKey()  # lines for the run's summary


def _missing(marker: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, qdiscs)"
    if marker == "netem_kernel":
        from netem.capabilities import netem_available

        if not netem_available():
            return (
                "needs a kernel with sch_netem; this one has none: run this tier in the UML "
                "guest with `testbed sandbox pytest -m netem_kernel tests` (make test does)"
            )
    return None


def _cuda_missing() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    return "needs CUDA (torch.cuda.is_available() is False)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and (reason := _cuda_missing()):
        pytest.skip(reason)  # never a failure: no CI machine has a GPU
    for marker in ("netns", "netem_kernel"):
        if item.get_closest_marker(marker) is None:
            continue
        reason = _missing(marker)
        if reason is None:
            continue
        if IN_CI:
            pytest.fail(f"tier {marker!r} cannot run in CI: {reason}", pytrace=False)
        pytest.skip(f"tier {marker!r}: {reason}")


@pytest.fixture
def make_lab() -> Iterator[Callable[..., Lab]]:
    """Build labs (namespaces on a bridge) that are removed when the test ends, pass or fail."""
    labs: list[Lab] = []

    def build(size: int, **kwargs) -> Lab:
        lab = Lab(size, **kwargs)
        labs.append(lab)
        lab.start()
        return lab

    yield build
    for lab in labs:
        lab.close()


@pytest.fixture
def measured(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record what a test measured on the wire: the session's summary prints it, passed or not,
    so a tier's output shows the figures its assertions were made on."""
    lines = request.config.stash.setdefault(_measured_key, [])
    return lambda line: lines.append(f"{request.node.nodeid}: {line}")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    lines = config.stash.get(_measured_key, [])
    if lines:
        terminalreporter.section("measured on the wire")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A failed test that ran a scenario says why: its run directories' summaries and the last
    lines of every worker's log (the tests keep their runs under `tmp_path`)."""
    report = yield
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and isinstance(tmp_path, Path):
        text = describe_runs(tmp_path)
        if text:
            report.sections.append(("run directories", text))
    return report
