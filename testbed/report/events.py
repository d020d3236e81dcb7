"""The events of a run directory: their types, their fields, and how a line is checked.

Every line of an events file is one JSON object with a `type` and `t` (seconds since the run
started, on the wall clock every writer shares). The types are `run` (the first line of
`events.jsonl`), `step` (one per step per worker), `fault`, `link` and `end`; a line of another
type is kept as it is (`Run.other`) so newer writers stay readable. docs/report.md lists every
field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

FORMAT = 1

# Figures of `AllReduceStats.extra` that count since the collective's sockets opened, not per
# step: a run's total is the last value, not the sum.
CUMULATIVE = frozenset({"tcp_retransmits"})
# Figures of `AllReduceStats.extra` that describe one step's state (ratios, deadlines, peers
# left out): a run's figure is their mean, not the sum. Every other figure counts (datagrams,
# chunks, seconds spent, calls) and sums.
LEVELS = frozenset({
    "shard_coverage", "broadcast_received", "deadline_seconds", "broadcast_deadline_seconds",
    "peers_absent", "compression_ratio", "compression_error", "feedback_residual",
})


class EventError(ValueError):
    """A line that is not a valid event; the reader adds the file and line number."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _get(data: dict[str, Any], name: str, kind: str, required: bool = False) -> Any:
    if name not in data or data[name] is None:
        if required:
            raise EventError(f"field {name!r} is missing")
        return None
    value = data[name]
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = _number(value)
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "node":  # a worker's rank or a host's name
        ok = isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    else:  # pragma: no cover - a programming error
        raise AssertionError(kind)
    if not ok:
        raise EventError(f"field {name!r} must be {_KIND_NAMES[kind]}, not {value!r}")
    return float(value) if kind == "number" else value


_KIND_NAMES = {"int": "an integer", "number": "a number", "str": "a string",
               "bool": "true or false", "node": "a rank or a host name"}


@dataclass
class StepEvent:
    """One worker's step: a `StepRecord` with its `AllReduceStats` flattened into it."""

    t: float
    rank: int
    step: int
    loss: float
    compute_seconds: float = math.nan
    wait_seconds: float = math.nan
    step_seconds: float = math.nan
    injected_delay_seconds: float = 0.0
    micro_batches: int = 0
    micro_batches_dropped: int = 0
    threshold_seconds: float | None = None
    drift: float | None = None
    collective: str | None = None
    allreduce_seconds: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    coverage: float | None = None
    peers_missing: tuple[int, ...] = ()
    evaluation: dict[str, float] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class DriftEvent:
    """A worker's drift at `step`, measured once every worker's figures of that step came
    (after the step's own event); `load_run` puts it on the step."""

    t: float
    rank: int
    step: int
    drift: float | None


@dataclass
class FaultEvent:
    """A fault the timeline applied: `scheduled` is when it was due, `t` when it happened."""

    t: float
    action: str
    scheduled: float | None = None
    target: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.action} {self.target}" if self.target else self.action


@dataclass
class LinkEvent:
    """A link's configured loss against what a probe measured (fractions, 0..1)."""

    t: float
    src: str
    dst: str
    configured_loss: float
    measured_loss: float
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.src}→{self.dst}"


@dataclass
class EndEvent:
    """A worker (`rank`) or the run itself (`rank` None) ended."""

    t: float
    success: bool
    rank: int | None = None
    error: str | None = None


@dataclass
class RunEvent:
    """The first line of `events.jsonl`: the run's name and its start on the wall clock."""

    t: float
    name: str
    started: float
    format: int = FORMAT
    fields: dict[str, Any] = field(default_factory=dict)


_STEP_NUMBERS = ("compute_seconds", "wait_seconds", "step_seconds", "injected_delay_seconds",
                 "threshold_seconds", "drift", "allreduce_seconds", "coverage")
_STEP_INTS = ("micro_batches", "micro_batches_dropped", "bytes_sent", "bytes_received")
_STEP_KNOWN = frozenset(("type", "t", "rank", "step", "loss", "collective", "peers_missing",
                         "evaluation", *_STEP_NUMBERS, *_STEP_INTS))


def _step(data: dict[str, Any], t: float) -> StepEvent:
    values: dict[str, Any] = {
        "t": t,
        "rank": _get(data, "rank", "int", required=True),
        "step": _get(data, "step", "int", required=True),
        "loss": _get(data, "loss", "number", required=True),
        "collective": _get(data, "collective", "str"),
    }
    for name in _STEP_NUMBERS:
        value = _get(data, name, "number")
        if value is not None:
            values[name] = value
    for name in _STEP_INTS:
        value = _get(data, name, "int")
        if value is not None:
            values[name] = value
    missing = data.get("peers_missing") or []
    if not (isinstance(missing, list) and all(isinstance(p, int) for p in missing)):
        raise EventError(f"field 'peers_missing' must be a list of ranks, not {missing!r}")
    values["peers_missing"] = tuple(missing)
    evaluation = data.get("evaluation") or {}
    if not (isinstance(evaluation, dict) and all(_number(v) for v in evaluation.values())):
        raise EventError(f"field 'evaluation' must map names to numbers, not {evaluation!r}")
    values["evaluation"] = {k: float(v) for k, v in evaluation.items()}
    values["extra"] = {k: float(v) for k, v in data.items()
                       if k not in _STEP_KNOWN and _number(v)}
    return StepEvent(**values)


def parse_event(data: Any) -> Any:
    """The typed event of one decoded JSON line; a dict of an unknown type is returned as is.
    Raises `EventError` naming the field at fault."""
    if not isinstance(data, dict):
        raise EventError(f"an event must be a JSON object, not {type(data).__name__}")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise EventError("field 'type' is missing")
    t = _get(data, "t", "number", required=True)
    if kind == "step":
        return _step(data, t)
    if kind == "drift":
        return DriftEvent(t, _get(data, "rank", "int", required=True),
                          _get(data, "step", "int", required=True), _get(data, "drift", "number"))
    if kind == "fault":
        rest = {k: v for k, v in data.items() if k not in ("type", "t", "action", "scheduled")}
        target = data.get("link", data.get("rank", data.get("target")))
        return FaultEvent(t, _get(data, "action", "str", required=True),
                          _get(data, "scheduled", "number"),
                          None if target is None else str(target), rest)
    if kind == "link":
        rest = {k: v for k, v in data.items()
                if k not in ("type", "t", "src", "dst", "configured_loss", "measured_loss")}
        return LinkEvent(t, str(_get(data, "src", "node", required=True)),
                         str(_get(data, "dst", "node", required=True)),
                         _get(data, "configured_loss", "number", required=True),
                         _get(data, "measured_loss", "number", required=True), rest)
    if kind == "end":
        return EndEvent(t, _get(data, "success", "bool", required=True),
                        _get(data, "rank", "int"), _get(data, "error", "str"))
    if kind == "run":
        rest = {k: v for k, v in data.items()
                if k not in ("type", "t", "name", "started", "format")}
        return RunEvent(t, _get(data, "name", "str", required=True),
                        _get(data, "started", "number", required=True),
                        _get(data, "format", "int") or FORMAT, rest)
    return data


def step_fields(record: Any, drift: float | None = None) -> dict[str, Any]:
    """A `StepRecord` (testbed.train.job) as the fields of a step event, its stats flattened:
    `allreduce_seconds`, bytes, `coverage`, `peers_missing`, `collective`, and every figure of
    `stats.extra` under its own name (`datagrams_lost`, `tcp_retransmits`, ...; `stats_NAME` if
    NAME would shadow a step field)."""
    fields: dict[str, Any] = {
        "rank": record.rank,
        "step": record.step,
        "loss": record.loss,
        "compute_seconds": record.compute_seconds,
        "wait_seconds": record.wait_seconds,
        "step_seconds": record.step_seconds,
        "injected_delay_seconds": record.injected_delay_seconds,
        "micro_batches": record.micro_batches,
        "micro_batches_dropped": record.micro_batches_dropped,
        "threshold_seconds": record.threshold_seconds,
    }
    if drift is not None:
        fields["drift"] = float(drift)
    stats = record.stats
    if stats is not None:
        fields.update(
            collective=stats.collective,
            allreduce_seconds=stats.seconds,
            bytes_sent=int(stats.bytes_sent),
            bytes_received=int(stats.bytes_received),
            coverage=stats.coverage,
            peers_missing=[int(p) for p in stats.peers_missing],
        )
        for name, value in stats.extra.items():
            fields[f"stats_{name}" if name in _STEP_KNOWN else name] = float(value)
    if record.evaluation:
        fields["evaluation"] = {k: float(v) for k, v in record.evaluation.items()}
    return fields
