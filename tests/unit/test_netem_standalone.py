"""netem stands alone: every one of its modules imports in a Python where neither torch nor
testbed can be imported. The package is installed editable, so both are on the path; a fresh
interpreter refuses them with a finder of its own instead, and reports every attempt (an import
that a module wraps in try/except counts too). Imports inside functions, which only run later,
are found in the source."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import netem

FORBIDDEN = ("torch", "testbed")

CHILD = """
import importlib, json, pkgutil, sys

forbidden, attempts = set(sys.argv[1:]), []


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in forbidden:
            attempts.append(name)
            raise ImportError(f"{name} is not importable here")
        return None


sys.meta_path.insert(0, Refuse())
import netem

imported = ["netem"]
for module in pkgutil.walk_packages(netem.__path__, "netem."):
    if module.name != "netem.sandbox.__main__":  # runs the command line
        importlib.import_module(module.name)
        imported.append(module.name)
print(json.dumps({"imported": imported, "attempts": attempts}))
"""


def test_every_netem_module_imports_without_torch_or_testbed(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", CHILD, *FORBIDDEN],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["attempts"] == []
    expected = {
        "netem.probe", "netem.probe.wire", "netem.probe.engine", "netem.probe.analysis",
        "netem.plan", "netem.backend", "netem.lab", "netem.sandbox", "netem.sandbox.cli",
        "netem.sandbox.mirror", "netem.capabilities", "netem.namespace", "netem.tc",
    }
    assert expected <= set(report["imported"])


def test_no_netem_source_imports_torch_or_testbed_even_inside_a_function():
    found = []
    for path in sorted(Path(netem.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            found += [
                f"{path.name}:{node.lineno} {name}"
                for name in names
                if name.partition(".")[0] in FORBIDDEN
            ]
    assert found == []
