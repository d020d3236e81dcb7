"""The timeline's events as the report marks them: numbered in the order they happened, the same
number on every time plot and in the page's Faults table, so a reader can tell which line is
which. One event of the scenario's timeline is one mark though it may have written several
`fault` events: a ramp writes one per update, and each Compose node writes its own copy.

No matplotlib here: the page numbers its table without drawing anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.report.events import FaultEvent
from testbed.report.run import Run


@dataclass
class Mark:
    """One timeline event: its `number` (from 1) and the fault events it wrote, by time."""

    number: int
    faults: list[FaultEvent]

    @property
    def start(self) -> float:
        return self.faults[0].t

    @property
    def end(self) -> float:
        return self.faults[-1].t

    @property
    def updates(self) -> int:
        """How many times it changed something: a ramp's updates (its copies from several
        nodes, due at the same moment, count once)."""
        return len({fault.scheduled if fault.scheduled is not None else fault.t
                    for fault in self.faults})

    @property
    def text(self) -> str:
        """What it did, as the timeline describes it (`step 15: set_link 0->1 loss=30%`), or
        its action, target and new values where the writer gave no description."""
        first = self.faults[0]
        description = first.fields.get("description")
        if description:
            text = str(description)
        else:
            changed = first.fields.get("set")
            values = [f"{key}={value}" for key, value in changed.items()] \
                if isinstance(changed, dict) else []
            text = " ".join([first.label, *values])
        if self.updates > 1:
            text += f" ({self.updates} updates until {self.end:.1f} s)"
        errors = sorted({str(f.fields["error"]) for f in self.faults if f.fields.get("error")})
        if errors:
            text += f" (failed: {'; '.join(errors)})"
        return text


def timeline_marks(run: Run) -> list[Mark]:
    """The run's fault events grouped by the timeline event that wrote them (its `index`; a
    fault without one stands alone), numbered by when each first took effect."""
    groups: dict[tuple[str, int], list[FaultEvent]] = {}
    for position, fault in enumerate(run.faults):  # by time
        index = fault.fields.get("index")
        key = ("timeline", index) if isinstance(index, int) and not isinstance(index, bool) \
            else ("alone", position)
        groups.setdefault(key, []).append(fault)
    ordered = sorted(groups.values(), key=lambda faults: faults[0].t)
    return [Mark(number, faults) for number, faults in enumerate(ordered, start=1)]
