"""The scenario model: workers, topology, job, collective, fault timeline and metrics of one run.

Every section has defaults, so five lines make a complete scenario; every model forbids unknown
fields. Link profiles are `netem.LinkProfile` itself, the job is `testbed.train.TrainConfig`
itself, straggler distributions are `testbed.train.stragglers.StragglerSpec`, and a collective's
options and capabilities are its registry entry's (`testbed.collectives.registry`), so each is
validated in one place. Nothing here imports torch: checking a scenario is quick.
The sections are their own modules (`topology`, `collective`, `timeline`, `sections`); the
checks across sections (`checks`) run once the fields are valid and report each problem at its
own path (`Problems`); what the rest of the testbed asks of a scenario is `queries`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field, model_validator

from netem.profile import Integer
from testbed.collectives import registry
from testbed.scenario.checks import problems
from testbed.scenario.collective import COLLECTIVES, CollectiveSpec
from testbed.scenario.fields import NAME_PATTERN, Problems, Section
from testbed.scenario.queries import ScenarioQueries
from testbed.scenario.sections import (
    Capture,
    JobSpec,
    Metrics,
    Security,
    Workers,
    worker_count,
)
from testbed.scenario.timeline import Event
from testbed.scenario.topology import Topology
from testbed.scenario.traffic import Flow
from testbed.train.config import TrainConfig


class Scenario(ScenarioQueries, Section):
    """One run: who trains what over which network, and what goes wrong when."""

    name: str = Field(default="scenario", pattern=NAME_PATTERN,
                      description="Names the run (default: the file's name).")
    description: str = Field(default="", description="Free text for the report.")
    seed: Integer = Field(default=0, ge=0, description="The run's one seed (model, data, "
                          "stragglers, and each link's netem seed unless its profile gives one).")
    workers: Annotated[Workers, BeforeValidator(worker_count)] = Field(
        default=Workers(count=4), description="A count, or {count, overrides}.")
    topology: Topology = Field(default=Topology(), description="The links between the workers.")
    job: JobSpec = Field(default=TrainConfig(), description="What every worker runs: a "
                         "training job (testbed.train.TrainConfig; seed is set at the top "
                         "level) or a command of your own ({command: [...]}).")
    collective: CollectiveSpec = Field(
        default=COLLECTIVES["ring"](kind="ring"),
        description=f"kind ({', '.join(registry.kinds())}) and that collective's options.")
    timeline: list[Event] = Field(default=[], description="Faults, at a time or a step: "
                                  "they run in time and step order.")
    metrics: Metrics = Metrics()
    capture: Capture = Field(default=Capture(), description="Links whose frames a run records "
                             "into pcap files, and the per-flow summary (docs/capture.md).")
    traffic: list[Flow] = Field(default=[], description="Background flows between workers "
                                "that compete with training for the links: iperf3, TCP bulk "
                                "or UDP at a rate, constant or on/off (docs/conditions.md).")
    security: Security = Field(default=Security(), description="Who may speak on the run's "
                               "sockets: authenticate true, false or auto (docs/transport.md).")

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        found = problems(self)
        if found:
            raise Problems(found)
        return self
