"""Grafana's dashboard schema as the JSON Schema the dashboards are checked against.

`python scripts/grafana_schema.py` writes grafana/schema/dashboard.schema.json from the files
vendored beside it (grafana/schema/README.md says where each comes from); `--check` writes
nothing and exits 1 if the committed file differs from what they give, or if a vendored file is
not the one published (its SHA-256 is pinned here).

The JSON Schema is Grafana's own rendering of its dashboard kind (`cog`, in the Grafana
Foundation SDK), with one correction taken from the kind itself (the CUE): cog closes every
struct, while the kind leaves some open (a `...` of their own) so that datasources can add
their fields, as Grafana's Prometheus datasource does on an annotation (`expr`, `step`,
`titleFormat`, `useValueForTime`...) and on a query variable (`definition`). Those are opened
again; every other struct stays closed, so an unknown panel property is an error. Before
deriving, the property names of every object are checked against @grafana/schema's TypeScript
types of the same Grafana version (generated from the same kind by another tool).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_DIR = ROOT / "grafana" / "schema"
OUT = SCHEMA_DIR / "dashboard.schema.json"
GRAFANA_VERSION = "11.2"
# Vendored file -> SHA-256 of the file as published (grafana/schema/README.md: where).
SOURCES = {
    "dashboard.cue": "ac2a33038ae3cf30aa188a62058f974bda8a61c30c932b255a2ce25d424e1cd2",
    "dashboard.jsonschema.json":
        "990c29d95df7aa13ddb0b1aa66207cb9c8de2291f9867c2123993f4d955753f4",
    "dashboard_types.gen.d.ts":
        "67569c9d3c3656cc723f774227102cbd07e1e6f045c4c23b646cabdd1086cf7f",
}
SPEC = "Dashboard"  # the JSON Schema's name for the kind's top-level `spec`

Path_ = tuple[str, ...]  # a definition, then field names down to a struct


def open_structs(cue: str) -> tuple[set[Path_], set[Path_]]:
    """The structs of the kind that are open: those with fields of their own and a `...` (more
    fields allowed), and those with only `...` (any object). Each as (definition, field...),
    read line by line (the file is `cue fmt`ed: one field per line, its label first)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', cue)  # no brace in a string counts
    frames: list[dict[str, Any]] = []  # label, fields, open
    with_fields: set[Path_] = set()
    any_object: set[Path_] = set()
    for raw in text.splitlines():
        line = re.sub(r"//.*", "", raw).strip()
        label = re.match(r"(#?\w+)\??:", line)
        name = label.group(1) if label else ""
        if label and frames:
            frames[-1]["fields"] += 1
        # `[...T]` is a list of T; a `...` of its own opens the struct it is in.
        for token in re.findall(r"\[\.\.\.|\.\.\.|\{|\}", line):
            if token == "...":
                frames[-1]["open"] = True
            elif token == "{":
                frames.append({"label": SPEC if name == "spec" else name, "fields": 0,
                               "open": False})
                name = ""  # a second brace on the line is an anonymous struct
            elif token == "}":
                frame = frames.pop()
                path = _path([*frames, frame])
                if frame["open"] and path:
                    (with_fields if frame["fields"] else any_object).add(path)
    if frames:
        raise ValueError(f"dashboard.cue: {len(frames)} struct(s) not closed")
    return with_fields, any_object


def _path(frames: list[dict[str, Any]]) -> Path_:
    """From the innermost definition (`#Name`, or the spec) down to the last frame."""
    labels = [frame["label"] for frame in frames]
    starts = [i for i, label in enumerate(labels) if label.startswith("#") or label == SPEC]
    if not starts:
        return ()
    return tuple(label.lstrip("#") for label in labels[starts[-1]:])


def typescript_properties(ts: str) -> dict[str, set[str]]:
    """Interface -> its property names, from @grafana/schema's generated declarations."""
    found: dict[str, set[str]] = {}
    for match in re.finditer(r"export interface (\w+) \{\n(.*?)\n\}", ts, re.S):
        body = re.sub(r"/\*.*?\*/", "", match.group(2), flags=re.S)
        depth, names = 0, set()
        for line in body.splitlines():
            if depth == 0 and (name := re.match(r"\s*(\w+)\??:", line)):
                names.add(name.group(1))
            depth += line.count("{") - line.count("}")
        found[match.group(1)] = names
    return found


def _objects(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The object schemas a property's schema allows (through alternatives and arrays)."""
    for alternative in node.get("oneOf", node.get("anyOf", [node])):
        if alternative.get("type") == "object":
            yield alternative
        elif alternative.get("type") == "array":
            yield from _objects(alternative["items"])


def _nodes(definitions: dict[str, Any], path: Path_) -> list[dict[str, Any]]:
    """The object schemas at `path`; none when the JSON Schema has no such definition (cog
    inlines some, e.g. a panel's targets)."""
    if path[0] not in definitions:
        return []
    nodes = [definitions[path[0]]]
    for field in path[1:]:
        nodes = [obj for node in nodes for obj in _objects(node["properties"][field])]
    return nodes


def derive(cue: str, published: dict[str, Any], ts: str) -> dict[str, Any]:
    """The JSON Schema to validate dashboards with: `published` with the kind's open structs
    opened again (see the module's docstring). Raises ValueError if the TypeScript types name
    other properties than the JSON Schema anywhere but in those open structs."""
    with_fields, any_object = open_structs(cue)
    schema = copy.deepcopy(published)
    definitions = schema["definitions"]
    interfaces = typescript_properties(ts)
    reopened = {path[0] for path in with_fields if len(path) == 1}
    for name, definition in definitions.items():
        if name not in interfaces or "properties" not in definition:
            continue
        ours, theirs = set(definition["properties"]), interfaces[name]
        if theirs - ours or (ours - theirs and name not in reopened):
            raise ValueError(f"{name}: the JSON Schema has {sorted(ours - theirs)}, the "
                             f"TypeScript types {sorted(theirs - ours)}")
    changed = []
    for path in sorted(with_fields | any_object):
        for node in _nodes(definitions, path):
            if path in any_object:
                node.pop("properties", None)
                node.pop("required", None)
            node["additionalProperties"] = {}
            changed.append(".".join(path))
    schema["$comment"] = (
        f"Grafana {GRAFANA_VERSION}'s dashboard kind as the Grafana Foundation SDK renders it "
        f"(dashboard.jsonschema.json), with the structs the kind (dashboard.cue) leaves open "
        f"opened again: {', '.join(changed)}. Written by scripts/grafana_schema.py; do not "
        f"edit.")
    return schema


def sources() -> dict[str, str]:
    """The vendored files' text; ValueError if one is not the file published."""
    texts = {}
    for name, digest in SOURCES.items():
        data = (SCHEMA_DIR / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"{SCHEMA_DIR / name} is not the published file (SHA-256 "
                             f"differs): vendor it again, see grafana/schema/README.md")
        texts[name] = data.decode()
    return texts


def render() -> str:
    texts = sources()
    schema = derive(texts["dashboard.cue"], json.loads(texts["dashboard.jsonschema.json"]),
                    texts["dashboard_types.gen.d.ts"])
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the committed schema is stale")
    args = parser.parse_args(argv)
    try:
        text = render()
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT}: differs from what the vendored files give; run: python "
                  f"scripts/grafana_schema.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
