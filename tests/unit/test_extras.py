"""The extras: a feature whose package is missing says which extra brings it; the rest goes on
(a report is written without its plots). Checked in a child interpreter that cannot import
the package."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

WITHOUT = textwrap.dedent("""
    import sys

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == {package!r}:
                raise ImportError(name)
            return None

    sys.meta_path.insert(0, Refuse())
""")


def child(package: str, body: str) -> subprocess.CompletedProcess:
    code = WITHOUT.format(package=package) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_the_digits_models_name_their_extra():
    result = child("sklearn", """
        from netem.extras import MissingExtra
        from testbed.train.data import digits
        try:
            digits()
        except MissingExtra as error:
            print(error)
    """)
    assert result.returncode == 0, result.stderr
    assert "pip install 'netem-testbed[digits]'" in result.stdout


@pytest.mark.parametrize(("package", "extra"), [("docker", "compose")])
def test_the_doctor_says_what_talking_to_docker_needs(package, extra):
    result = child(package, """
        from netem.capabilities import _docker_engine
        print(_docker_engine())
    """)
    assert result.returncode == 0, result.stderr
    assert f"netem-testbed[{extra}]" in result.stdout


def test_a_report_without_matplotlib_is_written_without_its_plots(tmp_path):
    result = child("matplotlib", f"""
        from testbed.report import RunWriter
        from testbed.report.page import render_run

        writer = RunWriter.create({str(tmp_path / "run")!r}, scenario="name: r\\n", name="r")
        writer.finish(success=True)
        writer.close()
        print(render_run({str(tmp_path / "run")!r}).skipped)
    """)
    assert result.returncode == 0, result.stderr
    assert "netem-testbed[reports]" in result.stdout
    assert "<h2>Plots</h2>" in (tmp_path / "run" / "index.html").read_text()
