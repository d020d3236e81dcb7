"""Fidelity: probe trains through real netem qdiscs measure what was configured.

Runs where the kernel has sch_netem (inside the UML guest here: `testbed sandbox pytest -m
netem_kernel tests`). Each link into host i is shaped by `netem.apply` on the switch side (`p<i>`
in the switch namespace, egress, per source address); the probes are real UDP datagrams between
namespaces.
The guest has one slow vCPU: trains run at 2500 probes/s, which it sustains sending and receiving.
"""

from __future__ import annotations

import concurrent.futures
import socket

import numpy as np
import pytest

from netem import apply
from netem.lab import Lab
from netem.namespace import inside
from netem.probe import (
    FRAME_OVERHEAD,
    HEADER_DTYPE,
    KIND_PROBE,
    ProbeResult,
    analyze,
    compare,
    offered_load,
    probe,
    run_train,
)
from netem.profile import LinkProfile

pytestmark = pytest.mark.netem_kernel


def measure(
    lab: Lab, profile: LinkProfile, *, source: int = 0, target: int = 1, **options
) -> ProbeResult:
    """Probe the link source -> target, with a bulk train when the profile has a rate."""
    src, dst = lab.hosts[source], lab.hosts[target]
    if profile.rate:
        options |= {"rate_duration": 1.0, "offered_rate": offered_load(profile)}
    return probe(src.netns, dst.netns, dst.address, **options)


def assert_faithful(
    profile: LinkProfile, result: ProbeResult, *must_check: str, ignore: tuple[str, ...] = ()
) -> None:
    """Every quantity that can be predicted (but those in `ignore`) is within its tolerance;
    `must_check` were checked."""
    checks = {c.quantity: c for c in compare(profile, result) if c.quantity not in ignore}
    failed = [check for check in checks.values() if check.passed is False]
    assert not failed, "\n".join(
        f"{c.quantity}: configured {c.show(c.configured)}, measured {c.show(c.measured)}, "
        f"tolerance {c.show(c.tolerance)}"
        for c in failed
    )
    for name in must_check:
        assert checks[name].passed is True, checks[name]


@pytest.mark.parametrize(("loss", "count"), [("1%", 10_000), ("10%", 10_000), ("30%", 20_000)])
def test_random_loss(make_lab, loss, count):
    # Binomial tolerances (docs/probes.md): 1% over 10 000 probes is judged within ±0.55 points.
    lab = make_lab(2)
    profile = LinkProfile.parse(loss=loss)
    apply(lab.hosts[1].switch_port, profile, netns=lab.switch)
    result = measure(lab, profile, count=count)
    assert result.sent == count
    assert_faithful(profile, result, "loss", "loss burst mean")


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_a_link_with_ecn_marks_ecn_capable_probes_and_drops_the_others(make_lab, family):
    """netem's `ecn`: where the loss model takes a packet, an ECN-capable one arrives marked CE
    instead, and one that is not is dropped as before; the probe counts both ways. Over 5 000
    probes the 10% is judged within 5.5 standard errors (about ±2.3 points), and a false
    failure of the bounds below is beyond 10 of them."""
    lab = make_lab(2)
    profile = LinkProfile.parse(loss="10%", ecn=True)
    apply(lab.hosts[1].switch_port, profile, netns=lab.switch)
    src, dst = lab.hosts[0], lab.hosts[1]
    address = dst.address if family == "ipv4" else dst.address6
    capable = probe(src.netns, dst.netns, address, count=5000, ecn=True)
    assert_faithful(profile, capable, "loss", "CE marks")
    assert capable.ecn_capable and capable.loss_ratio < 0.01 and capable.marked_ratio > 0.05
    plain = probe(src.netns, dst.netns, address, count=5000)
    assert_faithful(profile, plain, "loss")
    assert plain.marked == 0 and plain.loss_ratio > 0.05


def test_delay_and_jitter(make_lab):
    lab = make_lab(2)
    profile = LinkProfile.parse(delay="20ms", jitter="5ms")
    apply(lab.hosts[1].switch_port, profile, netns=lab.switch)
    result = measure(lab, profile)
    assert_faithful(profile, result, "delay mean", "jitter (stdev)")
    # Uniform jitter: delays between 15 and 25 ms (plus the path's own microseconds). The top
    # tenth is left out: a stall of the guest's process on a busy host delays a timer now and then.
    assert result.delay_min >= 0.015
    assert result.delay_percentiles[90] <= 0.025


def test_a_link_with_the_wrong_delay_fails_the_check(make_lab):
    """Shaped with 40 ms, judged against 20 ms: the delay check fails; against 40 ms it holds."""
    lab = make_lab(2)
    apply(lab.hosts[1].switch_port, LinkProfile.parse(delay="40ms"), netns=lab.switch)
    result = measure(lab, LinkProfile.parse(delay="40ms"), count=2000)
    wrong = {c.quantity: c for c in compare(LinkProfile.parse(delay="20ms"), result)}
    assert wrong["delay mean"].passed is False
    assert_faithful(LinkProfile.parse(delay="40ms"), result, "delay mean")


# The lab's veths run without segmentation offloads (wire-sized frames), and the guest's one
# vCPU then forwards about 75-100 Mbit/s of 1500-byte frames. So 100 Mbit/s is measured with
# 9000-byte frames (a jumbo-frame lab): the shaper's arithmetic is the same per byte, and the
# guest forwards a sixth of the packets.
@pytest.mark.parametrize(("rate", "mtu"), [("10mbit", 1500), ("50mbit", 1500), ("100mbit", 9000)])
def test_rate(make_lab, rate, mtu):
    lab = make_lab(2, mtu=mtu)
    profile = LinkProfile.parse(rate=rate)
    apply(lab.hosts[1].switch_port, profile, netns=lab.switch)
    result = measure(lab, profile)
    assert result.rate_frame_bytes == mtu + 14
    assert result.rate_frames > 500
    # Timing is the delay tests' business: here a busy host's scheduling noise must not count.
    assert_faithful(profile, result, "rate", ignore=("delay mean", "jitter (stdev)"))


def test_reorder(make_lab):
    lab = make_lab(2)
    profile = LinkProfile.parse(delay="10ms", reorder="25%")
    apply(lab.hosts[1].switch_port, profile, netns=lab.switch)
    result = measure(lab, profile)
    assert_faithful(profile, result, "reorder (overtaking)", "delay mean")
    # The overtaken probes (RFC 4737's "reordered") are far more than the 25% that overtook:
    # each early probe passes the ~25 held back behind it.
    assert result.reorder_ratio > 0.5


def test_duplicate(make_lab):
    lab = make_lab(2)
    profile = LinkProfile.parse(duplicate="5%")
    apply(lab.hosts[1].switch_port, profile, netns=lab.switch)
    assert_faithful(profile, measure(lab, profile), "duplicate")


def test_corrupt_flips_one_bit_per_damaged_frame(make_lab):
    """netem's corrupt flips one random bit of the frame. Capture every frame as it leaves the
    sender and as it reaches the receiver: the two differ in exactly one bit for about 5% of
    frames, and the probe receiver reports those whose flip landed in the UDP payload."""
    lab = make_lab(2)
    profile = LinkProfile.parse(corrupt="5%")
    apply(lab.hosts[1].switch_port, profile, netns=lab.switch)
    sender, receiver = lab.hosts
    size = 1024
    frame = size + FRAME_OVERHEAD
    with (
        capture(sender.netns, sender.iface) as sent,
        capture(receiver.netns, receiver.iface) as arrived,
    ):
        train = run_train(sender.netns, receiver.netns, receiver.address, size=size)
        before, after = frames_of(sent, frame), frames_of(arrived, frame)
    result = analyze(train)
    assert_faithful(profile, result, "corrupt")
    assert before.shape == after.shape  # corruption never drops a frame on the wire
    flipped = np.unpackbits(before ^ after, axis=1)
    bits = flipped.sum(axis=1)
    assert set(np.unique(bits).tolist()) <= {0, 1}
    damaged = bits == 1
    tolerance = 4 * np.sqrt(0.05 * 0.95 / damaged.size)
    assert abs(damaged.mean() - 0.05) <= tolerance
    # Warm-up and end markers are frames of the same size, but only probes are reported.
    probes = before[:, FRAME_OVERHEAD + HEADER_DTYPE.fields["kind"][1]] == KIND_PROBE
    where = np.argmax(flipped[damaged & probes], axis=1) // 8  # byte offset of each flip
    in_payload = int((where >= FRAME_OVERHEAD).sum())
    udp_length = int(((where == 38) | (where == 39)).sum())  # may arrive truncated: malformed
    reported = result.corrupt + result.malformed
    # A probe the receiving socket itself dropped (buffer full on a busy host) is not reported.
    assert in_payload - result.receiver_drops <= reported <= in_payload + udp_length


def test_gilbert_elliott_losses_come_in_bursts(make_lab):
    lab = make_lab(3)
    bursty = LinkProfile.parse(gilbert_elliott={"p": "2%", "r": "25%"})
    random = LinkProfile.parse(loss=bursty.mean_loss)
    apply(lab.hosts[2].switch_port, {lab.hosts[0].address: bursty, None: random}, netns=lab.switch)
    # Bursts make consecutive losses dependent: the mean loss needs more probes to pin down.
    ge = measure(lab, bursty, source=0, target=2, count=30_000)
    plain = measure(lab, random, source=1, target=2, count=10_000)
    assert_faithful(bursty, ge, "loss", "loss burst mean")
    assert_faithful(random, plain, "loss", "loss burst mean")
    # Same mean loss (7.4%), bursts of 4 on average against 1.08.
    assert ge.loss_burst_mean > 2.5 * plain.loss_burst_mean
    assert ge.loss_burst_max > plain.loss_burst_max


def test_pairwise_links_share_a_receiver(make_lab):
    """A -> B loses 10% while C -> B is clean, measured at the same time into the same host."""
    lab = make_lab(3)
    lossy, clean = LinkProfile.parse(loss="10%"), LinkProfile()
    apply(lab.hosts[2].switch_port, {lab.hosts[0].address: lossy, None: clean}, netns=lab.switch)
    receiver = lab.hosts[2]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # Two trains at once share the guest's one vCPU: half the usual pace each.
        a, c = (
            pool.submit(
                probe, lab.hosts[s].netns, receiver.netns, receiver.address, interval=0.0008
            )
            for s in (0, 1)
        )
        from_a, from_c = a.result(), c.result()
    # The two trains' timestamps carry each other's scheduling on the one vCPU (jitter up to
    # ~0.6 ms on a link without any): timing is test_delay_and_jitter's, loss is this test's.
    timing = ("delay mean", "jitter (stdev)")
    assert_faithful(lossy, from_a, "loss", ignore=timing)
    assert_faithful(clean, from_c, "loss", ignore=timing)
    assert from_c.loss_ratio == 0


class capture:
    """Every frame seen on an interface (both directions), from a packet socket opened in its
    namespace before the train and read after it."""

    def __init__(self, netns: str, iface: str) -> None:
        with inside(netns):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
        self.sock.bind((iface, 0))
        self.sock.setblocking(False)

    def __enter__(self) -> capture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def read(self) -> list[bytes]:
        frames = []
        while True:
            try:
                frames.append(self.sock.recv(65536))
            except BlockingIOError:
                return frames


def frames_of(tap: capture, length: int) -> np.ndarray:
    """The captured frames of exactly `length` bytes (the probes), as rows of bytes."""
    frames = [f for f in tap.read() if len(f) == length]
    return np.frombuffer(b"".join(frames), dtype=np.uint8).reshape(len(frames), length)
