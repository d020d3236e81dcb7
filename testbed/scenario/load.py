"""Reading scenario files: YAML in, a validated `Scenario` out, or one `ScenarioError` that lists
every problem as `FILE:LINE: path.to.field: what is wrong; allowed: ...`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from netem.profile import HUMAN
from testbed.collectives.registry import kinds
from testbed.scenario.collective import COLLECTIVES
from testbed.scenario.fields import Loc, Problems, dotted
from testbed.scenario.model import Scenario
from testbed.scenario.sections import COMMAND_JOB, TRAINING_JOB, CommandJob, job_kind
from testbed.train.config import TrainConfig

SHIPPED = Path(__file__).resolve().parents[2] / "compose" / "scenarios"


@dataclass(frozen=True)
class Problem:
    """One bad field: its path in the file, what is wrong, and its line (1-based) if known."""

    path: str
    message: str
    line: int | None = None
    column: int | None = None

    def format(self, source: str) -> str:
        where = source if self.line is None else f"{source}:{self.line}"
        if self.line is not None and self.column is not None:
            where += f":{self.column}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class ScenarioError(ValueError):
    """A scenario that cannot be used; `problems` has one entry per bad field."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source, self.problems = source, problems
        lines = "\n  ".join(problem.format(source) for problem in problems)
        super().__init__(f"invalid scenario {source}:\n  {lines}")


def scenario_files(directory: Path = SHIPPED) -> list[Path]:
    """The scenario files in `directory` (by default the shipped ones, compose/scenarios/)."""
    return sorted(directory.glob("*.yaml"))


def find_scenario(scenario: str | Path) -> Path:
    """A scenario file, or the shipped one of that name (compose/scenarios/NAME.yaml)."""
    shipped = {path.stem: path for path in scenario_files()}
    given = Path(scenario)
    return given if given.exists() or str(scenario) not in shipped else shipped[str(scenario)]


def load_scenario(source: str | Path, *, steps: int | None = None) -> Scenario:
    """Validate a scenario from a path (`Path`, or a string naming an existing `.yaml`/`.yml`
    file) or from YAML text. A file without `name` is named after it; `steps` shortens the job
    (`Scenario.with_steps`)."""
    path: Path | None = None
    if isinstance(source, Path) or (
        "\n" not in source and source.endswith((".yaml", ".yml"))
    ):
        path = Path(source)
        try:
            text = path.read_text()
        except OSError as error:
            raise ScenarioError(str(path), [Problem("", error.strerror or str(error))]) from None
        label = str(path)
    else:
        text, label = source, "<text>"
    data, root = _parse(text, label)
    if path is not None and "name" not in data:
        data = {"name": path.stem, **data}
    try:
        scenario = Scenario.model_validate(data, context=HUMAN)
    except ValidationError as error:
        raise ScenarioError(label, _problems(error, data, root)) from None
    if steps is None:
        return scenario
    try:
        return scenario.with_steps(steps)
    except ValueError as error:
        raise ScenarioError(label, [Problem("steps", str(error).removeprefix("steps: "))]) \
            from None


# --- YAML ---------------------------------------------------------------------------------------


def _parse(text: str, label: str) -> tuple[dict, yaml.Node]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        message = f"YAML syntax: {error.problem or error.context}"
        if error.context and error.problem:
            message += f" ({error.context})"
        raise ScenarioError(label, [Problem("", message, mark.line + 1, mark.column + 1)]) from None
    except yaml.YAMLError as error:
        raise ScenarioError(label, [Problem("", f"YAML: {error}")]) from None
    if root is None:
        raise ScenarioError(label, [Problem("", "empty file: a scenario is a mapping, e.g. "
                                            "{name: x, workers: 4, job: {steps: 50}}")])
    if not isinstance(data, dict):
        raise ScenarioError(label, [Problem("", f"expected a mapping of sections, got "
                                            f"{type(data).__name__}", root.start_mark.line + 1)])
    duplicates = list(_duplicate_keys(root, ()))
    if duplicates:
        raise ScenarioError(label, duplicates)
    return data, root


def _duplicate_keys(node: yaml.Node, loc: Loc):
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else str(key.value)
            if name in seen:
                yield Problem(dotted((*loc, name)), f"duplicate key (first on line {seen[name]})",
                              key.start_mark.line + 1)
            seen.setdefault(name, key.start_mark.line + 1)
            yield from _duplicate_keys(value, (*loc, name))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, (*loc, i))


def _line(root: yaml.Node, loc: Loc) -> int:
    """The line of the deepest node of `loc` present in the file (a key's line for a field)."""
    node, line = root, root.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = next(((k, v) for k, v in node.value
                          if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None)
            if found is None:
                break
            line, node = found[0].start_mark.line + 1, found[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


# --- pydantic errors to problems ----------------------------------------------------------------

_SHOW_INPUT = ("_type", "_parsing", "greater_than", "greater_than_equal", "less_than",
               "less_than_equal", "too_short", "too_long", "string_pattern_mismatch")


def _problems(error: ValidationError, data: dict, root: yaml.Node) -> list[Problem]:
    problems = []
    for item in error.errors():
        loc = _clean(item["loc"], data)
        for where, message in _messages(item, loc, data):
            problems.append(Problem(dotted(where), message, _line(root, where)))
    return problems


def _clean(loc: tuple, data: dict) -> Loc:
    """Drop the parts pydantic adds for unions (the collective's kind tag, the job's, member
    type names), keeping every part that is a key or index of the document there."""
    cleaned: list[str | int] = []
    value: Any = data
    for part in loc:
        present = _has(value, part) if isinstance(value, dict | list) else False
        added = (isinstance(part, str) and ("[" in part or "(" in part)) or (
            cleaned == ["collective"] and part in kinds()) or (
            cleaned == ["job"] and part in (TRAINING_JOB, COMMAND_JOB))
        if added and not present:
            continue
        cleaned.append(part)
        value = value[part] if present else None
    return tuple(cleaned)


def _messages(item: dict, loc: Loc, data: dict) -> list[tuple[Loc, str]]:
    kind, message = item["type"], item["msg"].removeprefix("Value error, ")
    ctx = item.get("ctx") or {}
    if kind == "value_error" and isinstance(ctx.get("error"), Problems):
        return [((*loc, *where), text) for where, text in ctx["error"].problems]
    if kind == "extra_forbidden":
        allowed = _fields_at(loc[:-1], data)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return [(loc, f"unknown field{hint}; allowed: {', '.join(allowed)}")]
    if kind == "missing":
        return [(loc, "required")]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        got = f"unknown collective {ctx['tag']!r}" if "tag" in ctx else "required"
        return [((*loc, "kind"), f"{got}; allowed: {', '.join(kinds())}")]
    if kind == "literal_error":
        return [(loc, f"expected {ctx.get('expected')}, got {item.get('input')!r}")]
    if kind.endswith(_SHOW_INPUT) and not isinstance(item.get("input"), dict | list):
        message = f"{message}, got {item.get('input')!r}"
    return [(loc, message)]


def _fields_at(loc: Loc, data: Any) -> list[str]:
    """The field names (aliases where set) allowed at `loc` of a scenario."""
    current: Any = Scenario
    value: Any = data
    for part in loc:
        value = value[part] if isinstance(value, dict | list) and _has(value, part) else None
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part)) or next(
                (f for f in current.model_fields.values() if f.alias == part), None)
            if field is None:
                return []
            current = field.annotation
        elif isinstance(part, int | str):
            current = next(iter(get_args(current)[-1:]), None)  # list[X] / dict[K, X] -> X
        current = _model_in(current, value)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [info.alias or name for name, info in current.model_fields.items()]
    return []


def _bare(annotation: Any) -> Any:
    """`annotation` without its `Annotated[...]` layers."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _has(value: dict | list, part: str | int) -> bool:
    return part in value if isinstance(value, dict) else isinstance(part, int) and part < len(value)


def _model_in(annotation: Any, value: Any) -> Any:
    """The model inside `annotation` (X | None, a union of collectives picked by kind, a job
    picked by whether it names a command)."""
    annotation = _bare(annotation)
    if isinstance(annotation, type):
        return annotation
    members = [a for a in map(_bare, get_args(annotation))
               if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(members) > 1 and isinstance(value, dict) and value.get("kind") in COLLECTIVES:
        return COLLECTIVES[value["kind"]]
    if CommandJob in members and isinstance(value, dict):
        return CommandJob if job_kind(value) == COMMAND_JOB else TrainConfig
    if len(members) == 1:
        return members[0]
    return annotation
