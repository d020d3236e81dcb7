"""The checks a scenario needs several sections for: a worker index against the count, a group
name against the groups, two links that set one pair alike, a timeline replayed on the links, a
collective against the job's strategy, a restart against the collective. They run once every
field is valid, and report each problem at its own path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from netem.profile import ProfileError
from netem.trace import TraceError
from testbed.collectives import registry
from testbed.scenario.fields import Loc
from testbed.scenario.links import ALL, LinkState, run_order
from testbed.scenario.sections import TOP_LEVEL
from testbed.scenario.timeline import RampLink, SetLink, StragglerBurst
from testbed.scenario.topology import Selector, profile_of

if TYPE_CHECKING:
    from testbed.scenario.model import Scenario

# The compressors that keep nothing from call to call and need no shapes (the quantizers), so
# Streaming DiLoCo's fragments, a different part of the model each call, can go through them.
STREAMING_COMPRESSORS = ("none", "int8", "int4")


def problems(scenario: Scenario) -> list[tuple[Loc, str]]:
    """Every problem across the sections of `scenario` (whose fields are each valid)."""
    found = [*_workers(scenario), *_topology(scenario), *_timeline(scenario),
             *_capture(scenario), *_traffic(scenario), *_security(scenario)]
    if scenario.command is not None:
        found.extend(_command(scenario))
    else:
        found.extend(_training(scenario))
        found.extend(_rejoin(scenario))
    return found


def _workers(scenario: Scenario) -> Iterator[tuple[Loc, str]]:
    seen: dict[int, int] = {}
    for i, override in enumerate(scenario.workers.overrides):
        loc = ("workers", "overrides", i, "worker")
        yield from _worker_problems(scenario, loc, override.worker)
        for worker in override.worker:
            if worker in seen:
                yield loc, f"worker {worker} is already overridden in overrides[{seen[worker]}]"
            seen.setdefault(worker, i)


def _topology(scenario: Scenario) -> Iterator[tuple[Loc, str]]:
    groups = scenario.topology.groups
    owner: dict[int, str] = {}
    for name, members in groups.items():
        loc = ("topology", "groups", name)
        if name == ALL:
            yield loc, f"{ALL!r} is reserved: it means every worker"
        yield from _worker_problems(scenario, loc, members)
        for worker in members:
            if worker in owner:
                yield loc, f"worker {worker} is already in group {owner[worker]!r}"
            owner.setdefault(worker, name)
    bad_ends = [problem for j, link in enumerate(scenario.topology.links)
                for problem in _endpoint_problems(scenario, ("topology", "links", j), link)]
    if bad_ends:
        yield from bad_ends
        return
    claimed: dict[tuple[int, int, int], int] = {}
    for j, link in enumerate(scenario.topology.links):
        pairs = link.pairs(groups, scenario.workers.count)
        if not pairs:
            yield ("topology", "links", j), f"{link.describe()} selects no link"
        for s, d in pairs:
            i = claimed.setdefault((s, d, link.specificity), j)
            if i != j:
                yield (("topology", "links", j), f"{link.describe()} sets {s}->{d} like "
                       f"links[{i}], with the same precedence: merge them or name a worker")
                break
        if link.trace is not None:
            try:
                link.trace.schedule().profiles(profile_of(scenario.topology, link))
            except TraceError as error:
                yield ("topology", "links", j, "trace"), str(error)


def _timeline(scenario: Scenario) -> Iterator[tuple[Loc, str]]:
    """Each event on its own, then the events in the order the run carries them out
    (`run_order`): a restart after a kill, every link change on the profiles the changes before
    it left."""
    for i, event in enumerate(scenario.timeline):
        loc: Loc = ("timeline", i)
        value = getattr(event, event.action)
        if (event.step is not None and scenario.command is None
                and event.step >= scenario.job.steps):
            yield (*loc, "step"), (f"step {event.step} is never reached: the job has steps "
                                   f"0..{scenario.job.steps - 1}")
        if isinstance(value, SetLink | RampLink):
            bad_ends = list(_endpoint_problems(scenario, (*loc, event.action, "link"),
                                               value.link))
            yield from bad_ends
            if not bad_ends and not value.link.pairs(scenario.topology.groups, scenario.count):
                yield ((*loc, event.action, "link"), f"{value.link.describe()} selects no link")
        elif event.action == "partition":
            yield from _group_problems(scenario, (*loc, "partition"), value)
        elif event.action == "heal":
            yield from _group_problems(scenario, (*loc, "heal"), value, allow_all=True)
        elif event.action in ("kill", "restart"):
            yield from _worker_problems(scenario, (*loc, event.action), value)
        elif isinstance(value, StragglerBurst):
            yield from _worker_problems(scenario, (*loc, "straggler_burst", "workers"),
                                        value.workers)
    order = run_order(scenario.timeline)
    killed: set[int] = set()
    for i in order:
        event = scenario.timeline[i]
        if event.action == "kill":
            killed.update(event.kill)
        elif event.action == "restart":
            for worker in event.restart:
                if worker not in killed:
                    yield (("timeline", i, "restart"), f"worker {worker} is restarted before "
                           f"any kill{_placed(order, i)}")
    # Every profile the link changes give, in the run's order (a ramp at both ends).
    for i, (src, dst), profile in LinkState.of(scenario).replay(scenario.timeline):
        if isinstance(profile, ProfileError):
            action = scenario.timeline[i].action
            yield (("timeline", i, action, "profile" if action == "set_link" else "to"),
                   f"on link {src}->{dst}: {_profile_message(profile)}{_placed(order, i)}")


def _placed(order: list[int], index: int) -> str:
    """Where the run puts event `index` among those the file lists apart from it ('' where
    the file's order is the run's)."""
    before = set(order[:order.index(index)])
    later = [f"timeline[{i}]" for i in sorted(before) if i > index]
    earlier = [f"timeline[{i}]" for i in range(index) if i not in before]
    parts = ([f"after {', '.join(later)}, listed after it"] if later else []) + (
        [f"before {', '.join(earlier)}, listed before it"] if earlier else [])
    if not parts:
        return ""
    return f" (events run in time and step order: this one runs {'; '.join(parts)})"


def _capture(scenario: Scenario) -> Iterator[tuple[Loc, str]]:
    for i, link in enumerate(scenario.capture.links):
        loc: Loc = ("capture", "links", i)
        bad_ends = list(_endpoint_problems(scenario, loc, link))
        yield from bad_ends
        if not bad_ends and not link.pairs(scenario.topology.groups, scenario.count):
            yield loc, f"{link.describe()} selects no link"


def _security(scenario: Scenario) -> Iterator[tuple[Loc, str]]:
    """`authenticate: true` needs a job whose sockets are the testbed's, over a collective
    that can prove the run's key on them."""
    if scenario.security.authenticate is not True:
        return
    loc: Loc = ("security", "authenticate")
    if scenario.command is not None:
        yield loc, ("a command job's sockets are its own program's: the testbed cannot "
                    "authenticate them; use false or auto")
    elif not scenario.collective.capabilities.authenticates:
        able = ", ".join(registry.with_capability("authenticates"))
        yield loc, (f"collective {scenario.collective.kind} cannot prove the run's key on its "
                    f"sockets (they are torch.distributed's); use a collective that can "
                    f"({able}), or false or auto")


def _command(scenario: Scenario) -> Iterator[tuple[Loc, str]]:
    """A command has no steps: the timeline runs on time, a burst pauses the program for
    its duration, and nothing slows single workers but bursts."""
    for i, event in enumerate(scenario.timeline):
        if event.step is not None:
            yield ("timeline", i, "step"), ("a command job has no steps: give the event a "
                                            "time (at: 30s)")
        burst = event.straggler_burst
        if burst is not None and burst.duration is None:
            yield (("timeline", i, "straggler_burst", "steps"),
                   "a command job has no steps: give the burst a duration (the program "
                   "is paused for it)")
    for j, override in enumerate(scenario.workers.overrides):
        for name in ("straggler", "slowdown"):
            if name in override.model_fields_set:
                yield (("workers", "overrides", j, name),
                       f"{name} slows a training job's steps; a command job has none "
                       "(pause it with a timeline straggler_burst)")
    job = scenario.command
    if job is not None and isinstance(job.gpus, list) and len(job.gpus) != scenario.count:
        yield ("job", "gpus"), (f"expected one entry per worker ({scenario.count}), got "
                                f"{len(job.gpus)}")


def _training(scenario: Scenario) -> Iterator[tuple[Loc, str]]:
    capabilities = scenario.collective.capabilities
    if scenario.job.strategy == "sharded" and not capabilities.sharded_step:
        owners = registry.with_capability("sharded_step")
        yield (("job", "strategy"), f"sharded needs a collective that owns the update "
               f"(step()): {', '.join(owners)}; got {scenario.collective.kind}")
    compressor = scenario.collective.compressor.kind
    if compressor != "none" and scenario.job.strategy == "sharded":
        yield (("collective", "compressor", "kind"), f"{compressor} compresses all-reduce "
               "calls; strategy sharded uses the collective's step(): use strategy gradient "
               "or average, or kind none")
    if (registry.compressor_kind(compressor).exchange_needed(capabilities)
            and not capabilities.reliable_exchange):
        offered = ", ".join(registry.with_capability("reliable_exchange"))
        yield (("collective", "compressor", "kind"), f"{compressor} needs a collective with a "
               f"reliable neighbour exchange ({offered}); over {scenario.collective.kind} use "
               "randk, powersgd or none")
    if scenario.job.streaming is not None and compressor not in STREAMING_COMPRESSORS:
        yield (("collective", "compressor", "kind"), f"{compressor} keeps state per vector or "
               "needs the whole model's shapes; Streaming DiLoCo's all-reduces carry a "
               f"different fragment each time: use {', '.join(STREAMING_COMPRESSORS)}")
    mismatch = scenario.collective.strategy_problem(scenario.job.strategy)
    if mismatch is not None:
        yield ("collective", mismatch[0]), mismatch[1]
    for name in TOP_LEVEL:
        if name in scenario.job.model_fields_set:
            yield ("job", name), f"set {name} at the top level of the scenario"


def _rejoin(scenario: Scenario) -> Iterator[tuple[Loc, str]]:
    """A restarted worker needs a collective that can take it back (capability
    `takes_back`), with options that allow it (`rejoin_problem`)."""
    restarts = [i for i, event in enumerate(scenario.timeline) if event.action == "restart"]
    if not restarts:
        return
    kind = scenario.collective.kind
    if not scenario.collective.capabilities.takes_back:
        why = (f"collective {kind} cannot take a worker back (its peers are fixed at the "
               f"start); use {' or '.join(registry.with_capability('takes_back'))}, or kill "
               "without restart")
    else:
        why = scenario.collective.rejoin_problem(scenario.collective.compressor.kind)
    if why is not None:
        yield ("timeline", restarts[0], "restart"), why


def _traffic(scenario: Scenario) -> Iterator[tuple[Loc, str]]:
    count = scenario.workers.count
    named: dict[str, int] = {}
    for i, flow in enumerate(scenario.traffic):
        for end, worker in (("from", flow.src), ("to", flow.dst)):
            if worker >= count:
                yield ("traffic", i, end), f"no worker {worker}: workers are 0..{count - 1}"
        if flow.name is not None:
            j = named.setdefault(flow.name, i)
            if j != i:
                yield ("traffic", i, "name"), f"{flow.name!r} already names traffic[{j}]"


def _worker_problems(scenario: Scenario, loc: Loc,
                     workers: list[int]) -> Iterator[tuple[Loc, str]]:
    count = scenario.workers.count
    for i, worker in enumerate(workers):
        if worker >= count:
            yield (*loc, i), f"no worker {worker}: workers are 0..{count - 1}"


def _group_problems(scenario: Scenario, loc: Loc, names: list[str],
                    allow_all: bool = False) -> Iterator[tuple[Loc, str]]:
    allowed = [*scenario.topology.groups, *([ALL] if allow_all else [])]
    for i, name in enumerate(names):
        if name not in allowed:
            listing = ", ".join(allowed) or "none defined (topology.groups)"
            yield (*loc, i), f"unknown group {name!r}; allowed: {listing}"


def _endpoint_problems(scenario: Scenario, loc: Loc,
                       selector: Selector) -> Iterator[tuple[Loc, str]]:
    if selector.between is not None:
        ends = [((*loc, "between", k), end) for k, end in enumerate(selector.between)]
    else:
        ends = [((*loc, "from"), selector.src), ((*loc, "to"), selector.dst)]
    for where, end in ends:
        if isinstance(end, int) and end >= scenario.workers.count:
            yield where, f"no worker {end}: workers are 0..{scenario.workers.count - 1}"
        elif isinstance(end, str) and end not in scenario.topology.groups:
            listing = ", ".join(scenario.topology.groups) or "none defined (topology.groups)"
            yield where, f"unknown group {end!r}; allowed: {listing}"


def _profile_message(error: ProfileError) -> str:
    return "; ".join(line.strip() for line in str(error).splitlines()[1:])
