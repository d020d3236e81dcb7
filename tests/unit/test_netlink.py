"""netem's netlink encoding without a kernel: the attributes of the request, and the decoding
back into a profile (a request and a dump share one layout)."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyroute2.netlink import NLA_F_NESTED
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from netem import netlink
from netem.distribution import UNIFORM_TABLE, distribution_table, sample_table
from netem.netlink import (
    U32_MAX,
    NetemOptions,
    NetemQdiscMsg,
    add_netem,
    forget_annotations,
    profile_from_options,
    qdisc_request,
    read_netem,
)
from netem.profile import GilbertElliott, LinkProfile

EXAMPLE = LinkProfile.parse(
    delay="20ms",
    jitter="5ms",
    delay_correlation="25%",
    distribution="normal",
    loss="1%",
    rate="10mbit",
)
GE = {"p": "1%", "r": "20%", "1-h": "70%", "1-k": "0.1%"}


def options(profile: LinkProfile, command: str = "add") -> NetemOptions:
    """Encode the request for the profile, then decode its bytes as a fresh message."""
    msg = qdisc_request(3, "root", "1:", profile, command=command)
    msg.encode()
    decoded = NetemQdiscMsg(msg.data)
    decoded.decode()
    assert decoded.get_attr("TCA_KIND") == "netem"
    return decoded.nla("TCA_OPTIONS")


def test_probabilities_are_u32_rounded_like_tc():
    profile = LinkProfile.parse(
        loss="1%", loss_correlation="100%", duplicate="0.000000001", corrupt="50%"
    )
    opts = options(profile)
    assert opts["loss"] == 42949673  # rint(0.01 * (2**32 - 1)), pyroute2 would truncate
    assert opts.get_attr("TCA_NETEM_CORR")["loss_corr"] == U32_MAX
    assert opts["duplicate"] == 4
    assert opts.get_attr("TCA_NETEM_CORRUPT")["probability"] == 2147483648


def test_gilbert_elliott_is_sent_as_the_kernels_p_r_h_k1():
    opts = options(LinkProfile.parse(gilbert_elliott=GE))
    ge = opts.get_attr("TCA_NETEM_LOSS").get_attr("NETEM_LOSS_GE")
    assert dict(ge) == {
        "p": round(0.01 * U32_MAX),
        "r": round(0.2 * U32_MAX),
        "h": U32_MAX - round(0.7 * U32_MAX),  # h: the chance to pass in the bad state
        "k1": round(0.001 * U32_MAX),
    }
    assert opts["loss"] == 0
    loss = opts.nla("TCA_NETEM_LOSS")
    assert struct.unpack_from("HH", loss.data, loss.offset)[1] == 5 | NLA_F_NESTED  # as tc


def test_times_go_as_exact_nanoseconds():
    opts = options(LinkProfile.parse(delay="1.000000001s", jitter="333ns"))
    assert opts.get_attr("TCA_NETEM_LATENCY64") == 1_000_000_001
    assert opts.get_attr("TCA_NETEM_JITTER64") == 333
    assert (opts["latency"], opts["jitter"]) == (0, 0)  # the old 64 ns ticks, unused (as tc)


@pytest.mark.parametrize(
    ("rate", "rate32", "rate64"),
    [("10mbit", 1_250_000, None), ("50gbit", U32_MAX, 6_250_000_000), (None, 0, None)],
)
def test_rate_is_netems_own_attribute_in_bytes(rate, rate32, rate64):
    opts = options(LinkProfile.parse(rate=rate))
    assert dict(opts.get_attr("TCA_NETEM_RATE")) == {
        "rate": rate32,
        "packet_overhead": 0,
        "cell_size": 0,
        "cell_overhead": 0,
    }
    assert opts.get_attr("TCA_NETEM_RATE64") == rate64


def test_no_generic_tca_rate_is_sent():
    """pyroute2's own encoder adds TCA_RATE (type 5) to the message, which netem rejects."""
    msg = qdisc_request(3, "root", "1:", EXAMPLE)
    msg.encode()
    offset, types = 36, []  # after nlmsghdr (16) and struct tcmsg (20)
    while offset < len(msg.data):
        length, kind = struct.unpack_from("HH", msg.data, offset)
        types.append(kind)
        offset += (length + 3) & ~3
    assert types == [1, 2]  # TCA_KIND, TCA_OPTIONS


def test_every_attribute_goes_even_when_zero():
    """netem keeps whatever a change leaves out: a perfect profile must reset everything."""
    opts = options(LinkProfile())
    names = [slot.name for slot in opts["attrs"]]
    assert names == [
        "TCA_NETEM_LATENCY64",
        "TCA_NETEM_JITTER64",
        "TCA_NETEM_CORR",
        "TCA_NETEM_REORDER",
        "TCA_NETEM_CORRUPT",
        "TCA_NETEM_RATE",
        "TCA_NETEM_ECN",
        "TCA_NETEM_SLOT",
    ]


def test_reorder_without_gap_sends_tcs_gap_of_one():
    assert options(LinkProfile.parse(delay="10ms", reorder="25%"))["gap"] == 1
    assert options(LinkProfile.parse(delay="10ms", reorder="25%", gap=7))["gap"] == 7
    assert options(LinkProfile.parse(delay="10ms"))["gap"] == 0


def test_distribution_table_is_iproutes():
    table = options(EXAMPLE).get_attr("TCA_NETEM_DELAY_DIST")
    assert table == distribution_table("normal")
    assert len(table) == 4096 and table[0] == -32768  # the first value of normal.dist


@pytest.mark.parametrize(
    ("profile", "command", "table"),
    [
        (LinkProfile.parse(delay="10ms", jitter="1ms"), "add", None),
        (LinkProfile.parse(delay="10ms", jitter="1ms"), "change", UNIFORM_TABLE),
        (LinkProfile.parse(delay="10ms", jitter="1ms"), "replace", UNIFORM_TABLE),
        (LinkProfile.parse(delay="10ms"), "change", None),
    ],
)
def test_uniform_table_replaces_an_old_table_on_change(profile, command, table):
    assert options(profile, command).get_attr("TCA_NETEM_DELAY_DIST") == table


def test_uniform_table_is_uniform_over_one_sigma():
    assert len(UNIFORM_TABLE) == 8192
    assert sum(UNIFORM_TABLE) == 0
    assert (min(UNIFORM_TABLE), max(UNIFORM_TABLE)) == (-8191, 8191)


def test_unknown_table_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("TC_LIB_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"experimental2.dist.*{tmp_path}.*TC_LIB_DIR"):
        distribution_table("experimental2")


def test_bad_command():
    with pytest.raises(ValueError, match="command: expected one of add, change, replace"):
        qdisc_request(3, "root", "1:", EXAMPLE, command="delete")


fractions = st.integers(0, 10**9).map(lambda n: n / 10**9)


@st.composite
def profiles(draw) -> LinkProfile:
    delay = draw(st.integers(0, 10**10)) / 10**9
    jitter = draw(st.integers(0, 2**31 - 1)) / 10**9 if delay else 0.0
    bursty = draw(st.booleans())
    reorder = draw(fractions) if delay else 0.0
    shapes = st.sampled_from(["normal", "pareto", "uniform"])
    ge = GilbertElliott(
        p=draw(fractions), r=draw(fractions), loss_bad=draw(fractions), loss_good=draw(fractions)
    )
    return LinkProfile(
        delay=delay,
        jitter=jitter,
        delay_correlation=draw(fractions),
        distribution=draw(shapes) if jitter else "uniform",
        loss=0.0 if bursty else draw(fractions),
        loss_correlation=draw(fractions),
        gilbert_elliott=ge if bursty else None,
        duplicate=draw(fractions),
        duplicate_correlation=draw(fractions),
        corrupt=draw(fractions),
        corrupt_correlation=draw(fractions),
        reorder=reorder,
        reorder_correlation=draw(fractions) if reorder else 0.0,
        gap=draw(st.just(0) | st.integers(2, 2**32 - 1)) if reorder else 0,
        rate=draw(st.none() | st.integers(1, 10**12).map(lambda n: n * 8)),
        limit=draw(st.integers(1, 2**32 - 1)),
    )


@given(profiles(), st.sampled_from(["add", "change"]))
def test_request_decodes_to_the_profile(profile, command):
    assert profile_from_options(options(profile, command), profile.distribution) == profile


def test_unsupported_settings_are_named():
    opts = NetemOptions()
    opts["limit"] = 1000
    opts["attrs"] = [["TCA_NETEM_LOSS", {"attrs": [["NETEM_LOSS_GI", "00" * 20]]}]]
    opts.encode()
    decoded = NetemOptions(opts.data)
    decoded.decode()
    with pytest.raises(ValueError, match="netem uses 4-state loss, which LinkProfile cannot"):
        profile_from_options(decoded)


class FakeRoute:
    """Stands in for IPRoute: keeps what was sent, dumps it back parsed as pyroute2 does."""

    def __init__(self) -> None:
        self.sent: list[NetemQdiscMsg] = []

    def nlm_request_batch(self, msgs):
        self.sent.extend(msgs)
        return iter(())

    def get_qdiscs(self, index=None):
        for msg in self.sent:
            msg.encode()
            dumped = tcmsg(msg.data)
            dumped.decode()
            if dumped["index"] == index:
                yield dumped


def test_annotations_give_the_distribution_back(monkeypatch, tmp_path):
    monkeypatch.setattr(netlink, "ANNOTATIONS", tmp_path)
    ipr = FakeRoute()
    add_netem(ipr, 7, "1:1", "10:", EXAMPLE, annotate="ns-a/eth0")
    assert ipr.sent[0]["header"]["flags"] & 0x600 == 0x600  # NLM_F_CREATE | NLM_F_EXCL
    assert (ipr.sent[0]["parent"], ipr.sent[0]["handle"]) == (0x10001, 0x100000)
    assert json.loads((tmp_path / "ns-a%2Feth0.json").read_text()) == {"10:": "normal"}
    assert read_netem(ipr, 7, "10:", annotate="ns-a/eth0") == EXAMPLE
    assert read_netem(ipr, 7, "10:").distribution == "uniform"  # the kernel keeps no name
    forget_annotations("ns-a/eth0")
    assert list(tmp_path.iterdir()) == []
    assert read_netem(ipr, 7, "10:", annotate="ns-a/eth0").distribution == "uniform"
    forget_annotations("ns-a/eth0")  # nothing left: no error


def test_reading_a_missing_qdisc():
    with pytest.raises(LookupError, match="no qdisc 5: on interface 7"):
        read_netem(FakeRoute(), 7, "5:")


def test_annotate_needs_a_handle():
    with pytest.raises(ValueError, match="explicit handle"):
        add_netem(FakeRoute(), 7, "root", 0, EXAMPLE, annotate="ns/eth0")


@pytest.mark.parametrize("command", ["add", "change", "replace"])
def test_a_seed_goes_as_a_u64_with_every_command(command):
    """netem re-seeds at random on a change without a seed (kernels before 2026): a profile's
    seed goes with every change too."""
    assert options(LinkProfile.parse(loss="1%"), command).get_attr("TCA_NETEM_PRNG_SEED") is None
    seeded = LinkProfile.parse(loss="1%", seed=2**64 - 1)
    assert options(seeded, command).get_attr("TCA_NETEM_PRNG_SEED") == 2**64 - 1


def test_a_seed_reads_back_only_where_it_is_the_profiles():
    seeded = LinkProfile.parse(loss="10%", seed=42)
    assert profile_from_options(options(seeded), seeded=True) == seeded
    # A dump always carries a seed, the kernel's own where none was given: not the profile's.
    assert profile_from_options(options(seeded)) == LinkProfile.parse(loss="10%")


def test_ecn_rate_overheads_and_slot_are_encoded():
    profile = LinkProfile.parse(
        loss="5%", ecn=True, rate="10mbit", packet_overhead=-4, cell_size=48, cell_overhead=5,
        slot={"min_delay": "1ms", "max_delay": "5.000001ms", "max_packets": 10,
              "max_bytes": 15000},
    )
    opts = options(profile)
    assert opts.get_attr("TCA_NETEM_ECN") == 1
    assert dict(opts.get_attr("TCA_NETEM_RATE")) == {
        "rate": 1_250_000, "packet_overhead": -4, "cell_size": 48, "cell_overhead": 5,
    }
    assert dict(opts.get_attr("TCA_NETEM_SLOT")) == {
        "min_delay": 1_000_000, "max_delay": 5_000_001, "max_packets": 10, "max_bytes": 15000,
        "dist_delay": 0, "dist_jitter": 0,
    }
    assert opts.get_attr("TCA_NETEM_SLOT_DIST") is None
    assert profile_from_options(opts) == profile


def test_no_ecn_and_no_slot_go_as_zeros_so_that_a_change_removes_them():
    opts = options(LinkProfile(), "change")
    assert opts.get_attr("TCA_NETEM_ECN") == 0
    assert set(dict(opts.get_attr("TCA_NETEM_SLOT")).values()) == {0}
    assert profile_from_options(opts) == LinkProfile()


@pytest.mark.parametrize(
    ("shape", "command", "sent"),
    [("pareto", "add", "pareto"), ("uniform", "add", None), ("uniform", "change", "uniform")],
)
def test_a_slot_distribution_goes_with_its_table(shape, command, sent):
    profile = LinkProfile.parse(slot={"distribution": shape, "delay": "4ms", "jitter": "1ms"})
    opts = options(profile, command)
    slot = dict(opts.get_attr("TCA_NETEM_SLOT"))
    assert (slot["min_delay"], slot["dist_delay"], slot["dist_jitter"]) == (0, 4_000_000, 10**6)
    table = opts.get_attr("TCA_NETEM_SLOT_DIST")
    assert table == (None if sent is None else distribution_table(sent))
    assert opts.get_attr("TCA_NETEM_DELAY_DIST") is None  # the jitter's table is another
    assert profile_from_options(opts, slot_distribution=shape) == profile
    assert profile_from_options(opts).slot.distribution == "uniform"  # no record: uniform


def test_a_samples_distribution_goes_with_the_table_made_from_them(tmp_path):
    samples = tmp_path / "rtt.txt"
    samples.write_text("10\n12\n11\n30\n")
    profile = LinkProfile.parse(distribution={"samples": str(samples), "unit": "ms"})
    opts = options(profile)
    assert opts.get_attr("TCA_NETEM_DELAY_DIST") == sample_table(samples).table
    assert profile_from_options(opts, profile.distribution.model_dump()) == profile
    samples.write_text("10\n12\n11\n31\n")
    with pytest.raises(ValueError, match=r"rtt\.txt: the file changed since the profile was made"):
        options(profile)


times = st.integers(1, 10**10).map(lambda n: n / 10**9)
slots = st.builds(
    lambda low, extra, packets, size: {"min_delay": low, "max_delay": low + extra,
                                       "max_packets": packets, "max_bytes": size},
    times, times, st.integers(0, 2**31 - 2), st.integers(0, 2**31 - 2),
) | st.builds(
    lambda shape, delay, jitter: {"distribution": shape, "delay": delay, "jitter": jitter},
    st.sampled_from(["uniform", "normal", "pareto"]), times,
    st.integers(1, 2**31 - 1).map(lambda n: n / 10**9),
)


@st.composite
def profiles_with_new_fields(draw) -> LinkProfile:
    rate = draw(st.none() | st.integers(1, 10**12).map(lambda n: n * 8))
    cell_size = draw(st.integers(0, 2**32 - 1)) if rate else 0
    bursty = draw(st.booleans())
    loss = 0.0 if bursty else draw(fractions)
    return LinkProfile.build({
        "loss": loss,
        "gilbert_elliott": {"p": draw(fractions)} if bursty else None,
        "ecn": draw(st.booleans()) if bursty or loss else False,
        "rate": rate,
        "packet_overhead": draw(st.integers(-(2**31), 2**31 - 1)) if rate else 0,
        "cell_size": cell_size,
        "cell_overhead": draw(st.integers(-(2**31), 2**31 - 1)) if cell_size else 0,
        "slot": draw(st.none() | slots),
        "seed": draw(st.none() | st.integers(0, 2**64 - 1)),
    })


@given(profiles_with_new_fields(), st.sampled_from(["add", "change"]))
def test_request_with_new_fields_decodes_to_the_profile(profile, command):
    slot = profile.slot
    shape = slot.distribution if slot is not None and slot.distribution is not None else "uniform"
    decoded = profile_from_options(options(profile, command), slot_distribution=shape, seeded=True)
    assert decoded == profile


def test_annotations_give_distributions_and_seed_back(monkeypatch, tmp_path):
    monkeypatch.setattr(netlink, "ANNOTATIONS", tmp_path / "records")
    samples = tmp_path / "rtt.txt"
    samples.write_text("10\n12\n11\n30\n")
    profile = LinkProfile.parse(
        distribution={"samples": str(samples), "unit": "ms"}, loss="1%", seed=7,
        slot={"distribution": "pareto", "delay": "4ms", "jitter": "1ms"},
    )
    ipr = FakeRoute()
    add_netem(ipr, 7, "1:1", "10:", profile, annotate="ns-a/eth0")
    record = json.loads((tmp_path / "records" / "ns-a%2Feth0.json").read_text())
    assert record == {"10:": {"distribution": profile.distribution.model_dump(),
                              "slot_distribution": "pareto", "seeded": True}}
    assert read_netem(ipr, 7, "10:", annotate="ns-a/eth0") == profile
    bare = read_netem(ipr, 7, "10:")
    assert (bare.distribution, bare.slot.distribution, bare.seed) == ("uniform", "uniform", None)
