"""pytest plugin: a shaped network for a test (docs/pytest.md).

Installed with the package (entry point `pytest11`: `testbed = "testbed.pytest_plugin"`):

- `make_netem_network(hosts=None, *, profile=None, links=None, scenario=None, seed=None,
  **fields)`: a factory of `NetemNetwork`s (hosts in network namespaces, every directed link
  shaped), each removed when the test ends, however it ends;
- `netem_network`: one such network, as the `netem` marker says;
- `@pytest.mark.netem(profile=None, /, *, hosts=2, links=None, scenario=None, seed=None,
  **fields)`: the defaults of both (every link's profile, its fields as keywords:
  `delay="50ms", loss="5%"`; the seed each link's netem seed is derived from);
- `netem_scenario(scenario, *, steps=None, timeout=None)`: run a whole scenario into the test's
  `tmp_path`, return its `RunResult`.

A test whose network this host cannot build (no root, no namespaces, or a profile only sch_netem
shapes on a kernel without it) is skipped with the reason and the command that runs the suite in
the UML guest; under `CI=true` it fails instead. A test that gives no seed gets one drawn for its
networks, and a failed one's report says the marker that replays it with that seed.

Importing this module imports neither netem's backends nor the testbed: the project's own suite
and every other pytest run load it at no cost until a test asks for a network.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from testbed.cluster.runner import RunResult
    from testbed.pytest_plugin.network import NetemNetwork, NetworkSpec

MARKER = "netem"
MARKER_HELP = (
    "netem(profile=None, /, *, hosts=2, links=None, scenario=None, seed=None, **fields): the "
    "shaped network of the netem_network and make_netem_network fixtures: every link's profile "
    "(a netem.LinkProfile, a mapping, or its fields: delay='50ms', loss='5%', rate='10mbit', "
    "...), the number of hosts, links with a profile of their own {(src, dst): profile}, or a "
    "scenario file whose topology the network is, and the seed of the links' netem seeds (drawn "
    "where not given) (docs/pytest.md)"
)

_spec_key: pytest.StashKey[NetworkSpec] = pytest.StashKey()  # the item's marker, validated
_networks_key: pytest.StashKey[list[NetemNetwork]] = pytest.StashKey()  # made for the item
_runs_key: pytest.StashKey[list[Path]] = pytest.StashKey()  # the item's scenario runs
_seed_key: pytest.StashKey[int] = pytest.StashKey()  # drawn for the item's networks given none
_open_key: pytest.StashKey[weakref.WeakSet[NetemNetwork]] = pytest.StashKey()  # this session


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    config.stash[_open_key] = weakref.WeakSet()


def pytest_unconfigure(config: pytest.Config) -> None:
    """A safety net: whatever network a finalizer did not close (a second Ctrl-C in the middle
    of one) is closed when the session ends."""
    for network in list(config.stash.get(_open_key, ())):
        network.close()


@atexit.register
def _close_leftovers() -> None:
    """The last safety net, for a session that never reached `pytest_unconfigure`."""
    module = sys.modules.get("testbed.pytest_plugin.network")
    if module is not None:
        module.close_all()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `netem` marker with a bad field fails its test before any fixture runs, naming it."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return
    from testbed.pytest_plugin.network import NetworkSpec

    try:
        item.stash[_spec_key] = NetworkSpec.of(*marker.args, **marker.kwargs)
        return
    except (ValueError, TypeError) as error:
        problem = str(error)
    pytest.fail(f"@pytest.mark.{MARKER}: {problem}", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A failed test says what its networks were (hosts, seed, links, cut links, its
    processes), the marker that replays them where their seed was drawn, and how its scenarios
    ended (each run's verdict and the tail of every worker's log)."""
    report = yield
    if report.failed:
        for network in item.stash.get(_networks_key, []):
            if len(network):
                report.sections.append((f"netem network {network.prefix}", network.describe()))
        if _seed_key in item.stash:
            marker = replay_marker(item.get_closest_marker(MARKER), item.stash[_seed_key])
            report.sections.append(("netem replay", "the networks' seed was drawn; to replay "
                                    f"them with the same seed, mark the test\n{marker}"))
        runs = item.stash.get(_runs_key, [])
        if runs:
            from testbed.report import describe_runs

            text = "\n".join(filter(None, (describe_runs(run) for run in runs)))
            if text:
                report.sections.append(("netem scenario runs", text))
    return report


@pytest.fixture
def make_netem_network(request: pytest.FixtureRequest) -> Iterator[Callable[..., NetemNetwork]]:
    """Build shaped networks: `make_netem_network(3, loss="5%")`. Arguments left out come from
    the test's `netem` marker (the profile and the scenario as one); a network given no seed
    (nor a scenario) gets the test's, drawn once; every network is removed when the test ends,
    with the processes started in its hosts."""
    from testbed.pytest_plugin.network import NetemNetwork, NetworkSpec, drawn_seed
    from testbed.pytest_plugin.requirements import unavailable

    config = request.config
    marker = request.node.stash.get(_spec_key, NetworkSpec())
    made = request.node.stash.setdefault(_networks_key, [])

    def unsupported(reason: str) -> None:
        __tracebackhide__ = True
        unavailable(reason, config)

    def make(hosts: int | None = None, *, profile: Any = None, links: Any = None,
             scenario: str | Path | None = None, seed: int | None = None,
             **fields: Any) -> NetemNetwork:
        __tracebackhide__ = True
        spec = NetworkSpec.of(profile, hosts=hosts, links=links, scenario=scenario, seed=seed,
                              **fields).under(marker)
        if spec.needs_seed:  # one seed for all of the test's networks: one marker replays them
            spec = dataclasses.replace(
                spec, seed=request.node.stash.setdefault(_seed_key, drawn_seed()))
        network = NetemNetwork(spec, on_unsupported=unsupported)
        reason = network.missing()
        if reason is not None:
            unavailable(reason, config)
        made.append(network)
        config.stash[_open_key].add(network)
        return network.start()

    yield make
    for network in reversed(made):
        network.close()


@pytest.fixture
def netem_network(make_netem_network: Callable[..., NetemNetwork]) -> NetemNetwork:
    """A shaped network as the test's `netem` marker says (2 perfect links without one)."""
    return make_netem_network()


@pytest.fixture
def netem_scenario(request: pytest.FixtureRequest,
                   tmp_path: Path) -> Callable[..., RunResult]:
    """Run a scenario end to end (`testbed.cluster.runner.ClusterRun`: its network, workers and
    timeline) into the test's `tmp_path`: `netem_scenario("quickstart", steps=5)` with a file, a
    shipped scenario's name or YAML text; returns the `RunResult` (`.success`, `.error`,
    `.summary`: the run's summary.json, `.run_dir`, `.workers`)."""
    from testbed.cluster.network import ClusterNetwork
    from testbed.cluster.runner import ClusterRun, safe_name
    from testbed.pytest_plugin.requirements import missing, unavailable
    from testbed.scenario import find_scenario

    runs = request.node.stash.setdefault(_runs_key, [])

    def run(scenario: str | Path, *, steps: int | None = None,
            timeout: float | None = None) -> RunResult:
        __tracebackhide__ = True
        if isinstance(scenario, str) and "\n" in scenario:
            path = _unique(tmp_path / "scenario.yaml")
            path.write_text(scenario)
        else:
            path = find_scenario(scenario)
        cluster = ClusterRun(path, steps=steps,
                             run_dir=_unique(tmp_path / f"run-{safe_name(path.stem)}"))
        reason = missing(ClusterNetwork(cluster.scenario))
        if reason is not None:
            unavailable(reason, request.config)
        runs.append(cluster.run_dir)
        return cluster.run(timeout=timeout)

    return run


def replay_marker(marker: pytest.Mark | None, seed: int) -> str:
    """The marker that replays a test's networks: its own arguments (none without one) with
    `seed`."""
    args = [repr(arg) for arg in marker.args] if marker else []
    given = {**(marker.kwargs if marker else {}), "seed": seed}
    words = [*args, *(f"{name}={value!r}" for name, value in given.items())]
    return f"@pytest.mark.{MARKER}({', '.join(words)})"


def _unique(path: Path) -> Path:
    """`path`, or `path` with -2, -3, ... before its suffix if it exists."""
    number = 2
    candidate = path
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
        number += 1
    return candidate
