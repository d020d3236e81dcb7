"""Link shaping with the kernel's netem, usable on its own: profiles, backends, probes."""

from netem.profile import GilbertElliott, LinkProfile, ProfileError

__all__ = ["GilbertElliott", "LinkProfile", "ProfileError"]
