"""Link traces read from files: Mahimahi's delivery opportunities and CSV rows of changes.

A trace is checked like a scenario: every error names the file and line and says what is
wrong. Reading is vectorised (numpy) where a trace is long (a Mahimahi trace has a line per
packet); a CSV trace has a row per change, few enough to read cell by cell.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from netem.profile import MAX_RATE
from netem.units import parse_fraction, parse_rate, parse_time

Format = Literal["mahimahi", "csv"]
FORMATS: tuple[Format, ...] = ("mahimahi", "csv")
MAX_LENGTH = 24 * 3600  # seconds: a trace's windows are held in memory, 10 ms each at most
MAX_DIGITS = 12  # of a Mahimahi timestamp: more is far beyond MAX_LENGTH
CSV_FIELDS = ("rate", "delay", "jitter", "loss")  # what a CSV row may change, besides `time`


class TraceError(ValueError):
    """A trace that cannot be read or replayed; the message names file:line and what is wrong."""


@dataclass(frozen=True)
class MahimahiTrace:
    """Mahimahi's link trace: the millisecond of each 1,500-byte delivery opportunity, not
    decreasing; the last one is the trace's length, after which it loops."""

    source: str
    opportunities_ms: np.ndarray  # int64

    @property
    def length(self) -> float:
        """Seconds."""
        return int(self.opportunities_ms[-1]) / 1000


@dataclass(frozen=True)
class CsvTrace:
    """Rows of changes: from each row's time on, the link has the row's values (NaN: an empty
    cell, the value before it, or the base profile's before any). The last row's time is
    where the trace ends."""

    source: str
    times: np.ndarray  # seconds, increasing
    columns: dict[str, np.ndarray]  # a LinkProfile field -> its value per row, in base units

    @property
    def length(self) -> float:
        """Seconds."""
        return float(self.times[-1])


Trace = MahimahiTrace | CsvTrace


def load_trace(path: str | Path, format: Format | None = None) -> Trace:
    """Read a trace file; its format from `format`, else from the name (`.csv`: csv, anything
    else: mahimahi)."""
    name = str(path)
    chosen = format or ("csv" if name.lower().endswith(".csv") else "mahimahi")
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        line = Path(path).read_bytes()[: error.start].count(b"\n") + 1
        raise TraceError(f"{name}:{line}: not UTF-8 text") from None
    except OSError as error:
        raise TraceError(f"{name}: {error.strerror}") from None
    return parse_trace(text, chosen, name)


def parse_trace(text: str, format: Format, source: str = "<trace>") -> Trace:
    """A trace from its text; `source` names it in errors."""
    if format == "mahimahi":
        return _mahimahi(text, source)
    if format == "csv":
        return _csv(text, source)
    raise TraceError(f"{source}: unknown trace format {format!r}; expected one of "
                     f"{', '.join(FORMATS)}")


def _mahimahi(text: str, source: str) -> MahimahiTrace:
    """One millisecond timestamp a line; blank lines and `#` comments (where the file names
    its origin) are skipped."""
    lines = np.array(text.split("\n"), dtype=np.str_)
    stripped = np.char.strip(lines)
    kept = (np.char.str_len(stripped) > 0) & ~np.char.startswith(stripped, "#")
    numbers = np.flatnonzero(kept) + 1
    values = stripped[kept]
    if values.size == 0:
        raise TraceError(f"{source}: no delivery opportunity: a Mahimahi trace has the "
                         "millisecond of one on each line")
    whole = np.char.isdigit(values) & (np.char.str_len(values) <= MAX_DIGITS)
    if not text.isascii():  # isdigit takes the digits of other scripts too
        whole &= np.array([value.isascii() for value in values.tolist()])
    if not whole.all():
        first = int(np.argmin(whole))
        raise TraceError(f"{source}:{numbers[first]}: expected a whole number of milliseconds, "
                         f"got {str(values[first])[:40]!r}")
    stamps = values.astype(np.int64)
    backwards = np.flatnonzero(np.diff(stamps) < 0)
    if backwards.size:
        at = backwards[0] + 1
        raise TraceError(f"{source}:{numbers[at]}: {stamps[at]} is before the timestamp above "
                         f"it ({stamps[at - 1]}): timestamps must not decrease")
    if stamps[-1] == 0:
        raise TraceError(f"{source}:{numbers[-1]}: the last timestamp is the trace's length, "
                         "so it must be above 0")
    if stamps[-1] > MAX_LENGTH * 1000:
        raise TraceError(f"{source}:{numbers[-1]}: the trace lasts {stamps[-1]}ms; at most "
                         f"{MAX_LENGTH * 1000}ms (24 hours)")
    return MahimahiTrace(source, stamps)


def _csv(text: str, source: str) -> CsvTrace:
    """A header naming `time` and any of `rate`, `delay`, `jitter`, `loss`, then a row per
    change, times increasing."""
    rows = csv.reader(io.StringIO(text, newline=""))
    try:
        numbered = [(rows.line_num, row) for row in rows if any(cell.strip() for cell in row)]
    except csv.Error as error:
        raise TraceError(f"{source}:{rows.line_num}: {error}") from None
    if not numbered:
        raise TraceError(f"{source}: empty: expected a header such as 'time,rate'")
    header_line, header = numbered[0]
    names = [cell.strip().lower() for cell in header]
    allowed = ("time", *CSV_FIELDS)
    for name in names:
        if name not in allowed:
            raise TraceError(f"{source}:{header_line}: unknown column {name!r}; the header "
                             f"names time and any of {', '.join(CSV_FIELDS)}")
        if names.count(name) > 1:
            raise TraceError(f"{source}:{header_line}: column {name!r} named twice")
    if "time" not in names or len(names) < 2:
        raise TraceError(f"{source}:{header_line}: the header names time and at least one of "
                         f"{', '.join(CSV_FIELDS)}, got {','.join(names)!r}")
    body = numbered[1:]
    if len(body) < 2:
        raise TraceError(f"{source}: expected at least two rows: the last row's time is where "
                         "the trace ends")
    times = np.empty(len(body))
    columns = {name: np.full(len(body), np.nan) for name in names if name != "time"}
    for row_index, (line, row) in enumerate(body):
        if len(row) != len(names):
            raise TraceError(f"{source}:{line}: {len(row)} cells, the header names {len(names)}")
        for name, cell in zip(names, row, strict=True):
            value = _cell(name, cell.strip(), f"{source}:{line}")
            if name == "time":
                times[row_index] = value
            elif value is not None:
                columns[name][row_index] = value
        if row_index and times[row_index] <= times[row_index - 1]:
            raise TraceError(f"{source}:{line}: time {row[names.index('time')].strip()!r} is not "
                             "after the row above's: times must increase")
    if times[-1] > MAX_LENGTH:
        raise TraceError(f"{source}:{body[-1][0]}: the trace lasts {times[-1]:g}s; at most "
                         f"{MAX_LENGTH}s (24 hours)")
    return CsvTrace(source, times, columns)


def _cell(name: str, cell: str, where: str) -> float | None:
    """A cell in base units (None: empty, the value before it stays); times and rates with
    their unit, as a profile takes them, but `time`, which may be bare seconds."""
    if not cell:
        if name == "time":
            raise TraceError(f"{where}: time: every row needs its time")
        return None
    try:
        if name == "time":
            return parse_time(cell)
        if name == "rate":
            bits = parse_rate(cell, unit_required=True)
            if bits > MAX_RATE:
                raise ValueError(f"expected at most {MAX_RATE // 10**12}tbit, got {cell!r}")
            return float(bits)
        if name == "loss":
            return parse_fraction(cell)
        return parse_time(cell, unit_required=True)
    except ValueError as error:
        raise TraceError(f"{where}: {name}: {error}") from None
