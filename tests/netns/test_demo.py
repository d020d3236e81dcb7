"""The README's main job, end to end: `testbed demo` shapes, measures and reports every link."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from netem.lab import lab_namespaces

pytestmark = pytest.mark.netns


def test_demo_measures_every_link_within_tolerance_and_leaves_nothing():
    before = set(lab_namespaces(orphans_only=True))
    result = subprocess.run(
        [str(Path(sys.executable).with_name("testbed")), "demo"], capture_output=True, text=True,
        timeout=600, env=os.environ | {"COLUMNS": "160"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 4 links measured within tolerance" in result.stdout
    for quantity in ("loss burst mean", "jitter (stdev)", "rate"):
        assert quantity in result.stdout
    # Namespaces whose owner is gone: the demo's, had it left any (other tests' live labs may
    # come and go meanwhile).
    assert set(lab_namespaces(orphans_only=True)) == before
