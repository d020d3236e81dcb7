"""Link traces: read a recorded trace (Mahimahi's or a CSV of changes), turn it into a schedule
of profiles at a resolution, and replay it on an interface in place (docs/conditions.md)."""

from netem.trace.load import (
    CsvTrace,
    MahimahiTrace,
    Trace,
    TraceError,
    load_trace,
    parse_trace,
)
from netem.trace.replay import Lateness, Replay
from netem.trace.schedule import (
    DEFAULT_RESOLUTION,
    FLOOR_RATE,
    MIN_RESOLUTION,
    Schedule,
    TraceSummary,
    schedule,
)

__all__ = [
    "DEFAULT_RESOLUTION",
    "FLOOR_RATE",
    "MIN_RESOLUTION",
    "CsvTrace",
    "Lateness",
    "MahimahiTrace",
    "Replay",
    "Schedule",
    "Trace",
    "TraceError",
    "TraceSummary",
    "load_trace",
    "parse_trace",
    "schedule",
]
