"""A scenario's `traffic:` section: background flows that compete with training for the links
(docs/conditions.md, "Cross traffic"). Each flow is iperf3 between two workers' namespaces (or
containers), over the same shaped links as the job: a TCP bulk transfer with the kernel's
congestion control of the user's choice, or UDP at a constant rate or on/off."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from netem.profile import BitsPerSecond, Seconds
from netem.units import format_rate, format_time
from testbed.scenario.fields import (
    NAME_PATTERN,
    Congestion,
    PositiveSeconds,
    Section,
    WorkerIndex,
)

TCP, UDP = "tcp", "udp"


class Flow(Section):
    """One background flow from worker `from` to worker `to`, from `start` to `stop` seconds
    after training started (`stop` null: until the run ends). UDP sends `rate` (on for `on`
    seconds, then silent for `off`, again and again, when both are given); TCP sends as fast as
    its congestion control (`congestion`, default the sender's) lets it."""

    name: str | None = Field(default=None, pattern=NAME_PATTERN, description="Names the flow "
                             "in the metrics and the report (default: FROM-TO-KIND, with its "
                             "index where two flows would share it).")
    src: WorkerIndex = Field(alias="from", description="The sending worker.")
    dst: WorkerIndex = Field(alias="to", description="The receiving worker.")
    kind: Literal["tcp", "udp"] = Field(description="tcp: a bulk transfer; udp: datagrams at "
                                        "`rate`.")
    start: Seconds = Field(default=0.0, ge=0, description="Seconds after training started "
                           "that the flow begins.")
    stop: Seconds | None = Field(default=None, gt=0, description="Seconds after training "
                                 "started that it ends (null: when the run ends).")
    rate: BitsPerSecond | None = Field(default=None, description="UDP: the sending rate while "
                                       "on (10mbit, 1gbit).")
    on: PositiveSeconds | None = Field(default=None, description="UDP on/off: seconds each "
                                       "burst sends (with `off`).")
    off: PositiveSeconds | None = Field(default=None, description="UDP on/off: seconds of "
                                        "silence after each burst (with `on`).")
    congestion: Congestion | None = Field(default=None, description="TCP: the sender's "
                                          "congestion control (cubic, bbr; default: the "
                                          "sending worker's).")

    @model_validator(mode="before")
    @classmethod
    def _yaml_on_off(cls, data: Any) -> Any:
        """YAML 1.1 reads the keys `on` and `off` as true and false: they are `on` and `off`."""
        if isinstance(data, dict) and (True in data or False in data):
            names = {True: "on", False: "off"}
            return {names.get(key, key) if isinstance(key, bool) else key: value
                    for key, value in data.items()}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Flow:
        if self.src == self.dst:
            raise ValueError(f"from and to are both worker {self.src}: a flow crosses a link")
        if self.stop is not None and self.stop <= self.start:
            raise ValueError(f"stop ({format_time(self.stop)}) must come after start "
                             f"({format_time(self.start)})")
        if (self.on is None) != (self.off is None):
            raise ValueError("on and off go together: give both (an on/off UDP flow) or "
                             "neither (a constant one)")
        if self.kind == UDP:
            if self.rate is None:
                raise ValueError("a udp flow needs a rate (e.g. rate: 20mbit)")
            if self.congestion is not None:
                raise ValueError("congestion is TCP's; a udp flow sends at its rate")
        else:
            extra = [name for name in ("rate", "on", "off") if getattr(self, name) is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)}: UDP's; a tcp flow sends as fast as its "
                                 "congestion control lets it")
        return self

    def describe(self) -> str:
        """One line: what the flow sends, when."""
        what = (f"udp {format_rate(self.rate or 0)}" if self.kind == UDP
                else f"tcp {self.congestion or 'bulk'}")
        if self.on is not None and self.off is not None:
            what += f" on {format_time(self.on)}/off {format_time(self.off)}"
        since = format_time(self.start) if self.start else "the start"
        until = "the end" if self.stop is None else format_time(self.stop)
        return f"{self.src}->{self.dst} {what}, {since} to {until}"


def flow_names(flows: list[Flow]) -> list[str]:
    """Each flow's name: its own, else FROM-TO-KIND (with its index where two would share one)."""
    names = [flow.name or f"{flow.src}-{flow.dst}-{flow.kind}" for flow in flows]
    return [name if flow.name or names.count(name) == 1 else f"{name}-{index}"
            for index, (name, flow) in enumerate(zip(names, flows, strict=True))]
