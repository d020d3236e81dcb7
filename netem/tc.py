"""How tc spells things: handles, and a netem qdisc's arguments.

Pure text, no kernel: plans render their dry-run command lines with it (`Plan` steps'
`commands()`), the netlink encoder parses handles given in tc's spelling, and the guest tests
hand `tc` the same arguments to check that it agrees with the netlink encoding.
"""

from __future__ import annotations

from pathlib import Path

from pyroute2.netlink.rtnl import TC_H_ROOT

from netem.profile import LinkProfile, SampledDistribution, Slot
from netem.units import format_fraction


def tc_handle(value: int | str) -> int:
    """A qdisc or class handle from an int, 'root', '1:', '1:0' or '1:a' (hexadecimal, like tc)."""
    if isinstance(value, int):
        return value
    if value == "root":
        return TC_H_ROOT
    major, colon, minor = value.partition(":")
    try:
        if not colon:
            raise ValueError
        return (int(major or "0", 16) << 16) | int(minor or "0", 16)
    except ValueError:
        raise ValueError(
            f"expected a handle such as 'root', '1:' or '1:1', got {value!r}"
        ) from None


def format_handle(handle: int) -> str:
    """tc's spelling of a handle: '1:' for a qdisc, '1:a' for a class."""
    if handle == TC_H_ROOT:
        return "root"
    major, minor = handle >> 16, handle & 0xFFFF
    return f"{major:x}:" + (f"{minor:x}" if minor else "")


def netem_tc_args(profile: LinkProfile) -> list[str]:
    """The `tc qdisc ... netem` arguments for the profile, in the order of tc-netem(8).

    Times and rates are written in the largest unit that keeps them exact (tc truncates). A
    distribution made from samples is named by its file's stem: tc reads it from STEM.dist in
    its TC_LIB_DIR (iproute2's maketable makes one). `seed` needs iproute2 6.6 or later.
    """
    args = ["limit", str(profile.limit)]
    dup_corr_only = profile.duplicate_correlation and not (
        profile.delay_correlation
        or profile.loss_correlation
        or profile.reorder_correlation
        or profile.corrupt_correlation
    )
    if profile.delay or profile.jitter or profile.delay_correlation:
        args += ["delay", _tc_time(profile.delay)]
        if profile.jitter or profile.delay_correlation:
            args.append(_tc_time(profile.jitter))
        if profile.delay_correlation:
            args.append(format_fraction(profile.delay_correlation))
        if profile.distribution != "uniform":
            args += ["distribution", _table_name(profile.distribution)]
    # tc sends the correlations only if one of delay, loss, reorder or corrupt has one: a lone
    # duplicate correlation goes out with an explicit (zero) loss correlation.
    if profile.loss or profile.loss_correlation or dup_corr_only:
        args += ["loss", "random", format_fraction(profile.loss)]
        if profile.loss_correlation or dup_corr_only:
            args.append(format_fraction(profile.loss_correlation))
    if profile.gilbert_elliott is not None:
        ge = profile.gilbert_elliott
        args += ["loss", "gemodel"]
        args += [format_fraction(v) for v in (ge.p, ge.r, ge.loss_bad, ge.loss_good)]
    if profile.ecn:
        args.append("ecn")
    for name in ("corrupt", "duplicate", "reorder"):
        value, correlation = getattr(profile, name), getattr(profile, f"{name}_correlation")
        if value or correlation:
            args += [name, format_fraction(value)]
            if correlation:
                args.append(format_fraction(correlation))
    if profile.gap:
        args += ["gap", str(profile.gap)]
    if profile.rate:
        args += ["rate", _tc_rate(profile.rate)]
        # Overheads are positional: each one before the last given goes too, zero or not.
        overheads = [profile.packet_overhead, profile.cell_size, profile.cell_overhead]
        while overheads and not overheads[-1]:
            overheads.pop()
        args += [str(value) for value in overheads]
    if profile.slot is not None:
        args += _slot_args(profile.slot)
    if profile.seed is not None:
        args += ["seed", str(profile.seed)]
    return args


def _slot_args(slot: Slot) -> list[str]:
    if slot.distribution is None:
        args = ["slot", _tc_time(slot.min_delay), _tc_time(slot.max_delay)]
    else:
        args = ["slot", "distribution", _table_name(slot.distribution), _tc_time(slot.delay),
                _tc_time(slot.jitter)]
    if slot.max_packets:
        args += ["packets", str(slot.max_packets)]
    if slot.max_bytes:
        args += ["bytes", str(slot.max_bytes)]
    return args


def _table_name(distribution: str | SampledDistribution) -> str:
    if isinstance(distribution, SampledDistribution):
        return Path(distribution.samples).stem
    return distribution


def _tc_time(seconds: float) -> str:
    ns = round(seconds * 1e9)
    for unit, scale in (("s", 10**9), ("ms", 10**6), ("us", 10**3)):
        if ns and ns % scale == 0:
            return f"{ns // scale}{unit}"
    return f"{ns}ns"


def _tc_rate(bits_per_second: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_second % scale == 0:
            return f"{bits_per_second // scale}{unit}"
    return f"{bits_per_second}bit"
