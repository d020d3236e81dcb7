"""Grafana dashboards of the testbed's worker metrics, generated from code.

`testbed dashboards` rewrites `grafana/dashboards/*.json`; `--check` exits 1 (and
names the files) when the committed JSON differs from what this module generates. Each
dashboard is one function returning Grafana's dashboard JSON as plain dicts; the panels, the
targets and the variables come from the shared helpers below, so every query filters by the
same three variables (`scenario`, `run`, `worker`) and every panel reads the one provisioned
datasource (`DATASOURCE_UID`, grafana/provisioning/datasources/prometheus.yaml).

`scenario` and `run` are the labels a scrape target gets from the run's
`prometheus-targets.json` (file_sd, `testbed.cluster.relay.MetricsRelay.targets`) or from the
Compose project's static config; `worker` selects the `rank` label every metric carries.
Every dashboard also marks the fault timeline's events as annotations (`annotations`), from
`testbed_fault_event_timestamp_seconds`. docs/grafana.md describes every panel and annotation;
grafana/schema/ holds the dashboard schema of the Grafana version the dashboards are written
for, which tests/unit/test_dashboard_schema.py checks them against.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_DIR = ROOT / "grafana" / "dashboards"
DATASOURCE_UID = "testbed-prometheus"
DATASOURCE = {"type": "prometheus", "uid": DATASOURCE_UID}
SCHEMA_VERSION = 39  # Grafana 11
VARIABLES = ("scenario", "run", "worker")
# Every selector carries these matchers: the variables, `worker` being the metrics' rank.
FILTER = 'scenario=~"$scenario", run=~"$run", rank=~"$worker"'
RATE = "$__rate_interval"
WIDTH, HEIGHT, COLUMNS = 12, 8, 2  # a panel's grid size (24 columns); panels per row

# -- PromQL ------------------------------------------------------------------------------------


def sel(metric: str, **matchers: str) -> str:
    """`metric{scenario=~"$scenario", run=~"$run", rank=~"$worker", k="v"...}`."""
    extra = "".join(f', {key}="{value}"' for key, value in matchers.items())
    return f"{metric}{{{FILTER}{extra}}}"


def rate(metric: str, by: str, window: str = RATE, fn: str = "rate", **matchers: str) -> str:
    """`sum by (by) (fn(selector[window]))`."""
    return f"sum by ({by}) ({fn}({sel(metric, **matchers)}[{window}]))"


def quantile(q: float, histogram: str, by: str, **matchers: str) -> str:
    """The q-quantile of a histogram (its name without `_bucket`) per `by`."""
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', f'le, {by}', **matchers)})"


def mean(histogram: str, by: str, **matchers: str) -> str:
    """Mean observation of a histogram per `by` over the rate window."""
    return (f"{rate(histogram + '_sum', by, **matchers)}\n  / "
            f"{rate(histogram + '_count', by, **matchers)}")


def ratio(part: str, whole: Sequence[str], by: str, **matchers: str) -> str:
    """rate(part) / sum of rate(whole...) per `by` (the part is usually one of the whole)."""
    denominator = "\n    + ".join(rate(name, by, **matchers) for name in whole)
    return f"{rate(part, by, **matchers)}\n  / ({denominator})"


# -- panels ------------------------------------------------------------------------------------


def target(expr: str, legend: str = "", **extra: Any) -> dict[str, Any]:
    """A Prometheus query of a panel (refIds are given by `panel`)."""
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto",
            "range": True, "instant": False, **extra}


def panel(title: str, description: str, targets: Sequence[dict[str, Any]], *,
          unit: str = "short", kind: str = "timeseries", minimum: float | None = None,
          maximum: float | None = None, options: Mapping[str, Any] | None = None,
          custom: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A panel without its place (`layout` gives ids and gridPos)."""
    defaults: dict[str, Any] = {"unit": unit}
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if custom:
        defaults["custom"] = dict(custom)
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": dict(options) if options is not None else {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def heatmap(title: str, description: str, histogram: str) -> dict[str, Any]:
    """A histogram's observations per rate window as a heatmap, bucket by bucket."""
    expr = rate(histogram + "_bucket", "le", fn="increase")
    return panel(title, description, [target(expr, "{{le}}", format="heatmap")], unit="s",
                 kind="heatmap", options={
                     "calculate": False,
                     "yAxis": {"unit": "s", "axisPlacement": "left"},
                     "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                     "cellGap": 1,
                     "tooltip": {"mode": "single", "yHistogram": True},
                     "legend": {"show": True},
                 })


def table(title: str, description: str, expr: str) -> dict[str, Any]:
    """The latest value of each series, one row per series."""
    return panel(title, description, [target(expr, format="table", instant=True,
                                             range=False)],
                 kind="table", options={"showHeader": True, "cellHeight": "sm"})


def layout(panels: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ids 1..n and a grid of COLUMNS panels per row, in order."""
    return [{"id": i + 1,
             "gridPos": {"h": HEIGHT, "w": WIDTH, "x": (i % COLUMNS) * WIDTH,
                         "y": (i // COLUMNS) * HEIGHT},
             **p} for i, p in enumerate(panels)]


def variable(name: str, label: str, query: str, *, sort: int,
             all_by_default: bool = True) -> dict[str, Any]:
    """A multi-value query variable with All (`.*`), refreshed when the time range changes;
    All is selected at first, or else the first value in `sort` order."""
    # Without `current`, Grafana selects the first value once it has the options.
    current = ({"current": {"selected": True, "text": ["All"], "value": ["$__all"]}}
               if all_by_default else {})
    return {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "definition": query,
        "query": {"qryType": 1, "query": query,
                  "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2, "regex": "", "sort": sort, "multi": True, "includeAll": True,
        "allValue": ".*", **current, "options": [], "hide": 0,
    }


def variables() -> list[dict[str, Any]]:
    """scenario, run (newest first: run directories end with their UTC start), worker."""
    base = "testbed_steps_total"
    return [
        variable("scenario", "Scenario", f"label_values({base}, scenario)", sort=1),
        variable("run", "Run", f'label_values({base}{{scenario=~"$scenario"}}, run)', sort=2,
                 all_by_default=False),
        variable("worker", "Worker",
                 f'label_values({base}{{scenario=~"$scenario", run=~"$run"}}, rank)', sort=3),
    ]


# -- annotations: the fault timeline --------------------------------------------------------

FAULTS = "testbed_fault_event_timestamp_seconds"
ANNOTATION_STEP = "2s"  # the scrape interval of the provisioned datasource (timeInterval)
# Each annotation marks some of the timeline's actions (testbed.scenario.timeline.ACTIONS, and
# ramp_step, a ramp's later updates): name, colour, actions.
FAULT_ANNOTATIONS = (
    ("Link changes", "orange", ("set_link", "ramp_link", "ramp_step", "partition", "heal")),
    ("Kills and restarts", "red", ("kill", "restart")),
    ("Straggler bursts", "purple", ("straggler_burst",)),
)


def fault_annotation(name: str, color: str, actions: Sequence[str]) -> dict[str, Any]:
    """The timeline's events of `actions` as Grafana annotations: one per event, at the time
    it took effect. The metric's value is that time (Grafana's "series value as timestamp",
    in ms); every worker exports every event, hence the max over the selected workers;
    `last_over_time` over the rate window so that no query step misses a value (the series
    of a worker that stopped ends with it)."""
    selector = f'{FAULTS}{{{FILTER}, action=~"{"|".join(actions)}"}}'
    expr = (f"max by (scenario, run, action, target) "
            f"(last_over_time({selector}[{RATE}])) * 1000")
    return {
        "name": name, "datasource": DATASOURCE, "enable": True, "hide": False,
        "iconColor": color, "expr": expr, "step": ANNOTATION_STEP, "useValueForTime": True,
        "titleFormat": "{{action}} {{target}}", "textFormat": "{{scenario}}, run {{run}}",
        "tagKeys": "action",
    }


def annotations() -> list[dict[str, Any]]:
    """Every dashboard's: the faults are read against whatever panel shows their effect."""
    return [fault_annotation(*spec) for spec in FAULT_ANNOTATIONS]


def dashboard(uid: str, title: str, description: str,
              panels: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["testbed"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "timezone": "utc",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "templating": {"list": variables()},
        "annotations": {"list": annotations()},
        "links": [{"type": "dashboards", "tags": ["testbed"], "title": "Testbed",
                   "icon": "external link", "tooltip": "", "asDropdown": True,
                   "targetBlank": False, "includeVars": True, "keepTime": True}],
        "panels": layout(panels),
    }


WORKER = "worker {{rank}}"
LINK = "{{peer}} → {{rank}}"

# -- the dashboards ----------------------------------------------------------------------------


def overview() -> dict[str, Any]:
    return dashboard("testbed-overview", "Testbed: overview", "Training progress, step time "
                     "and the collective's throughput of a run, per worker.", [
        panel("Training loss", "Mean cross-entropy (nats) of each step's micro-batches, and "
              "of the last held-out evaluation.",
              [target(sel("testbed_loss", split="train"), WORKER),
               target(sel("testbed_loss", split="eval"), WORKER + " eval")]),
        panel("Perplexity", "exp(loss) of the step (train) and the evaluation's perplexity.",
              [target(sel("testbed_perplexity", split="train"), WORKER),
               target(sel("testbed_perplexity", split="eval"), WORKER + " eval")]),
        panel("Held-out accuracy", "Accuracy of the last evaluation (job.eval_every).",
              [target(sel("testbed_accuracy_ratio", split="eval"), WORKER)],
              unit="percentunit", minimum=0, maximum=1),
        panel("Steps per second", "Training steps completed per second.",
              [target(rate("testbed_steps_total", "rank"), WORKER)], unit="ops"),
        panel("Step time", "p50 and p90 of the whole step, per worker.",
              [target(quantile(0.5, "testbed_step_duration_seconds", "rank"), WORKER + " p50"),
               target(quantile(0.9, "testbed_step_duration_seconds", "rank"), WORKER + " p90")],
              unit="s"),
        panel("Compute and wait", "Mean compute time of a step (forward, backward, injected "
              "delay) and mean time after it (the collective and the update).",
              [target(mean("testbed_compute_duration_seconds", "rank"), WORKER + " compute"),
               target(mean("testbed_wait_duration_seconds", "rank"), WORKER + " wait")],
              unit="s"),
        panel("Collective throughput", "Bytes the collective sent and received per second, "
              "all selected workers, per collective.",
              [target(rate("testbed_collective_sent_bytes_total", "collective"),
                      "{{collective}} sent"),
               target(rate("testbed_collective_received_bytes_total", "collective"),
                      "{{collective}} received")], unit="Bps"),
        panel("All-reduce time", "p50 and p90 duration of an all-reduce call, per collective.",
              [target(quantile(0.5, "testbed_collective_duration_seconds", "collective"),
                      "{{collective}} p50"),
               target(quantile(0.9, "testbed_collective_duration_seconds", "collective"),
                      "{{collective}} p90")], unit="s"),
        panel("All-reduce calls", "All-reduce calls per second, per worker and collective.",
              [target(rate("testbed_collective_calls_total", "rank, collective"),
                      WORKER + " {{collective}}")], unit="ops"),
        panel("Coverage", "Fraction of the (peer, element) contributions in the last result: "
              "1 for exact collectives, below 1 when the lossy or Moshpit averaging missed "
              "peers.", [target(sel("testbed_collective_coverage_ratio"),
                                WORKER + " {{collective}}")],
              unit="percentunit", minimum=0, maximum=1),
        panel("Last step", "Number of the last step each worker completed.",
              [target(sel("testbed_step"), WORKER)]),
    ])


def network() -> dict[str, Any]:
    lost = "testbed_datagrams_lost_total"
    received = "testbed_datagrams_received_total"
    measured = (f"{ratio(lost, [lost, received], 'rank, peer')}\n"
                f"or 0 * {rate(received, 'rank, peer')}")
    return dashboard("testbed-network", "Testbed: network", "Each link as configured (netem "
                     "profile) and as the transport measured it, and TCP's retransmits.", [
        panel("Configured loss per link", "Mean loss of the netem profile the worker was "
              "started with, per incoming link (peer → worker).",
              [target(sel("testbed_link_loss_ratio", direction="in"), LINK)],
              unit="percentunit", minimum=0),
        panel("Measured loss per link", "Datagrams lost / (lost + received) per incoming "
              "link, from the gaps in the peer's sequence numbers; 0 where nothing was lost.",
              [target(measured, LINK)], unit="percentunit", minimum=0),
        panel("Configured delay per link", "Mean one-way delay and jitter of the netem "
              "profile, per incoming link.",
              [target(sel("testbed_link_delay_seconds", direction="in"), LINK + " delay"),
               target(sel("testbed_link_jitter_seconds", direction="in"), LINK + " jitter")],
              unit="s", minimum=0),
        table("Link profiles", "The netem profile of each link, as netem writes it.",
              sel("testbed_link_profile_info")),
        panel("Datagrams lost", "Datagrams per second that never came, per incoming link.",
              [target(rate(lost, "rank, peer"), LINK)], unit="pps"),
        panel("Datagrams late", "Datagrams per second that came after their step had closed "
              "(the deadline was too short, or the sender a straggler).",
              [target(rate("testbed_datagrams_late_total", "rank, peer"), LINK)], unit="pps"),
        panel("Chunks missing at the deadline", "Lossy all-reduce: chunks per second from "
              "each peer that were not there by the deadline (lost, late or malformed).",
              [target(rate("testbed_collective_chunks_missing_total", "rank, peer"), LINK)],
              unit="short"),
        panel("Lossy deadlines", "The gather and broadcast deadlines of the last call (0: a "
              "broadcast over TCP).",
              [target(sel("testbed_collective_deadline_seconds"), WORKER + " {{phase}}")],
              unit="s"),
        panel("Lossy resyncs", "Calls per rate window whose broadcast went over TCP "
              "(resync_every): the lossy all-reduce's only repair.",
              [target(rate("testbed_collective_resyncs_total", "rank", fn="increase"),
                      WORKER)]),
        panel("TCP retransmits per worker", "Segments per second the worker's namespace "
              "retransmitted (every TCP socket), and the retransmit ratio.",
              [target(rate("testbed_netns_tcp_retransmitted_segments_total", "rank"),
                      WORKER + " segments/s"),
               target(ratio("testbed_netns_tcp_retransmitted_segments_total",
                            ["testbed_netns_tcp_sent_segments_total"], "rank"),
                      WORKER + " ratio")]),
        panel("TCP retransmits per socket", "Segments per second retransmitted by the "
              "collective's own sockets (the ring's two, from TCP_INFO).",
              [target(rate("testbed_collective_tcp_retransmitted_segments_total",
                           "rank, collective"), WORKER + " {{collective}}")]),
        panel("Transport throughput", "Bytes per second each worker sent through its "
              "transport, by protocol (in a cluster run: the lossy all-reduce's UDP).",
              [target(rate("testbed_transport_sent_bytes_total", "rank, protocol"),
                      WORKER + " {{protocol}}")], unit="Bps"),
        panel("Background flows", "Bits per second each background flow (the scenario's "
              "traffic:, iperf3) delivered into the worker, beside the job's own traffic on "
              "the same links.",
              [target(f"8 * {rate('testbed_traffic_received_bytes_total', 'rank, peer, flow')}",
                      "{{flow}} (" + LINK + ")")], unit="bps", minimum=0),
        panel("Background flows sending", "1 while a background flow sends into the worker, "
              "and the datagrams per second a UDP flow lost.",
              [target(f"max by (rank, peer, flow) ({sel('testbed_traffic_active')})",
                      "{{flow}} on"),
               target(rate("testbed_traffic_lost_datagrams_total", "rank, peer, flow"),
                      "{{flow}} lost/s")], minimum=0),
        panel("Host receive-buffer drops", "UDP datagrams per second the kernel dropped for "
              "full receive buffers in the worker's namespace: the host's loss, not the "
              "network's.",
              [target(rate("testbed_netns_udp_receive_buffer_errors_total", "rank"), WORKER)],
              unit="pps"),
    ])


def drift() -> dict[str, Any]:
    return dashboard("testbed-drift", "Testbed: parameter drift", "How far each worker's "
                     "parameters are from the workers' mean, from random projections.", [
        panel("Relative drift per worker", "Estimated L2 distance of the worker's parameters "
              "from the reference, divided by the reference's norm (0: in step).",
              [target(sel("testbed_parameter_drift_ratio"), WORKER + " ({{reference}})")],
              unit="percentunit", minimum=0),
        panel("Worst relative drift", "The largest relative drift among the selected "
              "workers.",
              [target(f"max by (reference) ({sel('testbed_parameter_drift_ratio')})",
                      "max ({{reference}})")], unit="percentunit", minimum=0),
        panel("Absolute drift", "Estimated L2 distance from the reference, in parameter units.",
              [target(sel("testbed_parameter_drift"), WORKER + " ({{reference}})")],
              minimum=0),
        panel("Reference norm", "Estimated L2 norm of the reference parameters.",
              [target(sel("testbed_parameter_reference_norm"), WORKER + " ({{reference}})")]),
        panel("Drift measurements", "Measurements taken (metrics.drift_every); a worker "
              "that stops counting missed the exchange.",
              [target(sel("testbed_parameter_drift_measurements_total"),
                      WORKER + " ({{reference}})")]),
        panel("What the lossy all-reduce delivered", "Fraction of the contributions to the "
              "worker's own shard that came in time, and of the other owners' broadcast "
              "chunks: below 1, the copies drift apart.",
              [target(sel("testbed_collective_shard_coverage_ratio"), WORKER + " shard"),
               target(sel("testbed_collective_broadcast_received_ratio"),
                      WORKER + " broadcast")], unit="percentunit", minimum=0, maximum=1),
    ])


def stragglers() -> dict[str, Any]:
    micro = "testbed_micro_batches_total"
    dropped = "testbed_micro_batches_dropped_total"
    return dashboard("testbed-stragglers", "Testbed: stragglers", "Who waits for whom: "
                     "injected delay, compute time, the wait for the slowest peer, and what "
                     "DropCompute drops.", [
        heatmap("Straggler wait", "How long steps waited for the slowest peer (slowest "
                "compute minus own), per bucket, all selected workers.",
                "testbed_straggler_wait_seconds"),
        panel("Straggler wait per worker", "p50 and p90 of the wait for the slowest peer.",
              [target(quantile(0.5, "testbed_straggler_wait_seconds", "rank"), WORKER + " p50"),
               target(quantile(0.9, "testbed_straggler_wait_seconds", "rank"),
                      WORKER + " p90")], unit="s"),
        panel("Injected delay", "Straggler delay injected into the worker's compute, as a "
              "fraction of the wall-clock time (seconds per second).",
              [target(rate("testbed_injected_delay_seconds_total", "rank"), WORKER)],
              unit="percentunit"),
        panel("Compute time", "p90 compute time of a step per worker.",
              [target(quantile(0.9, "testbed_compute_duration_seconds", "rank"), WORKER)],
              unit="s"),
        panel("DropCompute drop rate", "Micro-batches dropped / (computed + dropped).",
              [target(ratio(dropped, [micro, dropped], "rank"), WORKER)],
              unit="percentunit", minimum=0, maximum=1),
        panel("DropCompute threshold", "The compute-time threshold in force (absent: no "
              "DropCompute, or auto still warming up).",
              [target(sel("testbed_dropcompute_threshold_seconds"), WORKER)], unit="s"),
        panel("Micro-batches", "Micro-batches per second computed and dropped.",
              [target(rate(micro, "rank"), WORKER + " computed"),
               target(rate(dropped, "rank"), WORKER + " dropped")]),
        panel("Mean wait after compute", "Mean time from the end of compute to the end of "
              "the step: what the stragglers cost the others.",
              [target(mean("testbed_wait_duration_seconds", "rank"), WORKER)], unit="s"),
    ])


def moshpit() -> dict[str, Any]:
    rounds = "testbed_collective_rounds_total"
    incomplete = "testbed_collective_incomplete_rounds_total"
    collective = {"collective": "moshpit"}
    return dashboard("testbed-moshpit", "Testbed: Moshpit", "Moshpit averaging: rounds, "
                     "rounds with a member missing, missing peers and workers that came back.",
                     [
        panel("Averaging rounds", "Rounds per second each worker averaged in.",
              [target(rate(rounds, "rank", **collective), WORKER)], unit="ops"),
        panel("Incomplete rounds", "Fraction of the rounds with a group member missing.",
              [target(ratio(incomplete, [rounds], "rank", **collective), WORKER)],
              unit="percentunit", minimum=0, maximum=1),
        panel("Peers missing", "Peers left out of the last call.",
              [target(sel("testbed_collective_peers_missing", **collective), WORKER)]),
        panel("Calls without a peer", "Calls per rate window that left each peer out (its "
              "group went on without it).",
              [target(rate("testbed_collective_peer_missing_total", "rank, peer",
                           fn="increase", **collective), "{{rank}} without {{peer}}")]),
        panel("Rejoins", "Times each worker's process started again (a restart after a "
              "preemption), in the time range: resets of its step counter.",
              [target(rate("testbed_steps_total", "rank", window="$__range", fn="resets"),
                      WORKER)], unit="short", minimum=0),
        panel("Coverage", "Fraction of the contributions in the last averaging.",
              [target(sel("testbed_collective_coverage_ratio", **collective), WORKER)],
              unit="percentunit", minimum=0, maximum=1),
    ])


DASHBOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "overview": overview, "network": network, "drift": drift, "stragglers": stragglers,
    "moshpit": moshpit,
}


def render(build: Callable[[], dict[str, Any]]) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def generated() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{name}.json": render(build) for name, build in DASHBOARDS.items()}


# -- Grafana's variables, for running a panel's query without Grafana ---------------------------

_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


def regex_value(values: str | Sequence[str]) -> str:
    """A variable's value as Grafana writes it into a Prometheus regex matcher: escaped, and
    several values as `(a|b)`."""
    if isinstance(values, str):
        return _REGEX_SPECIAL.sub(r"\\\\\1", values)
    escaped = [regex_value(v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def rate_interval(interval: float, scrape_interval: float) -> float:
    """Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval)."""
    return max(interval + scrape_interval, 4 * scrape_interval)


def substitute(expr: str, values: Mapping[str, str | Sequence[str]], *, interval: float,
               scrape_interval: float, range_seconds: float) -> str:
    """`expr` with Grafana's variables replaced as Grafana would: the dashboard's (`values`,
    regex-escaped, `.*` for All) and $__interval, $__rate_interval, $__range (seconds). A
    variable left unknown raises ValueError."""
    builtin = {
        "__rate_interval": f"{rate_interval(interval, scrape_interval):g}s",
        "__interval_ms": f"{round(interval * 1000)}",
        "__interval": f"{interval:g}s",
        "__range_s": f"{round(range_seconds)}",
        "__range": f"{round(range_seconds)}s",
    }

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in builtin:
            return builtin[name]
        if name in values:
            value = values[name]
            return ".*" if value == "$__all" else regex_value(value)
        raise ValueError(f"unknown variable ${name} in {expr!r}")

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


# -- writing ----------------------------------------------------------------------------------


def write(out: Path = DASHBOARD_DIR, *, check: bool = False) -> int:
    """`testbed dashboards`: write every dashboard's JSON into `out`; with `check`, write
    nothing and return 1 if the committed JSON differs from the code (0 if not)."""
    files = generated()
    if check:
        stale = sorted(name for name, text in files.items()
                       if not (out / name).exists() or (out / name).read_text() != text)
        extra = sorted(p.name for p in out.glob("*.json") if p.name not in files)
        for name in stale:
            print(f"{out / name}: differs from testbed/dashboards.py", file=sys.stderr)
        for name in extra:
            print(f"{out / name}: no dashboard generates it", file=sys.stderr)
        if stale or extra:
            print("run: testbed dashboards", file=sys.stderr)
            return 1
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
        print(out / name)
    return 0
