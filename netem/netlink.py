"""The netem qdisc through rtnetlink (pyroute2): install a `LinkProfile`, read it back.

pyroute2's own netem encoder cannot be used as it is: `rate=` adds the generic TCA_RATE that
netem rejects (ERANGE), it truncates probabilities, counts time in whole microseconds, knows
neither Gilbert-Elliott loss nor delay distribution tables. So netem's TCA_OPTIONS are encoded
here the way iproute2's `tc` sends them (tc/q_netem.c), and the kernel's dump is decoded back.
docs/netlink.md explains the choices: the GE mapping, the tables, the rate, the annotations.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
from collections.abc import Iterator
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

from netem.profile import GilbertElliott, LinkProfile
from netem.tc import format_handle, tc_handle

U32_MAX = 2**32 - 1
PSCHED_SHIFT = 6  # the kernel's old time unit (qopt.latency) is 64 ns; LATENCY64 is exact
NETEM_DIST_SCALE = 8192  # a table entry of NETEM_DIST_SCALE stands for one jitter (sigma)
ANNOTATIONS = Path("/run/netem-testbed/netem")
# Flags as `tc qdisc add|change|replace` sends them.
_FLAGS = {
    "add": NLM_F_CREATE | NLM_F_EXCL,
    "change": 0,
    "replace": NLM_F_CREATE | NLM_F_REPLACE,
}
# A uniform table, sent instead of none on change: the kernel keeps the previous table when a
# change carries none and cannot be told to drop it. Odd steps over (-1, 1) sigma, mean 0.
UNIFORM_TABLE = tuple(range(-NETEM_DIST_SCALE + 1, NETEM_DIST_SCALE, 2))


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
        ("TCA_NETEM_SLOT", "hex"),
        ("TCA_NETEM_SLOT_DIST", "none"),
        ("TCA_NETEM_PRNG_SEED", "none"),
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


def netem_options(profile: LinkProfile, *, table: tuple[int, ...] | None = None) -> dict:
    """The TCA_OPTIONS value for `NetemOptions` that installs the profile.

    Every attribute the profile covers is sent, zeros included, so that a change replaces all of
    the old settings (netem keeps whatever a change leaves out). The delay table is the one
    exception: pass it in `table` (see `add_netem`).
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
    attrs.append(
        [
            "TCA_NETEM_RATE",
            {
                "rate": min(rate, U32_MAX),
                "packet_overhead": 0,
                "cell_size": 0,
                "cell_overhead": 0,
            },
        ]
    )
    if table is not None:
        attrs.append(["TCA_NETEM_DELAY_DIST", table])
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


def qdisc_request(
    ifindex: int,
    parent: int | str,
    handle: int | str,
    profile: LinkProfile,
    *,
    command: str = "add",
) -> NetemQdiscMsg:
    """The RTM_NEWQDISC message `add_netem` sends (exposed to test the encoding without a kernel).

    A table goes with every profile whose distribution is not uniform, and on change/replace with
    a uniform one too (`UNIFORM_TABLE`): otherwise a table installed before would stay.
    """
    if command not in _FLAGS:
        raise ValueError(f"command: expected one of {', '.join(_FLAGS)}, got {command!r}")
    table = None
    if profile.jitter and (profile.distribution != "uniform" or command != "add"):
        table = distribution_table(profile.distribution)
    msg = NetemQdiscMsg()
    msg["family"] = 0
    msg["index"] = ifindex
    msg["handle"] = tc_handle(handle)
    msg["parent"] = tc_handle(parent)
    msg["attrs"] = [
        ["TCA_KIND", "netem"],
        ["TCA_OPTIONS", netem_options(profile, table=table)],
    ]
    return msg


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
    class such as '1:1'; `handle` is the qdisc's own ('10:'). With `annotate`, the distribution
    (which the kernel does not dump) is recorded under that key for `read_netem`.
    """
    if annotate is not None and not tc_handle(handle):
        raise ValueError("handle: recording the distribution needs an explicit handle, not 0")
    msg = qdisc_request(ifindex, parent, handle, profile, command=command)
    _request(ipr, msg, RTM_NEWQDISC, _FLAGS[command])
    if annotate is not None:
        _record(annotate, tc_handle(handle), profile.distribution)


def read_netem(
    ipr: Any, ifindex: int, handle: int | str, *, annotate: str | None = None
) -> LinkProfile:
    """The profile of the netem qdisc with that handle on the interface, as the kernel has it.

    The kernel does not dump the delay table: the distribution is what `add_netem` recorded
    under `annotate`, uniform without a record. Settings a `LinkProfile` cannot describe (4-state
    loss, ecn, slots, rate overheads) raise ValueError rather than being dropped.
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
    distribution = _recorded(annotate, wanted) if annotate is not None else "uniform"
    return profile_from_options(options, distribution)


def _request(ipr: Any, msg: nlmsg, msg_type: int, flags: int) -> None:
    """Send one request and wait for its acknowledgement; a refusal raises NetlinkError.

    `nlm_request_batch`, because pyroute2 0.9.7's synchronous `nlm_request` fails on IPRoute
    (KeyError 'nlm_generator').
    """
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | flags
    list(ipr.nlm_request_batch([msg]))


def profile_from_options(options: NetemOptions, distribution: str = "uniform") -> LinkProfile:
    """Decode netem's options (a dump, or a request) into a profile."""
    attr = options.get_attr
    corr, rate, loss = attr("TCA_NETEM_CORR"), attr("TCA_NETEM_RATE"), attr("TCA_NETEM_LOSS")
    unsupported = [
        name
        for name, used in (
            ("4-state loss", loss is not None and loss.get_attr("NETEM_LOSS_GI") is not None),
            ("ecn", bool(attr("TCA_NETEM_ECN"))),
            ("slot", attr("TCA_NETEM_SLOT") is not None),
            (
                "rate overheads",
                rate is not None
                and any(rate[k] for k in ("packet_overhead", "cell_size", "cell_overhead")),
            ),
        )
        if used
    ]
    if unsupported:
        raise ValueError(f"netem uses {', '.join(unsupported)}, which LinkProfile cannot describe")
    latency = attr("TCA_NETEM_LATENCY64", options["latency"] << PSCHED_SHIFT)
    jitter = attr("TCA_NETEM_JITTER64", options["jitter"] << PSCHED_SHIFT)
    rate_bytes = attr("TCA_NETEM_RATE64", rate["rate"] if rate is not None else 0)
    gemodel = loss.get_attr("NETEM_LOSS_GE") if loss is not None else None
    values: dict[str, Any] = {
        "delay": latency / 1e9,
        "jitter": jitter / 1e9,
        "distribution": distribution if jitter else "uniform",
        "loss": _fraction(options["loss"]) if gemodel is None else 0.0,
        "duplicate": _fraction(options["duplicate"]),
        "limit": options["limit"],
        "gap": 0 if options["gap"] == 1 else options["gap"],  # 1 is tc's default for 0
        "rate": rate_bytes * 8 or None,
    }
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


def _annotation_file(key: str) -> Path:
    return ANNOTATIONS / f"{quote(key, safe='')}.json"


def _records(key: str) -> dict[str, str]:
    try:
        return json.loads(_annotation_file(key).read_text())
    except FileNotFoundError:
        return {}


def _record(key: str, handle: int, distribution: str) -> None:
    """Write {handle: distribution} into the key's file, atomically (write, then rename)."""
    records = _records(key) | {format_handle(handle): distribution}
    path = _annotation_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(records, sort_keys=True))
    scratch.replace(path)


def _recorded(key: str, handle: int) -> str:
    return _records(key).get(format_handle(handle), "uniform")


def forget_annotations(annotate: str) -> None:
    """Remove what `add_netem` recorded under this key (every handle), if anything."""
    _annotation_file(annotate).unlink(missing_ok=True)
