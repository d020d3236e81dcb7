"""Your own DDP model over the scenario's collective, in a command job (docs/your-code.md).

In a script that `testbed run` starts as the job (`job: {command: [...]}`), three lines give a
`DistributedDataParallel` model the collective the scenario names (lossy, Moshpit, ring, gloo,
with its compressor), already placed on the scenario's network:

    from testbed.ddp import scenario_hook
    model = DistributedDataParallel(net)
    model.register_comm_hook(state=None, hook=scenario_hook())

The worker's spec (TESTBED_WORKER_SPEC, set for the command) says where every worker is; the
scenario (TESTBED_SCENARIO) says which collective with which options. DDP keeps its own process
group (init_process_group with the RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT the run set)
for its bookkeeping; the gradients go through the collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from testbed import collectives
from testbed.cluster.worker import WorkerSpec, placement
from testbed.collectives.hook import Hook, comm_hook
from testbed.scenario import load_scenario

SPEC = "TESTBED_WORKER_SPEC"


def scenario_collective() -> Any:
    """The scenario's collective (with its compressor) for this worker, from the environment a
    command job runs in. Close it when done (or let the process end)."""
    text = os.environ.get(SPEC)
    if text is None:
        raise RuntimeError(f"{SPEC} is not set: this process was not started by `testbed run` "
                           "as a scenario's job.command (docs/your-code.md)")
    spec = WorkerSpec.from_json(text)
    scenario = load_scenario(spec.scenario)
    collective = collectives.place(scenario.collective.kind, placement(spec, scenario),
                                   scenario.collective.options())
    compressor = scenario.collective.compressor
    if compressor.kind == "none":
        return collective
    return collectives.compress(collective, compressor.kind, **compressor.parameters())


def scenario_hook(on_stats: Callable[[Any], None] | None = None) -> Hook:
    """A DDP communication hook over `scenario_collective()`; `on_stats` sees what each
    all-reduce cost (`AllReduceStats`)."""
    return comm_hook(scenario_collective(), on_stats)
