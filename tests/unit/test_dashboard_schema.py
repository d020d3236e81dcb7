"""Every dashboard against Grafana's own dashboard schema (grafana/schema/, README there): the
JSON Schema that scripts/grafana_schema.py derives from the vendored files is the committed one,
every grafana/dashboards/*.json is valid under it, and it rejects what Grafana's kind forbids
(an unknown panel property, a value of the wrong type), so the check can fail."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from jsonschema.exceptions import ValidationError

from testbed import dashboards

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = ROOT / "grafana" / "schema"
SCRIPT = ROOT / "scripts" / "grafana_schema.py"
SCHEMA = json.loads((SCHEMA_DIR / "dashboard.schema.json").read_text())
PUBLISHED = json.loads((SCHEMA_DIR / "dashboard.jsonschema.json").read_text())
BOARDS = {path.name: json.loads(path.read_text())
          for path in sorted((ROOT / "grafana" / "dashboards").glob("*.json"))}


def errors(board: dict[str, Any], schema: dict[str, Any] = SCHEMA) -> list[str]:
    """Every violation, as `path: message`."""
    jsonschema.Draft7Validator.check_schema(schema)
    return [f"{'/'.join(map(str, leaf.absolute_path))}: {leaf.message}"
            for error in jsonschema.Draft7Validator(schema).iter_errors(board)
            for leaf in leaves(error)]


def leaves(error: ValidationError) -> list[ValidationError]:
    """For a value that is none of some alternatives (a panel is a panel or a row), the errors
    of the alternative it misses least."""
    if not error.context:
        return [error]
    branches: dict[Any, list[ValidationError]] = {}
    for sub in error.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    return [leaf for sub in min(branches.values(), key=len) for leaf in leaves(sub)]


def test_the_committed_schema_is_derived_from_the_vendored_files():
    # --check also refuses a vendored file that is not the one published (pinned SHA-256).
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_dashboard_is_valid_under_grafanas_schema(name: str):
    assert not errors(BOARDS[name]), "\n".join(errors(BOARDS[name]))


def test_the_dashboards_are_written_for_the_schemas_grafana_version():
    # The schema version the kind defaults to is the one the dashboards declare; the Compose
    # project's Grafana (when it names one) is of the schema's minor version.
    default = SCHEMA["definitions"]["Dashboard"]["properties"]["schemaVersion"]["default"]
    assert default == dashboards.SCHEMA_VERSION
    assert {board["schemaVersion"] for board in BOARDS.values()} == {default}
    compose = ROOT / "testbed" / "compose.py"
    image = re.search(r"grafana/grafana:(\d+\.\d+)", compose.read_text()) if compose.exists() \
        else None
    if image:
        script = SCRIPT.read_text()
        assert f'GRAFANA_VERSION = "{image.group(1)}"' in script, (
            f"Compose runs Grafana {image.group(1)}: vendor its schema (grafana/schema/README.md)")


def board_with(change: str) -> dict[str, Any]:
    """The overview dashboard with one thing wrong."""
    board = copy.deepcopy(BOARDS["overview.json"])
    panel = board["panels"][0]
    if change == "unknown panel property":
        panel["legendFormat"] = "{{rank}}"  # belongs in a target
    elif change == "grid width as text":
        panel["gridPos"]["w"] = "12"
    elif change == "grid wider than the grid":
        panel["gridPos"]["w"] = 25
    elif change == "unknown crosshair mode":
        board["graphTooltip"] = 3
    elif change == "unknown dashboard property":
        board["refersh"] = "5s"
    elif change == "annotation without colour":
        del board["annotations"]["list"][0]["iconColor"]
    elif change == "variable of no known type":
        board["templating"]["list"][0]["type"] = "promql"
    elif change == "unknown field option":
        panel["fieldConfig"]["defaults"]["units"] = "s"
    return board


@pytest.mark.parametrize("change", [
    "unknown panel property", "grid width as text", "grid wider than the grid",
    "unknown crosshair mode", "unknown dashboard property", "annotation without colour",
    "variable of no known type", "unknown field option",
])
def test_the_schema_rejects_what_grafanas_kind_forbids(change: str):
    found = errors(board_with(change))
    assert found, f"{change}: accepted"
    # Only the change is wrong: everything else in the board is still valid.
    where = {"unknown panel property": "panels/0", "grid width as text": "panels/0/gridPos/w",
             "grid wider than the grid": "panels/0/gridPos/w",
             "unknown crosshair mode": "graphTooltip", "unknown dashboard property": "",
             "annotation without colour": "annotations/list/0",
             "variable of no known type": "templating/list/0/type",
             "unknown field option": "panels/0/fieldConfig/defaults"}[change]
    assert {error.split(": ", 1)[0] for error in found} == {where}, found


def test_only_the_structs_grafanas_kind_leaves_open_were_opened():
    # As published, the JSON Schema closes every struct: Prometheus' annotation fields and a
    # query variable's `definition` are refused there, and nothing else is.
    found = errors(BOARDS["overview.json"], PUBLISHED)
    assert found
    assert all(re.match(r"(annotations|templating)/list/\d+[/:]", e) for e in found), found
    definitions = SCHEMA["definitions"]
    for name in ("AnnotationQuery", "AnnotationTarget", "VariableModel"):
        assert definitions[name]["additionalProperties"] == {}, name
    for name in ("Dashboard", "Panel", "RowPanel", "GridPos", "FieldConfig", "FieldConfigSource",
                 "DashboardLink", "DataSourceRef", "VariableOption"):
        assert definitions[name]["additionalProperties"] is False, name
