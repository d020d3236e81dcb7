"""Docker Compose placement: `project` writes a scenario's Compose project (`testbed compose`);
`swarm` writes the same workers as a Docker Swarm stack (`testbed compose --swarm`); `engine`
starts Docker Engines of the testbed's own and keeps the images on a disk a User-Mode
Linux guest can mount; `up` runs a project end to end where netem exists (`testbed compose
--up`: on this host, or inside the guest)."""

from testbed.compose.project import (
    FILE,
    KEY_COPY,
    MONITORING,
    PROMETHEUS_CONFIG,
    PROMETHEUS_PORT,
    ROOT,
    SCENARIO_COPY,
    ComposeError,
    check_compose,
    compose_project,
    default_directory,
    prometheus_config,
    remove_projects,
    worker_addresses,
    write_project,
)

__all__ = [
    "FILE",
    "KEY_COPY",
    "MONITORING",
    "PROMETHEUS_CONFIG",
    "PROMETHEUS_PORT",
    "ROOT",
    "SCENARIO_COPY",
    "ComposeError",
    "check_compose",
    "compose_project",
    "default_directory",
    "prometheus_config",
    "remove_projects",
    "worker_addresses",
    "write_project",
]
