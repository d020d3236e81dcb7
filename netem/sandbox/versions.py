"""Which user-mode-linux and libc6 to fetch. sid moves: use the pins while the mirror has
them, else the newest (in Debian's order, as dpkg compares versions)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence

from netem.sandbox.errors import SandboxError

# What was verified to work here; `prepare` falls back to the newest when the mirror drops them.
PINNED_UML = "7.2um1"
PINNED_LIBC = "2.41-12+deb13u4"
SUITES = ("sid", "trixie")  # fetched from the host's mirror (`apt_mirror`)


def version_ge(a: str, b: str) -> bool:
    """Debian version order, as dpkg defines it."""
    return subprocess.run(["dpkg", "--compare-versions", a, "ge", b]).returncode == 0


def _newest(versions: Sequence[str]) -> str:
    newest = versions[0]
    for version in versions[1:]:
        if not version_ge(newest, version):
            newest = version
    return newest


def choose_uml(available: Sequence[str]) -> tuple[str, str | None]:
    """The user-mode-linux version to use, and a note when it is not the pinned one."""
    if not available:
        raise SandboxError(
            "choosing versions: the mirror lists no user-mode-linux package in sid"
        )
    if PINNED_UML in available:
        return PINNED_UML, None
    newest = _newest(available)
    return newest, f"user-mode-linux {PINNED_UML} is gone from the mirror; using {newest}"


def choose_libc(
    available: Sequence[tuple[str, str]], minimum: str | None
) -> tuple[str, str | None]:
    """The libc6 version (from (version, suite) pairs) to run the UML binary with, and a note
    when it is not the pinned one: the pin if listed and new enough, else the newest of trixie
    that is, else the newest of sid that is."""
    def enough(version: str) -> bool:
        return minimum is None or version_ge(version, minimum)

    if any(v == PINNED_LIBC for v, _ in available) and enough(PINNED_LIBC):
        return PINNED_LIBC, None
    for suite in SUITES[::-1]:
        fit = [v for v, s in available if s == suite and enough(v)]
        if fit:
            chosen = _newest(fit)
            return chosen, f"libc6 {PINNED_LIBC} is not usable here; using {chosen} ({suite})"
    raise SandboxError(
        f"choosing versions: no libc6 in {' or '.join(SUITES)} satisfies >= {minimum}"
    )


def parse_madison(text: str) -> list[tuple[str, str]]:
    """(version, suite) pairs from `apt-cache madison` output."""
    pairs = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 3 and fields[2]:
            pairs.append((fields[1], fields[2].split()[1].split("/")[0]))
    return pairs


def libc_minimum(control: str) -> str | None:
    """The `libc6 (>= X)` bound from a package's control fields, if any."""
    found = re.search(r"^(?:Pre-)?Depends:.*?\blibc6 \(>= ([^)]+)\)", control, re.MULTILINE)
    return found.group(1) if found else None

