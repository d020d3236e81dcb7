"""benchmarks/results/collectives.md: the four-worker cells' tables, the targets and the
observations, all drawn from this run's outcomes."""

from __future__ import annotations

from pathlib import Path

from benchmarks.collectives.cells import (
    KINDS,
    LOSSY_PACE_CAP,
    PACE,
    RATES,
    SETUP_NUMEL,
    SIZES,
    WARMUP_NUMEL,
    Cell,
    Outcome,
    congestion_of,
    rate_name,
    show,
    size_name,
    verdict,
)
from benchmarks.collectives.inputs import TOLERANCE
from benchmarks.report import Run


def ran(outcomes: list[Outcome]) -> list[str]:
    """The collectives this run measured, in the table's order."""
    return [kind for kind in KINDS if any(o.cell.kind == kind for o in outcomes)]


def tables(outcomes: list[Outcome]) -> list[str]:
    kinds = ran(outcomes)
    by = {(o.cell.kind, o.cell.numel, o.cell.rate, o.cell.loss): o for o in outcomes}
    out: list[str] = []
    header = "| size | " + " | ".join(kinds) + " |"
    rule = "| --- " * (len(kinds) + 1) + "|"
    unshaped = [o for o in outcomes if o.cell.rate is None]
    if unshaped:
        out += ["### Unshaped links (no rate, no loss): time per all-reduce, and gloo-bbr's "
                "time over it (> 1: faster than gloo)", "", header, rule]
        for numel in sorted({o.cell.numel for o in unshaped}):
            reference = by.get(("gloo-bbr", numel, None, 0.0))
            cells = []
            for kind in kinds:
                o = by.get((kind, numel, None, 0.0))
                text = show(o)
                if (o and o.status == "ok" and reference and reference.status == "ok"):
                    bus = o.cell.factor * o.cell.bytes * 8 / o.time / 1e9
                    text += f", x{reference.time / o.time:.2f} vs gloo, {bus:.2f} Gbit/s bus"
                cells.append(text)
            out.append(f"| {size_name(numel)} | " + " | ".join(cells) + " |")
        out.append("")
    for rate in [r for r in RATES.values() if any(o.cell.rate == r for o in outcomes)]:
        out += [f"### {rate_name(rate)} per downlink: time per all-reduce (fraction of the "
                "bandwidth bound)", "", "| size | loss | " + " | ".join(kinds) + " |",
                "| --- " * (len(kinds) + 2) + "|"]
        keys = sorted({(o.cell.numel, o.cell.loss) for o in outcomes if o.cell.rate == rate})
        for numel, loss in keys:
            bound = Cell("lossy", numel, rate, loss).bound
            cells = [show(by.get((kind, numel, rate, loss))) for kind in kinds]
            out.append(f"| {size_name(numel)} (bound {bound:.3g} s) | {loss:.0%} | "
                       + " | ".join(cells) + " |")
        out.append("")
        ratios = []
        for numel in sorted({o.cell.numel for o in outcomes if o.cell.rate == rate}):
            row = []
            for kind in kinds:
                row.append(ratio_text(by.get((kind, numel, rate, 0.0)),
                                      by.get((kind, numel, rate, 0.10))))
            if any(text != "-" for text in row):
                ratios.append(f"| {size_name(numel)} | " + " | ".join(row) + " |")
        if ratios:
            out += [f"Time at 10% loss over the same collective's time at 0% "
                    f"({rate_name(rate)}):", "", header, rule, *ratios, ""]
    memory = []
    for numel in sorted({o.cell.numel for o in outcomes}):
        row = []
        for kind in kinds:
            values = [o.extra_memory for o in outcomes if o.cell.kind == kind
                      and o.cell.numel == numel and o.status == "ok"]
            row.append(f"{max(values):.2f}" if values else "-")
        memory.append(f"| {size_name(numel)} | " + " | ".join(row) + " |")
    out += ["### Peak extra memory per worker, in tensor sizes (worst rank, worst cell)", "",
            "ru_maxrss after the calls minus before them (inputs and collective already built), "
            "over the tensor's bytes; the result itself is one tensor size. For small tensors "
            "fixed costs (allocator arenas, socket buffers, gloo's pairs) dominate the ratio.",
            "", header, rule,
            *memory, ""]
    return out


def ratio_text(clean: Outcome | None, lossy: Outcome | None) -> str:
    if clean is None or lossy is None:
        return "-"
    if clean.status != "ok":
        return "no 0% time"
    if lossy.status == "skipped":
        return "not run"
    if lossy.status == "timeout":
        return f"> {lossy.cell.call_timeout / clean.time:.3g}x"
    if lossy.status != "ok":
        return "failed"
    return f"{lossy.time / clean.time:.2f}x"


def targets(outcomes: list[Outcome]) -> list[tuple[bool | None, str]]:
    by = {(o.cell.kind, o.cell.numel, o.cell.rate, o.cell.loss): o for o in outcomes}
    lines: list[tuple[bool | None, str]] = []
    for numel in sorted({o.cell.numel for o in outcomes}):
        o = by.get(("lossy", numel, 100e6, 0.0))
        if o is not None:
            ok = o.status == "ok" and o.exact and o.fraction >= 0.9
            lines.append((ok, f"lossy, {size_name(numel)}, 100 Mbit/s, 0% loss: "
                          f"{o.fraction:.3f} of the bandwidth bound (target >= 0.9)"
                          + ("" if o.status == "ok" else f" [{show(o)}]")))
    for rate in RATES.values():
        for numel in sorted({o.cell.numel for o in outcomes}):
            clean, lossy = by.get(("lossy", numel, rate, 0.0)), by.get(("lossy", numel, rate, 0.1))
            if clean is None or lossy is None:
                continue
            ok = clean.status == lossy.status == "ok" and lossy.time <= 1.2 * clean.time
            lines.append((ok, f"lossy, {size_name(numel)}, {rate_name(rate)}: time at 10% loss "
                          f"/ time at 0% = {ratio_text(clean, lossy)} (target <= 1.2x)"))
    lossy_memory = [o for o in outcomes if o.cell.kind == "lossy" and o.status == "ok"]
    if lossy_memory:
        largest = max(o.cell.numel for o in lossy_memory)
        worst = max(o.extra_memory for o in lossy_memory if o.cell.numel == largest)
        lines.append((worst < 3, f"lossy, {size_name(largest)}: peak extra memory per worker "
                      f"{worst:.2f}x the tensor (target < 3x; worst cell)"))
    for kind in ("gloo-cubic", "gloo-bbr"):
        for rate in RATES.values():
            for numel in sorted({o.cell.numel for o in outcomes}):
                clean, lossy = by.get((kind, numel, rate, 0.0)), by.get((kind, numel, rate, 0.1))
                if clean is not None and lossy is not None:
                    lines.append((None, f"{kind}, {size_name(numel)}, {rate_name(rate)}: time "
                                  f"at 10% loss / time at 0% = {ratio_text(clean, lossy)} "
                                  "(beside lossy)"))
    wrong = [o for o in outcomes if o.status == "ok" and o.cell.loss == 0 and not o.exact]
    lines.append((not wrong, "every lossless cell that finished returned the true mean "
                  f"(tolerance {TOLERANCE:g})" + (": not in " + ", ".join(
                      f"{o.cell.kind} {size_name(o.cell.numel)} {rate_name(o.cell.rate)}"
                      for o in wrong) if wrong else "")))
    return lines


def observations(outcomes: list[Outcome]) -> list[str]:
    """Sentences drawn from the numbers of this run only."""
    by = {(o.cell.kind, o.cell.numel, o.cell.rate, o.cell.loss): o for o in outcomes}
    said: list[str] = []
    ok = [o for o in outcomes if o.status == "ok"]
    largest = max((o.cell.numel for o in ok), default=None)
    for rate in [r for r in RATES.values() if any(o.cell.rate == r for o in ok)]:
        clean = [o for o in ok if o.cell.rate == rate and o.cell.loss == 0
                 and o.cell.numel == largest]
        if clean:
            best = max(clean, key=lambda o: o.fraction)
            said.append(
                f"At {rate_name(rate)} without loss on {size_name(largest)} elements, "
                + ", ".join(f"{o.cell.kind} reached {o.fraction:.2f}" for o in clean)
                + f" of the bandwidth bound; {best.cell.kind} came closest.")
        for kind in ran(outcomes):
            ratios = [(numel, by.get((kind, numel, rate, 0.0)), by.get((kind, numel, rate, 0.1)))
                      for numel in SIZES.values()]
            shown = [f"{ratio_text(c, w)} on {size_name(n)}" for n, c, w in ratios
                     if c is not None and w is not None]
            if shown:
                said.append(f"{kind} at {rate_name(rate)}, 10% loss against 0%: "
                            + ", ".join(shown) + ".")
    timeouts = [o for o in outcomes if o.status == "timeout"]
    if timeouts:
        said.append("Timed out: " + ", ".join(
            f"{o.cell.kind} {size_name(o.cell.numel)} {rate_name(o.cell.rate)} "
            f"{o.cell.loss:.0%}" for o in timeouts) + ".")
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        said.append("Failed: " + "; ".join(
            f"{o.cell.kind} {size_name(o.cell.numel)} {rate_name(o.cell.rate)} "
            f"{o.cell.loss:.0%}: {o.note}" for o in failed) + ".")
    lossy = [o for o in ok if o.cell.kind == "lossy" and o.cell.loss > 0]
    if lossy:
        said.append("lossy's coverage under loss ranged " + f"{min(o.coverage for o in lossy):.3f}"
                    f"-{max(o.coverage for o in lossy):.3f}; its worst rank's error |result - "
                    "mean| over the inputs' rms distance to the mean was at most "
                    f"{max(o.relative_error for o in lossy):.3f} (0: exact; 1: no better than "
                    "a typical input alone).")
    clean = [o for o in ok if o.cell.kind == "lossy" and o.cell.loss == 0]
    if clean:
        lost = sum(o.counters.get("datagrams_lost", 0) for o in clean)
        dropped = sum(o.counters.get("rcvbuf_drops", 0) for o in clean)
        late = sum(o.counters.get("datagrams_late", 0) for o in clean)
        if lost or late:
            said.append(f"On lossless links lossy's timed calls still counted {lost:.0f} "
                        f"datagrams lost ({dropped:.0f} of them in the receivers' socket "
                        "buffers, the rest on the way: the shaper's queue, or the bridge when "
                        f"unshaped) and {late:.0f} late, over {len(clean)} cells.")
        else:
            said.append(f"On lossless links lossy's timed calls lost no datagram and had none "
                        f"late ({len(clean)} cells).")
    gloo = [o for o in ok if o.cell.kind.startswith("gloo") and o.tcp]
    if gloo:
        seen = sorted({(o.cell.kind, algo) for o in gloo for algo in o.tcp})
        said.append("gloo's sockets (ss -ti in rank 0's namespace) ran: " + ", ".join(
            f"{kind}: {algo}" for kind, algo in seen) + ".")
    return said


def report(outcomes: list[Outcome], run: Run, note: str = "") -> str:
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().strip()
    return "\n".join([
        *run.header("Collectives: all-reduce among four workers on shaped links", note),
        "How: a lab of four namespaces on a bridge (MTU 1500, offloads off); every host's "
        "downlink (the switch port towards it) shaped with `netem.apply(..., "
        "backend=\"fallback\")`: htb at the rate with a 1000-packet fifo queue, nftables random "
        "drop for the loss (this kernel has no sch_netem). Each worker is its own process in "
        "its own namespace; the "
        "parent releases all four for each call, so every call starts together. Every "
        f"collective but lossy first makes a {SETUP_NUMEL:,}-element call that sets up its "
        "connections and threads; then one warm-up "
        f"call (on the first {WARMUP_NUMEL / 1e6:g}M elements for larger tensors, except "
        "lossy, which learns its deadlines from its warm-ups: three up to "
        f"{WARMUP_NUMEL / 1e6:g}M elements, one above), then timed calls ("
        + ", ".join(f"{size_name(n)}: {r}" for n, r in sorted(
            {o.cell.numel: o.cell.reps for o in outcomes}.items())) + "); "
        "time per all-reduce is the slowest rank's, averaged over the timed calls. Each call "
        "has a timeout of 10x the bound (lossy's: at its pacing), 30-120 s; a cell that timed "
        "out is killed, and the same collective is not tried at the same rate with more loss "
        "or a larger tensor. "
        "The inputs are `mean + c_r * noise` with the c_r summing to zero (no subset does), "
        f"so a lossless result must equal `mean` (tolerance {TOLERANCE:g}).",
        "",
        f"Collectives: `lossy` paced at {PACE:.2f}x the link rate, at most "
        f"{LOSSY_PACE_CAP / 1e6:g} Mbit/s per sender (its pace on unshaped links), each "
        "sender's chunks to its three peers interleaved, with its defaults otherwise: a "
        "phase ends once every sender's stream has ended (`settle`), and its "
        "deadline, a backstop, starts at 1.5x the paced phase time + 2 s (at most the call "
        "timeout / 2.5) and is learned from there; `lossy-keyed`: the same with the run's "
        "key (a 16-byte BLAKE2b MAC after every datagram's payload, checked before it is "
        "used, and proof of the key in every TCP hello); `ring` and `moshpit` (one group of "
        f"four) over TCP {congestion_of(outcomes)} per socket; `gloo-cubic` and `gloo-bbr`: "
        "torch.distributed gloo with the namespaces' default TCP congestion control set to "
        "cubic or bbr (cubic is allowed for the moment of the sysctl; host list: "
        f"`{allowed}`). The bandwidth bound is 2(N-1)/N x bytes / rate with N = 4; the "
        "fraction in brackets is bound / time. `cov` is the mean coverage (fraction of "
        "contributions in the result).",
        "",
        *tables(outcomes),
        "### Targets",
        "",
        *[f"- {verdict(ok)}: {text}" for ok, text in targets(outcomes)],
        "",
        "### Observations (generated from this run's numbers)",
        "",
        " ".join(observations(outcomes)),
        "",
    ])
