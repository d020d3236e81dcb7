"""What the rest of the testbed asks of a valid scenario (a worker's straggler, slowdown,
congestion control and training configuration, every link's profile, the links captured, the
one-line summary) and the scenarios derived from one (more links captured, fewer steps)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError

from netem.profile import LinkProfile
from testbed.scenario.fields import Problems, dotted
from testbed.scenario.sections import AUTO, CommandJob, Placement, WorkerOverride
from testbed.scenario.topology import LinkTrace, resolve_link, resolve_trace
from testbed.scenario.traffic import Flow, flow_names
from testbed.train.config import TrainConfig
from testbed.train.stragglers import StragglerSpec

if TYPE_CHECKING:
    from testbed.scenario.model import Scenario


class ScenarioQueries:
    """What a `Scenario` answers (it inherits these): reads of its validated fields, and the
    scenarios derived from it."""

    @property
    def command(self) -> CommandJob | None:
        """The user's command, if the job is one (else a training job)."""
        return self.job if isinstance(self.job, CommandJob) else None

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

    def traces(self) -> dict[tuple[int, int], LinkTrace]:
        """The directed links that replay a trace (`topology.links[].trace`), and its trace."""
        found = {(s, d): resolve_trace(self.topology, s, d)
                 for s in range(self.count) for d in range(self.count) if s != d}
        return {pair: trace for pair, trace in found.items() if trace is not None}

    def flows(self) -> dict[str, Flow]:
        """The background flows (`traffic`), by name (`traffic.flow_names`)."""
        return dict(zip(flow_names(self.traffic), self.traffic, strict=True))

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
            return type(self).model_validate(data)
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
        return type(self).model_validate(data)

    def summary(self) -> str:
        """One line: name, workers, network, job, collective, faults."""
        default = self.topology.default
        network = [f"default {default}"]
        if self.topology.groups:
            network.append(f"groups {', '.join(self.topology.groups)}")
        if self.topology.links:
            network.append(f"{len(self.topology.links)} link override(s)")
        if traced := self.traces():
            network.append(f"{len(traced)} link(s) replaying a trace")
        actions = sorted({event.action for event in self.timeline})
        compressor = self.collective.compressor.kind
        compression = "" if compressor == "none" else f"+{compressor}"
        job = (f"command {' '.join(self.command.command)}" if self.command is not None else
               f"job {self.job.model} x {self.job.steps} steps; "
               f"collective {self.collective.kind}{compression}")
        capture = f"; capture {self.capture.describe()}" if self.capture.links else ""
        traffic = f"; {len(self.traffic)} background flow(s)" if self.traffic else ""
        return (
            f"{self.name}: {self.count} workers; {'; '.join(network)}; "
            f"{self.topology.congestion}; {job}; "
            f"{len(self.timeline)} event(s){' (' + ', '.join(actions) + ')' if actions else ''}"
            f"{capture}{traffic}"
        )
