"""`testbed demo`: the shaping path end to end, measured.

Three hosts in namespaces on a bridge; the links into host 0 are shaped per source (directed,
pairwise links on one receiver) and each is measured with probe trains. Part one runs on this
machine's kernel with whatever shaping it has; part two boots a User-Mode Linux guest whose
kernel has netem, when this one does not, and runs full netem profiles (delay, jitter, bursty
loss). Every configured value is printed beside the measured one with its tolerance.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from netem.lab import Lab
from netem.probe import Check, compare, offered_load, probe
from netem.profile import GilbertElliott, LinkProfile

RECEIVER = 0
PROBES = 5000
RATE_SECONDS = 1.0


@dataclass(frozen=True)
class DemoLink:
    """One directed link into the receiver: its source host and what it should do."""

    source: int
    profile: LinkProfile


@dataclass(frozen=True)
class Part:
    """One half of the demo: links shaped and measured on one kernel with one backend."""

    title: str
    backend: str
    links: tuple[DemoLink, ...]


HOST_PART = Part(
    "fallback (nft loss, htb rate)",
    "fallback",
    (
        DemoLink(1, LinkProfile.parse(loss="10%", rate="20mbit")),
        DemoLink(2, LinkProfile()),
    ),
)
NETEM_PART = Part(
    "netem",
    "netem",
    (
        DemoLink(
            1,
            LinkProfile(
                delay=0.02,
                jitter=0.005,
                distribution="normal",
                gilbert_elliott=GilbertElliott(p=0.01, r=0.25, loss_bad=1.0),
            ),
        ),
        DemoLink(2, LinkProfile.parse(delay="5ms", loss="2%", rate="50mbit")),
    ),
)


@dataclass(frozen=True)
class Measured:
    """The checks of one link, as shown in the summary."""

    part: str
    link: str
    profile: str
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(check.passed is not False for check in self.checks)


Progress = Callable[[str], None]


def measure_part(part: Part, say: Progress = lambda _: None) -> list[Measured]:
    """Build a lab, shape the links into the receiver, probe each one, clean up."""
    from netem import apply

    say("building a lab of 3 hosts on a bridge")
    with Lab(3) as lab:
        receiver = lab.hosts[RECEIVER]
        rules = {lab.hosts[link.source].address: link.profile for link in part.links}
        say(f"shaping the links into {receiver.netns} ({part.backend})")
        applied = apply(
            receiver.switch_port, rules, netns=lab.switch, direction="egress",
            backend=part.backend,
        )
        outcomes = []
        for link in part.links:
            source = lab.hosts[link.source]
            name = f"h{link.source} -> h{RECEIVER}"
            say(f"probing {name}: {link.profile}")
            result = probe(
                source.netns, receiver.netns, receiver.address, count=PROBES,
                rate_duration=RATE_SECONDS if link.profile.rate else 0.0,
                offered_rate=offered_load(link.profile),
            )
            checks = tuple(compare(link.profile, result))
            outcomes.append(Measured(part.title, name, str(link.profile), checks))
        say(f"removing the lab ({applied.backend} shaping, offloads off on "
            f"{', '.join(applied.offloads_disabled) or 'nothing'})")
    return outcomes


def measure_in_guest(part: Part, say: Progress) -> list[Measured]:
    """Run `part` where netem exists: here if this kernel has it, else in a UML guest."""
    from netem import sandbox
    from netem.capabilities import netem_available

    if netem_available():
        return measure_part(part, say)
    say("preparing the User-Mode Linux kernel (cached after the first run)")
    kernel = sandbox.prepare(quiet=True)
    say(f"measuring in a guest: {sandbox.describe(kernel)}")
    with tempfile.TemporaryDirectory(prefix="tb-demo-") as folder:
        out = Path(folder) / "netem.json"
        result = sandbox.run(
            [sys.executable, "-m", "testbed.demo", str(out)], kernel=kernel, stream=False,
            timeout=600,
        )
        if result.returncode != 0 or not out.exists():
            raise sandbox.SandboxError(
                f"the guest's measurement failed (exit {result.returncode}):\n{result.output}"
            )
        return [_measured_from(item) for item in json.loads(out.read_text())]


def run(say: Progress = lambda _: None) -> list[Measured]:
    """Both parts, host first."""
    return measure_part(HOST_PART, say) + measure_in_guest(NETEM_PART, say)


def _measured_from(item: dict) -> Measured:
    checks = tuple(Check(**check) for check in item.pop("checks"))
    return Measured(**item, checks=checks)


def _write(outcomes: Sequence[Measured], path: Path) -> None:
    path.write_text(json.dumps([dataclasses.asdict(outcome) for outcome in outcomes]))


def summary_rows(outcomes: Sequence[Measured]) -> list[tuple[str, ...]]:
    """One row per checked quantity: part, link, quantity, configured, measured, tolerance,
    verdict (quantities that cannot be predicted for a profile are left out)."""
    rows = []
    for outcome in outcomes:
        for check in outcome.checks:
            if check.passed is None or (check.configured == 0 and check.measured == 0):
                continue
            tolerance = "-" if math.isnan(check.tolerance) else f"± {check.show(check.tolerance)}"
            rows.append((
                outcome.part, outcome.link, check.quantity, check.show(check.configured),
                check.show(check.measured), tolerance, "pass" if check.passed else "FAIL",
            ))
    return rows


if __name__ == "__main__":  # the guest half: python -m testbed.demo OUT.json
    _write(measure_part(NETEM_PART, lambda line: print(line, flush=True)), Path(sys.argv[1]))
