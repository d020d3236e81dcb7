"""The runner's process imports no torch: torch costs seconds of CPU to import (10 s in the
UML guest, whose one CPU the zygote then needs for its own import), and only the zygote and
its forks use it. Checked in a child interpreter that cannot import torch."""

from __future__ import annotations

import importlib

import pytest

import testbed.metrics
from tests.unit.test_extras import child


@pytest.mark.parametrize("module", ["testbed.cli.runs", "testbed.cluster.runner"])
def test_the_runner_imports_no_torch(module):
    result = child("torch", f"""
        import importlib
        importlib.import_module({module!r})
        print("imported")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "imported\n"


def test_every_name_the_metrics_package_exports_is_found():
    """The package loads its names on first use (so the runner's `testbed.metrics.traffic`
    brings no torch): each must still be found, and be its module's own."""
    for name in testbed.metrics.__all__:
        module = importlib.import_module(f"testbed.metrics.{testbed.metrics._WHERE[name]}")
        assert getattr(testbed.metrics, name) is getattr(module, name)
    assert sorted(testbed.metrics.__all__) == sorted(testbed.metrics._WHERE)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        testbed.metrics.nothing  # noqa: B018
