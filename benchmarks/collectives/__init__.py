"""Collectives benchmark: all-reduce among four workers in namespaces on shaped links.

`lossy` (also `lossy-keyed`: with a run key, a MAC on every datagram), `ring`, `moshpit` and
`gloo` (twice: TCP cubic and TCP bbr) side by side, on 1M, 10M
and 100M float32 elements, with every host's downlink rate-limited (100 Mbit/s, 1 Gbit/s) and
losing 0/1/5/10% of its packets (the host kernel's fallback shaping: htb rate, nftables loss, on
the switch-side ports), plus one unshaped set compared against gloo. Every worker is its own
process in its own namespace; the parent starts them together for each call (a line on their
stdin), so no call pays for another's start. Writes benchmarks/results/collectives.md.
`--grid` runs Moshpit on a grid instead: 8 and 16 peers in groups of four, every peer's
downlink and uplink at 100 Mbit/s, against the bound of one group all-reduce per grid axis
(benchmarks/results/collectives-moshpit-grid.md), saying where a call's time goes (each round
and its phases, TCP's counters); `--queue-limit` and `--no-idle-restart` change the grid's
queues and TCP's restart after idle, to measure what they cost.

    .venv/bin/python -m benchmarks.collectives [--quick] [--grid [WORLDS]] [--congestion ALGO]
        [--queue-limit PACKETS] [--no-idle-restart] [--out PATH]
"""
