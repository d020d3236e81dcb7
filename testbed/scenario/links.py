"""Link state: what every directed link between two workers carries, and what a timeline event
does to it. The one place with these rules; scenario validation replays a timeline with it, and
both placements (namespaces: `cluster.network`; containers: `cluster.node`) keep one and only
shape the kernel after it.

- A link's *profile* is what the scenario and the timeline's link changes gave it; a
  *partition* cuts links (100% loss, `CUT`) without forgetting their profile, so a later heal
  restores whatever was set meanwhile.
- A partition of several groups cuts the links between workers of different listed groups; of
  one group, every link between it and the rest. A heal ends the partition of exactly its
  groups, or with `all` every partition, or with no such partition in force whatever a
  partition of its groups would cut; a link another partition still cuts stays cut.
- A ramp moves a link from its profile at the start (or the ramp's `from`) to `to` over `over`
  seconds; `ramp_profiles` gives any moment of it.
- A link's *seed* (of netem's random numbers) is its profile's own, else one derived from the
  run's seed and the link (`derive_seed(run_seed, src, dst)`: another link's change leaves it as
  it is), where the link draws random numbers (`draws_random`). `shaped` is what the kernel is
  given: the link's profile with its seed, on every change (netem restarts its sequence from
  the seed it is sent, and re-seeds at random on a change that carries none).
- A timeline's events act in the order a run carries them out (`run_order`: each clock's
  events by time or step), which validation replays (`replay`), whatever the file's order.

Pure: no kernel, no clock, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from netem.profile import LinkProfile, ProfileError, derive_seed

Pair = tuple[int, int]
CUT = LinkProfile(loss=1.0)  # what a partitioned link carries: nothing
ALL = "all"  # reserved group name: every worker (in `heal`, every partition)


def draws_random(profile: LinkProfile) -> bool:
    """Whether netem draws random numbers from the link's seed: for loss, duplication,
    corruption, reordering, jitter or a slot distribution. A link without any needs no seed."""
    return bool(profile.loss or profile.gilbert_elliott or profile.duplicate or profile.corrupt
                or profile.reorder or profile.jitter
                or (profile.slot is not None and profile.slot.distribution is not None))


def partition_pairs(groups: Mapping[str, Sequence[int]], names: Sequence[str],
                    count: int) -> set[Pair]:
    """The directed links a partition of `names` cuts: between workers of different listed
    groups; a single group is cut from every worker outside it."""
    members = [set(groups[name]) for name in names]
    if len(members) == 1:
        inside = members[0]
        return {(s, d) for s in range(count) for d in range(count)
                if (s in inside) != (d in inside)}
    cut: set[Pair] = set()
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            cut |= {(s, d) for s in a for d in b} | {(d, s) for s in a for d in b}
    return cut


def run_order(events: Sequence[Any]) -> list[int]:
    """The indices of timeline `events` in the order a run carries them out: the events of each
    clock by their time (`at`) or step, ties in the file's order. Between the two clocks the
    file's order stands: which of a time and a step comes first is known only as the run goes
    (`testbed.cluster.timeline`)."""
    order = list(range(len(events)))
    for clock in ("at", "step"):
        places = [i for i in order if events[i].clock[0] == clock]
        for place, index in zip(places, sorted(places, key=lambda i: events[i].clock[1]),
                                strict=True):
            order[place] = index
    return order


class LinkState:
    """Every directed link's profile, the cut links and the partitions in force, among `count`
    workers in `groups`, and the run's seed (None: the kernel picks each link's). Each change
    returns the links whose effective profile it may have changed: what a shaper has to redo."""

    def __init__(self, profiles: Mapping[Pair, LinkProfile],
                 groups: Mapping[str, Sequence[int]], count: int,
                 run_seed: int | None = None) -> None:
        self.count = count
        self.run_seed = run_seed
        self.groups = {name: list(members) for name, members in groups.items()}
        self._profiles = dict(profiles)
        self._cut: set[Pair] = set()
        self._partitions: dict[frozenset[str], set[Pair]] = {}

    @classmethod
    def of(cls, scenario: Any) -> LinkState:
        """The links of a scenario (a `Scenario`) before any fault, seeded by its `seed`."""
        return cls(scenario.links(), scenario.topology.groups, scenario.count, scenario.seed)

    # -- reading

    def pair(self, src: int, dst: int) -> Pair:
        """(src, dst), checked to be a link between two workers."""
        if src == dst or not (0 <= src < self.count and 0 <= dst < self.count):
            raise ValueError(f"no link {src}->{dst}: workers are 0..{self.count - 1}, src != dst")
        return (src, dst)

    def current(self, src: int, dst: int) -> LinkProfile:
        """The link's profile as the scenario and the timeline left it (cut or not)."""
        return self._profiles[self.pair(src, dst)]

    def effective(self, src: int, dst: int) -> LinkProfile:
        """What the link carries now: `CUT` while partitioned, else `current`."""
        pair = self.pair(src, dst)
        return CUT if pair in self._cut else self._profiles[pair]

    def is_cut(self, src: int, dst: int) -> bool:
        return self.pair(src, dst) in self._cut

    @property
    def cut(self) -> set[Pair]:
        return set(self._cut)

    def into(self, dst: int) -> dict[int, LinkProfile]:
        """What each other worker's packets to `dst` carry now, by sender."""
        return {src: self.effective(src, dst) for src in range(self.count) if src != dst}

    def shaped(self, src: int, dst: int) -> LinkProfile:
        """What the kernel is given for the link now: `effective`, with the link's seed."""
        profile = self.effective(src, dst)
        seed = self._seed(self.pair(src, dst), profile)
        return profile if seed == profile.seed else profile.model_copy(update={"seed": seed})

    def shaped_into(self, dst: int) -> dict[int, LinkProfile]:
        """`shaped` of each other worker's link to `dst`, by sender."""
        return {src: self.shaped(src, dst) for src in range(self.count) if src != dst}

    def seeds(self) -> dict[str, int]:
        """Each link's seed as its profile stands (cut or not), keyed "src->dst" as a run
        records them: the links that have one."""
        found = {pair: self._seed(pair, profile) for pair, profile in self._profiles.items()}
        return {f"{s}->{d}": seed for (s, d), seed in sorted(found.items()) if seed is not None}

    def _seed(self, pair: Pair, profile: LinkProfile) -> int | None:
        """The profile's own seed, else the run's for the link where the profile draws random
        numbers (see the module's rules)."""
        if profile.seed is not None or self.run_seed is None or not draws_random(profile):
            return profile.seed
        return derive_seed(self.run_seed, *pair)

    # -- changing

    def set(self, changes: Mapping[Pair, LinkProfile]) -> set[Pair]:
        """Give these links these profiles (a cut link stays cut until healed)."""
        for pair, profile in changes.items():
            if not isinstance(profile, LinkProfile):
                raise TypeError(f"link {pair}: expected a LinkProfile, got {profile!r}")
            self._profiles[self.pair(*pair)] = profile
        return set(changes)

    def cut_links(self, pairs: Iterable[Pair]) -> set[Pair]:
        """Cut these links (100% loss); returns those that were not cut already."""
        new = {self.pair(*pair) for pair in pairs} - self._cut
        self._cut |= new
        return new

    def heal_links(self, pairs: Iterable[Pair] | None = None) -> set[Pair]:
        """Restore these cut links (None: every one) to their profile; returns those healed."""
        chosen = set(self._cut) if pairs is None else {self.pair(*p) for p in pairs}
        healed = chosen & self._cut
        self._cut -= healed
        return healed

    def partition(self, names: Sequence[str]) -> set[Pair]:
        """Cut the links a partition of these groups cuts, remembering the partition."""
        pairs = partition_pairs(self.groups, names, self.count)
        self._partitions[frozenset(names)] = pairs
        return self.cut_links(pairs)

    def heal(self, names: Sequence[str]) -> set[Pair]:
        """End the partition of these groups (`all`: every one; see the module's rules)."""
        if ALL in names:
            ended = list(self._partitions)
        else:
            ended = [key] if (key := frozenset(names)) in self._partitions else []
        pairs: set[Pair] = set()
        for key in ended:
            pairs |= self._partitions.pop(key)
        if not ended and ALL not in names:
            pairs = partition_pairs(self.groups, names, self.count)
        still = set().union(*self._partitions.values())
        return self.heal_links(pairs - still)

    # -- the timeline's link events

    def apply(self, event: Any) -> set[Pair]:
        """Carry out a timeline event's set_link, partition or heal; returns the links it
        touched. (A ramp runs over time: `ramp_start`, then `ramp_profiles` at each moment.)"""
        value = getattr(event, event.action)
        if event.action == "set_link":
            pairs = value.link.pairs(self.groups, self.count)
            return self.set({pair: value.apply(self._profiles[pair]) for pair in pairs})
        if event.action == "partition":
            return self.partition(list(value))
        if event.action == "heal":
            return self.heal(list(value))
        raise ValueError(f"{event.action}: not one of set_link, partition, heal")

    def ramp_start(self, ramp: Any) -> dict[Pair, LinkProfile]:
        """Each link a ramp moves, with its profile when the ramp starts."""
        return {pair: self._profiles[pair] for pair in ramp.link.pairs(self.groups, self.count)}

    @staticmethod
    def ramp_profiles(ramp: Any, start: Mapping[Pair, LinkProfile],
                      elapsed: float) -> dict[Pair, LinkProfile]:
        """What each link of a ramp carries `elapsed` seconds in, from its `start` profile."""
        return {pair: ramp.profile_at(profile, elapsed) for pair, profile in start.items()}

    def replay(self, events: Sequence[Any]) -> Iterator[tuple[int, Pair, LinkProfile | Exception]]:
        """Every profile a link will be given along `events` (a timeline, in the order a run
        carries it out: `run_order`; a ramp at both ends), as (event index, link, profile),
        changing this state as it goes (replay a fresh `LinkState.of(scenario)`). Where an
        event's profile cannot be made (`ProfileError`), the error comes in the profile's place,
        once, and that event changes nothing."""
        for index in run_order(events):
            event = events[index]
            if event.action not in ("set_link", "ramp_link"):
                continue
            value = getattr(event, event.action)
            ends = (None,) if event.action == "set_link" else (0.0, value.over)
            given: dict[Pair, list[LinkProfile]] = {}
            try:
                for pair in value.link.pairs(self.groups, self.count):
                    current = self._profiles[pair]
                    given[pair] = [value.apply(current) if end is None
                                   else value.profile_at(current, end) for end in ends]
            except ProfileError as error:
                yield index, pair, error
                continue
            for pair, profiles in given.items():
                for profile in profiles:
                    yield index, pair, profile
            self.set({pair: profiles[-1] for pair, profiles in given.items()})

    def changed_by(self, events: Sequence[Any]) -> set[Pair]:
        """The links a timeline will change or cut (a shaper gives them rules of their own
        from the start, so the changes go in place)."""
        pairs: set[Pair] = set()
        for event in events:
            value = getattr(event, event.action)
            if event.action in ("set_link", "ramp_link"):
                pairs |= set(value.link.pairs(self.groups, self.count))
            elif event.action == "partition":
                pairs |= partition_pairs(self.groups, list(value), self.count)
        return pairs
