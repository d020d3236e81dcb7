"""Loss for tests of what sits above the link (transport, metrics): nftables drops a share of
the packets matching a rule on their way into a host of a lab."""

from __future__ import annotations

from netem.lab import Host, Lab

TABLE = "loss"


def drop(lab: Lab, host: Host, match: str, percent: int) -> None:
    """Drop `percent`% (1..100) of the packets matching `match` on their way into `host`."""
    if not 0 < percent <= 100:
        raise ValueError(f"percent: expected 1..100, got {percent}")
    share = "" if percent == 100 else f"numgen random mod 100 < {percent} "
    for command in (
        f"add table inet {TABLE}",
        f"add chain inet {TABLE} pre {{ type filter hook prerouting priority -300 ; }}",
        f"add rule inet {TABLE} pre {match} {share}counter drop",
    ):
        result = lab.run(host, ["nft", *command.split()])
        assert result.returncode == 0, f"nft {command}: {result.stderr}"


def stop_dropping(lab: Lab, host: Host) -> None:
    """Remove every rule `drop` added on `host`."""
    result = lab.run(host, ["nft", "delete", "table", "inet", TABLE])
    assert result.returncode == 0, f"nft delete table inet {TABLE}: {result.stderr}"
