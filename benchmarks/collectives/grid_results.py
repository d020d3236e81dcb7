"""benchmarks/results/collectives-moshpit-grid.md: Moshpit on grids against its bound, the ring
beside it as a reference."""

from __future__ import annotations

from benchmarks.collectives.cells import (
    GRID_GROUP,
    GRID_RATE,
    SETUP_NUMEL,
    Outcome,
    all_reduce_share,
    congestion_of,
    show,
    size_name,
    verdict,
)
from benchmarks.collectives.inputs import TOLERANCE
from benchmarks.report import Run
from netem.profile import DEFAULT_LIMIT
from testbed.collectives.grid import Grid


def grid_targets(outcomes: list[Outcome]) -> list[tuple[bool | None, str]]:
    lines: list[tuple[bool | None, str]] = []
    for o in outcomes:
        if o.cell.kind != "moshpit":
            if o.status == "ok":
                lines.append((None, f"{o.cell.kind}, {o.cell.world} peers, "
                              f"{size_name(o.cell.numel)}: {o.fraction:.3f} of its bound "
                              "(reference)"))
            continue
        where = (f"moshpit, {o.cell.world} peers, {size_name(o.cell.numel)}, "
                 f"{o.cell.rate / 1e6:g} Mbit/s")
        if o.status != "ok":
            lines.append((False, f"{where}: {show(o)}"))
            continue
        lines.append((o.fraction >= 0.85 and o.exact,
                      f"{where}: {o.fraction:.3f} of the grid's bandwidth bound, "
                      f"{'exact' if o.exact else 'NOT the exact mean'} (target >= 0.85, exact)"))
        lines.append((o.call_memory < 2, f"{where}: a call's peak extra memory "
                      f"{o.call_memory:.2f}x the tensor (target < 2x); {o.extra_memory:.2f}x "
                      "with the connections and threads its set-up call made"))
    return lines


def round_bound(o: Outcome, axis: int) -> float:
    """Seconds the bandwidth bound allows one round: 2(g-1)/g tensors at the rate, side g
    (half of it in each phase)."""
    side = Grid.for_world(o.cell.world).sides[axis]
    return all_reduce_share(side) * o.cell.bytes * 8 / o.cell.rate


def where_time_goes(outcomes: list[Outcome]) -> list[str]:
    """Per cell: Moshpit's rounds against their own bounds and what a call spent outside
    them; for every cell, what TCP did per call and peer in the peers' namespaces."""
    lines = []
    for o in outcomes:
        if o.status != "ok":
            continue
        where = f"{o.cell.kind}, {o.cell.world} peers, {size_name(o.cell.numel)}"
        parts = [f"the peers began a call within {o.start_skew * 1e3:.0f} ms of each other; "
                 f"from the last one's start to the last end {o.after_last_start:.3g} s "
                 f"({o.cell.bound / o.after_last_start:.2f} of the bound)"]
        if o.round_seconds:
            sides = Grid.for_world(o.cell.world).sides
            parts += [f"round {i + 1} (a group of {sides[i]}) {seconds:.3g} s against its "
                      f"{round_bound(o, i):.3g} s ({round_bound(o, i) / seconds:.2f}): roll call "
                      f"{roll_call * 1e3:.0f} ms, reduce-scatter {scatter:.3g} s, all-gather "
                      f"{seconds - roll_call - scatter:.3g} s"
                      for i, (seconds, roll_call, scatter) in enumerate(o.round_seconds)]
            parts.append(f"outside the rounds {o.outside_rounds * 1e3:.0f} ms")
        calls = len(o.seconds) * o.cell.world
        sent = o.counters.get("netns_sent_segments", 0)
        parts.append(
            f"per call and peer {sent / calls:,.0f} segments sent, "
            f"{o.counters.get('netns_retransmitted_segments', 0) / calls:.1f} retransmitted, "
            f"{o.counters.get('netns_timeouts', 0) / calls:.2f} retransmission timeouts, "
            f"{o.counters.get('netns_loss_probes', 0) / calls:.2f} tail loss probes")
        lines.append(f"- {where}: " + "; ".join(parts))
    return lines


def grid_report(outcomes: list[Outcome], run: Run, note: str = "") -> str:
    rows = ["| collective | peers | grid | rate | size | bound | time per all-reduce | of the "
            "bound | exact | slowest call | call memory | with set-up | host CPU busy |",
            "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: "
            "| ---: |"]
    limit = outcomes[0].cell.queue_limit if outcomes else DEFAULT_LIMIT
    idle_restart = outcomes[0].cell.idle_restart if outcomes else True
    for o in outcomes:
        sides = ("x".join(map(str, Grid.for_world(o.cell.world).sides))
                 if o.cell.kind == "moshpit" else "ring")
        slowest = f"{max(o.seconds):.3g} s" if o.seconds else "-"
        rows.append(f"| {o.cell.kind} | {o.cell.world} | {sides} | {o.cell.rate / 1e6:g} Mbit/s | "
                    f"{size_name(o.cell.numel)} | "
                    f"{o.cell.bound:.3g} s | {show(o, with_bound=False)} | "
                    f"{o.fraction:.2f} | {'yes' if o.exact else 'no'} | {slowest} | "
                    f"{o.call_memory:.2f} | {o.extra_memory:.2f} | {o.cpu_busy:.0%} |")
    return "\n".join([
        *run.header("Moshpit on a grid: groups of four, the same rate each way on every peer",
                    note),
        "How: a lab of N namespaces on a bridge (MTU 1500, offloads off); every peer's downlink "
        "(the switch port towards it) and uplink (its own port's egress) shaped to the rate "
        "of the table (`--grid-rate`, 100 Mbit/s unless said) with `netem.apply(..., "
        "backend=\"fallback\")` (htb, this kernel has no sch_netem), no loss. Each peer is "
        "its own process in its own namespace, Moshpit over TCP "
        f"{congestion_of(outcomes)} with `group_size` {GRID_GROUP}: N = 8 sits on a 4x2 grid, "
        f"N = 16 on 4x4. A {SETUP_NUMEL:,}-element set-up call, one warm-up call, then timed "
        "calls (1M: 5, 10M: 2); the time is the "
        "slowest peer's, averaged over the timed calls; the call's deadline (`timeout`) is 10x the "
        "bound, 30-120 s. Moshpit's bound is one group all-reduce per grid axis: each peer "
        "receives 2(g-1)/g of the tensor per side g (4x2: 2.5 tensors; 4x4: 3), at the rate; "
        "the ring (reliable ring all-reduce over TCP, one stream in and one out per worker) "
        "runs on the same links as a reference for what TCP reaches there, against its own "
        "bound, 2(N-1)/N tensors. The "
        "inputs are `mean + c_r * noise` with the c_r summing to zero and no proper subset "
        f"doing so (`offsets`): the result must equal `mean` (tolerance {TOLERANCE:g}). Memory, "
        "over the tensor's bytes, worst peer (the result itself is one tensor): `call "
        "memory` is the peak resident size over the warm-up and timed calls (VmHWM, reset as "
        "they begin) over the resident size they began at, once the set-up call had made "
        "the connections and threads; `with set-up` is ru_maxrss after the calls over before "
        "the set-up call, the collective already built: it adds those fixed costs, a few MB "
        f"whatever the tensor. Each shaped link queues up to {limit} packets (`--queue-limit`;"
        f" {limit * 1514 * 8 / (outcomes[0].cell.rate if outcomes else GRID_RATE) * 1e3:.0f} "
        "ms of full frames at the rate); TCP's congestion window "
        + ("restarts after an idle retransmission timeout (the kernel's default)"
           if idle_restart else "survives idle pauses (`--no-idle-restart`: "
           "net.ipv4.tcp_slow_start_after_idle=0)") + ".",
        "",
        *rows,
        "",
        "### Targets",
        "",
        *[f"- {verdict(ok)}: {text}" for ok, text in grid_targets(outcomes)],
        "",
        "### Where a call's time goes",
        "",
        "The timed calls' averages. The table's time is the slowest peer's from its own start, "
        "so it counts how long the first peer to begin waited for the last (the runner tells "
        "the peers to begin one after another, on two cores); from the last peer's start to "
        "the last end is the call once every peer is in. A round's time is its slowest "
        "peer's, from the roll call to the last slice of its all-gather, against the bound "
        "of its group's all-reduce alone (half of it for each phase), with that peer's phases "
        "(a roll call waits for the group's last member to begin the round); outside the "
        "rounds is the rest of the call (the slowest peer's). The TCP counters are the peers' "
        "namespaces' (/proc/net/snmp, /proc/net/netstat), differences across each call: a "
        "retransmission here follows a drop at a full queue (the links lose nothing).",
        "",
        *where_time_goes(outcomes),
        "",
    ])
