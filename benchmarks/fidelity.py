"""Fidelity benchmark: configure links, measure them with probe trains, tabulate both.

Full netem runs where the kernel has sch_netem: here, inside a User-Mode Linux guest
(netem.sandbox), because the host kernel has none. The fallback (nftables loss, htb rate) runs
on the host. Writes benchmarks/results/fidelity.md.

    .venv/bin/python -m benchmarks.fidelity [--output PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.machine import in_guest
from benchmarks.report import Run
from netem import apply
from netem.capabilities import netem_available
from netem.lab import Lab
from netem.probe import PERCENTILES, Check, compare, offered_load, probe
from netem.profile import LinkProfile

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "fidelity.md"
HEADLINE = {  # profile field -> the checks that measure it
    "loss": ("loss", "loss burst mean"),
    "gilbert_elliott": ("loss", "loss burst mean"),
    "delay": ("delay mean",),
    "jitter": ("jitter (stdev)",),
    "reorder": ("reorder (overtaking)",),
    "duplicate": ("duplicate",),
    "corrupt": ("corrupt",),
    "rate": ("rate",),
    "packet_overhead": ("rate",),
    "cell_size": ("rate",),
    "distribution": ("delay mean", "jitter (stdev)", *(f"delay p{p}" for p in PERCENTILES)),
    "slot": ("slot wait",),
    "ecn": ("loss", "CE marks"),
}
SAMPLES = REPO / "benchmarks" / "data" / "delays-lognormal.txt"  # its header says how it was made


@dataclass(frozen=True)
class Case:
    name: str
    spec: dict[str, Any]
    count: int = 5000
    size: int = 128
    interval: float = 0.0004
    mtu: int = 1500
    family: int = 4  # the IP version the probes go over

    @property
    def profile(self) -> LinkProfile:
        return LinkProfile.parse(self.spec)


NETEM_CASES = (
    Case("loss 1%", {"loss": "1%"}, count=10_000),
    Case("loss 10%", {"loss": "10%"}, count=10_000),
    Case("loss 30%", {"loss": "30%"}, count=20_000),
    Case("Gilbert-Elliott p=2% r=25%", {"gilbert_elliott": {"p": "2%", "r": "25%"}}, count=30_000),
    Case("random loss at the same mean (7.41%)", {"loss": 0.074074074}, count=10_000),
    Case("delay 20ms jitter 5ms", {"delay": "20ms", "jitter": "5ms"}),
    Case("delay 10ms reorder 25%", {"delay": "10ms", "reorder": "25%"}),
    Case("duplicate 5%", {"duplicate": "5%"}),
    Case("corrupt 5%", {"corrupt": "5%"}, size=1024),
    Case("rate 10mbit", {"rate": "10mbit"}),
    # Wire-sized frames (the lab's veths run without offloads): the guest's one vCPU forwards
    # about 75-100 Mbit/s of 1500-byte frames, so 100 Mbit/s is measured on 9000-byte frames.
    Case("rate 50mbit", {"rate": "50mbit"}),
    Case("rate 100mbit (MTU 9000)", {"rate": "100mbit"}, mtu=9000),
    # Overheads on 1294-byte frames (MTU 1280, the least a lab with IPv6 addresses takes), where
    # they cost the frames more than the rate's tolerance: 200 bytes a packet, and ATM's cells
    # (an 8-byte AAL5 trailer, 48-byte cells with a 5-byte header each). The timed probes go
    # every 800 us with 200 bytes more each, so that they take at most half the rate.
    Case("rate 10mbit packet overhead 200 (MTU 1280)",
         {"rate": "10mbit", "packet_overhead": 200}, mtu=1280, interval=0.0008),
    Case("rate 10mbit ATM cells 48+5, overhead 8 (MTU 1280)",
         {"rate": "10mbit", "packet_overhead": 8, "cell_size": 48, "cell_overhead": 5},
         mtu=1280),
    Case("slot 5ms-10ms, at most 64 packets or 32768 bytes a slot",
         {"slot": {"min_delay": "5ms", "max_delay": "10ms", "max_packets": 64,
                   "max_bytes": 32768}},
         count=10_000),
    Case("delay distribution from heavy-tailed samples (lognormal)",
         {"distribution": {"samples": str(SAMPLES), "unit": "ms"}}, count=10_000),
    Case("IPv6: delay 20ms loss 10%", {"delay": "20ms", "loss": "10%"}, count=10_000, family=6),
    # ECN-capable probes (ECT(0)) on a link that marks CE where its loss model says "lose".
    Case("ECN: loss 10% marked, not dropped", {"loss": "10%", "ecn": True}, count=10_000),
    Case(
        "WAN: delay 40ms jitter 8ms loss 2% rate 50mbit",
        {"delay": "40ms", "jitter": "8ms", "loss": "2%", "rate": "50mbit"},
        count=10_000,
    ),
)
FALLBACK_CASES = (
    Case("loss 10%", {"loss": "10%"}, count=20_000, interval=0.0001),
    Case("loss 30%", {"loss": "30%"}, count=20_000, interval=0.0001),
    Case("rate 10mbit", {"rate": "10mbit"}),
    Case("rate 100mbit", {"rate": "100mbit"}),
)


@dataclass
class Outcome:
    case: str
    backend: str
    kernel: str
    probes: int
    seconds: float
    checks: list[dict[str, Any]] = field(default_factory=list)


def run_cases(cases: tuple[Case, ...], backend: str) -> list[Outcome]:
    """Each case on a fresh two-host lab: shape the link into h1, probe it from h0."""
    outcomes = []
    for case in cases:
        profile = case.profile
        with Lab(2, mtu=case.mtu) as lab:
            apply(lab.hosts[1].switch_port, profile, netns=lab.switch,
                  backend="netem" if backend.startswith("netem") else "fallback")
            a, b = lab.hosts
            start = time.monotonic()
            result = probe(
                a.netns,
                b.netns,
                b.address6 if case.family == 6 else b.address,
                count=case.count,
                size=case.size,
                interval=case.interval,
                rate_duration=1.0 if profile.rate else 0.0,
                offered_rate=offered_load(profile),
                ecn=profile.ecn,
            )
            seconds = time.monotonic() - start
        outcome = Outcome(case.name, backend, platform.release(), result.sent, seconds)
        outcome.checks = [dataclasses.asdict(check) for check in compare(profile, result)]
        outcomes.append(outcome)
        print(f"{backend}: {case.name}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return outcomes


def netem_outcomes() -> tuple[list[Outcome], str]:
    """The netem cases, here if this kernel has netem, else in a guest."""
    if netem_available():
        return run_cases(NETEM_CASES, "netem"), "host kernel"
    items, guest = in_guest("benchmarks.fidelity")
    return [Outcome(**item) for item in items], guest


def row(case: str, backend: str, check: Check, probes: int) -> str:
    verdict = {True: "pass", False: "**FAIL**"}.get(check.passed, f"not checked: {check.note}")
    tolerance = "-" if math.isnan(check.tolerance) else f"± {check.show(check.tolerance)}"
    return (
        f"| {case} | {backend} | {check.quantity} | {check.show(check.configured)} | "
        f"{check.show(check.measured)} | {tolerance} | {verdict} | {probes} |"
    )


def report(outcomes: list[Outcome], guest: str, run: Run) -> str:
    specs = {c.name: c for c in NETEM_CASES} | {f"fb:{c.name}": c for c in FALLBACK_CASES}
    lines = []
    others = passed_others = 0
    for outcome in outcomes:
        case = specs[outcome.case if outcome.backend.startswith("netem") else f"fb:{outcome.case}"]
        wanted = {name for key in case.spec for name in HEADLINE.get(key, ())}
        for item in outcome.checks:
            check = Check(**item)
            if check.quantity in wanted or check.passed is False:
                lines.append(row(outcome.case, outcome.backend, check, outcome.probes))
            elif check.passed is not None:
                others += 1
                passed_others += bool(check.passed)
    kernels = sorted({(o.backend, o.kernel) for o in outcomes})
    total = sum(1 for line in lines if "| pass |" in line or "FAIL" in line)
    failed = sum(1 for line in lines if "FAIL" in line)
    return "\n".join(
        [
            *run.header("Fidelity: configured against measured", also="\nKernels: " + "; ".join(
                f"{backend}: Linux {kernel}" for backend, kernel in kernels)
                + f". netem ran in: {guest}."),
            "Each case builds a fresh lab (two namespaces on a bridge), shapes the link into h1",
            "on the switch-side port, and sends a timed probe train from h0 (UDP over IPv4, over",
            "IPv6 where the case says so, ECN-capable where the link has ecn; the stated number",
            "of probes of 128 bytes, 1024 for",
            "corruption, every 400 us; every 800 us for the packet-overhead case, every 100 us",
            "for the host's loss cases), plus a one-second bulk train for rates. The lab's veths",
            "run without segmentation offloads, so every frame is wire-sized; the guest's one",
            "vCPU forwards about 75-100 Mbit/s of 1500-byte frames, so its 100 Mbit/s case uses",
            "a jumbo-frame lab (MTU 9000) and its other rate cases stay at 50 Mbit/s; the",
            "overhead cases run at MTU 1280, where the overheads cost a frame more than the",
            "rate's tolerance. The sample-built distribution's delays are",
            "benchmarks/data/delays-lognormal.txt (its header says how they were made).",
            "Tolerances and the meaning of each quantity: docs/probes.md. `netem-in-UML` runs",
            "inside a User-Mode Linux guest (one vCPU); `fallback-host` is the host kernel's",
            "nftables loss and htb rate. The links are shaped with `netem.apply`",
            "(docs/shaping.md): an htb root on the port with a netem leaf, or for the fallback",
            "an htb class at the rate and an nft netdev-egress drop rule.",
            "",
            f"Headline checks: {total - failed} of {total} pass. Every other predicted quantity "
            f"(no unexpected loss, duplication, corruption, reordering, delay; no probe dropped by "
            f"its own receiver): {passed_others} of {others} pass.",
            "",
            "| case | backend | quantity | configured | measured | tolerance | pass | probes |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *lines,
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fidelity",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--guest-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.guest_json:  # inside the guest: the netem cases only, as JSON for the host
        outcomes = run_cases(NETEM_CASES, "netem-in-UML")
        args.guest_json.write_text(json.dumps([dataclasses.asdict(o) for o in outcomes]))
        return
    run = Run.start("benchmarks.fidelity")
    outcomes, guest = netem_outcomes()
    outcomes += run_cases(FALLBACK_CASES, "fallback-host")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report(outcomes, guest, run))
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
