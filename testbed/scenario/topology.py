"""The network between the workers: which directed links a selector picks (written as a mapping
or as text such as '0->1'), the profile every link gets, and changes to a profile."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from netem.profile import Integer, LinkProfile, Seconds
from netem.trace import (
    DEFAULT_RESOLUTION,
    MIN_RESOLUTION,
    Schedule,
    TraceError,
    load_trace,
    schedule,
)
from testbed.scenario.fields import Congestion, Endpoint, GroupName, Section, WorkerIndex
from testbed.scenario.links import ALL


class Selector(Section):
    """Which directed links: `from` and `to` (a worker index or a group name each), or `between`
    two of them (both directions). Nothing given: every link."""

    src: Endpoint | None = Field(default=None, alias="from")
    dst: Endpoint | None = Field(default=None, alias="to")
    between: tuple[Endpoint, Endpoint] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> Selector:
        if (self.src is None) != (self.dst is None):
            raise ValueError("give both from and to (one direction), or between (both)")
        if self.between is not None and self.src is not None:
            raise ValueError("give from/to (one direction) or between (both), not both")
        return self

    @property
    def is_all(self) -> bool:
        return self.src is None and self.between is None

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        if self.between is not None:
            return self.between
        return () if self.src is None else (self.src, self.dst)

    @property
    def specificity(self) -> int:
        """How many ends are single workers: a more specific link wins over a less specific."""
        return sum(isinstance(end, int) for end in self.endpoints)

    def matches(self, groups: Mapping[str, list[int]], src: int, dst: int) -> bool:
        """Whether the directed link src -> dst is one of these."""
        if src == dst:
            return False
        if self.is_all:
            return True

        def member(worker: int, end: Endpoint) -> bool:
            return worker == end if isinstance(end, int) else worker in groups.get(end, ())

        if self.between is not None:
            a, b = self.between
            return (member(src, a) and member(dst, b)) or (member(src, b) and member(dst, a))
        return member(src, self.src) and member(dst, self.dst)

    def pairs(self, groups: Mapping[str, list[int]], count: int) -> list[tuple[int, int]]:
        """Every directed link (src, dst) selected, in order."""
        return [
            (s, d) for s in range(count) for d in range(count) if self.matches(groups, s, d)
        ]

    def describe(self) -> str:
        if self.is_all:
            return "all links"
        if self.between is not None:
            return f"{self.between[0]}<->{self.between[1]}"
        return f"{self.src}->{self.dst}"


LINK_TEXT = r"^\s*([A-Za-z0-9_.-]+)\s*(<->|->)\s*([A-Za-z0-9_.-]+)\s*$"
LINK_HELP = ("a link such as '0->1' (one direction), '0<->2' (both), 'east->west' (groups) or "
             "'all', or a mapping {from: 0, to: 1} / {between: [0, 2]}")


def link_text(value: Any) -> Any:
    """`"0->1"` is `{from: 0, to: 1}`, `"a<->b"` is `{between: [a, b]}`, `"all"` every link."""
    if not isinstance(value, str):
        return value
    if value.strip() == ALL:
        return {}
    match = re.match(LINK_TEXT, value)
    if not match:
        raise ValueError(f"expected {LINK_HELP}, got {value!r}")
    first, arrow, second = match.groups()
    ends = [int(end) if end.isdigit() else end for end in (first, second)]
    return {"from": ends[0], "to": ends[1]} if arrow == "->" else {"between": ends}


LinkText = Annotated[Selector, BeforeValidator(link_text)]


class LinkTrace(Section):
    """A recorded trace the link replays from the start of training (docs/conditions.md): its
    values (a Mahimahi trace's capacity; a CSV's rate, delay, jitter, loss) replace the link
    profile's, window by window; the profile's other fields stay."""

    file: str = Field(description="The trace file (relative to the scenario's directory).")
    format: Literal["mahimahi", "csv"] | None = Field(
        default=None, description="mahimahi (a line per 1,500-byte delivery opportunity, its "
        "millisecond) or csv (a row per change: time, rate, delay, jitter, loss). Default: csv "
        "for a .csv file, else mahimahi.")
    loop: bool = Field(default=True, description="Start again at the trace's end (false: the "
                       "link goes back to its profile there).")
    resolution: Annotated[Seconds, Field(ge=MIN_RESOLUTION)] = Field(
        default=DEFAULT_RESOLUTION, description="How often the kernel's qdisc is changed in "
        "place, e.g. 100ms (10 ms at least).")

    @model_validator(mode="after")
    def _readable(self) -> LinkTrace:
        """The file is read and cut into windows now, so a bad line is refused with the
        scenario (file:line, what is wrong)."""
        self.schedule()
        return self

    def schedule(self) -> Schedule:
        """The trace's values per window (read once per file, format and resolution)."""
        path = Path(self.file)
        try:
            stamp = path.stat().st_mtime_ns
        except OSError as error:
            raise ValueError(f"{self.file}: {error.strerror}") from None
        try:
            return _schedule(str(path), self.format, self.resolution, stamp)
        except TraceError as error:
            raise ValueError(str(error)) from None


@functools.lru_cache(maxsize=32)
def _schedule(path: str, format: Literal["mahimahi", "csv"] | None, resolution: float,
              stamp: int) -> Schedule:
    """`schedule(load_trace(...))`, cached: a scenario is validated again when it is derived
    (shortened, captured), and a long trace takes a while to read."""
    del stamp  # part of the key only: a file changed since is read again
    return schedule(load_trace(path, format), resolution)


class Link(Selector):
    """A profile for some links, overriding the default (and less specific links); with a
    `trace` the links replay it on top of the profile (the default's, if none is given)."""

    profile: LinkProfile | None = None
    trace: LinkTrace | None = Field(default=None, description="A recorded trace the links "
                                    "replay from the start of training, on top of the profile.")

    @model_validator(mode="after")
    def _selects(self) -> Link:
        if self.is_all:
            raise ValueError("give from and to, or between: the default covers every link")
        if self.profile is None and self.trace is None:
            raise ValueError("give a profile, a trace, or both")
        return self


class Topology(Section):
    """The network between the workers. Every directed link i -> j gets `default`, unless a
    link in `links` selects it; of several, the one naming more single workers wins."""

    default: LinkProfile = Field(default=LinkProfile(), description="Every link's profile "
                                 "unless `links` selects it (default: a perfect link).")
    groups: dict[GroupName, Annotated[list[WorkerIndex], Field(min_length=1)]] = Field(
        default={}, description="Named, disjoint sets of workers, e.g. regions.")
    links: list[Link] = Field(default=[], description="Profiles of some links: from/to (one "
                              "direction) or between (both); the most specific wins.")
    mtu: Integer = Field(default=1500, ge=576, le=9000, description="MTU of every link.")
    congestion: Congestion = Field(default="cubic", description="Every worker's TCP congestion "
                                   "control (recorded with the run).")


def selecting(topology: Topology, src: int, dst: int) -> Link | None:
    """The most specific link that selects the directed link src -> dst (worker->worker over
    worker->group over group->group), if any. Validation makes sure no two links select one
    pair with the same specificity, so the order does not matter."""
    best: Link | None = None
    for link in topology.links:
        if link.matches(topology.groups, src, dst) and (
            best is None or link.specificity > best.specificity
        ):
            best = link
    return best


def resolve_link(topology: Topology, src: int, dst: int) -> LinkProfile:
    """The profile of the directed link src -> dst: the selecting link's, else the default."""
    return profile_of(topology, selecting(topology, src, dst))


def profile_of(topology: Topology, link: Link | None) -> LinkProfile:
    """What an entry of `links` gives the links it selects: its profile, or the default where
    it gives none (a trace alone, on top of the default) or there is no entry."""
    return topology.default if link is None or link.profile is None else link.profile


def resolve_trace(topology: Topology, src: int, dst: int) -> LinkTrace | None:
    """The trace the directed link src -> dst replays, if its selecting link has one."""
    best = selecting(topology, src, dst)
    return None if best is None else best.trace


def _link_patch_model() -> type[BaseModel]:
    """`LinkProfile`'s fields, types and field validators, every field optional: a change to a
    link, checked as a whole once applied to the link's profile (`patch_profile`)."""
    fields: dict[str, Any] = {}
    for name, info in LinkProfile.model_fields.items():
        annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else (
            info.annotation)
        fields[name] = (annotation | None, Field(default=None, alias=info.alias))
    validators = {
        decorator.cls_var_name: field_validator(*decorator.info.fields, mode=decorator.info.mode)(
            classmethod(_null_passes(decorator.func.__func__)))
        for decorator in LinkProfile.__pydantic_decorators__.field_validators.values()
    }
    model = create_model("LinkPatch", __base__=Section, __validators__=validators, **fields)
    model.__doc__ = ("Some fields of a link profile (same units as LinkProfile); the others stay "
                     "as they are, and null resets a field to its default.")
    return model


def _null_passes(check: Callable[..., Any]) -> Callable[..., Any]:
    """A field validator of the profile, for a patch: null resets the field to its default, so
    there is no value to check."""

    @functools.wraps(check)
    def checked(cls: type, value: Any, *rest: Any) -> Any:
        return value if value is None else check(cls, value, *rest)

    return checked


LinkPatch = _link_patch_model()


def patch_profile(current: LinkProfile, change: BaseModel) -> LinkProfile:
    """`current` with the fields given in `change` (a `LinkPatch`) replaced; a field given as
    null goes back to its default. Raises `ProfileError` if the result is not a valid profile."""
    merged = {**current.model_dump(by_alias=True),
              **change.model_dump(include=set(change.model_fields_set), by_alias=True)}
    return LinkProfile.build({key: value for key, value in merged.items() if value is not None})
