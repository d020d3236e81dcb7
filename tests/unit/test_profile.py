"""LinkProfile: unit parsing, validation errors that name the field, and lossless round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from netem import GilbertElliott, LinkProfile, ProfileError
from netem.profile import MAX_JITTER
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
    [("100mbit", 100_000_000), ("1gbit", 10**9), ("500kbit", 500_000), ("10mbps", 80_000_000)],
)
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


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
