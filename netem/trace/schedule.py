"""A trace as a schedule: the link's values per window of a fixed resolution, and the profiles
a replay sets from them.

Window k covers [k * resolution, (k + 1) * resolution). A Mahimahi trace gives each window the
rate of its delivery opportunities (1,500 bytes each: opportunities * 1500 * 8 / window's
length); a window without one gets `FLOOR_RATE`, since a rate of 0 is no rate to the kernel. A
CSV trace gives each window the values of the last row at or before its start (a change shorter
than a window may be skipped). A trace's length is rounded up to whole windows, so a looping
trace stays on the grid of its start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from netem.profile import LinkProfile, ProfileError
from netem.trace.load import CsvTrace, MahimahiTrace, Trace, TraceError
from netem.units import format_time

DEFAULT_RESOLUTION = 0.1  # seconds
MIN_RESOLUTION = 0.01
OPPORTUNITY_BITS = 1500 * 8  # one Mahimahi delivery opportunity
FLOOR_RATE = 12_000  # bits/s where a window has no opportunity: one opportunity a second
UNSET = -1.0  # a window's value that the base profile gives (every real value is >= 0)


@dataclass(frozen=True)
class TraceSummary:
    """What `describe` reports of a schedule: rates in bits/s (None without a rate column)."""

    source: str
    length: float  # seconds, whole windows
    resolution: float
    windows: int
    fields: tuple[str, ...]
    mean_rate: float | None
    min_rate: float | None
    max_rate: float | None
    floor_windows: int  # Mahimahi windows without an opportunity, at FLOOR_RATE


@dataclass(frozen=True)
class Schedule:
    """The values of the traced `fields` per window, in base units (bits/s, seconds,
    fractions); UNSET where the base profile's value stays."""

    source: str
    resolution: float  # seconds
    fields: tuple[str, ...]
    values: np.ndarray  # float64, (windows, fields)
    floor_windows: int = 0

    @property
    def windows(self) -> int:
        return len(self.values)

    @property
    def length(self) -> float:
        """Seconds: whole windows."""
        return round(self.windows * self.resolution, 9)

    def profiles(self, base: LinkProfile) -> tuple[list[LinkProfile], np.ndarray]:
        """The distinct profiles the schedule sets on top of `base`, and which one each window
        has (an index into them). Raises TraceError naming the first window whose values do
        not make a profile with `base`'s other fields."""
        distinct, which = np.unique(self.values, axis=0, return_inverse=True)
        which = which.reshape(-1)
        dumped = base.model_dump(exclude_defaults=True, by_alias=True)
        profiles = []
        for number, row in enumerate(distinct):
            changes = {name: int(value) if name == "rate" else float(value)
                       for name, value in zip(self.fields, row, strict=True) if value != UNSET}
            try:
                profiles.append(LinkProfile.build({**dumped, **changes}))
            except ProfileError as error:
                first = int(np.argmax(which == number))
                raise TraceError(f"{self.source}: at {first * self.resolution:.9g}s the "
                                 f"trace and the base profile make no profile: {error}") from None
        return profiles, which

    def describe(self) -> TraceSummary:
        """Length and rates, as `scenario check` reports a trace."""
        rates = np.empty(0)
        if "rate" in self.fields:
            column = self.values[:, self.fields.index("rate")]
            rates = column[column != UNSET]
        mean, least, most = ((float(rates.mean()), float(rates.min()), float(rates.max()))
                             if rates.size else (None, None, None))
        return TraceSummary(self.source, self.length, self.resolution, self.windows,
                            self.fields, mean, least, most, self.floor_windows)


def schedule(trace: Trace, resolution: float = DEFAULT_RESOLUTION) -> Schedule:
    """The trace's values per window of `resolution` seconds (10 ms at least)."""
    if not (math.isfinite(resolution) and resolution >= MIN_RESOLUTION):
        raise TraceError(f"resolution: expected at least {format_time(MIN_RESOLUTION)}, got "
                         f"{resolution!r}")
    step_us = round(resolution * 1e6)
    if isinstance(trace, MahimahiTrace):
        return _mahimahi(trace, step_us)
    return _csv(trace, step_us)


def _mahimahi(trace: MahimahiTrace, step_us: int) -> Schedule:
    period_us = int(trace.opportunities_ms[-1]) * 1000
    windows = -(-period_us // step_us)
    # The trace loops: an opportunity at its last millisecond is one at the next loop's first.
    at = trace.opportunities_ms * 1000 % period_us // step_us
    counts = np.bincount(at, minlength=windows)
    widths = np.full(windows, step_us, dtype=np.float64)
    widths[-1] = period_us - (windows - 1) * step_us
    rates = counts * OPPORTUNITY_BITS / (widths / 1e6)
    empty = counts == 0
    rates[empty] = FLOOR_RATE
    return Schedule(trace.source, step_us / 1e6, ("rate",), rates.reshape(-1, 1),
                    int(empty.sum()))


def _csv(trace: CsvTrace, step_us: int) -> Schedule:
    times_us = np.round(trace.times * 1e6).astype(np.int64)
    windows = max(1, -(-int(times_us[-1]) // step_us))
    starts = np.arange(windows, dtype=np.int64) * step_us
    row = np.searchsorted(times_us, starts, side="right") - 1  # -1: before the first row
    fields = tuple(trace.columns)
    values = np.full((windows, len(fields)), UNSET)
    for column, name in enumerate(fields):
        given = trace.columns[name]
        # The last row with a value at or before each row: an empty cell keeps the one before.
        latest = np.maximum.accumulate(np.where(np.isnan(given), -1, np.arange(given.size)))
        source = np.where(row >= 0, latest[np.maximum(row, 0)], -1)
        values[:, column] = np.where(source >= 0, given[np.maximum(source, 0)], UNSET)
    return Schedule(trace.source, step_us / 1e6, fields, values)
