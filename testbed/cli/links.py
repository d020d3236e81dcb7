"""A link: shape it (`shape`, like tcconfig), measure it with probe trains (`probe`), and both
end to end on this kernel and with full netem (`demo`)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.console import Console

from testbed.cli.render import (
    applied_line,
    demo_table,
    probe_summary,
    probe_table,
    replay_line,
    rules_table,
    trace_line,
)
from testbed.cli.sandbox import call_sandbox

if TYPE_CHECKING:
    from netem.profile import LinkProfile

commands = typer.Typer()
MAPPINGS = ("distribution", "slot")  # flags that take a YAML mapping (of a scenario's field)


def _set(name: str, what: str) -> typer.models.OptionInfo:
    """`--NAME`, a field of the link's profile."""
    return typer.Option(f"--{name}", help=what, show_default=False)


def _mapping_or_text(flag: str, value: str | None) -> object:
    """A flag's value: a YAML flow mapping (`{samples: rtt.txt, unit: ms}`, as a scenario file
    writes the field) as a mapping, anything else as it is."""
    import yaml

    if value is None or not value.lstrip().startswith("{"):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as error:
        raise ValueError(f"{flag}: not a YAML mapping: {error}") from None


def _expect(name: str, what: str) -> typer.models.OptionInfo:
    """`--expect-NAME`, a field of the profile the probes are checked against."""
    return _set(f"expect-{name}", f"Expected {what}.")


@commands.command()
def probe(
    source: Annotated[str, typer.Option("--from", help="Namespace (or /proc/PID/ns/net) the "
                                        "probes leave from.", show_default=False)],
    destination: Annotated[str, typer.Option("--to", help="Namespace of the receiver.",
                                             show_default=False)],
    address: Annotated[str, typer.Option("--to-address", help="The receiver's IPv4 address, "
                                         "inside --to.", show_default=False)],
    count: Annotated[int, typer.Option(min=1, help="Probes in the timed train.")] = 5000,
    interval: Annotated[str, typer.Option(help="Spacing of the probes, e.g. 400us.")] = "400us",
    size: Annotated[int, typer.Option(min=32, help="UDP payload bytes of a probe.")] = 128,
    rate_duration: Annotated[
        str | None,
        typer.Option(help="Length of the bulk train that measures the rate (0: none). "
                     "Default: 1s when a rate is expected, else none."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the end of a train.")] = 5.0,
    ecn: Annotated[
        bool | None,
        typer.Option("--ecn/--no-ecn", help="Send the timed train ECN-capable (ECT(0)) and count "
                     "the probes that arrive marked CE. Default: when the expected profile has "
                     "ecn.", show_default=False),
    ] = None,
    expect_profile: Annotated[
        typer.FileText | None,
        typer.Option(help="YAML mapping of a link profile (docs/profiles.md); --expect-* "
                     "flags override its fields.", show_default=False),
    ] = None,
    expect_delay: Annotated[str | None, _expect("delay", "delay, e.g. 20ms")] = None,
    expect_jitter: Annotated[str | None, _expect("jitter", "jitter, e.g. 5ms")] = None,
    expect_distribution: Annotated[
        str | None, _expect("distribution", "delay distribution (uniform, normal, ...)")
    ] = None,
    expect_loss: Annotated[str | None, _expect("loss", "random loss, e.g. 10%")] = None,
    expect_duplicate: Annotated[str | None, _expect("duplicate", "duplication")] = None,
    expect_corrupt: Annotated[str | None, _expect("corrupt", "corruption")] = None,
    expect_reorder: Annotated[str | None, _expect("reorder", "reordering")] = None,
    expect_rate: Annotated[str | None, _expect("rate", "rate, e.g. 10mbit")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result and the checks "
                                              "as JSON (docs/cli.md).")] = False,
) -> None:
    """Measure a link with probe trains: loss and its bursts, one-way delay, jitter, reordering,
    duplication, corruption and rate, beside what was expected. Exit code 1 if a check fails."""
    import yaml

    from netem.probe import ProbeError, compare, offered_load
    from netem.probe import probe as run_probe
    from netem.profile import LinkProfile, ProfileError
    from netem.units import parse_time

    flags = {
        "delay": expect_delay, "jitter": expect_jitter, "distribution": expect_distribution,
        "loss": expect_loss, "duplicate": expect_duplicate, "corrupt": expect_corrupt,
        "reorder": expect_reorder, "rate": expect_rate,
    }
    flags = {name: value for name, value in flags.items() if value is not None}
    try:
        spec = yaml.safe_load(expect_profile) if expect_profile else None
        if spec is not None and not isinstance(spec, dict):
            raise typer.BadParameter("expected a YAML mapping of profile fields",
                                     param_hint="--expect-profile")
        expected = LinkProfile.parse(spec, **flags) if spec or flags else None
        spacing = parse_time(interval)
        bulk = parse_time(rate_duration) if rate_duration is not None else (
            1.0 if expected is not None and expected.rate else 0.0
        )
    except (ProfileError, ValueError, yaml.YAMLError) as exc:
        typer.echo(f"testbed probe: {exc}", err=True)
        raise typer.Exit(2) from None
    offered = offered_load(expected) if expected is not None else None
    try:
        capable = ecn if ecn is not None else expected is not None and expected.ecn
        result = run_probe(source, destination, address, count=count, interval=spacing,
                           size=size, rate_duration=bulk, offered_rate=offered, timeout=timeout,
                           ecn=capable)
    except ProbeError as exc:
        typer.echo(f"testbed probe: {exc}", err=True)
        raise typer.Exit(2) from None
    checks = compare(expected or LinkProfile(), result)
    failed = expected is not None and any(check.passed is False for check in checks)
    if json_output:
        typer.echo(json.dumps({
            "result": dataclasses.asdict(result),
            "checks": [dataclasses.asdict(check) for check in checks] if expected else [],
            "passed": not failed}, indent=2, default=str))
        raise typer.Exit(1 if failed else 0)
    table, notes = probe_table(f"probe {source} -> {destination} ({address})", checks,
                               expected=expected is not None)
    console = Console()
    console.print(table)
    for number, note in enumerate(notes, start=1):
        console.print(f"({number}) {note}", style="dim")
    console.print(probe_summary(result))
    if failed:
        raise typer.Exit(1)


@commands.command()
def shape(
    iface: Annotated[str, typer.Argument(help="The interface to shape.", show_default=False)],
    netns: Annotated[
        str | None, typer.Option(help="Its network namespace (a name, or a path such as "
                                 "/proc/PID/ns/net). Default: this one.", show_default=False)
    ] = None,
    direction: Annotated[
        Literal["egress", "ingress"],
        typer.Option(help="egress: traffic leaving IFACE (e.g. the switch port towards the "
                     "receiver); ingress: traffic arriving on IFACE (through an ifb)."),
    ] = "egress",
    source: Annotated[
        str | None,
        typer.Option("--from", help="Shape only the traffic from this IPv4 address or network "
                     "(a pairwise link); the rules of other sources stay. Default: the rule "
                     "for everyone else.", show_default=False),
    ] = None,
    backend: Annotated[
        Literal["auto", "netem", "fallback"],
        typer.Option(help="netem; fallback (nftables loss, htb rate) for kernels without it; "
                     "auto: netem if this kernel has it."),
    ] = "auto",
    delay: Annotated[str | None, _set("delay", "Delay, e.g. 20ms.")] = None,
    jitter: Annotated[str | None, _set("jitter", "Delay variation, e.g. 5ms.")] = None,
    distribution: Annotated[
        str | None, _set("distribution", "Of the jitter: uniform, normal, pareto, paretonormal, "
                         "or made from measured delays: '{samples: FILE, unit: ms}'.")
    ] = None,
    delay_correlation: Annotated[
        str | None, _set("delay-correlation", "Of successive delays, e.g. 25%.")
    ] = None,
    loss: Annotated[str | None, _set("loss", "Random loss, e.g. 5%.")] = None,
    loss_correlation: Annotated[
        str | None, _set("loss-correlation", "Of successive losses, e.g. 25%.")
    ] = None,
    ge_p: Annotated[str | None, _set("ge-p", "Gilbert-Elliott bursty loss: good->bad.")] = None,
    ge_r: Annotated[str | None, _set("ge-r", "Gilbert-Elliott: bad->good.")] = None,
    ge_1_h: Annotated[str | None, _set("ge-1-h", "Gilbert-Elliott: loss when bad.")] = None,
    ge_1_k: Annotated[str | None, _set("ge-1-k", "Gilbert-Elliott: loss when good.")] = None,
    duplicate: Annotated[str | None, _set("duplicate", "Duplication, e.g. 1%.")] = None,
    corrupt: Annotated[str | None, _set("corrupt", "Corruption (a flipped bit), e.g. 1%.")] = None,
    reorder: Annotated[str | None, _set("reorder", "Packets sent early (needs a delay).")] = None,
    gap: Annotated[int | None, _set("gap", "Reorder every GAP-th packet.")] = None,
    ecn: Annotated[bool, typer.Option("--ecn", help="Mark ECN-capable packets instead of "
                                      "dropping them (needs a loss).")] = False,
    rate: Annotated[str | None, _set("rate", "Rate, e.g. 100mbit.")] = None,
    overhead: Annotated[int | None, _set("overhead", "Bytes added to each packet's size for "
                                         "the rate (negative: taken off).")] = None,
    cell_size: Annotated[int | None, _set("cell-size", "The rate is paid in whole cells of "
                                          "this many bytes (ATM: 48).")] = None,
    cell_overhead: Annotated[int | None, _set("cell-overhead", "Bytes added to every "
                                              "cell.")] = None,
    slot: Annotated[str | None, _set("slot", "Packets leave in slots: '{min_delay: 1ms, "
                                     "max_delay: 5ms, max_packets: 10}' (docs/profiles.md).")
                    ] = None,
    limit: Annotated[int | None, _set("limit", "Queue length in packets (1000).")] = None,
    seed: Annotated[int | None, _set("seed", "Seed of netem's random numbers: the same seed "
                                     "and traffic, the same decisions.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the equivalent tc/nft commands; needs no "
                           "root, touches nothing (the other sources' rules are not read).")
    ] = False,
    show_rules: Annotated[bool, typer.Option("--show", help="Print IFACE's rules.")] = False,
    clear_rules: Annotated[
        bool, typer.Option("--clear", help="Remove all shaping from IFACE.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    trace: Annotated[
        Path | None, typer.Option("--trace", help="Replay a link trace on IFACE (the other "
                                  "flags: the profile it moves) until it ends or Ctrl-C, then "
                                  "restore what was there. docs/conditions.md.",
                                  show_default=False)
    ] = None,
    trace_format: Annotated[
        Literal["mahimahi", "csv"] | None,
        typer.Option("--format", help="Of the trace. Default: csv for a .csv file, else "
                     "mahimahi.", show_default=False),
    ] = None,
    resolution: Annotated[
        str, typer.Option(help="How often the replay changes the link (10ms at least).")
    ] = "100ms",
    loop: Annotated[bool, typer.Option("--loop/--no-loop", help="Start the trace again at "
                                       "its end.")] = True,
) -> None:
    """Shape an interface with a link profile, per source (like tcconfig's tcset); --show reads
    it back from the kernel (tcshow), --clear removes it (tcdel); --trace replays a recorded
    link. docs/shaping.md."""
    from pyroute2.netlink.exceptions import NetlinkError

    from netem.backend import (
        ShapingError,
        UnsupportedByKernel,
        change,
        clear,
        show,
    )
    from netem.plan import build_plan, parse_source, render_commands, source_key
    from netem.profile import LinkProfile, ProfileError

    def fail(message: object, code: int) -> typer.Exit:
        typer.echo(f"testbed shape: {message}", err=True)
        return typer.Exit(code)

    fields = {
        "delay": delay, "jitter": jitter, "distribution": distribution,
        "delay_correlation": delay_correlation, "loss": loss, "loss_correlation": loss_correlation,
        "ecn": ecn or None, "duplicate": duplicate, "corrupt": corrupt, "reorder": reorder,
        "gap": gap, "rate": rate, "packet_overhead": overhead, "cell_size": cell_size,
        "cell_overhead": cell_overhead, "slot": slot, "limit": limit, "seed": seed,
    }
    spec: dict[str, object] = {name: value for name, value in fields.items() if value is not None}
    ge = {"p": ge_p, "r": ge_r, "1-h": ge_1_h, "1-k": ge_1_k}
    if any(value is not None for value in ge.values()):
        spec["gilbert_elliott"] = {name: value for name, value in ge.items() if value is not None}
    if dry_run + show_rules + clear_rules > 1:
        raise fail("--dry-run, --show and --clear exclude one another", 2)
    if trace is not None and (dry_run or show_rules or clear_rules or source is not None):
        raise fail("--trace replays on the whole interface: no --from, --dry-run, --show or "
                   "--clear with it", 2)
    if (show_rules or clear_rules) and (spec or source is not None):
        raise fail("--show and --clear take no profile and no --from", 2)
    try:
        key = None if source is None else source_key(parse_source(source))
    except ValueError:
        raise fail(f"--from: source {source!r} is not an IPv4 address or network, e.g. "
                   "198.18.0.1 or 198.18.0.0/24 (without --from: everyone else's traffic)",
                   2) from None
    if not (spec or show_rules or clear_rules or trace):
        raise fail("nothing to shape: give what the link does (--delay, --loss, --rate, ...); "
                   "--clear removes the shaping, --show prints it", 2)
    try:
        profile = LinkProfile.parse({name: _mapping_or_text(f"--{name}", value)
                                     if name in MAPPINGS else value
                                     for name, value in spec.items()})
        if dry_run:
            if backend == "auto":  # what the netem backend would do, unless told otherwise
                why = ("not root, so the kernel was not probed" if os.geteuid() != 0
                       else "a dry run does not probe the kernel")
                typer.echo(f"testbed shape: {why}: showing the netem backend (--backend "
                           "fallback shows the other)", err=True)
            chosen = "netem" if backend == "auto" else backend
            plan = build_plan(iface, {key: profile}, direction=direction, backend=chosen)
    except UnsupportedByKernel as exc:
        hint = "\n(--backend netem --dry-run prints the netem commands)" if dry_run else ""
        raise fail(f"{exc}{hint}", 2) from None
    except (ProfileError, ValueError) as exc:
        raise fail(exc, 2) from None
    if dry_run:
        command_lines = render_commands(plan, netns)
        if as_json:
            typer.echo(json.dumps({"backend": plan.backend, "commands": command_lines}, indent=2))
        else:
            typer.echo("\n".join(command_lines))
        return
    if os.geteuid() != 0:
        raise fail("shaping needs root (CAP_NET_ADMIN); --dry-run prints the commands without", 1)
    if trace is not None:
        _replay(iface, netns, profile, trace, fail, trace_format=trace_format,
                resolution=resolution, loop=loop, direction=direction, backend=backend,
                as_json=as_json)
        return
    try:
        if clear_rules:
            clear(iface, netns=netns)
            typer.echo(json.dumps({"iface": iface, "cleared": True}) if as_json
                       else f"{iface}: shaping removed")
            return
        if show_rules:
            _print_rules(iface, netns, show(iface, netns=netns), as_json=as_json)
            return
        rules = {**show(iface, netns=netns), key: profile}
        applied = change(iface, rules, netns=netns, direction=direction, backend=backend)
    except ProfileError as exc:
        raise fail(exc, 2) from None
    except (ShapingError, NetlinkError, OSError, ValueError) as exc:
        raise fail(exc, 1) from None
    _print_rules(iface, netns, applied.rules, as_json=as_json, applied={
        "backend": applied.backend, "direction": applied.direction, "device": applied.device,
        "in_place": applied.in_place, "offloads_disabled": applied.offloads_disabled,
    })


def _replay(
    iface: str,
    netns: str | None,
    profile: LinkProfile,
    trace: Path,
    fail: Callable[[object, int], typer.Exit],
    *,
    trace_format: Literal["mahimahi", "csv"] | None,
    resolution: str,
    loop: bool,
    direction: Literal["egress", "ingress"],
    backend: Literal["auto", "netem", "fallback"],
    as_json: bool,
) -> None:
    """`shape --trace`: replay until the trace ends or Ctrl-C (exit code 130), then restore."""
    from pyroute2.netlink.exceptions import NetlinkError

    from netem.backend import ShapingError, UnsupportedByKernel
    from netem.trace import Replay, TraceError, load_trace, schedule
    from netem.units import parse_time

    try:
        plan = schedule(load_trace(trace, trace_format), parse_time(resolution))
        replay = Replay(iface, profile, plan, netns=netns, loop=loop, direction=direction,
                        backend=backend)
    except (TraceError, ValueError) as exc:
        raise fail(exc, 2) from None
    summary = plan.describe()
    console = Console(stderr=as_json)
    console.print(trace_line(summary))
    interrupted = False
    try:
        with replay:
            try:
                while not replay.wait(0.5):  # the main thread stays where Ctrl-C lands
                    pass
            except KeyboardInterrupt:
                interrupted = True
    except UnsupportedByKernel as exc:
        raise fail(exc, 2) from None
    except (ShapingError, NetlinkError, OSError, ValueError) as exc:
        raise fail(exc, 1) from None
    if as_json:
        typer.echo(json.dumps({"iface": iface, "netns": netns,
                               "trace": dataclasses.asdict(summary),
                               "late": dataclasses.asdict(replay.late),
                               "interrupted": interrupted}, indent=2))
    else:
        console.print(replay_line(iface, replay.late, interrupted=interrupted))
    if interrupted:
        raise typer.Exit(130)


def _print_rules(
    iface: str, netns: str | None, rules: dict, *, as_json: bool, applied: dict | None = None
) -> None:
    """The rules of an interface as a table (or JSON), and how they were applied."""
    listing = [{"from": source, "profile": profile.to_spec()} for source, profile in rules.items()]
    if as_json:
        typer.echo(json.dumps({"iface": iface, "netns": netns, **(applied or {}),
                               "rules": listing}, indent=2))
        return
    console = Console()
    if not rules:
        console.print(f"{iface}: not shaped")
        return
    console.print(rules_table(iface, netns, rules))
    if applied is not None:
        console.print(applied_line(iface, applied))


@commands.command()
def demo() -> None:
    """The main job end to end: shape the links into one host of a 3-host lab per source, measure
    each with probe trains, on this kernel and then with full netem (in a UML guest if needed).
    Exit code 1 if a measured value misses its tolerance."""
    from testbed import demo as demonstration

    console = Console()
    started = time.monotonic()

    def say(line: str) -> None:
        console.log(line)
        status.update(f"[bold]{line}")

    with console.status("starting") as status:
        outcomes = call_sandbox(lambda: demonstration.run(say))
    elapsed = time.monotonic() - started
    console.print(demo_table(demonstration.summary_rows(outcomes), elapsed))
    failed = [f"{o.part}: {o.link}" for o in outcomes if not o.passed]
    if failed:
        console.print(f"[red]{len(failed)} link(s) missed a tolerance: {'; '.join(failed)}")
        raise typer.Exit(1)
    console.print(f"[green]all {len(outcomes)} links measured within tolerance")
