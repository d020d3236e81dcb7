"""What a shaped network needs here, and what a test does without it: skipped with the reason
and the way out (the UML sandbox), or failed under CI, like the project's own test tiers."""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable
from typing import NoReturn

import pytest

from netem.capabilities import probe_kernel
from netem.plan import UnsupportedByKernel
from netem.profile import LinkProfile
from testbed.cluster.network import ClusterNetwork

TRUE = ("1", "true", "yes")
LAB = ("netns", "veth", "htb", "u32")  # a lab and its per-source classes
FALLBACK = ("nftables", "numgen")  # the fallback's loss, partitions included


def in_ci() -> bool:
    """Whether `CI` says this is CI (1, true or yes, any case): then a test fails instead of
    being skipped for what this host lacks."""
    return os.environ.get("CI", "").lower() in TRUE


def sandbox_hint(config: pytest.Config) -> str:
    """The command that runs this very pytest in a guest whose kernel has netem."""
    command = shlex.join(["python", "-m", "netem.sandbox", "pytest",
                          *config.invocation_params.args])
    return f"run the suite where netem is: `{command}`"


def unavailable(reason: str, config: pytest.Config) -> NoReturn:
    """Skip the test with `reason`, or fail it under CI (reported at the test's own line)."""
    __tracebackhide__ = True
    if in_ci():
        pytest.fail(f"netem: cannot run in CI: {reason}", pytrace=False)
    pytest.skip(f"netem: {reason}; {sandbox_hint(config)}")


def missing(network: ClusterNetwork) -> str | None:
    """Why `network` (not started) cannot be built and shaped here, or None. Pure: creates
    nothing but the capability probe's throwaway namespace."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, qdiscs)"
    found, details = probe_kernel()
    needed = LAB + (FALLBACK if network.backend == "fallback" else ())
    absent = [name for name in needed if not found[name]]
    if absent:
        return "this kernel cannot build a shaped network: " + "; ".join(
            f"{name}: {details.get(name, 'missing')}" for name in absent)
    try:
        network.check()
    except UnsupportedByKernel as error:
        links = network.links
        profiles = [links.current(src, dst) for src in range(links.count)
                    for dst in range(links.count) if src != dst]
        return lacking_netem(profiles) or str(error)
    return None


def lacking_netem(profiles: Iterable[LinkProfile]) -> str | None:
    """What these profiles need of sch_netem, said for a kernel without it; None if nothing."""
    features = sorted(set().union(*(profile.netem_features() for profile in profiles)))
    if not features:
        return None
    return (f"{', '.join(features)} need{'s' if len(features) == 1 else ''} sch_netem, which "
            "this kernel lacks (its fallback shapes loss, rate and limit only)")
