"""A run's captures (the scenario's `capture` section, `testbed run --capture`): both ends of
each chosen link recorded into `RUN_DIR/capture/` while the workers run, and what each link
did to each flow in `capture/flows.json` once the run ended (docs/capture.md).

Worker w is host w of the network's lab. A link src->dst is captured on src's interface in its
namespace (the frames src put on the wire towards dst) and on dst's in its own (the frames that
reached dst from src). The shaping sits between the two, on the switch port towards dst, so
every difference between the files is what the link did.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from netem.capture import LinkCapture, analyse, write_flows
from testbed.cluster.network import ClusterNetwork
from testbed.scenario.model import Scenario

CAPTURE_DIR = "capture"
SETTLE = 0.2  # seconds the receivers' taps stay after the senders', beyond the links' delay
SETTLE_MOST = 5.0


class RunCapture:
    """The captures of one run into `run_dir/capture`; times in flows.json count from `origin`
    (the run's start, seconds since the epoch)."""

    def __init__(self, scenario: Scenario, run_dir: Path, origin: float) -> None:
        self.pairs = scenario.capture_pairs()
        self.directory = Path(run_dir) / CAPTURE_DIR
        self.capture = LinkCapture(self.directory, snap=scenario.capture.snap,
                                   max_bytes=scenario.capture.max_bytes, origin=origin)
        self.manifest: dict[str, Any] | None = None
        self.flows: dict[str, Any] | None = None
        self.error: str | None = None

    def start(self, network: ClusterNetwork) -> None:
        """Open every capture point (before the workers start)."""
        for src, dst in self.pairs:
            self.capture.add_lab_link(network.lab, src, dst)
        self.capture.start()

    def close(self, network: ClusterNetwork) -> None:
        """Stop capturing (the workers have ended): the senders' taps first, the receivers'
        once what was still crossing a link had time to arrive (its delay and jitter now)."""
        delays = [network.links.effective(src, dst) for src, dst in self.pairs]
        settle = min(SETTLE_MOST, SETTLE + max((p.delay + p.jitter for p in delays), default=0))
        self.manifest = self.capture.close(settle=settle)

    def summarise(self) -> dict[str, Any] | None:
        """Analyse what was captured and write `capture/flows.json`; None (and `error` set)
        if nothing was captured or the files cannot be read: a capture never fails a run."""
        if self.manifest is None:
            return None
        try:
            self.flows = analyse(self.directory)
            write_flows(self.directory, self.flows)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            print(f"capture: not summarised: {self.error}", file=sys.stderr)
            return None
        return self.flows

    def event(self) -> dict[str, Any]:
        """The run's `capture` event: where the files are, each link's totals and bounds."""
        if self.flows is None:
            return {"directory": CAPTURE_DIR, "links": [f"{s}->{d}" for s, d in self.pairs],
                    "error": self.error or "nothing captured"}
        return {"directory": CAPTURE_DIR, "flows": f"{CAPTURE_DIR}/flows.json",
                "truncated": self.flows["truncated"], "seconds": self.flows["seconds"],
                "links": [link_totals(link) for link in self.flows["links"]]}


def link_totals(link: dict[str, Any]) -> dict[str, Any]:
    """One link of a flows document, without its flows: its totals, files and bounds."""
    return {"link": link["link"], **{k: v for k, v in link["totals"].items()
                                     if k != "delay_seconds"},
            "delay_seconds": link["totals"].get("delay_seconds"), "files": link["files"],
            "truncated": link["truncated"], "kernel_drops": link["kernel_drops"],
            "complete": link["complete"]}
