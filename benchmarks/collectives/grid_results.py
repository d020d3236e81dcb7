"""benchmarks/results/collectives-moshpit-grid.md: Moshpit on grids against its bound, the ring
beside it as a reference."""

from __future__ import annotations

from benchmarks.collectives.cells import (
    GRID_GROUP,
    SETUP_NUMEL,
    Outcome,
    congestion_of,
    show,
    size_name,
    verdict,
)
from benchmarks.collectives.inputs import TOLERANCE
from benchmarks.report import Run
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


def grid_report(outcomes: list[Outcome], run: Run, note: str = "") -> str:
    rows = ["| collective | peers | grid | rate | size | bound | time per all-reduce | of the "
            "bound | exact | slowest call | call memory | with set-up | host CPU busy |",
            "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: "
            "| ---: |"]
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
        "whatever the tensor.",
        "",
        *rows,
        "",
        "### Targets",
        "",
        *[f"- {verdict(ok)}: {text}" for ok, text in grid_targets(outcomes)],
        "",
    ])
