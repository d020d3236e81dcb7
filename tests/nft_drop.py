"""Loss for tests of what sits above the link (transport, metrics): nftables drops a share of
the packets matching a rule on their way into a host of a lab."""

from __future__ import annotations

from netem.lab import Host, Lab


def drop(lab: Lab, host: Host, match: str, percent: int) -> None:
    """Drop `percent`% of the packets matching `match` on their way into `host`."""
    for command in (
        "add table inet loss",
        "add chain inet loss pre { type filter hook prerouting priority -300 ; }",
        f"add rule inet loss pre {match} numgen random mod 100 < {percent} counter drop",
    ):
        result = lab.run(host, ["nft", *command.split()])
        assert result.returncode == 0, f"nft {command}: {result.stderr}"
