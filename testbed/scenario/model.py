"""The scenario model: workers, topology, job, collective, fault timeline and metrics of one run.

Every section has defaults, so five lines make a complete scenario; every model forbids unknown
fields. Link profiles are `netem.LinkProfile` itself, the job is `testbed.train.TrainConfig`
itself, straggler distributions are `testbed.train.stragglers.StragglerSpec`, and a collective's
options and capabilities are its registry entry's (`testbed.collectives.registry`), so each is
validated in one place. Nothing here imports torch: checking a scenario is quick.
Checks that need several sections (a worker index against the count, a group name against the
groups) run once the fields are valid and report each problem at its own path (`Problems`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import reduce
from operator import or_
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.json_schema import GenerateJsonSchema

from netem.profile import BitsPerSecond, Fraction, LinkProfile, LinkTime, ProfileError, Seconds
from netem.units import FRACTION_HELP, RATE_HELP, SIZE_HELP, TIME_HELP, format_size, parse_size
from testbed.collectives import registry
from testbed.scenario.links import ALL, LinkState
from testbed.train.config import TrainConfig, _threshold
from testbed.train.stragglers import StragglerSpec

Loc = tuple[str | int, ...]
CONGESTION = ("cubic", "bbr")
Congestion = Literal["cubic", "bbr"]


class Problems(ValueError):
    """Problems found across sections, each at its path relative to the model that found them."""

    def __init__(self, problems: list[tuple[Loc, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{dotted(loc)}: {message}" for loc, message in problems))


def dotted(loc: Loc) -> str:
    """`('topology', 'links', 2, 'profile', 'loss')` -> `topology.links[2].profile.loss`; a key
    that is not a plain name is quoted (`workers["a b"]`)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not re.fullmatch(r"[A-Za-z0-9_-]+", str(part)):
            text += f"[{json.dumps(str(part))}]"
        else:
            text += f".{part}" if text else str(part)
    return text


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


# --- small types --------------------------------------------------------------------------------


def _endpoint(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | str) or value == "":
        raise ValueError(f"expected a worker index or a group name, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"expected a worker index (0 or more) or a group name, got {value}")
    return value


def _as_list(value: Any) -> Any:
    """One item or a list of them."""
    return value if isinstance(value, list | tuple) else [value]


def _worker_count(value: Any) -> Any:
    """`workers: 4` is `workers: {count: 4}`."""
    if isinstance(value, bool | str | float):
        raise ValueError(
            f"expected a number of workers or a mapping {{count, overrides}}, got {value!r}"
        )
    return {"count": value} if isinstance(value, int) else value


Endpoint = Annotated[int | str, BeforeValidator(_endpoint)]
WorkerIndex = Annotated[int, Field(ge=0, strict=True)]
WorkerList = Annotated[list[WorkerIndex], Field(min_length=1), BeforeValidator(_as_list)]
GroupName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")]
GroupList = Annotated[list[GroupName], Field(min_length=1), BeforeValidator(_as_list)]
PositiveSeconds = Annotated[Seconds, Field(gt=0)]


# --- links --------------------------------------------------------------------------------------


class Selector(_Model):
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


class Link(Selector):
    """A profile for some links, overriding the default (and less specific links)."""

    profile: LinkProfile

    @model_validator(mode="after")
    def _selects(self) -> Link:
        if self.is_all:
            raise ValueError("give from and to, or between: the default covers every link")
        return self


class Topology(_Model):
    """The network between the workers. Every directed link i -> j gets `default`, unless a
    link in `links` selects it; of several, the one naming more single workers wins."""

    default: LinkProfile = Field(default=LinkProfile(), description="Every link's profile "
                                 "unless `links` selects it (default: a perfect link).")
    groups: dict[GroupName, Annotated[list[WorkerIndex], Field(min_length=1)]] = Field(
        default={}, description="Named, disjoint sets of workers, e.g. regions.")
    links: list[Link] = Field(default=[], description="Profiles of some links: from/to (one "
                              "direction) or between (both); the most specific wins.")
    mtu: int = Field(default=1500, ge=576, le=9000, description="MTU of every link.")
    congestion: Congestion = Field(default="cubic", description="Every worker's TCP congestion "
                                   "control (recorded with the run).")


def resolve_link(topology: Topology, src: int, dst: int) -> LinkProfile:
    """The profile of the directed link src -> dst: the most specific link that selects it
    (worker->worker over worker->group over group->group), else the default. Validation makes
    sure no two links select one pair with the same specificity, so the order does not matter."""
    best: Link | None = None
    for link in topology.links:
        if link.matches(topology.groups, src, dst) and (
            best is None or link.specificity > best.specificity
        ):
            best = link
    return topology.default if best is None else best.profile


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
            classmethod(decorator.func.__func__))
        for decorator in LinkProfile.__pydantic_decorators__.field_validators.values()
    }
    model = create_model("LinkPatch", __base__=_Model, __validators__=validators, **fields)
    model.__doc__ = ("Some fields of a link profile (same units as LinkProfile); the others stay "
                     "as they are, and null resets a field to its default.")
    return model


LinkPatch = _link_patch_model()


def patch_profile(current: LinkProfile, change: BaseModel) -> LinkProfile:
    """`current` with the fields given in `change` (a `LinkPatch`) replaced; a field given as
    null goes back to its default. Raises `ProfileError` if the result is not a valid profile."""
    merged = {**current.model_dump(by_alias=True),
              **change.model_dump(include=set(change.model_fields_set), by_alias=True)}
    return LinkProfile.build({key: value for key, value in merged.items() if value is not None})


def _profile_message(error: ProfileError) -> str:
    return "; ".join(line.strip() for line in str(error).splitlines()[1:])


# --- workers ------------------------------------------------------------------------------------


class WorkerOverride(_Model):
    """Settings of some workers that differ from the others'."""

    worker: WorkerList
    straggler: StragglerSpec | None = None
    slowdown: float = Field(default=1.0, ge=1.0)
    congestion: Congestion | None = None

    @model_validator(mode="after")
    def _overrides_something(self) -> WorkerOverride:
        if self.model_fields_set <= {"worker"}:
            raise ValueError("give at least one of straggler, slowdown, congestion")
        return self


class Workers(_Model):
    """`count` workers (ranks 0..count-1); `overrides` set single workers apart."""

    count: int = Field(ge=1, le=256)
    overrides: list[WorkerOverride] = []


# --- collective ---------------------------------------------------------------------------------


CompressorKind = Literal["none", "topk", "randk", "arc_topk", "int8", "int4", "powersgd"]
assert get_args(CompressorKind) == tuple(registry.COMPRESSORS)
ArcSketch = Literal["projection", "marginal"]
assert get_args(ArcSketch) == registry.ARC_SKETCHES
Feedback = Literal["ef21m", "ef14"]
assert get_args(Feedback) == registry.FEEDBACKS


class Compressor(_Model):
    """A compression layer over the collective (docs/compression.md): the sparsifiers topk,
    randk and arc_topk (with EF21M error feedback), the quantizers int8 and int4 (group-wise,
    two-step all-reduce), or powersgd. Each kind takes only its own parameters."""

    kind: CompressorKind = Field(default="none", description="none, topk, randk, arc_topk, "
                                 "int8, int4 or powersgd.")
    density: float = Field(default=0.01, gt=0, le=1, description="Fraction of the values a "
                           "sparsifier sends.")
    sketch: ArcSketch = Field(default="projection", description="arc_topk: how the workers "
                              "agree on a pattern: projection (the paper's: each weight "
                              "matrix's rows projected on a shared random matrix, whole rows "
                              "kept) or marginal (row and column energies, single coordinates "
                              "kept).")
    sketch_rank: int = Field(default=4, ge=1, description="arc_topk with sketch projection: "
                             "columns of the random projection (the paper's r).")
    block: int = Field(default=64, ge=1, description="arc_topk without the parameters' shapes "
                       "(a DDP bucket): values per row of the sketch.")
    group_size: int = Field(default=128, ge=2, le=65536, multiple_of=2, description="int8/int4: "
                            "values per scale (32-256 usual).")
    symmetric: bool = Field(default=True, description="int8/int4: symmetric (scale) or "
                            "asymmetric (scale and minimum) per group.")
    stochastic: bool = Field(default=False, description="int8/int4: stochastic rounding "
                             "(unbiased) instead of nearest.")
    error_feedback: bool = Field(default=True, description="Sparsifiers: error feedback (which: "
                                 "`feedback`); powersgd: its error memory.")
    feedback: Feedback = Field(default="ef21m", description="Sparsifiers' error feedback: "
                               "ef21m (momentum, a shared estimate, the first step sent whole) "
                               "or ef14 (each worker's own error).")
    momentum: float = Field(default=1.0, gt=0, le=1, description="EF21M's eta (1: EF21; the "
                            "job's optimizer keeps its own momentum).")
    resync_every: int = Field(default=0, ge=0, description="Sparsifiers: every N calls, set the "
                              "shared EF21M estimate to the exact mean (0: never).")
    rank: int = Field(default=2, ge=1, description="powersgd: rank of the approximation.")
    seed: int = Field(default=0, ge=0, description="randk: the shared seed; arc_topk: the "
                      "shared projections; int8/int4: stochastic rounding; powersgd: the first "
                      "Q.")

    @model_validator(mode="after")
    def _own_parameters(self) -> Compressor:
        allowed = registry.COMPRESSORS[self.kind].parameters
        for name in sorted(self.model_fields_set - {"kind"}):
            if name not in allowed:
                raise ValueError(f"{name}: not a parameter of {self.kind}; allowed: "
                                 f"{', '.join(allowed) or 'none'}")
        if self.feedback == "ef14" and (self.momentum != 1.0 or self.resync_every):
            raise ValueError("momentum and resync_every are EF21M's: feedback ef14 keeps no "
                             "momentum and no shared estimate")
        return self

    def parameters(self) -> dict[str, Any]:
        """The parameters given, for `testbed.collectives.compression.wrap(inner, kind, ...)`."""
        return self.model_dump(exclude={"kind"}, exclude_unset=True)


class _Collective(registry.CollectiveOptions):
    kind: str  # and, after the kind's own options, `compressor: Compressor`

    def options(self) -> dict[str, Any]:
        """The options given, for `testbed.collectives.place(kind, placement, options)`; the
        registry entry adds the placement's."""
        return self.model_dump(exclude={"kind", "compressor"}, exclude_unset=True)

    @property
    def capabilities(self) -> registry.Capabilities:
        return registry.kind(self.kind).capabilities


def _collective_model(entry: registry.Kind) -> type[_Collective]:
    model = create_model(
        f"{entry.name.capitalize()}Collective", __base__=(entry.options, _Collective),
        kind=(Literal[entry.name], ...),
        compressor=(Compressor, Field(default=Compressor(), description="Compression over the "
                                      "collective (kind none: off); docs/compression.md.")))
    model.__doc__ = f"Collective {entry.name!r}: {entry.summary}."
    return model


COLLECTIVES: dict[str, type[_Collective]] = {name: _collective_model(registry.kind(name))
                                             for name in registry.kinds()}
CollectiveSpec = Annotated[reduce(or_, COLLECTIVES.values()), Field(discriminator="kind")]


# --- security -----------------------------------------------------------------------------------


def _switch(value: Any) -> Any:
    """true, false or auto; not 1 or 'yes' (YAML's yes/no/on/off are booleans already)."""
    if isinstance(value, bool) or value == AUTO:
        return value
    raise ValueError(f"expected true, false or {AUTO}, got {value!r}")


AUTO = "auto"
Switch = Annotated[Literal["auto", True, False], BeforeValidator(_switch)]
Placement = Literal["namespaces", "compose"]


class Security(_Model):
    """Who may speak on a run's sockets (docs/transport.md, "Who may send"). A datagram is
    always taken only from the address registered for the rank it names. With `authenticate`,
    each run also has a secret: every datagram carries a MAC of it and every TCP hello proves
    it, so not even a stranger that forges a peer's source address is heard. `auto`: on under
    Compose (a network others may share), off in namespaces (only this host's processes reach
    them, and the MAC costs CPU per datagram: benchmarks/results/datagram-cost.md)."""

    authenticate: Switch = Field(default=AUTO, description="true, false or auto (on under "
                                 "Compose, off in namespaces): a secret per run, a MAC on every "
                                 "datagram and proof of it in every TCP hello.")


# --- metrics ------------------------------------------------------------------------------------


class Metrics(_Model):
    """What the workers export besides their per-step events: `/metrics` on `port` in each
    worker's namespace (0: any free port), parameter drift every `drift_every` steps (0: never)
    from a `drift_k`-dimensional random projection, and a probe of every link before training
    (`probe_links`: configured against measured, as `testbed probe` does). `linger`: seconds
    a finished worker keeps its endpoint up (until the whole run is done). `dump_parameters`:
    each drift measurement also writes the vector it sketched into the run directory, so the
    estimate can be checked against the exact distance."""

    port: int = Field(default=9100, ge=0, le=65535)
    drift_every: int = Field(default=10, ge=0)
    drift_k: int | None = Field(default=None, ge=1, description="Numbers in each drift sketch "
                                "(null: the estimator's default, 64).")
    dump_parameters: bool = Field(default=False, description=(
        "At every drift measurement each worker also writes its flat parameter vector to the "
        "run directory (parameters/rank<R>-step<S>.npy): what the sketch estimated, in full."))
    probe_links: bool = False
    linger: Seconds = Field(default=0.0, ge=0, description=(
        "Seconds a worker keeps serving /metrics after its last step, so a scraper sees the "
        "final values; the run ends them as soon as every worker is done."))


# --- capture ------------------------------------------------------------------------------------


LINK_TEXT = r"^\s*([A-Za-z0-9_.-]+)\s*(<->|->)\s*([A-Za-z0-9_.-]+)\s*$"
LINK_HELP = ("a link such as '0->1' (one direction), '0<->2' (both), 'east->west' (groups) or "
             "'all', or a mapping {from: 0, to: 1} / {between: [0, 2]}")


def _link_text(value: Any) -> Any:
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


LinkText = Annotated[Selector, BeforeValidator(_link_text)]
def _byte_size(value: Any, info: ValidationInfo) -> int:
    """A size, with its unit in human input (a bare `max_bytes: 20` would be 20 bytes)."""
    return parse_size(value, unit_required=bool(info.context and info.context.get("human")))


ByteSize = Annotated[int, BeforeValidator(_byte_size)]


class Capture(_Model):
    """Links whose frames are recorded during a run (docs/capture.md): for each directed link
    src->dst, what src put on the wire towards dst and what reached dst from src, as pcap files
    of the run directory (`capture/SRC-DST.sent.pcap`, `.received.pcap`), and what the link did
    to each flow (`capture/flows.json`)."""

    links: list[LinkText] = Field(default=[], description="The links to capture: '0->1', "
                                  "'0<->2', 'east->west', 'all', or {from, to} / {between}.")
    max_bytes: ByteSize = Field(default=20_000_000, ge=1000, le=10**12, description="Each "
                                "file's size limit (20MB, 512kB, 1MiB): writing stops there "
                                "and the file is marked truncated.")
    snap: int = Field(default=128, ge=64, le=65535, description="Bytes kept of each frame "
                      "(headers and the first payload bytes).")

    def pairs(self, groups: Mapping[str, list[int]], count: int) -> list[tuple[int, int]]:
        """Every directed link (src, dst) selected, each once, in the order given."""
        seen: dict[tuple[int, int], None] = {}
        for link in self.links:
            seen.update(dict.fromkeys(link.pairs(groups, count)))
        return list(seen)

    def describe(self) -> str:
        return (f"{', '.join(link.describe() for link in self.links)} "
                f"({format_size(self.max_bytes)} per file, snap {self.snap})")


# --- timeline -----------------------------------------------------------------------------------


RAMPABLE = (
    "delay", "jitter", "delay_correlation", "loss", "loss_correlation", "duplicate",
    "duplicate_correlation", "corrupt", "corrupt_correlation", "reorder", "reorder_correlation",
    "rate",
)


class SetLink(_Model):
    """Change the selected links: the fields of `profile` replace theirs, the others stay."""

    link: Selector = Selector()
    profile: LinkPatch

    def apply(self, current: LinkProfile) -> LinkProfile:
        return patch_profile(current, self.profile)


class RampLink(_Model):
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


class StragglerBurst(_Model):
    """Add `delay` to every step of `workers` for `duration` seconds or `steps` steps."""

    workers: WorkerList
    delay: StragglerSpec
    duration: PositiveSeconds | None = None
    steps: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _how_long(self) -> StragglerBurst:
        if (self.duration is None) == (self.steps is None):
            raise ValueError("give exactly one of duration (seconds) or steps")
        return self


ACTIONS = ("set_link", "ramp_link", "partition", "heal", "kill", "restart", "straggler_burst")


class Event(_Model):
    """One fault, at a time (`at`, seconds since training started) or a step (`step`, before
    that step starts), with exactly one action."""

    at: Seconds | None = Field(default=None, description="Seconds since training started.")
    step: int | None = Field(default=None, ge=0, description="Before this step starts.")
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
        when = f"at {self.at:g}s" if self.at is not None else f"step {self.step}"
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


def _patch_text(patch: BaseModel) -> str:
    given = patch.model_dump(include=set(patch.model_fields_set))
    shown = LinkProfile.model_construct(**{k: v for k, v in given.items() if v is not None})
    text = [f"{key}={value}" for key, value in shown.to_spec().items()]
    text += [f"{key}=default" for key, value in given.items() if value is None]
    return " ".join(text) or "(nothing)"


# --- a command of the user's own as the job ---------------------------------------------------


MASTER_PORT = 29400  # torch.distributed's rendezvous on worker 0 (apart from the testbed's ports)


class CommandJob(_Model):
    """A program of the user's own as the job (docs/your-code.md): every worker runs it in its
    namespace (or container) with the torch.distributed environment set (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, ...), so a script written for torchrun runs unmodified."""

    command: list[str] = Field(min_length=1, description="The program and its arguments, run "
                               "in `cwd`; `python` is the interpreter that runs the testbed.")
    env: dict[str, str] = Field(default={}, description="More environment variables for it.")
    cwd: str | None = Field(default=None, description="Where it runs, relative to the "
                            "scenario file (default: the scenario file's directory).")
    master_port: int = Field(default=MASTER_PORT, ge=1, le=65535, description="MASTER_PORT: "
                             "where torch.distributed's rendezvous listens on worker 0.")
    metrics_port: int | None = Field(default=None, ge=1, le=65535, description="A port the "
                                     "program serves Prometheus metrics on in each worker: "
                                     "scraped with the workers' own (TESTBED_METRICS_PORT).")


def _job_kind(value: Any) -> str:
    """Which job a scenario's `job` is: a command of the user's own, or a training job."""
    is_command = isinstance(value, CommandJob) or (isinstance(value, dict) and "command" in value)
    return COMMAND_JOB if is_command else TRAINING_JOB


TRAINING_JOB, COMMAND_JOB = "training job", "command job"  # tags of `job`'s union
JobSpec = Annotated[
    Annotated[TrainConfig, Tag(TRAINING_JOB)] | Annotated[CommandJob, Tag(COMMAND_JOB)],
    Discriminator(_job_kind),
]


# --- the scenario -------------------------------------------------------------------------------


class Scenario(_Model):
    """One run: who trains what over which network, and what goes wrong when."""

    name: str = Field(default="scenario", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="Names the run (default: the file's name).")
    description: str = Field(default="", description="Free text for the report.")
    seed: int = Field(default=0, ge=0, description="The run's one seed (model, data, stragglers).")
    workers: Annotated[Workers, BeforeValidator(_worker_count)] = Field(
        default=Workers(count=4), description="A count, or {count, overrides}.")
    topology: Topology = Field(default=Topology(), description="The links between the workers.")
    job: JobSpec = Field(default=TrainConfig(), description="What every worker runs: a "
                         "training job (testbed.train.TrainConfig; seed is set at the top "
                         "level) or a command of your own ({command: [...]}).")
    collective: CollectiveSpec = Field(
        default=COLLECTIVES["ring"](kind="ring"),
        description=f"kind ({', '.join(registry.kinds())}) and that collective's options.")
    timeline: list[Event] = Field(default=[], description="Faults, at a time or a step, in "
                                  "the order they happen.")
    metrics: Metrics = Metrics()
    capture: Capture = Field(default=Capture(), description="Links whose frames a run records "
                             "into pcap files, and the per-flow summary (docs/capture.md).")
    security: Security = Field(default=Security(), description="Who may speak on the run's "
                               "sockets: authenticate true, false or auto (docs/transport.md).")

    @property
    def command(self) -> CommandJob | None:
        """The user's command, if the job is one (else a training job)."""
        return self.job if isinstance(self.job, CommandJob) else None

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        problems = [*self._check_workers(), *self._check_topology(), *self._check_timeline(),
                    *self._check_capture(), *self._check_security()]
        if self.command is not None:
            problems.extend(self._check_command())
        else:
            problems.extend(self._check_training())
            problems.extend(self._check_rejoin())
        if problems:
            raise Problems(problems)
        return self

    def _check_command(self) -> Iterator[tuple[Loc, str]]:
        """A command has no steps: the timeline runs on time, a burst pauses the program for
        its duration, and nothing slows single workers but bursts."""
        for i, event in enumerate(self.timeline):
            if event.step is not None:
                yield ("timeline", i, "step"), ("a command job has no steps: give the event a "
                                                "time (at: 30s)")
            burst = event.straggler_burst
            if burst is not None and burst.duration is None:
                yield (("timeline", i, "straggler_burst", "steps"),
                       "a command job has no steps: give the burst a duration (the program "
                       "is paused for it)")
        for j, override in enumerate(self.workers.overrides):
            for name in ("straggler", "slowdown"):
                if name in override.model_fields_set:
                    yield (("workers", "overrides", j, name),
                           f"{name} slows a training job's steps; a command job has none "
                           "(pause it with a timeline straggler_burst)")

    def _check_training(self) -> Iterator[tuple[Loc, str]]:
        capabilities = self.collective.capabilities
        if self.job.strategy == "sharded" and not capabilities.sharded_step:
            owners = registry.with_capability("sharded_step")
            yield (("job", "strategy"), f"sharded needs a collective that owns the update "
                   f"(step()): {', '.join(owners)}; got {self.collective.kind}")
        compressor = self.collective.compressor.kind
        if compressor != "none" and self.job.strategy == "sharded":
            yield (("collective", "compressor", "kind"), f"{compressor} compresses all-reduce "
                   "calls; strategy sharded uses the collective's step(): use strategy gradient "
                   "or average, or kind none")
        if (registry.compressor_kind(compressor).exchange_needed(capabilities)
                and not capabilities.reliable_exchange):
            offered = ", ".join(registry.with_capability("reliable_exchange"))
            yield (("collective", "compressor", "kind"), f"{compressor} needs a collective with a "
                   f"reliable neighbour exchange ({offered}); over {self.collective.kind} use "
                   "randk, powersgd or none")
        mismatch = self.collective.strategy_problem(self.job.strategy)
        if mismatch is not None:
            yield ("collective", mismatch[0]), mismatch[1]
        if "seed" in self.job.model_fields_set:
            yield ("job", "seed"), "set seed at the top level of the scenario"

    # -- checks across sections

    def _check_security(self) -> Iterator[tuple[Loc, str]]:
        """`authenticate: true` needs a job whose sockets are the testbed's, over a collective
        that can prove the run's key on them."""
        if self.security.authenticate is not True:
            return
        loc: Loc = ("security", "authenticate")
        if self.command is not None:
            yield loc, ("a command job's sockets are its own program's: the testbed cannot "
                        "authenticate them; use false or auto")
        elif not self.collective.capabilities.authenticates:
            able = ", ".join(registry.with_capability("authenticates"))
            yield loc, (f"collective {self.collective.kind} cannot prove the run's key on its "
                        f"sockets (they are torch.distributed's); use a collective that can "
                        f"({able}), or false or auto")

    def _check_rejoin(self) -> Iterator[tuple[Loc, str]]:
        """A restarted worker needs a collective that can take it back (capability
        `takes_back`), with options that allow it (`rejoin_problem`)."""
        restarts = [i for i, event in enumerate(self.timeline) if event.action == "restart"]
        if not restarts:
            return
        kind = self.collective.kind
        if not self.collective.capabilities.takes_back:
            why = (f"collective {kind} cannot take a worker back (its peers are fixed at the "
                   f"start); use {' or '.join(registry.with_capability('takes_back'))}, or kill "
                   "without restart")
        else:
            why = self.collective.rejoin_problem(self.collective.compressor.kind)
        if why is not None:
            yield ("timeline", restarts[0], "restart"), why

    def _worker_problems(self, loc: Loc, workers: list[int]) -> Iterator[tuple[Loc, str]]:
        count = self.workers.count
        for i, worker in enumerate(workers):
            if worker >= count:
                yield (*loc, i), f"no worker {worker}: workers are 0..{count - 1}"

    def _group_problems(self, loc: Loc, names: list[str], allow_all: bool = False):
        allowed = [*self.topology.groups, *([ALL] if allow_all else [])]
        for i, name in enumerate(names):
            if name not in allowed:
                listing = ", ".join(allowed) or "none defined (topology.groups)"
                yield (*loc, i), f"unknown group {name!r}; allowed: {listing}"

    def _check_workers(self) -> Iterator[tuple[Loc, str]]:
        seen: dict[int, int] = {}
        for i, override in enumerate(self.workers.overrides):
            loc = ("workers", "overrides", i, "worker")
            yield from self._worker_problems(loc, override.worker)
            for worker in override.worker:
                if worker in seen:
                    yield loc, f"worker {worker} is already overridden in overrides[{seen[worker]}]"
                seen.setdefault(worker, i)

    def _check_topology(self) -> Iterator[tuple[Loc, str]]:
        groups = self.topology.groups
        owner: dict[int, str] = {}
        for name, members in groups.items():
            loc = ("topology", "groups", name)
            if name == ALL:
                yield loc, f"{ALL!r} is reserved: it means every worker"
            yield from self._worker_problems(loc, members)
            for worker in members:
                if worker in owner:
                    yield loc, f"worker {worker} is already in group {owner[worker]!r}"
                owner.setdefault(worker, name)
        bad_ends = [problem for j, link in enumerate(self.topology.links)
                    for problem in self._endpoint_problems(("topology", "links", j), link)]
        if bad_ends:
            yield from bad_ends
            return
        claimed: dict[tuple[int, int, int], int] = {}
        for j, link in enumerate(self.topology.links):
            pairs = link.pairs(groups, self.workers.count)
            if not pairs:
                yield ("topology", "links", j), f"{link.describe()} selects no link"
            for s, d in pairs:
                i = claimed.setdefault((s, d, link.specificity), j)
                if i != j:
                    yield (("topology", "links", j), f"{link.describe()} sets {s}->{d} like "
                           f"links[{i}], with the same precedence: merge them or name a worker")
                    break

    def _endpoint_problems(self, loc: Loc, selector: Selector) -> Iterator[tuple[Loc, str]]:
        if selector.between is not None:
            ends = [((*loc, "between", k), end) for k, end in enumerate(selector.between)]
        else:
            ends = [((*loc, "from"), selector.src), ((*loc, "to"), selector.dst)]
        for where, end in ends:
            if isinstance(end, int) and end >= self.workers.count:
                yield where, f"no worker {end}: workers are 0..{self.workers.count - 1}"
            elif isinstance(end, str) and end not in self.topology.groups:
                listing = ", ".join(self.topology.groups) or "none defined (topology.groups)"
                yield where, f"unknown group {end!r}; allowed: {listing}"

    def _check_capture(self) -> Iterator[tuple[Loc, str]]:
        for i, link in enumerate(self.capture.links):
            loc: Loc = ("capture", "links", i)
            bad_ends = list(self._endpoint_problems(loc, link))
            yield from bad_ends
            if not bad_ends and not link.pairs(self.topology.groups, self.count):
                yield loc, f"{link.describe()} selects no link"

    def _check_timeline(self) -> Iterator[tuple[Loc, str]]:
        kills: list[tuple[int, str, float]] = []  # (worker, clock, when)
        linked = []  # the link events whose ends are valid, to replay
        for i, event in enumerate(self.timeline):
            loc: Loc = ("timeline", i)
            value = getattr(event, event.action)
            if event.step is not None and self.command is None and event.step >= self.job.steps:
                yield (*loc, "step"), (f"step {event.step} is never reached: the job has steps "
                                       f"0..{self.job.steps - 1}")
            if isinstance(value, SetLink | RampLink):
                bad_ends = list(self._endpoint_problems((*loc, event.action, "link"), value.link))
                yield from bad_ends
                if not bad_ends:
                    if not value.link.pairs(self.topology.groups, self.count):
                        yield ((*loc, event.action, "link"),
                               f"{value.link.describe()} selects no link")
                    linked.append((i, event))
            elif event.action == "partition":
                yield from self._group_problems((*loc, "partition"), value)
            elif event.action == "heal":
                yield from self._group_problems((*loc, "heal"), value, allow_all=True)
            elif event.action in ("kill", "restart"):
                yield from self._worker_problems((*loc, event.action), value)
            elif isinstance(value, StragglerBurst):
                yield from self._worker_problems((*loc, "straggler_burst", "workers"),
                                                 value.workers)
            clock, when = event.clock
            if event.action == "kill":
                for worker in value:
                    kills.append((worker, clock, when))
            elif event.action == "restart":
                for worker in value:
                    if not any(w == worker and (c != clock or t <= when) for w, c, t in kills):
                        yield (*loc, "restart"), f"worker {worker} is restarted before any kill"
        # Every profile the link changes give, in file order (a ramp at both ends).
        replayed = LinkState.of(self).replay([event for _, event in linked])
        for j, (src, dst), profile in replayed:
            if isinstance(profile, ProfileError):
                i, event = linked[j]
                field = "profile" if event.action == "set_link" else "to"
                yield (("timeline", i, event.action, field),
                       f"on link {src}->{dst}: {_profile_message(profile)}")

    # -- what the cluster needs

    @property
    def count(self) -> int:
        return self.workers.count

    def override(self, worker: int) -> WorkerOverride | None:
        return next((o for o in self.workers.overrides if worker in o.worker), None)

    def straggler(self, worker: int) -> StragglerSpec | None:
        """Worker's injected delay: its override's, else the job's (same for all)."""
        override = self.override(worker)
        return override.straggler if override and override.straggler else self.job.straggler

    def slowdown(self, worker: int) -> float:
        override = self.override(worker)
        return override.slowdown if override else 1.0

    def authenticates(self, placement: Placement) -> bool:
        """Whether a run of this scenario at `placement` (namespaces or compose) has a secret:
        `security.authenticate`, with auto resolved (on under Compose, where its collective
        can prove the key)."""
        setting = self.security.authenticate
        if setting != AUTO:
            return setting
        return (placement == "compose" and self.command is None
                and self.collective.capabilities.authenticates)

    def congestion(self, worker: int) -> str:
        """The TCP congestion control `worker` uses (record it with the run)."""
        override = self.override(worker)
        return (override.congestion if override else None) or self.topology.congestion

    def group(self, worker: int) -> str | None:
        return next((n for n, members in self.topology.groups.items() if worker in members), None)

    def train_config(self, worker: int) -> TrainConfig:
        """Worker's `TrainConfig`: the job with the scenario's seed and the worker's straggler."""
        if self.command is not None:
            raise ValueError("job: a command job has no training configuration")
        spec = self.job.model_dump(exclude_unset=True, by_alias=True)
        spec.update(seed=self.seed, straggler=self.straggler(worker))
        return TrainConfig.model_validate(spec)

    def link_profile(self, src: int, dst: int) -> LinkProfile:
        return resolve_link(self.topology, src, dst)

    def links(self) -> dict[tuple[int, int], LinkProfile]:
        """The profile of every directed link between two workers, before any fault."""
        return {
            (s, d): resolve_link(self.topology, s, d)
            for s in range(self.count) for d in range(self.count) if s != d
        }

    def capture_pairs(self) -> list[tuple[int, int]]:
        """The directed links (src, dst) a run captures, each once."""
        return self.capture.pairs(self.topology.groups, self.count)

    def with_capture(self, links: Sequence[str]) -> Scenario:
        """This scenario capturing `links` too (`testbed run --capture 0->1`); a `ValueError`
        names each bad one and what is wrong with it."""
        if not links:
            return self
        data = self.model_dump(exclude_unset=True, by_alias=True)
        section = data.setdefault("capture", {})
        given = len(section.get("links", []))
        section["links"] = [*section.get("links", []), *links]
        try:
            return Scenario.model_validate(data)
        except ValidationError as error:
            problems: list[str] = []
            for item in error.errors():
                found = item.get("ctx", {}).get("error")
                pairs = (found.problems if isinstance(found, Problems) else
                         [(item["loc"], item["msg"].removeprefix("Value error, "))])
                for loc, message in pairs:
                    if tuple(loc[:2]) == ("capture", "links") and len(loc) > 2 and isinstance(
                            loc[2], int) and loc[2] >= given:
                        rest = [part for part in loc[3:] if not str(part).startswith(
                            "function-")]
                        where = f" ({dotted(tuple(rest))})" if rest else ""
                        problems.append(f"{links[loc[2] - given]}{where}: {message}")
            raise ValueError("; ".join(problems) or str(error)) from None

    def with_steps(self, steps: int) -> Scenario:
        """This scenario shortened (or lengthened) to `steps` steps, e.g. for CI; events at a
        step move proportionally (same share of the run), events at a time stay."""
        if steps < 1:
            raise ValueError(f"steps: expected 1 or more, got {steps}")
        if self.command is not None:
            raise ValueError("steps: a command job has no steps to shorten (give the program "
                             "its own option in job.command)")
        data = self.model_dump(exclude_unset=True, by_alias=True)
        scale = steps / self.job.steps
        data.setdefault("job", {})["steps"] = steps
        for event in data.get("timeline", []):
            if event.get("step") is not None:
                event["step"] = min(int(event["step"] * scale), steps - 1)
        return Scenario.model_validate(data)

    def summary(self) -> str:
        """One line: name, workers, network, job, collective, faults."""
        default = self.topology.default
        network = [f"default {default}"]
        if self.topology.groups:
            network.append(f"groups {', '.join(self.topology.groups)}")
        if self.topology.links:
            network.append(f"{len(self.topology.links)} link override(s)")
        actions = sorted({event.action for event in self.timeline})
        compressor = self.collective.compressor.kind
        compression = "" if compressor == "none" else f"+{compressor}"
        job = (f"command {' '.join(self.command.command)}" if self.command is not None else
               f"job {self.job.model} x {self.job.steps} steps; "
               f"collective {self.collective.kind}{compression}")
        capture = f"; capture {self.capture.describe()}" if self.capture.links else ""
        return (
            f"{self.name}: {self.count} workers; {'; '.join(network)}; "
            f"{self.topology.congestion}; {job}; "
            f"{len(self.timeline)} event(s){' (' + ', '.join(actions) + ')' if actions else ''}"
            f"{capture}"
        )


# --- JSON Schema --------------------------------------------------------------------------------

_MAGNITUDE = r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"  # not negative
_ZERO = r"0*\.?0*"
_TIME_UNITS = "s|sec|ms|msec|us|usec|ns|nsec|S|MS|US|NS"
_RATE_UNITS = "bit|bps|[kKmMgGtT]bit|[kKmMgG]bps"
_PERCENT = r"(100(\.0*)?|[0-9]?[0-9](\.[0-9]*)?|\.[0-9]+)\s*%"  # 0% to 100%
_FRACTION = r"(0?\.[0-9]+|[01](\.0*)?|0\.[0-9]*)"  # 0 to 1


def _string(pattern: str) -> dict:
    return {"type": "string", "pattern": rf"^\s*({pattern})\s*$"}


def _schema(help_text: str, *branches: dict) -> Callable[[dict], dict]:
    return lambda _inner: {"anyOf": list(branches), "description": help_text}


def _before(annotated: Any) -> Callable:
    return next(m.func for m in get_args(annotated)[1:] if isinstance(m, BeforeValidator))


_TIME = _schema(TIME_HELP, {"type": "number", "minimum": 0},
                _string(rf"{_MAGNITUDE}\s*({_TIME_UNITS})?"))
# Before-validators that accept more than their inner type (human units, a single item for a
# list, a count for `workers`), and the JSON Schema of what they accept. A link's times and rate
# take their unit (only 0 goes without), as the loader says.
_WIDER: dict[Callable, Callable[[dict], dict]] = {
    _before(Seconds): _TIME,
    _before(LinkTime): _schema(
        f"{TIME_HELP} (with its unit: a bare number would be seconds)", {"const": 0},
        _string(rf"{_MAGNITUDE}\s*({_TIME_UNITS})|{_ZERO}")),
    _before(Fraction): _schema(FRACTION_HELP, {"type": "number", "minimum": 0, "maximum": 1},
                               _string(f"{_PERCENT}|{_FRACTION}")),
    _before(BitsPerSecond): _schema(
        f"{RATE_HELP} (with its unit: a bare number would be bits/s)",
        _string(rf"{_MAGNITUDE}\s*({_RATE_UNITS})")),
    _threshold: lambda inner: {"anyOf": [_TIME(inner), {"const": "auto"}],
                               "description": f"'auto' or {TIME_HELP}"},
    _as_list: lambda inner: {"anyOf": [inner.get("items", {}), inner]},
    _link_text: lambda inner: {"anyOf": [{"type": "string", "pattern": LINK_TEXT,
                                          "description": LINK_HELP}, {"const": ALL}, inner]},
    _byte_size: _schema(f"{SIZE_HELP} (with its unit: a bare number would be bytes)",
                        {"const": 0},
                        _string(rf"{_MAGNITUDE}\s*([bB]|[kKmMgG][bB]?|[kKmMgG]i[bB])|{_ZERO}")),
    _worker_count: lambda inner: {"anyOf": [{"type": "integer", "minimum": 1}, inner]},
}


class _SchemaGenerator(GenerateJsonSchema):
    def function_before_schema(self, schema: Any) -> dict:
        inner = self.generate_inner(schema["schema"])
        wider = _WIDER.get(schema["function"]["function"])
        return wider(inner) if wider else inner


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a scenario file (for editors: completion, inline errors)."""
    schema = Scenario.model_json_schema(schema_generator=_SchemaGenerator)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "title": "testbed scenario",
    }
