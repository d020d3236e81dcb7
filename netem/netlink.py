"""The netem qdisc through rtnetlink (pyroute2): install a `LinkProfile`, read it back.

pyroute2's own netem encoder cannot be used as it is: `rate=` adds the generic TCA_RATE that
netem rejects (ERANGE), it truncates probabilities, counts time in whole microseconds, knows
neither Gilbert-Elliott loss, delay distribution tables, slots nor seeds. So netem's TCA_OPTIONS
are encoded here the way iproute2's `tc` sends them (tc/q_netem.c), and the kernel's dump is
decoded back. docs/netlink.md explains the choices: the GE mapping, the tables, the rate, the
slots, the seed, the annotations.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pyroute2.netlink import (
    NLA_F_NESTED,
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_EXCL,
    NLM_F_REPLACE,
    NLM_F_REQUEST,
    nla,
    nlmsg,
)
from pyroute2.netlink.rtnl import RTM_NEWQDISC
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from netem.distribution import distribution_table
from netem.profile import GilbertElliott, LinkProfile, SampledDistribution, Slot
from netem.tc import format_handle, tc_handle

U32_MAX = 2**32 - 1
PSCHED_SHIFT = 6  # the kernel's old time unit (qopt.latency) is 64 ns; LATENCY64 is exact
ANNOTATIONS = Path("/run/netem-testbed/netem")
# Flags as `tc qdisc add|change|replace` sends them.
_FLAGS = {
    "add": NLM_F_CREATE | NLM_F_EXCL,
    "change": 0,
    "replace": NLM_F_CREATE | NLM_F_REPLACE,
}


class NetemOptions(nla):
    """netem's TCA_OPTIONS: struct tc_netem_qopt, then attributes (linux/pkt_sched.h)."""

    fields = (
        ("latency", "I"),
        ("limit", "I"),
        ("loss", "I"),
        ("gap", "I"),
        ("duplicate", "I"),
        ("jitter", "I"),
    )
    nla_map = (
        ("TCA_NETEM_UNSPEC", "none"),
        ("TCA_NETEM_CORR", "corr"),
        ("TCA_NETEM_DELAY_DIST", "array(int16)"),
        ("TCA_NETEM_REORDER", "probability"),
        ("TCA_NETEM_CORRUPT", "probability"),
        ("TCA_NETEM_LOSS", "loss_model"),
        ("TCA_NETEM_RATE", "rate"),
        ("TCA_NETEM_ECN", "uint32"),
        ("TCA_NETEM_RATE64", "uint64"),
        ("TCA_NETEM_PAD", "none"),
        ("TCA_NETEM_LATENCY64", "int64"),
        ("TCA_NETEM_JITTER64", "int64"),
        ("TCA_NETEM_SLOT", "slot"),
        ("TCA_NETEM_SLOT_DIST", "array(int16)"),
        ("TCA_NETEM_PRNG_SEED", "uint64"),
    )

    class corr(nla):
        fields = (("delay_corr", "I"), ("loss_corr", "I"), ("dup_corr", "I"))

    class probability(nla):
        """struct tc_netem_reorder and tc_netem_corrupt."""

        fields = (("probability", "I"), ("correlation", "I"))

    class rate(nla):
        fields = (
            ("rate", "I"),
            ("packet_overhead", "i"),
            ("cell_size", "I"),
            ("cell_overhead", "i"),
        )

    class slot(nla):
        """struct tc_netem_slot: times in ns; 0 packets or bytes is no limit."""

        fields = (
            ("min_delay", "q"),
            ("max_delay", "q"),
            ("max_packets", "i"),
            ("max_bytes", "i"),
            ("dist_delay", "q"),
            ("dist_jitter", "q"),
        )

    class loss_model(nla):
        nla_flags = NLA_F_NESTED
        nla_map = (
            ("NETEM_LOSS_UNSPEC", "none"),
            ("NETEM_LOSS_GI", "hex"),
            ("NETEM_LOSS_GE", "gemodel"),
        )

        class gemodel(nla):
            """The kernel's {p, r, h, k1}: h is the chance to *pass* in the bad state."""

            fields = (("p", "I"), ("r", "I"), ("h", "I"), ("k1", "I"))


class NetemQdiscMsg(nlmsg):
    """An RTM_NEWQDISC request for a netem qdisc (a tcmsg whose options are `NetemOptions`)."""

    fields = tcmsg.fields
    nla_map = (
        ("TCA_UNSPEC", "none"),
        ("TCA_KIND", "asciiz"),
        ("TCA_OPTIONS", "netem_options"),
    )
    netem_options = NetemOptions


def _u32(fraction: float) -> int:
    """A 0..1 probability on the kernel's u32 scale, rounded like tc's set_percent (rint)."""
    return round(fraction * U32_MAX)


def _fraction(value: int) -> float:
    return value / U32_MAX


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def netem_options(
    profile: LinkProfile,
    *,
    table: tuple[int, ...] | None = None,
    slot_table: tuple[int, ...] | None = None,
) -> dict:
    """The TCA_OPTIONS value for `NetemOptions` that installs the profile.

    Every attribute the profile covers is sent, zeros included, so that a change replaces all of
    the old settings (netem keeps whatever a change leaves out). The exceptions: the seed goes
    only when the profile has one (without, the kernel chooses), and the delay and slot tables
    only when given in `table` and `slot_table` (see `qdisc_request`).
    """
    ge = profile.gilbert_elliott
    rate = (profile.rate or 0) // 8  # bytes per second
    attrs: list[list[Any]] = [
        ["TCA_NETEM_LATENCY64", _ns(profile.delay)],
        ["TCA_NETEM_JITTER64", _ns(profile.jitter)],
        [
            "TCA_NETEM_CORR",
            {
                "delay_corr": _u32(profile.delay_correlation),
                "loss_corr": _u32(profile.loss_correlation),
                "dup_corr": _u32(profile.duplicate_correlation),
            },
        ],
        [
            "TCA_NETEM_REORDER",
            {
                "probability": _u32(profile.reorder),
                "correlation": _u32(profile.reorder_correlation),
            },
        ],
        [
            "TCA_NETEM_CORRUPT",
            {
                "probability": _u32(profile.corrupt),
                "correlation": _u32(profile.corrupt_correlation),
            },
        ],
    ]
    if ge is not None:
        gemodel = {
            "p": _u32(ge.p),
            "r": _u32(ge.r),
            "h": U32_MAX - _u32(ge.loss_bad),  # as tc does for its "1-h" argument
            "k1": _u32(ge.loss_good),
        }
        attrs.append(["TCA_NETEM_LOSS", {"attrs": [["NETEM_LOSS_GE", gemodel]]}])
    if rate > U32_MAX:
        attrs.append(["TCA_NETEM_RATE64", rate])
    attrs += [
        [
            "TCA_NETEM_RATE",
            {
                "rate": min(rate, U32_MAX),
                "packet_overhead": profile.packet_overhead,
                "cell_size": profile.cell_size,
                "cell_overhead": profile.cell_overhead,
            },
        ],
        ["TCA_NETEM_ECN", int(profile.ecn)],
        ["TCA_NETEM_SLOT", _slot_struct(profile.slot)],
    ]
    if profile.seed is not None:
        attrs.append(["TCA_NETEM_PRNG_SEED", profile.seed])
    if table is not None:
        attrs.append(["TCA_NETEM_DELAY_DIST", table])
    if slot_table is not None:
        attrs.append(["TCA_NETEM_SLOT_DIST", slot_table])
    return {
        "latency": 0,  # superseded by LATENCY64/JITTER64, as in tc
        "jitter": 0,
        "limit": profile.limit,
        "loss": _u32(profile.loss),
        # netem reorders only with a gap; tc's default gap is 1 (LinkProfile writes it 0).
        "gap": max(profile.gap, 1) if profile.reorder else profile.gap,
        "duplicate": _u32(profile.duplicate),
        "attrs": attrs,
    }


def _slot_struct(slot: Slot | None) -> dict[str, int]:
    """struct tc_netem_slot; all zeros (no slots) without one."""
    if slot is None:
        return dict.fromkeys((name for name, _ in NetemOptions.slot.fields), 0)
    return {
        "min_delay": _ns(slot.min_delay),
        "max_delay": _ns(slot.max_delay),
        "max_packets": slot.max_packets,
        "max_bytes": slot.max_bytes,
        "dist_delay": _ns(slot.delay),
        "dist_jitter": _ns(slot.jitter),
    }


def qdisc_request(
    ifindex: int,
    parent: int | str,
    handle: int | str,
    profile: LinkProfile,
    *,
    command: str = "add",
) -> NetemQdiscMsg:
    """The RTM_NEWQDISC message `add_netem` sends (exposed to test the encoding without a kernel).

    A table goes with every jitter whose distribution is not uniform, and on change/replace
    with a uniform one too (`UNIFORM_TABLE`): otherwise a table installed before would stay.
    The same holds for a slot distribution's table.
    """
    if command not in _FLAGS:
        raise ValueError(f"command: expected one of {', '.join(_FLAGS)}, got {command!r}")
    slot = profile.slot
    slot_table = None
    if slot is not None and slot.distribution is not None:
        slot_table = _table(slot.distribution, slot.jitter, command)
    msg = NetemQdiscMsg()
    msg["family"] = 0
    msg["index"] = ifindex
    msg["handle"] = tc_handle(handle)
    msg["parent"] = tc_handle(parent)
    msg["attrs"] = [
        ["TCA_KIND", "netem"],
        [
            "TCA_OPTIONS",
            netem_options(
                profile,
                table=_table(profile.distribution, profile.jitter, command),
                slot_table=slot_table,
            ),
        ],
    ]
    return msg


def _table(
    distribution: str | SampledDistribution, jitter: float, command: str
) -> tuple[int, ...] | None:
    """The table a jitter of this distribution needs sent with the command, if any."""
    if not jitter or (distribution == "uniform" and command == "add"):
        return None
    if isinstance(distribution, SampledDistribution):
        return distribution.table()
    return distribution_table(distribution)


def add_netem(
    ipr: Any,
    ifindex: int,
    parent: int | str,
    handle: int | str,
    profile: LinkProfile,
    *,
    command: str = "add",
    annotate: str | None = None,
) -> None:
    """Install (command 'add', 'change' or 'replace') a netem qdisc shaping as the profile says.

    `ipr` is a pyroute2 IPRoute/NetNS in the interface's namespace; `parent` is 'root' or a
    class such as '1:1'; `handle` is the qdisc's own ('10:'). With `annotate`, what the kernel
    does not dump (the distributions, whether the seed is the profile's) is recorded under that
    key for `read_netem`.
    """
    if annotate is not None and not tc_handle(handle):
        raise ValueError("handle: recording the distribution needs an explicit handle, not 0")
    msg = qdisc_request(ifindex, parent, handle, profile, command=command)
    _request(ipr, msg, RTM_NEWQDISC, _FLAGS[command])
    if annotate is not None:
        _record(annotate, tc_handle(handle), _undumped(profile))


def read_netem(
    ipr: Any, ifindex: int, handle: int | str, *, annotate: str | None = None
) -> LinkProfile:
    """The profile of the netem qdisc with that handle on the interface, as the kernel has it.

    The kernel does not dump the tables, and dumps a seed even where none was given (its own,
    random): the distributions and whether the seed is the profile's are what `add_netem`
    recorded under `annotate`; without a record, distributions read back as uniform and the
    seed as none. Settings a `LinkProfile` cannot describe (4-state loss) raise ValueError
    rather than being dropped.
    """
    wanted = tc_handle(handle)
    found = [q for q in ipr.get_qdiscs(index=ifindex) if q["handle"] == wanted]
    if not found:
        raise LookupError(f"no qdisc {format_handle(wanted)} on interface {ifindex}")
    reply = found[0]
    kind = reply.get_attr("TCA_KIND")
    if kind != "netem":
        raise ValueError(
            f"qdisc {format_handle(wanted)} on interface {ifindex} is {kind}, not netem"
        )
    raw = reply.nla("TCA_OPTIONS")
    options = NetemOptions(data=raw.data, offset=raw.offset, length=raw.length)
    options.decode()
    recorded = _recorded(annotate, wanted) if annotate is not None else {}
    return profile_from_options(options, **recorded)


def _request(ipr: Any, msg: nlmsg, msg_type: int, flags: int) -> None:
    """Send one request and wait for its acknowledgement; a refusal raises NetlinkError.

    `nlm_request_batch`, because pyroute2 0.9.7's synchronous `nlm_request` fails on IPRoute
    (KeyError 'nlm_generator').
    """
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | flags
    list(ipr.nlm_request_batch([msg]))


def profile_from_options(
    options: NetemOptions,
    distribution: str | Mapping[str, Any] = "uniform",
    *,
    slot_distribution: str | Mapping[str, Any] = "uniform",
    seeded: bool = False,
) -> LinkProfile:
    """Decode netem's options (a dump, or a request) into a profile.

    What the options do not carry comes as arguments: the distributions of the jitter and of a
    slot distribution (as `LinkProfile` takes them), and whether a seed in the options is the
    profile's (a dump has the kernel's own where none was given).
    """
    attr = options.get_attr
    corr, rate, loss = attr("TCA_NETEM_CORR"), attr("TCA_NETEM_RATE"), attr("TCA_NETEM_LOSS")
    if loss is not None and loss.get_attr("NETEM_LOSS_GI") is not None:
        raise ValueError("netem uses 4-state loss, which LinkProfile cannot describe")
    latency = attr("TCA_NETEM_LATENCY64", options["latency"] << PSCHED_SHIFT)
    jitter = attr("TCA_NETEM_JITTER64", options["jitter"] << PSCHED_SHIFT)
    rate_bytes = attr("TCA_NETEM_RATE64", rate["rate"] if rate is not None else 0)
    gemodel = loss.get_attr("NETEM_LOSS_GE") if loss is not None else None
    values: dict[str, Any] = {
        "delay": latency / 1e9,
        "jitter": jitter / 1e9,
        "distribution": distribution if jitter else "uniform",
        "loss": _fraction(options["loss"]) if gemodel is None else 0.0,
        "ecn": bool(attr("TCA_NETEM_ECN")),
        "duplicate": _fraction(options["duplicate"]),
        "limit": options["limit"],
        "gap": 0 if options["gap"] == 1 else options["gap"],  # 1 is tc's default for 0
        "rate": rate_bytes * 8 or None,
        "slot": _slot(attr("TCA_NETEM_SLOT"), slot_distribution),
        "seed": attr("TCA_NETEM_PRNG_SEED") if seeded else None,
    }
    if rate is not None:
        values |= {name: rate[name] for name in ("packet_overhead", "cell_size", "cell_overhead")}
    if corr is not None:
        values |= {
            "delay_correlation": _fraction(corr["delay_corr"]),
            "loss_correlation": _fraction(corr["loss_corr"]),
            "duplicate_correlation": _fraction(corr["dup_corr"]),
        }
    for name in ("reorder", "corrupt"):
        pair = attr(f"TCA_NETEM_{name.upper()}")
        if pair is not None:
            values[name] = _fraction(pair["probability"])
            values[f"{name}_correlation"] = _fraction(pair["correlation"])
    if gemodel is not None:
        values["gilbert_elliott"] = GilbertElliott(
            p=_fraction(gemodel["p"]),
            r=_fraction(gemodel["r"]),
            loss_bad=_fraction(U32_MAX - gemodel["h"]),
            loss_good=_fraction(gemodel["k1"]),
        )
    return LinkProfile.build(values)


def _slot(
    slot: NetemOptions.slot | None, distribution: str | Mapping[str, Any]
) -> dict[str, Any] | None:
    """A slot's fields from struct tc_netem_slot; None where it makes no slots (all zero)."""
    if slot is None or not (slot["min_delay"] or slot["max_delay"] or slot["dist_jitter"]):
        return None
    limits = {"max_packets": slot["max_packets"], "max_bytes": slot["max_bytes"]}
    if slot["dist_jitter"]:
        times = {"distribution": distribution, "delay": slot["dist_delay"] / 1e9,
                 "jitter": slot["dist_jitter"] / 1e9}
    else:
        times = {"min_delay": slot["min_delay"] / 1e9, "max_delay": slot["max_delay"] / 1e9}
    return times | limits


def _annotation_file(key: str) -> Path:
    return ANNOTATIONS / f"{quote(key, safe='')}.json"


def _records(key: str) -> dict[str, str | dict[str, Any]]:
    try:
        return json.loads(_annotation_file(key).read_text())
    except FileNotFoundError:
        return {}


def _undumped(profile: LinkProfile) -> str | dict[str, Any]:
    """What a dump lacks of the profile, as `profile_from_options` takes it: the jitter's
    distribution (its name alone when that is all), a slot's, and whether the seed is the
    profile's."""
    record: dict[str, Any] = {}
    if profile.slot is not None and profile.slot.distribution is not None:
        record["slot_distribution"] = _dumped(profile.slot.distribution)
    if profile.seed is not None:
        record["seeded"] = True
    if not record and isinstance(profile.distribution, str):
        return profile.distribution
    return {"distribution": _dumped(profile.distribution), **record}


def _dumped(distribution: str | SampledDistribution) -> str | dict[str, Any]:
    return distribution if isinstance(distribution, str) else distribution.model_dump()


def _record(key: str, handle: int, undumped: str | dict[str, Any]) -> None:
    """Write {handle: undumped} into the key's file, atomically (write, then rename)."""
    records = _records(key) | {format_handle(handle): undumped}
    path = _annotation_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(records, sort_keys=True))
    scratch.replace(path)


def _recorded(key: str, handle: int) -> dict[str, Any]:
    """The keyword arguments of `profile_from_options` recorded for the handle."""
    record = _records(key).get(format_handle(handle), "uniform")
    return {"distribution": record} if isinstance(record, str) else record


def forget_annotations(annotate: str) -> None:
    """Remove what `add_netem` recorded under this key (every handle), if anything."""
    _annotation_file(annotate).unlink(missing_ok=True)
