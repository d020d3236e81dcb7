"""Probes: numbered, timestamped UDP trains that measure what a link really does.

`wire` is the datagram's format, `engine` sends and receives trains between two network
namespaces, `analysis` turns what arrived into statistics, `verdicts` sets them beside what a
`LinkProfile` predicts.
The names below are the ones callers use; docs/probes.md describes the whole.
"""

from netem.probe.analysis import (
    PERCENTILES,
    ProbeResult,
    Train,
    analyze,
    arrival_bunches,
    bulk_rate,
    first_arrivals,
    held_by_stalls,
    late_arrivals,
    loss_bursts,
    overtaking_arrivals,
)
from netem.probe.engine import (
    DEFAULT_SIZE,
    RateResult,
    measure_rate,
    offered_load,
    probe,
    run_train,
)
from netem.probe.verdicts import (
    GUEST_TIMING_FLOOR,
    TIMING_FLOOR,
    Check,
    compare,
    expected_burst_mean,
    expected_rate,
    wire_bytes,
)
from netem.probe.wire import (
    FRAME_OVERHEAD,
    HEADER,
    HEADER_DTYPE,
    KIND_END,
    KIND_PROBE,
    KIND_WARMUP,
    STATUS_MALFORMED,
    STATUS_OK,
    STATUS_PAYLOAD_CORRUPT,
    ProbeError,
    decode,
    encode,
)

__all__ = [
    "DEFAULT_SIZE",
    "FRAME_OVERHEAD",
    "GUEST_TIMING_FLOOR",
    "HEADER",
    "HEADER_DTYPE",
    "KIND_END",
    "KIND_PROBE",
    "KIND_WARMUP",
    "PERCENTILES",
    "STATUS_MALFORMED",
    "STATUS_OK",
    "STATUS_PAYLOAD_CORRUPT",
    "TIMING_FLOOR",
    "Check",
    "ProbeError",
    "ProbeResult",
    "RateResult",
    "Train",
    "analyze",
    "arrival_bunches",
    "bulk_rate",
    "compare",
    "decode",
    "encode",
    "expected_burst_mean",
    "expected_rate",
    "first_arrivals",
    "held_by_stalls",
    "late_arrivals",
    "loss_bursts",
    "measure_rate",
    "offered_load",
    "overtaking_arrivals",
    "probe",
    "run_train",
    "wire_bytes",
]
