"""What this host can do for link shaping, found by trying rather than by reading kernel configs.

A qdisc may be built in, a loadable module, missing, or refused inside a container; the only
reliable answer is to add one. Kernel features are tried in a throwaway network namespace
(`tbcap-…`, always removed), so nothing on the host changes. Where no namespace can be made
(a container with CAP_NET_ADMIN but not CAP_SYS_ADMIN, as Compose workers are), they are tried
in this process's own namespace on throwaway interfaces and an nft table of their own (named
`tbcap…` too, always removed): what a container can shape is what its own namespace allows.
Results are cached per process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

from pyroute2 import IPRoute, NetNS, netns
from pyroute2.netlink.exceptions import NetlinkError

from netem.extras import MissingExtra, require
from netem.sandbox import cached_kernel, default_cache_dir, describe

NETNS_PREFIX = "tbcap-"
KERNEL_FEATURES = (
    "netns", "veth", "ifb", "netem", "htb", "tbf", "u32", "ingress", "mirred", "nftables", "numgen",
)
ETH_P_ALL, ETH_P_IP = 0x0003, 0x0800


@dataclass(frozen=True)
class Capabilities:
    """Each field: does it work here. `details` says why not (or what was found) per field."""

    root: bool
    netns: bool
    veth: bool
    ifb: bool
    netem: bool
    htb: bool
    tbf: bool
    u32: bool
    ingress: bool
    mirred: bool
    nftables: bool
    numgen: bool
    docker_engine: bool
    compose: bool
    uml_kernel: bool
    details: dict[str, str] = field(default_factory=dict, compare=False)

    def items(self) -> Iterator[tuple[str, bool]]:
        """(name, available) for every capability, in declaration order."""
        for f in fields(self):
            if f.name != "details":
                yield f.name, getattr(self, f.name)


_kernel: tuple[dict[str, bool], dict[str, str]] | None = None
_detected: Capabilities | None = None


def detect(*, refresh: bool = False) -> Capabilities:
    """Every capability, found by trying; cached for the life of the process."""
    global _detected
    if _detected is None or refresh:
        kernel, kernel_details = probe_kernel(refresh=refresh)
        found, details = dict(kernel), dict(kernel_details)
        for name, probe in (
            ("docker_engine", _docker_engine),
            ("compose", _compose),
            ("uml_kernel", _uml_kernel),
        ):
            found[name], details[name] = probe()
        _detected = Capabilities(root=os.geteuid() == 0, details=details, **found)
    return _detected


def netem_available() -> bool:
    """Whether a netem qdisc can be added on this kernel (tries it once per process)."""
    return probe_kernel()[0]["netem"]


def probe_kernel(*, refresh: bool = False) -> tuple[dict[str, bool], dict[str, str]]:
    """Try every kernel feature in a throwaway namespace: ({feature: works}, {feature: why})."""
    global _kernel
    if _kernel is None or refresh:
        _kernel = _probe_kernel()
    return _kernel


def _probe_kernel() -> tuple[dict[str, bool], dict[str, str]]:
    found = dict.fromkeys(KERNEL_FEATURES, False)
    details: dict[str, str] = {}
    if os.geteuid() != 0:
        details.update(dict.fromkeys(KERNEL_FEATURES, "not tried: needs root"))
        return found, details
    token = secrets.token_hex(3)
    name = f"{NETNS_PREFIX}{os.getpid()}-{token}"
    try:
        netns.create(name)
    except OSError as exc:
        details["netns"] = f"no network namespace ({exc}): tried in this one"
        _probe_here(f"tbcap{token}", found, details)
        return found, details
    try:
        found["netns"] = True
        with NetNS(name) as ns:
            _probe_tc(ns, found, details)
        _probe_nft(["ip", "netns", "exec", name], "tbcap", found, details)
    finally:
        with contextlib.suppress(FileNotFoundError):
            netns.remove(name)
    return found, details


def _probe_here(prefix: str, found: dict[str, bool], details: dict[str, str]) -> None:
    """The kernel features, tried in this process's own namespace on interfaces and an nft
    table named after `prefix`, all removed afterwards."""
    with IPRoute() as ip:
        try:
            _probe_tc(ip, found, details, names=(f"{prefix}a", f"{prefix}b", f"{prefix}i"))
        finally:
            for ifname in (f"{prefix}a", f"{prefix}i"):  # a veth goes with its peer
                for index in ip.link_lookup(ifname=ifname):
                    with contextlib.suppress(NetlinkError):
                        ip.link("del", index=index)
    try:
        _probe_nft([], prefix, found, details)
    finally:
        if found["nftables"]:
            subprocess.run(["nft", "delete", "table", "inet", prefix], capture_output=True,
                           timeout=30)


def remove_orphan_probes() -> list[str]:
    """Delete the namespaces of probes whose process is gone (a probe runs for a second; one
    left behind was killed mid-way). A running probe's namespace is left alone."""
    removed = []
    for name in netns.listnetns():
        if not name.startswith(NETNS_PREFIX):
            continue
        pid = name.removeprefix(NETNS_PREFIX).partition("-")[0]
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            continue
        with contextlib.suppress(FileNotFoundError):
            netns.remove(name)
            removed.append(name)
    return removed


def _probe_tc(ns: NetNS | IPRoute, found: dict[str, bool], details: dict[str, str],
              names: tuple[str, str, str] = ("a", "b", "i")) -> None:
    """veth a<->b and ifb i (`names`); netem on a, htb+u32 on b, tbf on i, a's ingress
    redirected to i."""
    a, b, i = names

    def index(ifname: str) -> int:
        return ns.link_lookup(ifname=ifname)[0]

    def veth() -> None:
        ns.link("add", ifname=a, kind="veth", peer={"ifname": b})
        for ifname in (a, b):
            ns.link("set", index=index(ifname), state="up")

    def ifb() -> None:
        ns.link("add", ifname=i, kind="ifb")
        ns.link("set", index=index(i), state="up")

    def netem() -> None:
        ns.tc("add", "netem", index=index(a), handle="1:", delay=1000)

    def htb() -> None:
        ns.tc("add", "htb", index=index(b), handle="1:", default=0x10)
        ns.tc("add-class", "htb", index=index(b), handle="1:10", parent="1:", rate="10mbit")

    def u32() -> None:
        ns.tc("add-filter", "u32", index=index(b), parent="1:", prio=1, protocol=ETH_P_IP,
              target="1:10", keys=["0x0/0x0+0"])

    def tbf() -> None:
        ns.tc("add", "tbf", index=index(i), handle="1:", rate="10mbit", burst=32000,
              latency="50ms")

    def ingress() -> None:
        ns.tc("add", "ingress", index=index(a))

    def mirred() -> None:
        redirect = {"kind": "mirred", "direction": "egress", "action": "redirect",
                    "ifindex": index(i)}
        ns.tc("add-filter", "u32", index=index(a), parent="ffff:", prio=1,
              protocol=ETH_P_ALL, target=0x1, keys=["0x0/0x0+0"], action=[redirect])

    steps: tuple[tuple[str, Callable[[], None], tuple[str, ...]], ...] = (
        ("veth", veth, ()),
        ("ifb", ifb, ()),
        ("netem", netem, ("veth",)),
        ("htb", htb, ("veth",)),
        ("u32", u32, ("htb",)),
        ("tbf", tbf, ("ifb",)),
        ("ingress", ingress, ("veth",)),
        ("mirred", mirred, ("ingress", "u32", "ifb")),
    )
    for feature, step, needs in steps:
        missing = [n for n in needs if not found[n]]
        if missing:
            details[feature] = f"not tried: needs {', '.join(missing)}"
            continue
        try:
            step()
        except NetlinkError as exc:
            details[feature] = _netlink_reason(exc)
        else:
            found[feature] = True


def _netlink_reason(exc: NetlinkError) -> str:
    if exc.code == errno.ENOENT:
        return "the kernel does not know this kind (not built, module not available)"
    if exc.code == errno.EPERM:
        return "refused: no CAP_NET_ADMIN here"
    return f"netlink error {exc.code}: {os.strerror(exc.code)}"


def _probe_nft(prefix: list[str], table: str, found: dict[str, bool],
               details: dict[str, str]) -> None:
    """An nft table `table` with a prerouting chain, and a numgen drop rule in it; `prefix`
    runs nft where the probe is (`ip netns exec NAME`, or nothing: here)."""
    if shutil.which("nft") is None:
        details["nftables"] = "the nft command is missing (Debian package nftables)"
        details["numgen"] = "not tried: needs nftables"
        return

    def nft(script: str) -> str | None:
        result = subprocess.run(
            [*prefix, "nft", "-f", "-"], input=script, capture_output=True, text=True,
            timeout=30,
        )
        return None if result.returncode == 0 else (result.stderr.strip() or "nft failed")

    error = nft(f"table inet {table} {{ chain pre {{ type filter hook prerouting priority raw; "
                "}; }\n")
    if error is not None:
        details["nftables"] = error.splitlines()[0]
        details["numgen"] = "not tried: needs nftables"
        return
    found["nftables"] = True
    error = nft(f"add rule inet {table} pre numgen random mod 100 < 10 drop\n")
    if error is None:
        found["numgen"] = True
    else:
        details["numgen"] = error.splitlines()[0]


def _docker_engine() -> tuple[bool, str]:
    try:  # slow to import; only the doctor needs it
        docker = require("docker", "compose", "talking to Docker Engine")
    except MissingExtra as error:
        return False, str(error)
    try:
        client = docker.from_env(timeout=3)
        with contextlib.closing(client):
            client.ping()
            return True, f"engine {client.version().get('Version', '?')}"
    except (docker.errors.DockerException, OSError):
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        return False, f"no engine answers at {where}"


def _compose() -> tuple[bool, str]:
    for argv, label in (
        (["docker", "compose", "version", "--short"], "v2 plugin"),
        (["docker-compose", "version", "--short"], "v1"),
    ):
        if shutil.which(argv[0]) is None:
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            result = subprocess.run(argv, capture_output=True, text=True, timeout=15)
            if result.returncode == 0:
                return True, f"{label} {result.stdout.strip()}"
    return False, "neither `docker compose` (v2) nor `docker-compose` (v1) works"


def _uml_kernel() -> tuple[bool, str]:
    kernel = cached_kernel()
    if kernel is None:
        return False, f"not prepared in {default_cache_dir()}"
    return True, describe(kernel)


# What each answer means for a user: (when available, when not).
CONSEQUENCES: dict[str, tuple[str, str]] = {
    "root": (
        "namespaces, qdiscs and nft rules can be set up",
        "run as root: namespaces and shaping need CAP_NET_ADMIN (kernel features not tried)",
    ),
    "netns": (
        "workers can run in network namespaces (netns placement)",
        "no namespaces: use Docker Compose placement",
    ),
    "veth": ("namespaces can be wired to a bridge", "labs of namespaces cannot be built"),
    "ifb": (
        "incoming traffic can be shaped on the receiver side",
        "ingress shaping impossible: only the sender's egress can be shaped",
    ),
    "netem": (
        "full shaping on this kernel: delay, jitter, reorder, duplicate, corrupt, bursty loss",
        "delay/jitter/reorder/duplicate/corrupt/bursty loss need the UML sandbox: "
        "`python -m netem.sandbox prepare`, then `python -m netem.sandbox run -- CMD` or "
        "`python -m netem.sandbox pytest`; on this host the fallback does random loss "
        "(nftables) and rate (htb/tbf) only",
    ),
    "htb": ("per-source rate classes (fallback rate shaping)", "no per-source rate classes"),
    "tbf": ("token-bucket rate limits", "no token-bucket rate limits"),
    "u32": (
        "traffic is classified by source address (pairwise links)",
        "links cannot be shaped per source",
    ),
    "ingress": ("incoming traffic can be intercepted", "no ingress hook: no receiver-side shaping"),
    "mirred": ("ingress traffic is redirected to an ifb", "no receiver-side shaping"),
    "nftables": (
        "random loss without netem (receiver-side drop rules)",
        "no loss without netem: install nftables, or use the UML sandbox",
    ),
    "numgen": ("`numgen random` drops a set fraction of packets", "no random loss through nft"),
    "docker_engine": (
        "containers can be started (compose placement)",
        "compose placement needs a running Docker engine (start dockerd); netns placement "
        "works without one",
    ),
    "compose": (
        "compose files can be brought up",
        "install Docker Compose: the v2 plugin, or Debian's docker-compose (v1)",
    ),
    "uml_kernel": (
        "the UML sandbox is ready: `python -m netem.sandbox run -- CMD`",
        "`python -m netem.sandbox prepare` fetches and verifies it once (about 40 MB, 15 s)",
    ),
}
