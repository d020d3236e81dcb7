"""Parsing of the human units that link profiles are written in ("10ms", "5%", "100mbit").

Every parser accepts either a number in base units (seconds, a 0..1 fraction, bits per second,
bytes) or a string with a unit, and raises ``ValueError`` with a message that says what is
allowed. Human input of a link's times and rates asks for the unit (`unit_required`): a bare
`delay: 5` would be 5 seconds where 5 ms was meant, a bare `rate: 100` 100 bit/s; only 0 needs
none.

One grammar serves every quantity: a number (digits, an optional point, an optional exponent;
no sign, so a leading '-' is refused as negative) and a unit of the quantity's table, in any
case. The parsers read strings with it, and `pattern` writes it as the regular expression a
JSON Schema checks the same strings with.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

_EXPONENT = r"(?:[eE][-+]?[0-9]+)?"
_NUMBER = r"[0-9]*\.?[0-9]+" + _EXPONENT
# The numbers of `_NUMBER` that are zero, and the others.
_ZERO = r"0*\.?0+" + _EXPONENT
_POSITIVE = r"(?:[0-9]*[1-9][0-9]*(?:\.[0-9]+)?|[0-9]*\.[0-9]*[1-9][0-9]*)" + _EXPONENT
# The numbers of `_NUMBER` from 0 to 1 and from 0 to 100, without an exponent: a range of
# numbers with one is beyond a regular expression (the parser takes '1e-2' all the same).
_UP_TO_ONE = r"0*(?:1(?:\.0+)?|0?\.[0-9]+|0)"
_UP_TO_HUNDRED = r"0*(?:100(?:\.0+)?|[0-9]{1,2}(?:\.[0-9]+)?|\.[0-9]+)"

TIME_HELP = "a duration such as '10ms', '1.5s', '250us' or a number of seconds"
FRACTION_HELP = "a percentage such as '5%' or a fraction between 0 and 1"
RATE_HELP = "a rate such as '100mbit', '1gbit' or '500kbit' (bits/s)"
SIZE_HELP = "a size such as '20MB', '512kB', '1MiB' or a number of bytes"


@dataclass(frozen=True)
class Quantity:
    """A kind of value: its units (lower case, each the base units it is worth; '' the base
    unit itself), what is allowed, and how a message asks for a unit."""

    units: Mapping[str, float]
    help: str
    bound: str  # what the range check says, after `help`
    positive: bool = False  # 0 refused too
    maximum: float | None = None
    base: str = ""  # what a bare number is
    suggested: tuple[str, ...] = ()  # units a message that asks for one offers

    def unit_pattern(self, *, required: bool = False) -> str:
        """Any of the units in any case ('ms', 'MS', 'Ms'), the longest first; optional where a
        bare number is in the base unit, unless `required`."""
        units = sorted((unit for unit in self.units if unit), key=len, reverse=True)
        choice = "|".join(
            "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in unit)
            for unit in units)
        return f"(?:{choice})" + ("" if required or "" not in self.units else "?")


QUANTITIES = {
    "time": Quantity(
        {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6,
         "ns": 1e-9, "nsec": 1e-9},
        TIME_HELP, " (not negative)", base="seconds", suggested=("ms", "s")),
    "fraction": Quantity({"": 1.0, "%": 0.01}, FRACTION_HELP, "", maximum=1),
    "rate": Quantity(
        {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12},
        RATE_HELP, " (greater than zero)", positive=True, base="bits/s",
        suggested=("mbit", "kbit")),
    "size": Quantity(
        {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
         "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30},
        SIZE_HELP, " (not negative)", base="bytes", suggested=("MB", "kB")),
}

# Rates in "bps" units: bytes per second to tc, bits per second to most tools and people, so
# refused as ambiguous (`parse_rate` names both readings).
_AMBIGUOUS_RATE = re.compile(rf"\s*({_NUMBER})\s*([kmgt]?)bps\s*", re.IGNORECASE)
_PREFIXES = {"": "", "k": "kilo", "m": "mega", "g": "giga", "t": "tera"}


def pattern(kind: str, *, unit_required: bool = False, positive: bool = False) -> str:
    """The regular expression (JSON Schema's dialect, which Python's `re` shares here) of the
    strings the parser of `kind` (a key of `QUANTITIES`) takes: with `unit_required`, only with
    a unit (but 0); with `positive` (or a quantity that refuses 0), not 0 either."""
    quantity = QUANTITIES[kind]
    positive = positive or quantity.positive
    if quantity.maximum is not None:
        if positive or unit_required:
            raise ValueError(f"{kind}: a pattern of its whole range only (0 too, no unit needed)")
        body = rf"{_UP_TO_HUNDRED}\s*%|{_UP_TO_ONE}"
    else:
        units = quantity.unit_pattern(required=unit_required)
        body = rf"{_POSITIVE if positive else _NUMBER}\s*{units}"
        if unit_required and not positive:
            body += f"|{_ZERO}"
    return rf"^\s*(?:{body})\s*$"


def _parse_quantity(value: object, quantity: Quantity, *, unit_required: bool = False) -> float:
    """`value` (a number in base units, or a string: a number and a unit) in base units."""
    number = _number(value, quantity.help)
    unit = ""
    if number is None:
        match = re.fullmatch(rf"(-?{_NUMBER})\s*({quantity.unit_pattern()})", str(value).strip())
        if not match:
            raise ValueError(f"expected {quantity.help}, got {value!r}")
        unit = match.group(2).lower()
        number = _finite(float(match.group(1)) * quantity.units[unit], value, quantity.help)
    if unit_required and not unit and number != 0:
        bare = str(value).strip()
        offered = " or ".join(f"'{bare}{suggested}'" for suggested in quantity.suggested)
        raise ValueError(f"{value!r} has no unit: write {offered} (a bare number would be "
                         f"{quantity.base})")
    signed = isinstance(value, str) and value.lstrip().startswith("-")  # even '-0'
    if (number < 0 or signed or (quantity.positive and number == 0)
            or (quantity.maximum is not None and number > quantity.maximum)):
        raise ValueError(f"expected {quantity.help}{quantity.bound}, got {value!r}")
    return number


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
    return _parse_quantity(value, QUANTITIES["time"], unit_required=unit_required)


def parse_fraction(value: object) -> float:
    """A probability 0..1 from '5%', '0.5%' or a fraction such as 0.05."""
    return _parse_quantity(value, QUANTITIES["fraction"])


def parse_rate(value: object, *, unit_required: bool = False) -> int:
    """Bits per second from '100mbit', '1gbit', '500kbit' or a number of bits/s (with
    `unit_required`, only from a string with its unit). '100mbps' is refused as ambiguous."""
    ambiguous = _AMBIGUOUS_RATE.fullmatch(value) if isinstance(value, str) else None
    if ambiguous:
        number, prefix = ambiguous.group(1), ambiguous.group(2).lower()
        as_bytes = _trim(float(number) * 8, 9)
        raise ValueError(
            f"expected a rate in bits per second, got {value!r}, which is ambiguous: tc reads "
            f"{prefix}bps as {_PREFIXES[prefix]}bytes per second ('{as_bytes}{prefix}bit'), "
            f"most tools as {_PREFIXES[prefix]}bits per second ('{number}{prefix}bit'): write "
            "the one you mean")
    return round(_parse_quantity(value, QUANTITIES["rate"], unit_required=unit_required))


def parse_size(value: object, *, unit_required: bool = False) -> int:
    """Bytes from '20MB', '512kB' (powers of 1000), '1MiB' (powers of 1024) or a number (with
    `unit_required`, only from a string with its unit, or 0)."""
    return round(_parse_quantity(value, QUANTITIES["size"], unit_required=unit_required))


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
