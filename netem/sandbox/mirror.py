"""The Debian mirror this host's apt uses, so that the sandbox fetches from it too.

The sandbox downloads its kernel and a glibc from Debian with an apt state of its own. Rather
than name a mirror, it takes the archive the host is configured with (a local mirror, a proxy
or a snapshot works as well as the public one), or `$TESTBED_APT_MIRROR` when that is set.
Both of apt's formats are read: deb822 `*.sources` files and one-line `*.list` files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

OVERRIDE = "TESTBED_APT_MIRROR"
APT_DIR = Path("/etc/apt")

# (URI, suites, components) of one `deb` source.
Source = tuple[str, list[str], list[str]]


def source_files(apt_dir: Path = APT_DIR) -> list[Path]:
    """Where apt reads its sources, in its order: sources.list, then sources.list.d by name."""
    parts = apt_dir / "sources.list.d"
    found = [*parts.glob("*.list"), *parts.glob("*.sources")] if parts.is_dir() else []
    return [apt_dir / "sources.list", *sorted(found)]


def apt_mirror(
    paths: Sequence[Path] | None = None, env: Mapping[str, str] | None = None
) -> str:
    """The archive to fetch Debian packages from: `$TESTBED_APT_MIRROR` if set (in `env`, default
    this process's environment), else the URI of the first `deb` source in `paths` (default
    `source_files()`) that serves a release's `main` component. A release is a suite without
    `-` or `/`: `bookworm`, `sid`, `stable`, not `bookworm-security` or `bookworm-updates`.

    Raises LookupError, naming the files read, when there is none.
    """
    env = os.environ if env is None else env
    if env.get(OVERRIDE, "").strip():
        return env[OVERRIDE].strip()
    paths = source_files() if paths is None else paths
    for path in paths:
        try:
            text = path.read_text()
        except (FileNotFoundError, IsADirectoryError):
            continue
        parse = _deb822 if path.suffix == ".sources" else _one_line
        for uri, suites, components in parse(text):
            if "main" in components and any(suite.isalpha() for suite in suites):
                return uri
    looked = ", ".join(str(path) for path in paths) or "no files"
    raise LookupError(
        f"no Debian mirror found: no `deb` source with a release's main component in {looked}; "
        f"set {OVERRIDE} to the mirror's URI"
    )


def _one_line(text: str) -> Iterator[Source]:
    """`deb [options] URI SUITE COMPONENT...` lines (sources.list(5), one-line style)."""
    for line in text.splitlines():
        words = line.partition("#")[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):  # options, which may contain spaces
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if len(words) >= 2:
            yield words[0], [words[1]], words[2:]


def _deb822(text: str) -> Iterator[Source]:
    """Stanzas of `Types:`, `URIs:`, `Suites:`, `Components:` (sources.list(5), deb822 style)."""
    for stanza in _stanzas(text):
        uris = stanza.get("uris", "").split()
        if (
            "deb" in stanza.get("types", "").split()
            and stanza.get("enabled", "yes").strip().lower() != "no"
            and uris
        ):
            yield uris[0], stanza.get("suites", "").split(), stanza.get("components", "").split()


def _stanzas(text: str) -> Iterator[dict[str, str]]:
    """deb822 paragraphs as {lower-case field: value}; continuation lines join their field."""
    fields: dict[str, str] = {}
    field = None
    for line in [*text.splitlines(), ""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                yield fields
            fields, field = {}, None
        elif line[0].isspace() and field is not None:
            fields[field] += " " + line.strip()
        elif ":" in line:
            name, _, value = line.partition(":")
            field = name.strip().lower()
            fields[field] = value.strip()
