"""Fidelity of the fallback (no sch_netem: nftables random loss, token-bucket rate) on the host
kernel, measured with probe trains between namespaces; and the probes' own wire format."""

from __future__ import annotations

import socket
import subprocess

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from typer.testing import CliRunner

from netem.lab import Lab
from netem.probe import (
    DEFAULT_SIZE,
    FRAME_OVERHEAD,
    KIND_END,
    KIND_WARMUP,
    STATUS_OK,
    compare,
    decode,
    inside,
    offered_load,
    probe,
    run_train,
)
from netem.profile import LinkProfile
from testbed.cli import app

pytestmark = pytest.mark.netns
FAST = 0.0001  # the host keeps up with 10 000 probes/s


def shape_fallback(lab: Lab, host: int, profile: LinkProfile) -> None:
    """Random loss with nftables and rate with tbf, on the switch port towards `host`."""
    port = lab.hosts[host].switch_port

    def run(*argv: str) -> None:
        subprocess.run(["ip", "netns", "exec", lab.switch, *argv], check=True)

    if profile.rate:
        run(
            "tc",
            "qdisc",
            "add",
            "dev",
            port,
            "root",
            "tbf",
            "rate",
            f"{profile.rate}bit",
            "burst",
            "32kb",
            "latency",
            "100ms",
        )
    if profile.loss:
        run(
            "nft",
            f"add table bridge tbloss; add chain bridge tbloss out {{ type filter hook "
            f"forward priority 0; }}; add rule bridge tbloss out oifname {port} numgen random "
            f"mod 1000000 < {round(profile.loss * 1_000_000)} drop",
        )


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
    shape_fallback(lab, 1, profile)
    a, b = lab.hosts
    result = probe(a.netns, b.netns, b.address, count=20_000, interval=FAST)
    checks = checks_of(profile, result)
    assert checks["loss"].passed, checks["loss"]
    assert checks["loss burst mean"].passed, checks["loss burst mean"]
    assert_no_failures(checks)


def test_rate(make_lab):
    lab = make_lab(2)
    profile = LinkProfile.parse(rate="10mbit")
    shape_fallback(lab, 1, profile)
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
    shape_fallback(lab, 1, LinkProfile.parse(loss="10%"))
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
