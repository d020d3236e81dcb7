"""The pytest plugin without a network (no root): it is installed (the `netem` marker and the
fixtures are there in every pytest run), a marker with a bad field fails its test naming the
field, what the marker and the factory take (`NetworkSpec`, its seed), the marker that replays a
failed test, and a measurement's verdict."""

from __future__ import annotations

import numpy as np
import pytest

from netem.probe import Check, Train, analyze
from netem.profile import LinkProfile, ProfileError
from testbed.pytest_plugin import replay_marker
from testbed.pytest_plugin.network import Measurement, NetworkSpec, drawn_seed

pytest_plugins = ["pytester"]


def test_the_plugin_registers_its_marker_and_fixtures(pytester: pytest.Pytester):
    markers = pytester.runpytest_subprocess("--markers")
    markers.stdout.fnmatch_lines(["@pytest.mark.netem(profile=None, /, *, hosts=2, *"])
    fixtures = pytester.runpytest_subprocess("--fixtures")
    fixtures.stdout.fnmatch_lines(["make_netem_network -- *", "netem_network -- *",
                                   "netem_scenario -- *"])


BAD_MARKERS = [  # (the marker's arguments, what its test's error says)
    ('delya="5ms"', ["@pytest.mark.netem: unknown field 'delya': expected a link profile's "
                     "fields (delay, *) or hosts, links, scenario"]),
    ('loss="5 percent"', ["@pytest.mark.netem: invalid link profile:", "  loss: *"]),
    ('{"lost": "5%"}', ["@pytest.mark.netem: profile: unknown field 'lost'*"]),
    ('jitter="5ms"', ["@pytest.mark.netem: invalid link profile:", "  *jitter needs a delay*"]),
    ("hosts=0", ["@pytest.mark.netem: hosts: expected a number of hosts (1 or more), got 0"]),
    ('links={(0, 1, 2): {"loss": "5%"}}',
     ["@pytest.mark.netem: links: expected (src, dst) host indices as keys, got (0, 1, 2)"]),
    ('links={(0, 1): {"loss": "50"}}',
     ["@pytest.mark.netem: links[[](0, 1)[]]: invalid link profile:", "  loss: *"]),
    ('loss="5%", scenario="quickstart"',
     ["@pytest.mark.netem: give a profile or a scenario (*), not both"]),
]


def test_a_bad_marker_fails_its_test_naming_the_field(pytester: pytest.Pytester):
    pytester.makepyfile("import pytest\n" + "".join(f"""
@pytest.mark.netem({marker})
def test_{number}(netem_network):
    raise AssertionError("never reached: the marker is checked first")
""" for number, (marker, _) in enumerate(BAD_MARKERS)))
    result = pytester.runpytest()
    result.assert_outcomes(errors=len(BAD_MARKERS))
    for number, (_, says) in enumerate(BAD_MARKERS):
        result.stdout.fnmatch_lines([f"*ERROR at setup of test_{number}*", *says],
                                    consecutive=True)
    result.stdout.no_fnmatch_line("*never reached*")


def test_the_spec_takes_a_profile_its_fields_or_both():
    assert NetworkSpec.of(loss="5%").profile == LinkProfile.parse(loss="5%")
    assert NetworkSpec.of({"loss": "5%", "rate": "10mbit"}, loss="1%").profile == (
        LinkProfile.parse(loss="1%", rate="10mbit"))
    wan = LinkProfile.parse(delay="40ms", loss="2%")
    assert NetworkSpec.of(wan, hosts=3).profile == wan
    spec = NetworkSpec.of(links={(0, 1): {"loss": "30%"}, (1, 0): wan})
    assert spec.links == {(0, 1): LinkProfile.parse(loss="30%"), (1, 0): wan}
    with pytest.raises(TypeError, match="hosts"):
        NetworkSpec.of(hosts=True)
    with pytest.raises(ProfileError, match="limit"):
        NetworkSpec.of(limit=0)


def test_the_factory_takes_what_it_is_not_given_from_the_marker():
    marker = NetworkSpec.of(loss="5%", hosts=3, links={(0, 1): {"loss": "50%"}})
    assert NetworkSpec.of().under(marker) == marker
    own = NetworkSpec.of(rate="10mbit").under(marker)
    assert own.profile == LinkProfile.parse(rate="10mbit")  # the profile as a whole
    assert (own.hosts, own.links) == (3, marker.links)
    assert NetworkSpec.of(hosts=4, links={}).under(marker).links == {}
    from_file = NetworkSpec.of(scenario="quickstart").under(marker)
    assert from_file.profile is None and from_file.scenario == "quickstart"
    assert NetworkSpec.of(hosts=2).under(NetworkSpec.of(scenario="quickstart")).scenario == (
        "quickstart")


def test_a_scenario_gives_the_network_its_topology():
    scenario = NetworkSpec.of(scenario="quickstart").scenario_model()
    assert scenario.count == 4
    assert scenario.link_profile(0, 1) == LinkProfile.parse(delay="5ms", loss="1%")
    with pytest.raises(TypeError, match="hosts: 2, but scenario quickstart has 4 workers"):
        NetworkSpec.of(hosts=2, scenario="quickstart").scenario_model()
    plain = NetworkSpec.of(loss="5%").scenario_model()
    assert plain.count == 2 and plain.links() == {(0, 1): LinkProfile(loss=0.05),
                                                  (1, 0): LinkProfile(loss=0.05)}


def test_the_seed_is_the_networks_and_drawn_where_not_given():
    spec = NetworkSpec.of(loss="5%", seed=7)
    assert spec.seed == 7 and spec.profile == LinkProfile.parse(loss="5%")  # not the profile's
    assert spec.scenario_model().seed == 7 and not spec.needs_seed
    assert NetworkSpec.of(hosts=3).under(spec).seed == 7
    assert NetworkSpec.of(seed=8).under(spec).seed == 8
    assert NetworkSpec.of(loss="5%").needs_seed
    assert not NetworkSpec.of(scenario="quickstart").needs_seed  # the scenario's own seed
    assert NetworkSpec.of(scenario="loss-5", seed=9).scenario_model().seed == 9
    own = NetworkSpec.of({"loss": "5%", "seed": 3})  # a profile's own seed: every link's
    assert own.seed is None and own.profile.seed == 3
    for bad in (-1, True, "7", 1.5):
        with pytest.raises(TypeError, match=r"seed: expected an integer, 0 or more, got "):
            NetworkSpec.of(seed=bad)
    assert 0 <= drawn_seed() < 2**32


def test_the_replay_marker_is_the_tests_own_with_the_seed():
    marker = pytest.mark.netem({"delay": "5ms"}, hosts=3, loss="5%").mark
    replay = replay_marker(marker, 1234)
    assert replay == "@pytest.mark.netem({'delay': '5ms'}, hosts=3, loss='5%', seed=1234)"
    assert replay_marker(None, 5) == "@pytest.mark.netem(seed=5)"


def test_a_measurement_asserts_the_quantities_asked_for():
    checks = {
        "loss": Check("loss", "ratio", 0.1, 0.104, 0.015, True),
        "delay mean": Check("delay mean", "seconds", 0.02, 0.025, 0.002, False),
        "rate": Check("rate", "bits/s", float("nan"), 1e7, float("nan"), None, "no rate"),
    }
    seq = np.arange(10)
    result = analyze(Train(sent=10, size=128, seq=seq, sent_ns=seq * 1_000_000,
                           recv_ns=seq * 1_000_000 + 25_000_000, payload_ok=np.ones(10, bool),
                           interval=0.001))
    measured = Measurement(0, 1, LinkProfile(loss=0.1, delay=0.02), result, checks)
    measured.assert_passed("loss")
    assert not measured.passed and measured.failures == [checks["delay mean"]]
    with pytest.raises(AssertionError, match=r"^delay mean: not as configured\n"
                       r"link 0->1 \(delay=20ms loss=10%\)") as raised:
        measured.assert_passed()
    assert "  delay mean: configured 20.000 ms, measured 25.000 ms, tolerance 2.000 ms: FAIL" in (
        str(raised.value))
    with pytest.raises(AssertionError, match=r"^rate: not as configured"):
        measured.assert_passed("loss", "rate")  # not checked is not passed
    with pytest.raises(KeyError, match="no check 'delay'"):
        measured.assert_passed("delay")
