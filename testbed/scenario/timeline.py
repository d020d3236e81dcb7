"""The `timeline` section: faults at a time or a step, one action each (a link changed or
ramped, a partition and its heal, workers killed and restarted, a straggler burst)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from netem.profile import AN_INTEGER, LinkProfile, Seconds
from testbed.scenario.fields import GroupList, PositiveSeconds, Section, WorkerList
from testbed.scenario.links import run_order
from testbed.scenario.topology import LinkPatch, Selector, patch_profile
from testbed.train.stragglers import StragglerSpec

RAMPABLE = (
    "delay", "jitter", "delay_correlation", "loss", "loss_correlation", "duplicate",
    "duplicate_correlation", "corrupt", "corrupt_correlation", "reorder", "reorder_correlation",
    "rate",
)


class SetLink(Section):
    """Change the selected links: the fields of `profile` replace theirs, the others stay."""

    link: Selector = Selector()
    profile: LinkPatch

    def apply(self, current: LinkProfile) -> LinkProfile:
        return patch_profile(current, self.profile)


class RampLink(Section):
    """Move some fields of the selected links linearly from `from` (default: their values when
    the ramp starts) to `to` over `over` seconds, in updates `every` seconds apart."""

    link: Selector = Selector()
    start: LinkPatch | None = Field(default=None, alias="from")
    to: LinkPatch
    over: PositiveSeconds
    every: PositiveSeconds = 1.0

    @model_validator(mode="after")
    def _rampable(self) -> RampLink:
        fields = self.to.model_fields_set
        if not fields:
            raise ValueError("to: give the fields to ramp")
        fixed = sorted(fields - set(RAMPABLE))
        if fixed:
            raise ValueError(f"to: cannot ramp {', '.join(fixed)}; rampable: {', '.join(RAMPABLE)}")
        if any(getattr(self.to, name) is None for name in fields):
            raise ValueError("to: a ramp needs a value for every field it moves, not null")
        if self.start is not None and self.start.model_fields_set != fields:
            raise ValueError(f"from: give the same fields as to ({', '.join(sorted(fields))})")
        if "rate" in fields and self.start is None:
            raise ValueError("a rate ramp needs from.rate (a link may have no rate to start from)")
        return self

    def profile_at(self, current: LinkProfile, elapsed: float) -> LinkProfile:
        """The profile `elapsed` seconds into the ramp of a link whose profile was `current`
        when the ramp started."""
        start = patch_profile(current, self.start) if self.start else current
        share = min(max(elapsed / self.over, 0.0), 1.0)
        values = {}
        for name in self.to.model_fields_set:
            a, b = getattr(start, name), getattr(self.to, name)
            value = a + (b - a) * share
            values[name] = round(value) if name == "rate" else value
        return LinkProfile.build({**start.model_dump(by_alias=True), **values})


class StragglerBurst(Section):
    """Add `delay` to every step of `workers` for `duration` seconds or `steps` steps."""

    workers: WorkerList
    delay: StragglerSpec
    duration: PositiveSeconds | None = None
    steps: Annotated[int, Field(ge=1), AN_INTEGER] | None = Field(default=None)

    @model_validator(mode="after")
    def _how_long(self) -> StragglerBurst:
        if (self.duration is None) == (self.steps is None):
            raise ValueError("give exactly one of duration (seconds) or steps")
        return self


ACTIONS = ("set_link", "ramp_link", "partition", "heal", "kill", "restart", "straggler_burst")


class Event(Section):
    """One fault, at a time (`at`, seconds since training started) or a step (`step`, before
    that step starts), with exactly one action."""

    at: Seconds | None = Field(default=None, description="Seconds since training started.")
    step: Annotated[int, Field(ge=0), AN_INTEGER] | None = Field(default=None, description=(
        "Before this step starts."))
    note: str = Field(default="", description="Shown in the event log.")
    set_link: SetLink | None = None
    ramp_link: RampLink | None = None
    partition: GroupList | None = None
    heal: GroupList | None = None
    kill: WorkerList | None = None
    restart: WorkerList | None = None
    straggler_burst: StragglerBurst | None = None

    @model_validator(mode="after")
    def _when_and_what(self) -> Event:
        if (self.at is None) == (self.step is None):
            raise ValueError("give exactly one of at (seconds, e.g. 30s) or step (a step number)")
        given = [name for name in ACTIONS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one action of {', '.join(ACTIONS)}; got {', '.join(given) or 'none'}"
            )
        return self

    @property
    def action(self) -> str:
        return next(name for name in ACTIONS if getattr(self, name) is not None)

    @property
    def clock(self) -> tuple[str, float]:
        """`('at', seconds)` or `('step', n)`."""
        return ("at", self.at) if self.at is not None else ("step", self.step)

    def describe(self) -> str:
        """One line for the event log: when, what, on what."""
        when = _when(self)
        value = getattr(self, self.action)
        if isinstance(value, SetLink):
            what = f"{value.link.describe()} {_patch_text(value.profile)}"
        elif isinstance(value, RampLink):
            start = _patch_text(value.start) if value.start else "current"
            what = (f"{value.link.describe()} {start} -> {_patch_text(value.to)} "
                    f"over {value.over:g}s")
        elif isinstance(value, StragglerBurst):
            span = f"{value.duration:g}s" if value.duration else f"{value.steps} steps"
            what = f"workers {value.workers} +{value.delay.mean_seconds:g}s/step for {span}"
        else:
            what = ", ".join(map(str, value))
        return f"{when}: {self.action} {what}" + (f" ({self.note})" if self.note else "")


def order_note(events: Sequence[Event]) -> str | None:
    """How the run orders `events` where that is not the file's order (None where it is)."""
    order = run_order(events)
    if order == sorted(order):
        return None
    listed = ", ".join(f"[{i}] {_when(events[i])}" for i in order)
    return f"timeline: runs in time and step order, not the file's: {listed}"


def _when(event: Event) -> str:
    return f"at {event.at:g}s" if event.at is not None else f"step {event.step}"


def _patch_text(patch: BaseModel) -> str:
    given = patch.model_dump(include=set(patch.model_fields_set))
    shown = LinkProfile.model_construct(**{k: v for k, v in given.items() if v is not None})
    text = [f"{key}={value}" for key, value in shown.to_spec().items()]
    text += [f"{key}=default" for key, value in given.items() if value is None]
    return " ".join(text) or "(nothing)"
