"""The run report: a run directory written while the run goes on (`RunWriter`), read back and
checked (`load_run`), summarized (`summary.json`) and rendered as PNG plots with one HTML page
(`render_run`), or several runs overlaid (`render_comparison`). docs/report.md has the layout
and every event's fields.

Importing this package does not import matplotlib; `render_run` and `render_comparison` do.
"""

from __future__ import annotations

from typing import Any

from testbed.report.events import EndEvent, FaultEvent, LinkEvent, RunEvent, StepEvent
from testbed.report.run import (
    Run,
    RunError,
    describe_runs,
    load_run,
    parameter_dumps,
    summarize,
)
from testbed.report.writer import RunWriter, write_summary

__all__ = [
    "EndEvent",
    "FaultEvent",
    "LinkEvent",
    "Run",
    "RunError",
    "RunEvent",
    "RunWriter",
    "StepEvent",
    "describe_runs",
    "load_run",
    "parameter_dumps",
    "render_comparison",
    "render_run",
    "summarize",
    "write_summary",
]


def render_run(*args: Any, **kwargs: Any) -> Any:
    """See `testbed.report.page.render_run`."""
    from testbed.report.page import render_run

    return render_run(*args, **kwargs)


def render_comparison(*args: Any, **kwargs: Any) -> Any:
    """See `testbed.report.page.render_comparison`."""
    from testbed.report.page import render_comparison

    return render_comparison(*args, **kwargs)
