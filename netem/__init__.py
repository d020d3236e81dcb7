"""Link shaping with the kernel's netem, usable on its own: profiles, backends, probes, trace
replay, and a User-Mode Linux sandbox for kernels without netem (`python -m netem.sandbox`)."""

import pyroute2.config

from netem.backend import (
    AppliedShaping,
    ShapingError,
    apply,
    change,
    clear,
    installed,
    show,
)
from netem.plan import UnsupportedByKernel
from netem.profile import GilbertElliott, LinkProfile, ProfileError
from netem.session import Session
from netem.trace import Replay, TraceError, load_trace, schedule

# pyroute2 forks short-lived helpers (namespace creation, sockets in a namespace) that inherit this
# process's signal handlers; when pyroute2 stops one with SIGTERM, a handler that raises would
# unwind the copy of the caller's stack inside the helper and run the caller's clean-ups there.
pyroute2.config.disable_mp_signal = True

__all__ = [
    "AppliedShaping",
    "GilbertElliott",
    "LinkProfile",
    "ProfileError",
    "Replay",
    "Session",
    "ShapingError",
    "TraceError",
    "UnsupportedByKernel",
    "apply",
    "change",
    "clear",
    "installed",
    "load_trace",
    "schedule",
    "show",
]
