"""Parsing of the human units that link profiles are written in ("10ms", "5%", "100mbit").

Every parser accepts either a number in base units (seconds, a 0..1 fraction, bits per second)
or a string with a unit, and raises ``ValueError`` with a message that says what is allowed.
Human input of a link's times and rates asks for the unit (`unit_required`): a bare `delay: 5`
would be 5 seconds where 5 ms was meant, a bare `rate: 100` 100 bit/s; only 0 needs none.
"""

from __future__ import annotations

import math
import re

_NUMBER = r"(-?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"

_TIME_UNITS = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "ms": 1e-3,
    "msec": 1e-3,
    "us": 1e-6,
    "usec": 1e-6,
    "ns": 1e-9,
    "nsec": 1e-9,
}
_RATE_UNITS = {
    "": 1,
    "bit": 1,
    "bps": 8,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
TIME_HELP = "a duration such as '10ms', '1.5s', '250us' or a number of seconds"
FRACTION_HELP = "a percentage such as '5%' or a fraction between 0 and 1"
RATE_HELP = "a rate such as '100mbit', '1gbit', '500kbit' (bits/s) or '10mbps' (bytes/s)"
SIZE_HELP = "a size such as '20MB', '512kB', '1MiB' or a number of bytes"


def _split(text: str, units: dict, help_text: str) -> tuple[float, str]:
    match = re.fullmatch(_NUMBER + r"\s*([a-zA-Z%]*)", text.strip())
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"expected {help_text}, got {text!r}")
    return _finite(float(match.group(1)), text, help_text), match.group(2).lower()


def _finite(number: float, value: object, help_text: str) -> float:
    if not math.isfinite(number):
        raise ValueError(f"expected {help_text} (a finite number), got {value!r}")
    return number


def _number(value: object, help_text: str) -> float | None:
    """Return a plain number, or None if ``value`` is a string to parse; reject other types
    and numbers that are not finite."""
    if isinstance(value, bool):
        raise ValueError(f"expected {help_text}, got {value!r}")
    if isinstance(value, int | float):
        return _finite(float(value), value, help_text)
    if isinstance(value, str):
        return None
    raise ValueError(f"expected {help_text}, got {value!r}")


def parse_time(value: object, *, unit_required: bool = False) -> float:
    """Seconds from '10ms', '1.5s', '250us', '3ns' or a number of seconds (with
    `unit_required`, only from a string with its unit, or 0)."""
    number = _number(value, TIME_HELP)
    unit = ""
    if number is None:
        magnitude, unit = _split(str(value), _TIME_UNITS, TIME_HELP)
        number = magnitude * _TIME_UNITS[unit]
    if unit_required and not unit and number != 0:
        raise ValueError(f"{value!r} has no unit: write '{_bare(value)}ms' or '{_bare(value)}s' "
                         "(a bare number would be seconds)")
    if number < 0:
        raise ValueError(f"expected {TIME_HELP} (not negative), got {value!r}")
    return number


def parse_fraction(value: object) -> float:
    """A probability 0..1 from '5%', '0.5%' or a fraction such as 0.05."""
    number = _number(value, FRACTION_HELP)
    if number is None:
        text = str(value).strip()
        if text.endswith("%"):
            magnitude, _ = _split(text[:-1], {"": 1}, FRACTION_HELP)
            number = magnitude / 100.0
        else:
            number, _ = _split(text, {"": 1}, FRACTION_HELP)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"expected {FRACTION_HELP}, got {value!r}")
    return number


def parse_rate(value: object, *, unit_required: bool = False) -> int:
    """Bits per second from '100mbit', '1gbit', '10mbps' (bytes) or a number of bits/s (with
    `unit_required`, only from a string with its unit)."""
    number = _number(value, RATE_HELP)
    unit = ""
    if number is None:
        magnitude, unit = _split(str(value), _RATE_UNITS, RATE_HELP)
        number = magnitude * _RATE_UNITS[unit]
    if unit_required and not unit and number != 0:
        raise ValueError(f"{value!r} has no unit: write '{_bare(value)}mbit' or "
                         f"'{_bare(value)}kbit' (a bare number would be bits/s)")
    if number <= 0:
        raise ValueError(f"expected {RATE_HELP} (greater than zero), got {value!r}")
    return round(number)


def _bare(value: object) -> str:
    return str(value).strip()


def parse_size(value: object, *, unit_required: bool = False) -> int:
    """Bytes from '20MB', '512kB' (powers of 1000), '1MiB' (powers of 1024) or a number (with
    `unit_required`, only from a string with its unit, or 0)."""
    number = _number(value, SIZE_HELP)
    unit = ""
    if number is None:
        magnitude, unit = _split(str(value), _SIZE_UNITS, SIZE_HELP)
        number = magnitude * _SIZE_UNITS[unit]
    if unit_required and not unit and number != 0:
        raise ValueError(f"{value!r} has no unit: write '{_bare(value)}MB' or "
                         f"'{_bare(value)}kB' (a bare number would be bytes)")
    if number < 0:
        raise ValueError(f"expected {SIZE_HELP} (not negative), got {value!r}")
    return round(number)


def format_size(size: int) -> str:
    """'20MB', '1.5kB', '300B' (powers of 1000), or '1MiB', '64KiB' for whole powers of 1024."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0 and size % 1000:
            return f"{size >> shift}{unit}"
    for unit, digits in (("GB", 9), ("MB", 6), ("kB", 3)):
        if size >= 10**digits:
            return f"{_trim(size / 10**digits, digits)}{unit}"
    return f"{size}B"


def format_time(seconds: float) -> str:
    """The shortest exact human form, to the nanosecond: '20ms', '1.5s', '250us'."""
    for unit, digits in (("s", 9), ("ms", 6), ("us", 3)):
        scale = 10.0 ** (digits - 9)
        if seconds >= scale:
            return f"{_trim(seconds / scale, digits)}{unit}"
    return f"{round(seconds * 1e9)}ns"


def format_fraction(fraction: float) -> str:
    """A percentage exact to the 9 decimals a fraction is kept to: '5%', '0.0001%'."""
    return f"{_trim(fraction * 100, 7)}%"


def format_rate(bits_per_second: int) -> str:
    for unit, digits in (("gbit", 9), ("mbit", 6), ("kbit", 3)):
        if bits_per_second >= 10**digits:
            return f"{_trim(bits_per_second / 10**digits, digits)}{unit}"
    return f"{bits_per_second}bit"


def _trim(number: float, digits: int) -> str:
    return f"{number:.{digits}f}".rstrip("0").rstrip(".")
