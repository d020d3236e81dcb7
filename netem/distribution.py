"""netem's delay distribution tables: iproute2's named ones, and ones made from measured delays.

netem draws a jittered delay from a table of s16 values: an entry of `NETEM_DIST_SCALE` stands
for one jitter (one standard deviation) around the mean delay. iproute2 ships tables by name
(`normal.dist`, ...) and makes others with its `maketable` program from measured values.
`make_table` does what maketable does (iproute2's netem/maketable.c), to the entry: normalise
the values to mean 0 and standard deviation 1, bin them on [-4, 4] in steps of 1/50000, and
invert the cumulative counts into 4096 quantiles scaled by 8192, interpolating the gaps. The
mean and standard deviation it normalises with are what netem must be given as delay and
jitter for the table to give the measured delays back.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NETEM_DIST_SCALE = 8192  # a table entry of NETEM_DIST_SCALE stands for one jitter (sigma)
TABLE_SIZE = 4096  # maketable's TABLESIZE
S16_MIN, S16_MAX = -(2**15), 2**15 - 1
DOMAIN = S16_MAX // NETEM_DIST_SCALE + 1  # maketable bins the normalised values on +-4 sigma
GRANULARITY = 50_000  # bins per sigma
# A uniform table, sent instead of none on change: the kernel keeps the previous table when a
# change carries none and cannot be told to drop it. Odd steps over (-1, 1) sigma, mean 0.
UNIFORM_TABLE = tuple(range(-NETEM_DIST_SCALE + 1, NETEM_DIST_SCALE, 2))


@functools.cache
def distribution_table(name: str) -> tuple[int, ...]:
    """The delay table `tc ... distribution NAME` sends: iproute2's NAME.dist, as s16 values.

    'uniform' has no file (netem's built-in law needs no table): `UNIFORM_TABLE` stands in.
    """
    if name == "uniform":
        return UNIFORM_TABLE
    for folder in _tc_lib_dirs():
        path = folder / f"{name}.dist"
        if path.is_file():
            return tuple(
                int(word, 0)
                for line in path.read_text().splitlines()
                if line.strip() and not line.startswith("#")
                for word in line.split()
            )
    tried = ", ".join(str(folder) for folder in _tc_lib_dirs())
    raise FileNotFoundError(
        f"delay distribution {name!r} needs iproute2's table {name}.dist (looked in {tried}); "
        "install iproute2 or set TC_LIB_DIR to the folder that holds it"
    )


def _tc_lib_dirs() -> Iterator[Path]:
    """Where tc looks for tables (TC_LIB_DIR, else its LIBDIR/tc), Debian's path first."""
    if os.environ.get("TC_LIB_DIR"):
        yield Path(os.environ["TC_LIB_DIR"])
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        yield Path("/usr/lib", multiarch, "tc")
    yield from (Path("/usr/lib/tc"), Path("/usr/lib64/tc"))


@dataclass(frozen=True)
class SampleTable:
    """A table made from samples, with the mean and standard deviation (in the samples' own
    unit) that netem needs as delay and jitter, and the table's digest."""

    table: tuple[int, ...]
    mean: float
    stdev: float
    digest: str


def sample_table(path: str | Path, column: str | None = None) -> SampleTable:
    """The table of the delays in `path` (one number a line, or the CSV column `column`).

    Raises ValueError naming the file (and the line) when it cannot be read or has too little
    to make a table of."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from None
    return _sample_table(path.resolve(), column, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _sample_table(path: Path, column: str | None, mtime_ns: int, size: int) -> SampleTable:
    """Read and tabulated once per version of the file (its time and size are in the key)."""
    values = read_samples(path, column)
    mean, stdev = maketable_stats(values)
    if not stdev > 0:
        raise ValueError(f"{path}: the samples do not vary (standard deviation 0): a table "
                         "needs at least two different values")
    table = make_table(values, mean, stdev)
    return SampleTable(table, mean, stdev, table_digest(table))


def read_samples(path: Path, column: str | None = None) -> np.ndarray:
    """The numbers in `path`: one a line (blank lines and '#' comments skipped), or the column
    named `column` of a CSV file with a header row. Raises ValueError naming file and line."""
    try:
        with path.open(newline="") as file:
            found = _csv_column(file, path, column) if column else _lines(file, path)
            values = np.array([_number(text, path, line) for line, text in found])
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    if values.size < 2:
        raise ValueError(f"{path}: a table needs at least 2 samples, found {values.size}")
    return values


def _lines(file, path: Path) -> Iterator[tuple[int, str]]:
    for line, text in enumerate(file, start=1):
        text = text.strip()
        if text and not text.startswith("#"):
            yield line, text


def _csv_column(file, path: Path, column: str) -> Iterator[tuple[int, str]]:
    reader = csv.reader(file)
    header = [name.strip() for name in next(reader, [])]
    if column not in header:
        raise ValueError(f"{path}: no column {column!r} in its header row "
                         f"(columns: {', '.join(header) or 'none'})")
    index = header.index(column)
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        if index >= len(row):
            raise ValueError(f"{path} line {reader.line_num}: no value in column {column!r}")
        yield reader.line_num, row[index].strip()


def _number(text: str, path: Path, line: int) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{path} line {line}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{path} line {line}: expected a finite number, got {text!r}")
    return value


def maketable_stats(values: np.ndarray) -> tuple[float, float]:
    """Mean and sample standard deviation as maketable computes them (sums in file order,
    then sqrt((sum of squares - n mean^2) / (n - 1))), so the table matches its output."""
    n = values.size
    mean = float(np.cumsum(values)[-1]) / n
    sumsquare = float(np.cumsum(values * values)[-1])
    variance = (sumsquare - n * mean * mean) / (n - 1)
    return mean, math.sqrt(variance) if variance > 0 else 0.0


def make_table(values: np.ndarray, mean: float, stdev: float) -> tuple[int, ...]:
    """maketable's inverse-CDF table of the values normalised by `mean` and `stdev`."""
    bins = 2 * DOMAIN * GRANULARITY
    index = np.rint(((values - mean) / stdev + DOMAIN) * GRANULARITY)
    counts = np.bincount(np.clip(index, 0, bins - 1).astype(np.int64), minlength=bins)
    cumulative = np.cumsum(counts)
    # Each bin writes its value at the quantile its cumulative count rounds to; the last bin of
    # a quantile wins, as in maketable's loop.
    quantile = np.minimum(np.rint(cumulative / cumulative[-1] * TABLE_SIZE), TABLE_SIZE - 1)
    value = np.clip(np.rint((np.arange(bins) / GRANULARITY - DOMAIN) * NETEM_DIST_SCALE),
                    S16_MIN + 1, S16_MAX)
    last = np.append(quantile[1:] != quantile[:-1], True)
    table = np.full(TABLE_SIZE, S16_MIN, dtype=np.int64)
    table[quantile[last].astype(np.int64)] = value[last]
    return tuple(_interpolate(table).tolist())


def _interpolate(table: np.ndarray) -> np.ndarray:
    """maketable's fill of the quantiles no bin wrote: on the line between the written ones
    around (S16_MIN before the first, S16_MAX after the last), in C's integer arithmetic."""
    positions = np.arange(table.size)
    written = table != S16_MIN
    before = np.maximum.accumulate(np.where(written, positions, -1))
    after = np.minimum.accumulate(np.where(written, positions, table.size)[::-1])[::-1]
    start = np.where(before >= 0, table[np.maximum(before, 0)], S16_MIN)
    end = np.where(after < table.size, table[np.minimum(after, table.size - 1)], S16_MAX)
    rise = (positions - before) * (end - start)
    step = np.sign(rise) * (np.abs(rise) // np.maximum(after - before, 1))  # C: towards 0
    return np.where(written, table, start + step)


def table_digest(table: tuple[int, ...]) -> str:
    """A short, stable name of a table's contents (what the kernel is given)."""
    return hashlib.blake2b(np.asarray(table, dtype="<i2").tobytes(), digest_size=8).hexdigest()
