"""Link shaping with the kernel's netem, usable on its own: profiles, backends, probes."""

from netem.backend import AppliedShaping, ShapingError, apply, change, clear, show
from netem.plan import UnsupportedByKernel
from netem.profile import GilbertElliott, LinkProfile, ProfileError

__all__ = [
    "AppliedShaping",
    "GilbertElliott",
    "LinkProfile",
    "ProfileError",
    "ShapingError",
    "UnsupportedByKernel",
    "apply",
    "change",
    "clear",
    "show",
]
