"""LinkProfile: unit parsing, validation errors that name the field, and lossless round trips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from netem import GilbertElliott, LinkProfile, ProfileError
from netem.netlink import qdisc_request
from netem.profile import (
    MAX_JITTER,
    MAX_RATE,
    MAX_S64_SECONDS,
    S32_MAX,
    S32_MIN,
    U32_MAX,
    U64_MAX,
    derive_seed,
)
from netem.units import parse_fraction, parse_rate, parse_time


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10ms", 0.01), ("1.5s", 1.5), ("250us", 250e-6), ("3ns", 3e-9), (0.2, 0.2), ("7", 7.0)],
)
def test_parse_time(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "fraction"), [("5%", 0.05), ("0.5%", 0.005), ("0.05", 0.05), (1, 1.0), ("100%", 1.0)]
)
def test_parse_fraction(text, fraction):
    assert parse_fraction(text) == pytest.approx(fraction)


@pytest.mark.parametrize(
    ("text", "bits"),
    [("100mbit", 100_000_000), ("1gbit", 10**9), ("500kbit", 500_000), ("1tbit", 10**12)],
)
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize(("text", "as_bytes", "as_bits"), [
    ("100mbps", "800mbit", "100mbit"), ("1.5Gbps", "12gbit", "1.5gbit"),
    ("10 KBPS", "80kbit", "10kbit"), ("64bps", "512bit", "64bit"), ("1tbps", "8tbit", "1tbit")])
def test_a_rate_in_bps_is_refused_naming_both_readings(text, as_bytes, as_bits):
    """tc reads 'mbps' as megabytes per second, most tools and people as megabits: neither is
    guessed."""
    with pytest.raises(ValueError, match="ambiguous") as error:
        parse_rate(text)
    assert f"'{as_bytes}'" in str(error.value) and f"'{as_bits}'" in str(error.value)
    assert "bytes per second" in str(error.value) and "bits per second" in str(error.value)


@pytest.mark.parametrize(
    ("spec", "field", "allowed"),
    [
        ({"loss": "150%"}, "loss", "percentage"),
        ({"loss": "-1%"}, "loss", "percentage"),
        ({"loss": True}, "loss", "percentage"),
        ({"delay": "10 parsecs"}, "delay", "duration"),
        ({"delay": "-5ms"}, "delay", "not negative"),
        ({"rate": "0mbit"}, "rate", "greater than zero"),
        ({"rate": "fast"}, "rate", "100mbit"),
        (
            {"distribution": "gauss", "delay": "1ms", "jitter": "1ms"},
            "distribution",
            "paretonormal",
        ),
        ({"lose": "5%"}, "lose", "allowed: delay, jitter"),
        ({"limit": 0}, "limit", "greater than or equal to 1"),
        ({"gap": -1}, "gap", "greater than or equal to 0"),
        ({"delay": "5s", "jitter": "3s"}, "jitter", "at most 2.147483647s"),
        ({"gilbert_elliott": {"p": "1%", "q": 1}}, "gilbert_elliott.q", "allowed: p, r, 1-h, 1-k"),
        ({"gilbert_elliott": {"p": "200%"}}, "gilbert_elliott.p", "percentage"),
    ],
)
def test_bad_field_is_named_with_what_is_allowed(spec, field, allowed):
    with pytest.raises(ProfileError) as error:
        LinkProfile.parse(spec)
    message = str(error.value)
    assert f"{field}: " in message
    assert allowed in message


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"jitter": "5ms"}, "jitter needs a delay"),
        ({"delay": "5ms", "distribution": "normal"}, "needs a jitter"),
        ({"loss": "1%", "gilbert_elliott": {"p": "1%"}}, "not both"),
        ({"reorder": "10%"}, "reorder needs a delay"),
        ({"delay": "1ms", "gap": 5}, "gap needs reorder"),
    ],
)
def test_inconsistent_combinations_are_explained(spec, reason):
    with pytest.raises(ProfileError, match=reason):
        LinkProfile.parse(spec)


def test_profiles_are_immutable():
    profile = LinkProfile.parse(loss="5%")
    with pytest.raises(ValueError, match="frozen"):
        profile.loss = 0.1  # type: ignore[misc]


def test_values_sit_on_the_kernel_grid():
    profile = LinkProfile.parse(delay="1.0000000004s", loss="0.1", rate="1001bit")
    assert profile.delay == 1.0
    assert profile.loss == 0.1
    assert profile.rate == 1000  # whole bytes per second


def test_gilbert_elliott_stationary_loss_and_bursts():
    model = GilbertElliott(p=0.01, r=0.3, loss_bad=0.9, loss_good=0.0)
    assert model.mean_loss == pytest.approx(0.01 / 0.31 * 0.9)
    assert model.mean_burst == pytest.approx(1 / 0.3)
    assert LinkProfile(gilbert_elliott=model).mean_loss == model.mean_loss


def test_netem_features_lists_what_needs_netem():
    assert LinkProfile.parse(loss="5%", rate="10mbit").netem_features() == set()
    profile = LinkProfile.parse(delay="10ms", jitter="2ms", distribution="pareto", duplicate="1%")
    assert profile.netem_features() == {"delay", "jitter", "distribution", "duplicate"}


fractions = st.integers(0, 10**9).map(lambda n: n / 10**9)
durations = st.integers(0, 10**10).map(lambda n: n / 10**9)


@st.composite
def profiles(draw) -> LinkProfile:
    delay = draw(durations)
    jitter = min(draw(durations), MAX_JITTER) if delay else 0.0
    bursty = draw(st.booleans())
    reorder = draw(fractions) if delay else 0.0
    return LinkProfile(
        delay=delay,
        jitter=jitter,
        delay_correlation=draw(fractions),
        distribution=draw(st.sampled_from(["normal", "pareto"])) if jitter else "uniform",
        loss=0.0 if bursty else draw(fractions),
        gilbert_elliott=GilbertElliott(p=draw(fractions), r=draw(fractions)) if bursty else None,
        duplicate=draw(fractions),
        corrupt=draw(fractions),
        reorder=reorder,
        gap=draw(st.integers(0, 10)) if reorder else 0,
        rate=draw(st.none() | st.integers(1, 10**11).map(lambda n: n * 8)),
        limit=draw(st.integers(1, 100_000)),
    )


@given(profiles())
def test_human_spec_round_trips(profile):
    assert LinkProfile.parse(profile.to_spec()) == profile


@given(profiles())
def test_json_round_trips(profile):
    assert LinkProfile.model_validate_json(profile.model_dump_json()) == profile


@pytest.mark.parametrize(
    ("spec", "field", "allowed"),
    [
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"seed": 2**64}, "seed", "less than or equal to 18446744073709551615"),
        ({"rate": "1mbit", "packet_overhead": -(2**31) - 1}, "packet_overhead", "-2147483648"),
        ({"rate": "1mbit", "cell_size": 2**32}, "cell_size", "4294967295"),
        ({"rate": "1mbit", "cell_size": 1, "cell_overhead": 2**31}, "cell_overhead", "2147483647"),
        ({"slot": {"min_delay": "1ms", "max_packets": -1}}, "slot.max_packets", "0"),
        ({"slot": {"min_delay": "1ms", "max_bytes": 2**31}}, "slot.max_bytes", "2147483647"),
        ({"slot": {"min_delay": "300y"}}, "slot.min_delay", "duration"),
        ({"slot": {"min_delay": "9223372037s"}}, "slot.min_delay", "9223372036"),
        ({"slot": {"min_delay": 5}}, "slot.min_delay", "'5ms'"),
        ({"slot": {"min": "1ms"}}, "slot.min", "allowed: min_delay, max_delay, distribution"),
        ({"slot": {"distribution": "gauss", "delay": "1ms", "jitter": "1ms"}},
         "slot.distribution", "paretonormal"),
        ({"slot": {"distribution": "normal", "delay": "1ms", "jitter": "3s"}},
         "slot.jitter", "at most 2.147483647s"),
        ({"distribution": 7, "delay": "1ms", "jitter": "1ms"}, "distribution", "{samples: FILE}"),
        ({"distribution": {"samples": "x.txt", "unit": "ms", "colum": "a"}}, "distribution.colum",
         "allowed: samples, column, unit, digest"),
    ],
)
def test_bad_new_field_is_named_with_what_is_allowed(spec, field, allowed):
    with pytest.raises(ProfileError) as error:
        LinkProfile.parse(spec)
    message = str(error.value)
    assert f"{field}: " in message
    assert allowed in message


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"ecn": True}, "ecn needs a loss model"),
        ({"ecn": True, "duplicate": "1%"}, "ecn needs a loss model"),
        ({"packet_overhead": 20}, "packet_overhead, cell_size and cell_overhead need a rate"),
        ({"cell_size": 48}, "need a rate"),
        ({"rate": "1mbit", "cell_overhead": 5}, "cell_overhead needs a cell_size"),
        ({"slot": {}}, "slot: give min_delay and max_delay"),
        ({"slot": {"min_delay": "5ms", "max_delay": "1ms"}}, "max_delay (1ms) must be at least"),
        ({"slot": {"delay": "5ms", "jitter": "1ms"}}, "are a slot distribution's"),
        ({"slot": {"distribution": "normal", "delay": "5ms"}}, "slot distribution needs a jitter"),
        ({"slot": {"distribution": "normal", "min_delay": "1ms", "delay": "5ms", "jitter": "1ms"}},
         "not both"),
    ],
)
def test_inconsistent_new_combinations_are_explained(spec, reason):
    with pytest.raises(ProfileError, match=re.escape(reason)):
        LinkProfile.parse(spec)


def test_ecn_takes_either_loss_model():
    assert LinkProfile.parse(loss="1%", ecn=True).ecn
    assert LinkProfile.parse(gilbert_elliott={"p": "1%"}, ecn=True).ecn


def test_slot_kinds_and_their_defaults():
    fixed = LinkProfile.parse(slot={"min_delay": "2ms"}).slot
    assert (fixed.min_delay, fixed.max_delay, fixed.max_packets, fixed.max_bytes) == (
        0.002, 0.002, 0, 0)
    shaped = LinkProfile.parse(slot={"distribution": "pareto", "delay": "4ms", "jitter": "1ms",
                                     "max_packets": 2**31 - 1}).slot
    assert (shaped.distribution, shaped.delay, shaped.jitter) == ("pareto", 0.004, 0.001)
    assert shaped.max_packets == 0  # netem's "no limit" is kept as 0, as it dumps it
    features = LinkProfile.parse(slot={"min_delay": "2ms"}, loss="1%", ecn=True).netem_features()
    assert features == {"slot", "ecn"}


def test_a_seed_is_any_u64_and_changes_nothing_else():
    assert LinkProfile.parse(seed=0).seed == 0
    assert LinkProfile.parse(seed=2**64 - 1).seed == 2**64 - 1
    assert LinkProfile.parse(loss="1%", seed=7).model_copy(update={"seed": None}) == (
        LinkProfile.parse(loss="1%"))
    assert LinkProfile.parse(seed=7).netem_features() == set()


def test_derive_seed_is_stable_and_differs_per_link():
    assert derive_seed(42, "198.18.0.1", "198.18.0.2") == 11054158419401772146
    assert derive_seed(42, 0, 1) != derive_seed(42, 1, 0) != derive_seed(43, 1, 0)
    assert derive_seed(42, "0", "1") != derive_seed(42, 0, 1)
    assert 0 <= derive_seed(-5) < 2**64
    LinkProfile.parse(seed=derive_seed(2**70, "a"))  # always a valid seed
    with pytest.raises(TypeError, match="run_seed: expected an integer"):
        derive_seed(True, 1)  # type: ignore[arg-type]


def samples_file(tmp_path) -> str:
    path = tmp_path / "rtt.txt"
    path.write_text("# one-way delays, ms\n10\n12\n11\n30\n")
    return str(path)


def test_samples_give_the_delay_and_jitter_unless_given(tmp_path):
    samples = samples_file(tmp_path)
    measured = LinkProfile.parse(distribution={"samples": samples, "unit": "ms"})
    assert measured.delay == pytest.approx(0.01575)  # the mean
    assert measured.jitter == pytest.approx(0.009535023, abs=1e-9)  # the standard deviation
    assert measured.distribution.samples == samples
    assert measured.netem_features() == {"delay", "jitter", "distribution"}
    given = LinkProfile.parse(delay="50ms", jitter="1ms",
                              distribution={"samples": samples, "unit": "us"})
    assert (given.delay, given.jitter) == (0.05, 0.001)
    seconds = tmp_path / "seconds.txt"
    seconds.write_text("0.010\n0.012\n0.011\n0.030\n")
    in_seconds = LinkProfile.build({"distribution": {"samples": str(seconds)}})  # base units
    assert (in_seconds.delay, in_seconds.jitter) == (measured.delay, measured.jitter)
    slot = LinkProfile.parse(slot={"distribution": {"samples": samples, "unit": "us"}}).slot
    assert (slot.delay, slot.jitter) == (15.75e-6, 9.535e-6)  # on the nanosecond grid


def test_samples_need_their_unit_in_human_input(tmp_path):
    with pytest.raises(ProfileError, match=r"distribution: give the unit of the samples' values"):
        LinkProfile.parse(distribution={"samples": samples_file(tmp_path)})
    with pytest.raises(ProfileError, match=r"distribution.unit: expected a time unit"):
        LinkProfile.parse(distribution={"samples": samples_file(tmp_path), "unit": "5ms"})


def test_a_bad_samples_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "rtt.txt"
    path.write_text("10\n12\nlost\n")
    with pytest.raises(ProfileError, match=r"distribution: .*rtt.txt line 3: expected a number"):
        LinkProfile.parse(distribution={"samples": str(path), "unit": "ms"})


def test_samples_round_trip_by_their_digest_without_the_file(tmp_path):
    samples = samples_file(tmp_path)
    profile = LinkProfile.parse(distribution={"samples": samples, "unit": "ms"}, loss="1%")
    table = profile.distribution.table()
    assert len(table) == 4096
    Path(samples).unlink()  # what was made is kept: the file is not read again
    assert LinkProfile.parse(profile.to_spec()) == profile
    assert LinkProfile.model_validate_json(profile.model_dump_json()) == profile
    Path(samples).write_text("1\n2\n3\n")
    with pytest.raises(ValueError, match=r"rtt.txt: the file changed since the profile was made"):
        profile.distribution.table()


@st.composite
def profiles_with_new_fields(draw) -> LinkProfile:
    rate = draw(st.none() | st.integers(1, 10**11).map(lambda n: n * 8))
    cell_size = draw(st.integers(0, 2**32 - 1)) if rate else 0
    times = st.integers(1, 10**10).map(lambda n: n / 10**9)
    slot = draw(st.none() | st.builds(
        lambda low, extra, packets, size: {"min_delay": low, "max_delay": low + extra,
                                           "max_packets": packets, "max_bytes": size},
        times, st.integers(0, 10**9).map(lambda n: n / 10**9), st.integers(0, 2**31 - 2),
        st.integers(0, 2**31 - 2),
    ) | st.builds(
        lambda shape, delay, jitter: {"distribution": shape, "delay": delay, "jitter": jitter},
        st.sampled_from(["uniform", "normal", "pareto"]), times,
        st.integers(1, 2**31 - 1).map(lambda n: n / 10**9),
    ))
    loss = draw(fractions)
    return LinkProfile.build({
        "loss": loss,
        "ecn": draw(st.booleans()) if loss else False,
        "rate": rate,
        "packet_overhead": draw(st.integers(-(2**31), 2**31 - 1)) if rate else 0,
        "cell_size": cell_size,
        "cell_overhead": draw(st.integers(-(2**31), 2**31 - 1)) if cell_size else 0,
        "slot": slot,
        "seed": draw(st.none() | st.integers(0, 2**64 - 1)),
    })


@given(profiles_with_new_fields())
def test_new_fields_round_trip(profile):
    assert LinkProfile.parse(profile.to_spec()) == profile
    assert LinkProfile.model_validate_json(profile.model_dump_json()) == profile


# Every field at the most the kernel stores is taken and encoded; one past it is refused, the
# message saying the bound; a value the grid would make 0 is refused, not dropped.
LARGEST = {"delay": f"{MAX_S64_SECONDS}s", "rate": f"{MAX_RATE // 10**12}tbit",
           "limit": U32_MAX, "gap": U32_MAX, "packet_overhead": S32_MAX, "cell_size": U32_MAX,
           "cell_overhead": S32_MIN, "seed": U64_MAX}


@pytest.mark.parametrize(("field", "value"), LARGEST.items(), ids=list(LARGEST))
def test_the_largest_value_of_each_field_reaches_the_kernel_encoded(field, value):
    needs = {"gap": {"delay": "1ms", "reorder": "1%"}, "packet_overhead": {"rate": "1mbit"},
             "cell_size": {"rate": "1mbit"},
             "cell_overhead": {"rate": "1mbit", "cell_size": 48}}.get(field, {})
    profile = LinkProfile.parse({**needs, field: value})
    qdisc_request(3, "root", "1:", profile).encode()  # struct.error if a field overflowed
    slot = LinkProfile.parse(slot={"min_delay": f"{MAX_S64_SECONDS}s"})
    qdisc_request(3, "root", "1:", slot).encode()


@pytest.mark.parametrize(("spec", "field", "said"), [
    ({"delay": "100000000000000s"}, "delay", f"at most {MAX_S64_SECONDS}s"),
    ({"delay": "1s", "jitter": "1e14s"}, "jitter", "at most"),
    ({"slot": {"min_delay": "1e14s"}}, "slot.min_delay", f"at most {MAX_S64_SECONDS}s"),
    ({"slot": {"distribution": "normal", "delay": "1e12s", "jitter": "1ms"}}, "slot.delay",
     f"at most {MAX_S64_SECONDS}s"),
    ({"rate": "1000000000000gbit"}, "rate", f"at most {MAX_RATE // 10**12}tbit"),
    ({"loss": "0.00000001%"}, "loss", "at least 0.0000001%"),
    ({"loss": 1e-10}, "loss", "at least 0.0000001%"),
    ({"delay": "0.1ns"}, "delay", "at least 1ns"),
    ({"gilbert_elliott": {"p": 4e-10}}, "gilbert_elliott.p", "at least 0.0000001%"),
    ({"delay": "1ms", "duplicate": "1e-12"}, "duplicate", "at least 0.0000001%"),
])
def test_a_value_beyond_what_the_kernel_stores_is_refused_saying_the_bound(spec, field, said):
    with pytest.raises(ProfileError) as error:
        LinkProfile.parse(spec)
    assert f"{field}: " in str(error.value) and said in str(error.value), error.value


def test_code_in_base_units_may_give_less_than_the_grid_keeps():
    """A ramp's first moments or a probability read back from the kernel: rounded, not refused."""
    assert LinkProfile.build({"loss": 1e-10, "delay": 1e-10}) == LinkProfile()
