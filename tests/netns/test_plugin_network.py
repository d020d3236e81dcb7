"""The pytest plugin as a user's suite meets it (root, namespaces, the host kernel's fallback:
loss, rate and limit): user test files run by pytest in a subprocess, with the `netem` marker and
the network fixtures; a failing test, an erroring fixture and Ctrl-C leave no namespace and no
process behind; without sch_netem a delay is skipped with its reason, or fails under CI; the
links' seeds, and the marker a failed test's report gives to replay it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from functools import partial

import pytest
from live import ended, unless_ended, wait_for

from netem.lab import lab_namespaces

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.netns

TIMEOUT = 300  # seconds for a user suite in a subprocess

# A UDP echo server and a client that retries each message until it is answered; both run as
# `python -c` in a host, the server's port and the client's count from argv.
USER_HELPERS = '''
import json, subprocess, sys
from pathlib import Path

ECHO = """
import socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    data, peer = sock.recvfrom(2048)
    sock.sendto(data, peer)
"""

CLIENT = """
import json, socket, sys, time
address, port, count, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
answered = attempts = 0
for number in range(count):
    give_up = time.monotonic() + budget
    while time.monotonic() < give_up:
        attempts += 1
        sock.sendto(str(number).encode(), (address, port))
        sock.settimeout(0.05)
        try:
            while sock.recv(2048) != str(number).encode():
                pass
        except TimeoutError:
            continue
        answered += 1
        break
print(json.dumps({"answered": answered, "attempts": attempts}))
"""


def echo_server(host, port=9000):
    server = host.popen([sys.executable, "-c", ECHO, str(port)], stdout=subprocess.PIPE)
    assert server.stdout.readline().strip() == "listening"
    return server


def echo(client, server, count=20, budget=5.0, port=9000):
    done = client.run([sys.executable, "-c", CLIENT, server.address, str(port), str(count),
                       str(budget)], timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def remember(**values):
    """For the test that runs this suite: what the user test made."""
    path = Path(__file__).with_name("made.jsonl")
    with path.open("a") as file:
        file.write(json.dumps(values) + "\\n")
'''


def user_suite(pytester: pytest.Pytester, source: str) -> None:
    pytester.makepyfile(helpers=USER_HELPERS, test_user=source)


def made(pytester: pytest.Pytester) -> list[dict]:
    path = pytester.path / "made.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_nothing_left(records: list[dict]) -> None:
    """No namespace of the user's networks and none of their processes is left."""
    assert records, "the user suite recorded nothing"
    for record in records:
        assert lab_namespaces(record["prefix"]) == [], f"namespaces of {record} left"
        for pid in record.get("pids", []):
            wait_for(f"process {pid} of {record} to end", partial(ended, pid), bool, 10.0,
                     every=0.05)


def test_a_udp_echo_gets_through_a_lossy_link_with_retries(pytester: pytest.Pytester):
    user_suite(pytester, """
        import pytest
        from helpers import echo, echo_server

        @pytest.mark.netem(loss="20%")
        def test_echo_over_a_lossy_link(netem_network):
            client, server = netem_network
            assert netem_network.profile(client, server).loss == 0.2
            echo_server(server)
            answers = echo(client, server, count=40)
            assert answers["answered"] == 40
            # 20% loss each way: about a third of the messages need another attempt (that
            # none does has a chance of 0.64**40, 2e-8).
            assert answers["attempts"] > 40, answers

        def test_without_a_marker_the_links_are_perfect(netem_network):
            client, server = netem_network
            assert netem_network.profile(0, 1).is_perfect and len(netem_network) == 2
            echo_server(server)
            assert echo(client, server, count=20) == {"answered": 20, "attempts": 20}
    """)
    result = pytester.runpytest_subprocess(timeout=TIMEOUT)
    result.assert_outcomes(passed=2)


def test_links_change_and_partition_and_heal_during_a_test(pytester: pytest.Pytester):
    user_suite(pytester, """
        from netem import LinkProfile
        from helpers import echo, echo_server

        def test_change_partition_heal(make_netem_network):
            network = make_netem_network(3, loss="1%")
            a, b, c = network
            echo_server(b)
            echo_server(c)
            network.set_link(a, b, {"loss": "40%"})
            assert network.profile(0, 1) == LinkProfile.parse(loss="40%")
            assert network.profile(1, 0) == LinkProfile.parse(loss="1%")

            network.partition([(a, b), (b, a)])
            assert network.profile(0, 1).loss == 1.0
            assert echo(a, b, count=3, budget=0.5)["answered"] == 0
            assert echo(a, c, count=10)["answered"] == 10  # only a <-> b is cut
            cut = network.measure(a, b, count=500, timeout=1.0)
            assert cut.result.received == 0
            cut.assert_passed("loss")

            network.heal()
            assert network.profile(0, 1) == LinkProfile.parse(loss="40%")  # kept while cut
            assert echo(a, b, count=10)["answered"] == 10
            network.set_link(0, 1, loss="0%")
            assert echo(a, b, count=10)["answered"] == 10
    """)
    result = pytester.runpytest_subprocess(timeout=TIMEOUT)
    result.assert_outcomes(passed=1)


def test_a_link_replays_a_trace_during_a_test(pytester: pytest.Pytester):
    """`network.replay`: the link takes the trace's values in turn on top of its profile, goes
    back to it when a trace that does not loop ends, and a bad trace names its line."""
    pytester.makefile(".csv", step="time,rate\n0,20mbit\n300ms,5mbit\n600ms,5mbit\n",
                      bad="time,rate\n0,20mbit\n1s,quick\n")
    user_suite(pytester, """
        import time
        import pytest
        from netem import LinkProfile

        def wait_until(condition, what):
            deadline = time.monotonic() + 10
            while not condition():
                assert time.monotonic() < deadline, f"never saw {what}"
                time.sleep(0.02)

        def test_replay(make_netem_network):
            network = make_netem_network(2, loss="1%")
            replay = network.replay(0, 1, "step.csv", loop=False)
            assert network.profile(0, 1) == LinkProfile.parse(loss="1%", rate="20mbit")
            wait_until(lambda: network.profile(0, 1).rate == 5_000_000, "the second window")
            wait_until(lambda: network.profile(0, 1) == LinkProfile.parse(loss="1%"),
                       "the link's own profile at the trace's end")
            replay.stop()
            assert replay.summary()["changes"] == 2
            assert network.profile(1, 0) == LinkProfile.parse(loss="1%")
            with pytest.raises(ValueError, match="bad.csv:3: rate"):
                network.replay(1, 0, "bad.csv")
    """)
    result = pytester.runpytest_subprocess(timeout=TIMEOUT)
    result.assert_outcomes(passed=1)


def test_measuring_a_link_gets_the_configured_loss_and_rate(pytester: pytest.Pytester):
    user_suite(pytester, """
        import pytest
        from netem.probe.verdicts import Z

        @pytest.mark.netem(loss="10%", links={(1, 0): {"rate": "20mbit"}})
        def test_measure(netem_network):
            lossy = netem_network.measure(0, 1)
            print(lossy)
            lossy.assert_passed()
            loss = lossy.checks["loss"]
            assert loss.passed and abs(lossy.result.loss_ratio - 0.10) <= loss.tolerance
            # Z binomial standard errors over 5000 probes: 5.5 * sqrt(0.1 * 0.9 / 5000) = 2.3 points
            assert loss.tolerance == pytest.approx(Z * (0.1 * 0.9 / 5000) ** 0.5)
            assert lossy.result.rate is None  # no rate configured: no bulk train

            limited = netem_network.measure(1, 0)
            print(limited)
            limited.assert_passed("rate")
            limited.assert_passed()
            assert abs(limited.result.rate - 20e6) <= 2e6
    """)
    result = pytester.runpytest_subprocess("-s", timeout=TIMEOUT)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*link 0->1 (loss=10%): * probes arrived",
                                 "  loss: configured 10.00%, measured *: pass"])


def test_a_failing_test_and_an_erroring_fixture_leave_nothing_behind(pytester: pytest.Pytester):
    user_suite(pytester, """
        import subprocess
        import pytest
        from helpers import echo_server, remember

        def test_fails(netem_network):
            server = echo_server(netem_network[1])
            # A shell with a child of its own: the child is in the namespace too.
            shell = netem_network[0].popen(["sh", "-c", "sleep 600 & echo $!; wait"],
                                           stdout=subprocess.PIPE)
            child = int(shell.stdout.readline())
            remember(prefix=netem_network.prefix, pids=[server.pid, shell.pid, child])
            assert 1 + 1 == 3, "a user's test that fails"

        @pytest.fixture
        def broken_service(make_netem_network):
            network = make_netem_network(2, loss="5%")
            server = echo_server(network[1])
            remember(prefix=network.prefix, pids=[server.pid])
            raise RuntimeError("a user's fixture that errors")

        def test_errors(broken_service):
            pass
    """)
    result = pytester.runpytest_subprocess(timeout=TIMEOUT)
    result.assert_outcomes(failed=1, errors=1)
    result.stdout.fnmatch_lines(["*netem network tb*", "2 hosts, namespaces tb*-h*, * shaping",
                                 "*processes started in hosts:*"])
    records = made(pytester)
    assert len(records) == 2
    assert_nothing_left(records)


def test_ctrl_c_during_a_test_removes_its_network_and_processes(pytester: pytest.Pytester):
    """SIGINT to the user's pytest while a test waits: pytest tears the fixtures down at the end
    of the session, and the network goes with its processes."""
    user_suite(pytester, """
        import time
        from helpers import echo_server, remember

        def test_waits(netem_network):
            server = echo_server(netem_network[1])
            remember(prefix=netem_network.prefix, pids=[server.pid])
            time.sleep(600)
    """)
    # A background job may inherit SIGINT ignored, and Python then keeps it ignored: restore
    # Python's own handler in the user's pytest.
    main = ("import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler);"
            " sys.exit(pytest.main(sys.argv[1:]))")
    log = (pytester.path / "pytest.log").open("w")
    process = subprocess.Popen([sys.executable, "-c", main, "-p", "no:cacheprovider",
                                f"--basetemp={pytester.path / 'tmp'}"],
                               cwd=pytester.path, stdout=log, stderr=subprocess.STDOUT)
    try:
        started = unless_ended(lambda: bool(made(pytester)), process,
                               (pytester.path / "pytest.log").read_text)
        wait_for("the user's test to start (the file it writes)", started, bool, 60, every=0.1)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    output = (pytester.path / "pytest.log").read_text()
    assert code == pytest.ExitCode.INTERRUPTED, output
    assert "KeyboardInterrupt" in output
    assert_nothing_left(made(pytester))


def test_ctrl_c_in_a_users_teardown_still_removes_the_network(pytester: pytest.Pytester):
    """A KeyboardInterrupt in a user's fixture teardown ends pytest's teardown of that test
    before the network's finalizer runs: the plugin closes the network when the session ends."""
    user_suite(pytester, """
        import pytest
        from helpers import echo_server, remember

        @pytest.fixture
        def service(netem_network):
            server = echo_server(netem_network[1])
            remember(prefix=netem_network.prefix, pids=[server.pid])
            yield server
            raise KeyboardInterrupt  # Ctrl-C while the user's teardown runs

        def test_uses_the_service(service):
            pass
    """)
    result = pytester.runpytest_subprocess(timeout=TIMEOUT)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert_nothing_left(made(pytester))


def test_without_netem_a_delay_is_skipped_with_its_reason_or_fails_under_ci(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    from netem.capabilities import netem_available

    if netem_available():
        pytest.skip("this kernel has sch_netem: nothing to be without")
    user_suite(pytester, """
        import pytest

        @pytest.mark.netem(delay="20ms", loss="5%")
        def test_marker_asks_for_a_delay(netem_network):
            raise AssertionError("never reached")

        @pytest.mark.netem(loss="5%")
        def test_a_change_asks_for_a_delay(netem_network):
            netem_network.set_link(0, 1, delay="10ms")
            raise AssertionError("never reached")
    """)
    monkeypatch.delenv("CI", raising=False)
    skipped = pytester.runpytest_subprocess("-rs", timeout=TIMEOUT)
    skipped.assert_outcomes(skipped=2)
    skipped.stdout.fnmatch_lines([
        "SKIPPED [[]1[]] test_user.py:*: netem: delay needs sch_netem, which this kernel lacks "
        "(its fallback shapes loss, rate and limit only); run the suite where netem is: "
        "`python -m netem.sandbox pytest *-rs`",
    ] * 2)

    monkeypatch.setenv("CI", "true")
    failed = pytester.runpytest_subprocess(timeout=TIMEOUT)
    assert failed.ret == pytest.ExitCode.TESTS_FAILED
    failed.assert_outcomes(errors=1, failed=1)  # the marker's at setup, the change's in the test
    failed.stdout.fnmatch_lines(["*netem: cannot run in CI: delay needs sch_netem*"] * 2)
    failed.stdout.no_fnmatch_line("*never reached*")


def test_a_scenario_runs_into_the_tests_tmp_path(pytester: pytest.Pytester):
    user_suite(pytester, """
        def test_training_under_loss(netem_scenario, tmp_path):
            result = netem_scenario('''
        name: user-run
        workers: 2
        topology: {default: {loss: 2%}}
        job: {model: mlp, steps: 3, batch: 16}
        collective: {kind: ring}
        ''')
            assert result.success, result.error
            assert result.summary["success"] is True
            assert result.run_dir.parent == tmp_path
            assert (result.run_dir / "summary.json").exists()
            assert [w.status for w in result.workers] == ["done", "done"]
            assert False, "the run passed; this shows the report's section"
    """)
    result = pytester.runpytest_subprocess(timeout=TIMEOUT)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: the run passed; this shows the report's*",
                                 "*netem scenario runs*", "*run-scenario: success=True error=None"])


def test_the_links_seeds_come_from_the_networks_and_a_failure_says_how_to_replay(
        pytester: pytest.Pytester):
    """A network's seed (given, else drawn once for the test) seeds each link's netem: the
    qdisc carries `derive_seed(seed, src, dst)`, on every change too. The fallback (this host's
    kernel) cannot use a seed: it is given none, and the seed is still reported."""
    user_suite(pytester, """
        import netem
        import pytest
        from netem.profile import derive_seed
        from helpers import remember

        def kernel(network, src, dst):
            '''What the kernel shapes src -> dst with: the rule of src's addresses on dst's
            switch port, else the port's catch-all.'''
            rules = netem.show(f"p{dst}", netns=f"{network.prefix}-sw")
            address = network[src].address
            return next((profile for source, profile in rules.items() if source is not None
                         and address in (source if isinstance(source, tuple) else (source,))),
                        rules[None])

        def seeded(network, src, dst):
            '''The seed the link's qdisc carries, as it should be with this backend.'''
            shaped = kernel(network, src, dst)
            if network.backend == "netem":
                assert shaped.seed == derive_seed(network.seed, src, dst)
            else:  # nftables' numgen takes no seed: none is given
                assert shaped.seed is None
            return shaped

        @pytest.mark.netem(loss="5%", seed=7)
        def test_given(netem_network):
            assert netem_network.seed == 7
            assert seeded(netem_network, 0, 1).loss == 0.05
            netem_network.set_link(1, 0, loss="20%")
            assert seeded(netem_network, 1, 0).loss == 0.2
            assert netem_network.profile(1, 0).seed is None  # the profile has none of its own

        @pytest.mark.netem(loss="5%")
        def test_drawn(make_netem_network):
            first, second = make_netem_network(), make_netem_network(3)
            remember(prefix=first.prefix, seed=first.seed)
            assert second.seed == first.seed  # one seed for the test's networks
            seeded(second, 2, 1)
            assert False, "a failing test: its report says how to replay it"
    """)
    result = pytester.runpytest_subprocess(timeout=TIMEOUT)
    result.assert_outcomes(passed=1, failed=1)
    (record,) = made(pytester)
    result.stdout.fnmatch_lines([
        f"*netem network {record['prefix']}*", "2 hosts, *", f"seed {record['seed']}",
        "*netem replay*", "the networks' seed was drawn; to replay them with the same seed, "
        "mark the test", f"@pytest.mark.netem(loss='5%', seed={record['seed']})"])
