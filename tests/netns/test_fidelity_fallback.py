"""Fidelity of the fallback (no sch_netem: nftables random loss, htb rate; `netem.apply` with
backend 'fallback' on the switch port) on the host kernel, measured with probe trains between
namespaces; and the probes' own wire format."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from typer.testing import CliRunner

from netem import apply
from netem.namespace import inside
from netem.probe import (
    DEFAULT_SIZE,
    FRAME_OVERHEAD,
    KIND_END,
    KIND_WARMUP,
    STATUS_OK,
    compare,
    decode,
    offered_load,
    probe,
    run_train,
)
from netem.profile import LinkProfile
from testbed.cli import app

pytestmark = pytest.mark.netns
FAST = 0.0001  # the host keeps up with 10 000 probes/s


def checks_of(profile: LinkProfile, result) -> dict:
    return {check.quantity: check for check in compare(profile, result)}


def assert_no_failures(checks: dict) -> None:
    failed = [check for check in checks.values() if check.passed is False]
    assert not failed, "\n".join(
        f"{c.quantity}: configured {c.show(c.configured)}, measured {c.show(c.measured)}, "
        f"tolerance {c.show(c.tolerance)}"
        for c in failed
    )


@pytest.mark.parametrize("loss", ["10%", "30%"])
def test_random_loss(make_lab, loss):
    lab = make_lab(2)
    profile = LinkProfile.parse(loss=loss)
    apply(lab.hosts[1].switch_port, profile, netns=lab.switch, backend="fallback")
    a, b = lab.hosts
    result = probe(a.netns, b.netns, b.address, count=20_000, interval=FAST)
    checks = checks_of(profile, result)
    assert checks["loss"].passed, checks["loss"]
    assert checks["loss burst mean"].passed, checks["loss burst mean"]
    assert_no_failures(checks)


def test_a_link_with_twice_the_loss_fails_the_check(make_lab):
    """The probe catches a link that does not do what it should: shaped with 20% loss, judged
    against 10%, the loss check fails (by some 85 standard errors over 20 000 probes)."""
    lab = make_lab(2)
    apply(lab.hosts[1].switch_port, LinkProfile.parse(loss="20%"), netns=lab.switch,
          backend="fallback")
    a, b = lab.hosts
    result = probe(a.netns, b.netns, b.address, count=20_000, interval=FAST)
    assert checks_of(LinkProfile.parse(loss="10%"), result)["loss"].passed is False
    assert checks_of(LinkProfile.parse(loss="20%"), result)["loss"].passed is True


def test_rate(make_lab):
    lab = make_lab(2)
    profile = LinkProfile.parse(rate="10mbit")
    apply(lab.hosts[1].switch_port, profile, netns=lab.switch, backend="fallback")
    a, b = lab.hosts
    # The timed train at its default pace (3.4 Mbit/s) leaves the link mostly idle.
    result = probe(
        a.netns, b.netns, b.address, rate_duration=1.0, offered_rate=offered_load(profile)
    )
    checks = checks_of(profile, result)
    assert checks["rate"].passed, checks["rate"]
    assert_no_failures(checks)
    assert result.rate_frames > 500


def test_probe_frames_on_the_wire(make_lab):
    """Capture the probes where they leave the sender and dissect them with scapy: UDP/IPv4
    to the receiver, the checksum left at zero (so damaged payloads reach the receiver), and
    the payload a probe of the train, numbered in sending order."""
    lab = make_lab(2)
    a, b = lab.hosts
    with inside(a.netns):
        tap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    with tap:
        tap.bind((a.iface, 0))
        tap.setblocking(False)
        train = run_train(a.netns, b.netns, b.address, count=200, interval=FAST)
        frames = []
        while True:
            try:
                frames.append(Ether(tap.recv(65536)))
            except BlockingIOError:
                break
    probes = [f for f in frames if UDP in f and f[IP].dst == b.address]
    assert len(probes) >= 202
    for frame in probes:
        assert (frame[IP].src, len(frame)) == (a.address, DEFAULT_SIZE + FRAME_OVERHEAD)
        assert frame[UDP].chksum == 0
    payloads = np.frombuffer(b"".join(bytes(f[UDP].payload) for f in probes), np.uint8)
    slots = payloads.reshape(len(probes), DEFAULT_SIZE)
    run = int.from_bytes(slots[0, 8:12].tobytes(), "big")
    decoded = decode(slots, np.full(len(probes), DEFAULT_SIZE), run=run, size=DEFAULT_SIZE)
    assert (decoded.status == STATUS_OK).all()
    # A warm-up marker, the probes in sending order, then end-of-train markers.
    assert decoded.kind[0] == KIND_WARMUP and (decoded.kind[201:] == KIND_END).all()
    assert decoded.seq[1:201].tolist() == list(range(200))
    assert train.seq.tolist() == list(range(200))


def test_the_probe_command_checks_a_link(make_lab):
    lab = make_lab(2)
    apply(lab.hosts[1].switch_port, LinkProfile.parse(loss="10%"), netns=lab.switch,
          backend="fallback")
    a, b = lab.hosts
    base = [
        "probe",
        "--from",
        a.netns,
        "--to",
        b.netns,
        "--to-address",
        b.address,
        "--count",
        "10000",
        "--interval",
        "100us",
    ]
    runner = CliRunner()
    good = runner.invoke(app, [*base, "--expect-loss", "10%"])
    assert good.exit_code == 0, good.output
    assert "loss" in good.output and "pass" in good.output
    wrong = runner.invoke(app, [*base, "--expect-loss", "20%"])
    assert wrong.exit_code == 1, wrong.output
    assert "FAIL" in wrong.output
    bad = runner.invoke(app, [*base, "--expect-loss", "lots"])
    assert bad.exit_code == 2
    assert "loss" in bad.output
