"""What a `LinkProfile` predicts for a probe train, beside what the train measured.

`compare` sets each quantity of a `ProbeResult` (`netem.probe.analysis`) beside what the profile
predicts, with a tolerance and a verdict (`Check`): loss as a Markov chain, the delay as netem
draws it (uniform, from a named table or one built from samples), its rate with the packet and
cell overheads, its slots, reordering, duplication and corruption. docs/probes.md explains the
models and the tolerances.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from netem.distribution import NETEM_DIST_SCALE, S16_MAX, TABLE_SIZE, maketable_stats, read_samples
from netem.probe.analysis import PERCENTILES, ProbeResult
from netem.probe.wire import FRAME_OVERHEAD, HEADER
from netem.profile import Distribution, LinkProfile, SampledDistribution

# Tolerances of `compare`; docs/probes.md explains each.
DELAY_TOLERANCE = 0.05  # relative
JITTER_TOLERANCE = 0.20  # relative
RATE_TOLERANCE = 0.10  # relative
TIMING_FLOOR = 0.0005  # absolute allowance for delay and jitter: the path's own latency/noise
# In a User-Mode Linux guest one vCPU runs both ends of a train and the shaper, its timers are
# coarser and its system calls slower: 0.65 ms of spread was seen on a link without jitter
# while the host was loaded.
GUEST_TIMING_FLOOR = 0.002
# Standard errors a count may be off (loss, reorder, duplicate, corrupt, bursts, drops): a
# correct link fails one such check with probability 4e-8; a CI run makes about 150 of them, so
# it fails by chance with probability below 1e-5.
Z = 5.5
MIN_BURSTS = 20  # fewer loss bursts (or slot bunches) than this say nothing about their mean
TABLE_REACH = S16_MAX / NETEM_DIST_SCALE  # a delay table's entries lie within +-4 jitters


@dataclass(frozen=True)
class Check:
    """One measured quantity beside what was configured. `passed` is None when the quantity
    cannot be predicted for this profile (`note` says why)."""

    quantity: str
    unit: str  # "ratio", "seconds", "bits/s", "packets" (a mean length) or "count"
    configured: float
    measured: float
    tolerance: float
    passed: bool | None
    note: str = ""

    def show(self, value: float) -> str:
        """`value` in this check's unit, for a table."""
        if math.isnan(value):
            return "-"
        if self.unit == "ratio":
            return f"{value * 100:.2f}%"
        if self.unit == "seconds":
            return f"{value * 1e3:.3f} ms"
        if self.unit == "bits/s":
            return f"{value / 1e6:.2f} Mbit/s"
        if self.unit == "count":
            return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
        return f"{value:.2f}"


def _check(
    quantity: str, unit: str, expected: float, measured: float, tolerance: float, note: str = ""
) -> Check:
    passed = bool(abs(measured - expected) <= tolerance)  # NaN measured: fails
    return Check(quantity, unit, expected, measured, tolerance, passed, note)


def _binomial(
    quantity: str, expected: float, measured: float, trials: int, note: str = ""
) -> Check:
    """A proportion of independent trials: Z standard errors (at least Z/n, so that an expected 0
    tolerates a stray event or four)."""
    n = max(trials, 1)
    tolerance = Z * math.sqrt(max(expected * (1 - expected), 1 / n) / n)
    return _check(quantity, "ratio", expected, measured, tolerance, note)


def _skipped(quantity: str, unit: str, measured: float, note: str) -> Check:
    return Check(quantity, unit, math.nan, measured, math.nan, None, note)


def _loss_chain(profile: LinkProfile) -> tuple[np.ndarray, np.ndarray]:
    """The loss process as a Markov chain: (per-state loss probability, transition matrix).
    One state for random loss; Gilbert-Elliott's two, whose loss depends on the state entered."""
    ge = profile.gilbert_elliott
    if ge is None:
        return np.array([profile.loss]), np.array([[1.0]])
    return np.array([ge.loss_good, ge.loss_bad]), np.array([[1 - ge.p, ge.p], [ge.r, 1 - ge.r]])


def _stationary(step: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eig(step.T)
    vector = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    return vector / vector.sum()


def expected_burst_mean(profile: LinkProfile) -> float:
    """Mean length of a run of consecutive losses (loss correlation aside):
    P(lost) / P(lost, then not lost) for the chain of `_loss_chain`."""
    loss, step = _loss_chain(profile)
    stationary = _stationary(step)
    lost = float(stationary @ loss)
    ends = float((stationary * loss) @ step @ (1 - loss))
    return lost / ends if ends > 0 else math.inf


def _burst_variance(profile: LinkProfile) -> float:
    """Per-probe variance of the loss count that bursts add to the independent case:
    2 (l_bad - l_good)^2 pi_good pi_bad rho / (1 - rho), rho = 1 - p - r (the chain's memory)."""
    ge = profile.gilbert_elliott
    if ge is None or ge.p + ge.r == 0:
        return 0.0
    rho = 1 - ge.p - ge.r
    bad = ge.p / (ge.p + ge.r)
    return max(2 * (ge.loss_bad - ge.loss_good) ** 2 * bad * (1 - bad) * rho / (1 - rho), 0.0)


def wire_bytes(profile: LinkProfile, length: int) -> int:
    """The bytes netem's rate charges a packet of `length` bytes (sch_netem.c, packet_time_ns):
    `packet_overhead` added, then, with cells, rounded up to whole cells of `cell_size` bytes that
    take `cell_overhead` bytes more each."""
    length += profile.packet_overhead
    if profile.cell_size:
        cells = -(-length // profile.cell_size)
        length = cells * (profile.cell_size + profile.cell_overhead)
    return length


def expected_rate(profile: LinkProfile, frame: int) -> float:
    """Bits/s of `frame`-byte frames through a netem rate: it passes `rate` bits/s of what it
    charges (`wire_bytes`), of which the frames are frame / charged."""
    charged = wire_bytes(profile, frame)
    return profile.rate * frame / charged if charged != frame else float(profile.rate)


def _drawn(distribution: Distribution, jitter: float) -> tuple[float, float]:
    """Mean and standard deviation of what netem adds to a delay drawn with `jitter` from
    `distribution`: uniform within +-jitter (standard deviation jitter/sqrt(3)); a named table,
    normalised, 0 and jitter; a table built from samples, its own entries' (in jitters: its
    tail is cut at 4 jitters, which narrows it). Raises ValueError if that table cannot be made
    again (its file changed or is gone)."""
    if isinstance(distribution, SampledDistribution):
        law = np.asarray(distribution.table()) / NETEM_DIST_SCALE
        return jitter * float(law.mean()), jitter * float(law.std())
    if distribution == "uniform":
        return 0.0, jitter / math.sqrt(3)
    return 0.0, jitter


def default_timing_floor() -> float:
    """The least delay and jitter allowance where this runs: wider inside the sandbox's guest
    (`netem.sandbox` marks it in the environment), whose one vCPU runs both ends and the shaper."""
    return GUEST_TIMING_FLOOR if os.environ.get("TESTBED_IN_GUEST") else TIMING_FLOOR


def compare(configured: LinkProfile, result: ProbeResult,
            timing_floor: float | None = None) -> list[Check]:
    """Every measured quantity beside what `configured` predicts, with a tolerance and a verdict.
    `timing_floor` (seconds) is the least allowance for delay and jitter: the path's own noise
    (default: `default_timing_floor()`).

    Corruption is modelled as netem does it: one flipped bit anywhere in the frame. A flip in the
    Ethernet, IP, UDP or probe header loses the probe (the kernel drops it, or its sequence number
    can no longer be trusted); a flip in the pad arrives as a corrupt probe.
    """
    frame = result.frame_bytes
    floor = timing_floor if timing_floor is not None else default_timing_floor()
    # The socket's drop counter also counts datagrams whose UDP checksum field (16 bits) a
    # corrupting link flipped from zero: the kernel then checks the sum and drops them there.
    flips = configured.corrupt * (result.arrivals + result.malformed) * 16 / (8 * frame)
    drops = result.receiver_drops
    checks = [
        _check(
            "receiver drops",
            "count",
            flips,
            drops,
            Z * math.sqrt(flips),
            "the probe's own socket overflowed: loss is overstated" if drops > flips else "",
        ),
    ]
    load = wire_bytes(configured, frame) * 8 / result.interval if result.interval > 0 else math.inf
    if configured.rate and load > configured.rate / 2:
        note = (
            f"the probe train itself ({load / 1e6:.1f} Mbit/s) loads the link: its own "
            "queueing adds delay and loss; probe more slowly"
        )
        checks += [
            _skipped(name, unit, value, note)
            for name, unit, value in (
                ("loss", "ratio", result.loss_ratio),
                ("loss burst mean", "packets", result.loss_burst_mean),
                *_delay_measures(configured, result),
            )
        ]
    else:
        checks += [
            _loss_check(configured, result),
            _burst_check(configured, result),
            *_delay_checks(configured, result, floor),
        ]
        if configured.ecn or result.ecn_capable:
            checks.append(_marked_check(configured, result))
    if configured.slot is not None:
        checks.append(_slot_check(configured, result, floor))
    checks.append(_reorder_check(configured, result))
    correlated = "netem's correlated generator does not keep the mean rate"
    if configured.duplicate_correlation > 0:
        checks.append(_skipped("duplicate", "ratio", result.duplicate_ratio, correlated))
    else:
        checks.append(
            _binomial("duplicate", configured.duplicate, result.duplicate_ratio, result.received)
        )
    if configured.corrupt_correlation > 0:
        checks.append(_skipped("corrupt", "ratio", result.corrupt_ratio, correlated))
    else:
        hit = configured.corrupt * result.size / frame
        dropped = configured.corrupt * FRAME_OVERHEAD / frame
        checks.append(
            _binomial(
                "corrupt",
                hit / (1 - dropped),
                result.corrupt_ratio,
                result.arrivals + result.malformed,
                f"one flipped bit per frame; {result.size} of its {frame} bytes are the probe's",
            )
        )
    if result.rate is not None:
        checks.append(_rate_check(configured, result))
    if configured.mean_loss >= 1 and result.received == 0:
        # A cut link: nothing arrives, so only the loss (and the receiver's drops) is measured.
        checks = [_skipped(c.quantity, c.unit, c.measured, "nothing arrives over a link with "
                           "100% loss") if math.isnan(c.measured) else c for c in checks]
    return checks


def _marking(configured: LinkProfile, result: ProbeResult) -> bool:
    """The link marks the probes CE where its loss model says "lose" (netem's `ecn`, and the
    probes were ECN-capable): they arrive, marked, instead."""
    return configured.ecn and result.ecn_capable


def _loss_check(configured: LinkProfile, result: ProbeResult) -> Check:
    """Z standard errors of the lost count: binomial for independent losses, plus the extra
    variance that bursts add. Probes a link marks instead of dropping are not lost."""
    if configured.loss_correlation > 0 and not _marking(configured, result):
        return _skipped(
            "loss",
            "ratio",
            result.loss_ratio,
            "netem's correlated generator does not keep the mean loss",
        )
    header = _header_hit(configured, result)
    if _marking(configured, result):
        return _binomial("loss", header, result.loss_ratio, result.sent,
                         "the link marks CE what its loss model takes (ecn)")
    return _chain_check("loss", configured, 1 - (1 - configured.mean_loss) * (1 - header),
                        result.loss_ratio, result.sent)


def _chain_check(quantity: str, configured: LinkProfile, expected: float, measured: float,
                 trials: int) -> Check:
    """A ratio the loss model sets: binomial, plus the extra variance that bursts add."""
    n = max(trials, 1)
    independent = max(expected * (1 - expected), 1 / n) / n
    tolerance = Z * math.sqrt(independent + _burst_variance(configured) / n)
    return _check(quantity, "ratio", expected, measured, tolerance)


def _marked_check(configured: LinkProfile, result: ProbeResult) -> Check:
    """The probes that arrived marked CE: what the loss model takes on a link with `ecn` (of
    ECN-capable probes), none on one without."""
    if not result.ecn_capable:
        return _skipped("CE marks", "ratio", math.nan,
                        "the probes were not ECN-capable (probe with ecn to count marks)")
    if not configured.ecn:
        return _binomial("CE marks", 0.0, result.marked_ratio, result.sent,
                         "no ecn configured: nothing should be marked")
    if configured.loss_correlation > 0:
        return _skipped("CE marks", "ratio", result.marked_ratio,
                        "netem's correlated generator does not keep the mean loss")
    kept = 1 - _header_hit(configured, result)
    return _chain_check("CE marks", configured, configured.mean_loss * kept,
                        result.marked_ratio, result.sent)


def _header_hit(configured: LinkProfile, result: ProbeResult) -> float:
    """The share of probes whose flipped bit (netem's one per corrupted frame) lands in the
    frame's headers or the probe's: lost, as the kernel drops them or their number is gone."""
    return configured.corrupt * (FRAME_OVERHEAD + HEADER.size) / result.frame_bytes


def _burst_check(configured: LinkProfile, result: ProbeResult) -> Check:
    measured = result.loss_burst_mean if result.loss_bursts else math.nan
    if configured.mean_loss == 0:
        return _skipped("loss burst mean", "packets", measured, "no loss configured")
    if _marking(configured, result):
        return _skipped("loss burst mean", "packets", measured,
                        "the link marks CE instead of losing (ecn)")
    if configured.loss_correlation > 0:
        return _skipped(
            "loss burst mean",
            "packets",
            measured,
            "netem's correlated generator changes the bursts",
        )
    bursts = sum(result.loss_bursts.values())
    if bursts < MIN_BURSTS:
        return _skipped(
            "loss burst mean", "packets", measured, f"only {bursts} bursts; {MIN_BURSTS} needed"
        )
    expected = expected_burst_mean(configured)
    # Burst lengths taken as geometric with this mean: variance mean*(mean-1).
    tolerance = max(Z * math.sqrt(expected * (expected - 1) / bursts), 0.05 * expected)
    return _check("loss burst mean", "packets", expected, measured, tolerance)


def _rate_check(configured: LinkProfile, result: ProbeResult) -> Check:
    """The bulk train's frames against the share of the rate they get once netem has charged
    each its overheads (`expected_rate`)."""
    if configured.rate is None:
        return _skipped("rate", "bits/s", result.rate, "no rate configured")
    frame = result.rate_frame_bytes
    expected = expected_rate(configured, frame)
    note = (f"{frame}-byte frames are charged {wire_bytes(configured, frame)} bytes of the rate"
            if expected != configured.rate else "")
    return _check("rate", "bits/s", expected, result.rate, RATE_TOLERANCE * expected, note)


def _early_fraction(configured: LinkProfile) -> float:
    """Fraction of packets netem sends at once, ahead of the delayed ones (gap 0 means tc's 1)."""
    gap = max(configured.gap, 1)
    return configured.reorder / (1 + configured.reorder * (gap - 1))


def _delay_measures(configured: LinkProfile, result: ProbeResult) -> list[tuple[str, str, float]]:
    """The delay quantities judged for this profile, with their measured values: mean and
    spread, and with a distribution built from samples its quantiles (`_quantile_checks`)."""
    measures = [("delay mean", "seconds", result.delay_mean),
                ("jitter (stdev)", "seconds", result.delay_stdev)]
    if isinstance(configured.distribution, SampledDistribution):
        measures += [(f"delay p{p}", "seconds", result.delay_percentiles[p]) for p in PERCENTILES]
    return measures


def _unpredictable_delay(configured: LinkProfile, result: ProbeResult) -> str:
    """Why no delay quantity can be predicted for this train, or ''."""
    if result.too_busy:
        trains = f" (in the last of {result.trains} trains)" if result.trains > 1 else ""
        return (f"{result.stalled} of {result.arrivals} probes were held up while the "
                f"sender stalled{trains}: the host was too busy to judge delay; probe again")
    if configured.rate and configured.jitter:
        return ("with a rate, netem keeps packets in order: each waits for the one ahead, so "
                "delays crowd towards delay + jitter and spread less")
    if configured.slot is not None:
        return ("slots hold each packet until the next slot opens: its delay depends on when it "
                "came (the slot wait is checked instead)")
    return ""


def _delay_checks(configured: LinkProfile, result: ProbeResult,
                  timing_floor: float) -> list[Check]:
    """Mean and spread of the one-way delay: a mixture of packets sent at once (the reordered
    fraction f) and packets delayed by delay + what the distribution draws, plus the
    serialisation at the rate; with a table built from samples, its quantiles too."""
    note = _unpredictable_delay(configured, result)
    try:
        offset, spread = _drawn(configured.distribution, configured.jitter)
    except ValueError as error:
        note = note or f"the delay table cannot be made again: {error}"
    if note:
        return [_skipped(name, unit, value, note)
                for name, unit, value in _delay_measures(configured, result)]
    early = _early_fraction(configured)
    charged = wire_bytes(configured, result.frame_bytes)
    serialise = charged * 8 / configured.rate if configured.rate else 0.0
    delayed = configured.delay + offset
    mean = (1 - early) * delayed + serialise
    stdev = math.sqrt((1 - early) * spread**2 + early * (1 - early) * delayed**2)
    checks = [
        _check(
            "delay mean",
            "seconds",
            mean,
            result.delay_mean,
            max(DELAY_TOLERANCE * mean, timing_floor),
        )
    ]
    if configured.delay_correlation > 0:
        checks.append(
            _skipped(
                "jitter (stdev)",
                "seconds",
                result.delay_stdev,
                "netem's correlated generator narrows the spread",
            )
        )
    else:
        checks.append(
            _check(
                "jitter (stdev)",
                "seconds",
                stdev,
                result.delay_stdev,
                max(JITTER_TOLERANCE * stdev, timing_floor),
            )
        )
    if isinstance(configured.distribution, SampledDistribution):
        checks += _quantile_checks(configured, configured.distribution, result, timing_floor)
    return checks


def _quantile_checks(configured: LinkProfile, distribution: SampledDistribution,
                     result: ProbeResult, timing_floor: float) -> list[Check]:
    """The delay percentiles (PERCENTILES) of a distribution built from samples: each is the
    samples' own, normalised as the table is (mean 0, standard deviation 1, cut at +-4) and
    drawn as netem draws it, delay + jitter * that value."""
    names = [(f"delay p{p}", result.delay_percentiles[p]) for p in PERCENTILES]
    mixed = ("reordering sends some packets at once, undelayed" if configured.reorder > 0
             else "netem's correlated generator narrows the spread"
             if configured.delay_correlation > 0 else "")
    if mixed:
        return [_skipped(name, "seconds", value, mixed) for name, value in names]
    samples = read_samples(Path(distribution.samples), distribution.column)
    mean, stdev = maketable_stats(samples)
    timed = max(result.arrivals - result.stalled, 1)
    checks = []
    for (name, measured), p in zip(names, PERCENTILES, strict=True):
        q = p / 100
        # How far the p-quantile of `timed` delays strays: how many of them fall below the
        # law's q'-quantile is binomial(timed, q'), so the measured one lies between the law's
        # (q - w)- and (q + w)-quantiles unless that count strays Z standard errors,
        # w = Z sqrt(q (1 - q) / timed) (p99 of 10,000: +-0.55 points). The table holds
        # the samples' quantiles at steps of 1/TABLE_SIZE (maketable rounds each sample's
        # cumulative fraction to one of its entries): w widens by one step. Its values' own
        # rounding (1/50,000 and 1/8192 of a jitter) is far below the timers' noise. The band
        # is asymmetric on a heavy tail: the tolerance is its wider side. Every delay also
        # carries the path's own latency and the timers' noise: the timing floor adds to it.
        w = Z * math.sqrt(q * (1 - q) / timed) + 1 / TABLE_SIZE
        quantiles = np.quantile(samples, [max(q - w, 0.0), q, min(q + w, 1.0)])
        low, expected, high = configured.delay + configured.jitter * np.clip(
            (quantiles - mean) / stdev, -TABLE_REACH, TABLE_REACH)
        band = max(high - expected, expected - low)
        checks.append(_check(name, "seconds", float(expected), measured,
                             float(band) + timing_floor))
    return checks


def _slot_check(configured: LinkProfile, result: ProbeResult, timing_floor: float) -> Check:
    """How long the first probe of each bunch a slotted link delivers waited for it. A packet
    that finds the last slot past starts the next: netem draws the time to it then (sch_netem.c,
    get_slot_next), and the slot lets go every packet that came meanwhile. So the first probe
    of a bunch waited one slot gap: on average the mean slot gap."""
    slot = configured.slot
    name, measured, interval = "slot wait", result.bunch_wait, result.interval
    if slot.distribution is None:
        mean = (slot.min_delay + slot.max_delay) / 2
        spread, reach = (slot.max_delay - slot.min_delay) / math.sqrt(12), mean - slot.min_delay
    else:
        try:
            offset, spread = _drawn(slot.distribution, slot.jitter)
        except ValueError as error:
            return _skipped(name, "seconds", measured, f"the slot table cannot be made again: "
                            f"{error}")
        mean = slot.delay + offset
        reach = slot.jitter * (1 if slot.distribution == "uniform" else TABLE_REACH)
    if mean < reach:
        return _skipped(name, "seconds", measured, "some slot gaps drawn are below 0: netem "
                        "opens those slots at once, so the gaps' mean is not the drawn one")
    # The most probes one slot can gather, at the pace of a sender catching up (twice its own).
    gathered = math.floor((mean + reach) / (interval / 2)) + 1 if interval > 0 else math.inf
    released = min(slot.max_packets or math.inf,
                   math.ceil(slot.max_bytes / result.frame_bytes) if slot.max_bytes else math.inf)
    if released < gathered:
        return _skipped(name, "seconds", measured, f"a slot may gather {gathered} probes and "
                        f"lets {released} go: the rest wait for the next; probe more slowly")
    if result.bunches < MIN_BURSTS:
        return _skipped(name, "seconds", measured,
                        f"only {result.bunches} bunches arrived; {MIN_BURSTS} needed")
    # Each bunch's wait is a slot gap of its own, drawn independently.
    error = spread / math.sqrt(result.bunches)
    return _check(name, "seconds", mean, measured, max(Z * error, timing_floor))


def _reorder_check(configured: LinkProfile, result: ProbeResult) -> Check:
    """The fraction of probes that overtook an earlier one. netem sends a fraction f at once;
    such a probe overtakes unless every probe sent within one delay before it also went at once."""
    if configured.jitter > 0:
        return _skipped(
            "reorder (overtaking)",
            "ratio",
            result.overtake_ratio,
            "jitter reorders packets too; no expected value",
        )
    if configured.reorder_correlation > 0:
        return _skipped(
            "reorder (overtaking)",
            "ratio",
            result.overtake_ratio,
            "netem's correlated generator does not keep the mean rate",
        )
    early = _early_fraction(configured)
    within = int(configured.delay / result.interval) if result.interval > 0 else 0
    expected = early * (1 - early**within)
    return _binomial("reorder (overtaking)", expected, result.overtake_ratio, result.received)
