"""The sandbox's Debian mirror, read from apt's configuration: both formats, the override and
the error. Temporary files only; the host's own configuration is never read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from netem.sandbox.mirror import OVERRIDE, apt_mirror, source_files

DEB822 = """\
# Security updates come first here, but they are no release's archive.
Types: deb
URIs: http://security.invalid/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src deb
URIs: http://mirror.invalid/debian
  http://second.invalid/debian
Suites: bookworm bookworm-updates
Components: main contrib
"""

ONE_LINE = """\
deb-src http://sources.invalid/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] http://other.invalid/debian bookworm contrib
deb [ trusted=yes ] http://line.invalid/debian bookworm main non-free-firmware # a comment
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_deb822_takes_the_first_release_with_main(tmp_path):
    sources = write(tmp_path / "debian.sources", DEB822)
    assert apt_mirror([sources], env={}) == "http://mirror.invalid/debian"


def test_one_line_format_skips_sources_and_options(tmp_path):
    sources = write(tmp_path / "sources.list", ONE_LINE)
    assert apt_mirror([sources], env={}) == "http://line.invalid/debian"


def test_disabled_stanzas_and_missing_files_are_skipped(tmp_path):
    disabled = write(
        tmp_path / "a.sources",
        "Enabled: no\nTypes: deb\nURIs: http://off.invalid/debian\nSuites: sid\nComponents: main\n",
    )
    other = write(tmp_path / "b.sources", DEB822)
    assert apt_mirror([tmp_path / "missing.list", disabled, other], env={}) == (
        "http://mirror.invalid/debian"
    )


def test_files_are_read_in_apts_order(tmp_path):
    write(tmp_path / "sources.list", "# nothing here\n")
    write(tmp_path / "sources.list.d" / "b.list", ONE_LINE)
    write(tmp_path / "sources.list.d" / "a.sources", DEB822)
    write(tmp_path / "sources.list.d" / "c.list.disabled", "deb http://no.invalid/d sid main\n")
    files = source_files(tmp_path)
    assert [path.name for path in files] == ["sources.list", "a.sources", "b.list"]
    assert apt_mirror(files, env={}) == "http://mirror.invalid/debian"


def test_the_override_wins(tmp_path):
    sources = write(tmp_path / "debian.sources", DEB822)
    env = {OVERRIDE: " http://override.invalid/debian "}
    assert apt_mirror([sources], env=env) == "http://override.invalid/debian"


def test_no_mirror_names_the_files_and_the_override(tmp_path):
    security = write(tmp_path / "security.list", "deb http://s.invalid/d bookworm-security main\n")
    with pytest.raises(LookupError) as caught:
        apt_mirror([security, tmp_path / "missing.sources"], env={OVERRIDE: ""})
    message = str(caught.value)
    assert str(security) in message and str(tmp_path / "missing.sources") in message
    assert OVERRIDE in message


def test_the_command_prints_the_mirror(tmp_path):
    env = {"PATH": "/usr/bin:/bin", OVERRIDE: "http://override.invalid/debian"}
    result = subprocess.run(
        [sys.executable, "-m", "netem.sandbox", "mirror"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "http://override.invalid/debian\n"
