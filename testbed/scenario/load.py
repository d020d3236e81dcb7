"""Reading scenario files: YAML in, a validated `Scenario` out, or one `ScenarioError` that lists
every problem as `FILE:LINE: path.to.field: what is wrong; allowed: ...`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from netem.profile import HUMAN
from testbed.scenario.fields import Loc, dotted
from testbed.scenario.job_files import missing_files
from testbed.scenario.messages import messages
from testbed.scenario.model import Scenario

SHIPPED = Path(__file__).resolve().parents[2] / "compose" / "scenarios"
LINK_SECTIONS = ("topology", "timeline")  # where link profiles (and their samples files) are


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


def load_scenario(source: str | Path, *, steps: int | None = None,
                  base_dir: str | Path | None = None, files: bool = False) -> Scenario:
    """Validate a scenario from a path (`Path`, or a string naming an existing `.yaml`/`.yml`
    file) or from YAML text. A file without `name` is named after it; `steps` shortens the job
    (`Scenario.with_steps`). A samples distribution's file (`distribution: {samples: FILE}`)
    and a link trace's (`trace: {file: FILE}`) are relative to `base_dir`: by default the
    scenario file's directory (YAML text: the current directory). With `files`, a command
    job's directory, program and script must be there too (`job_files.missing_files`), as
    where the scenario is about to run or be checked."""
    path: Path | None = None
    if isinstance(source, Path) or (
        "\n" not in source and source.endswith((".yaml", ".yml"))
    ):
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ScenarioError(str(path), [Problem("", error.strerror or str(error))]) from None
        except UnicodeDecodeError as error:
            raise ScenarioError(str(path), [Problem("", (
                f"not a text file (UTF-8): byte {error.object[error.start]:#04x} at offset "
                f"{error.start}; a scenario is YAML text"))]) from None
        label = str(path)
    else:
        text, label = source, "<text>"
    data, root = _parse(text, label)
    if path is not None and "name" not in data:
        data = {"name": path.stem, **data}
    base = base_dir if base_dir is not None else path.parent if path is not None else None
    if base is not None:
        data = {section: map_data_files(value, lambda _, name: str(Path(base) / name), section)
                if section in LINK_SECTIONS else value
                for section, value in data.items()}
    try:
        scenario = Scenario.model_validate(data, context=HUMAN)
        found = missing_files(scenario, Path(base)) if files and base is not None else []
    except ValidationError as error:
        found = messages(error, data)
    if found:
        raise ScenarioError(label, [Problem(dotted(where), message, _line(root, where))
                                    for where, message in found])
    if steps is None:
        return scenario
    try:
        return scenario.with_steps(steps)
    except ValueError as error:
        raise ScenarioError(label, [Problem("steps", str(error).removeprefix("steps: "))]) \
            from None


DATA_FILES = (("distribution", "samples"), ("trace", "file"))  # where a scenario names a file


def map_data_files(data: Any, change: Callable[[str, str], str], where: str = "") -> Any:
    """`data` (a scenario's document, or a part of it at the dotted path `where`) with the name
    of every file it reads besides itself (a samples distribution's, a link's or a slot's:
    `distribution: {samples: FILE}`; a link trace's: `trace: {file: FILE}`) replaced by
    `change(path of the field, name)`."""
    if isinstance(data, list):
        return [map_data_files(item, change, f"{where}[{index}]")
                for index, item in enumerate(data)]
    if not isinstance(data, dict):
        return data
    found = {key: map_data_files(value, change, f"{where}.{key}" if where else key)
             for key, value in data.items()}
    for key, field in DATA_FILES:
        given = found.get(key)
        if isinstance(given, dict) and isinstance(given.get(field), str):
            place = f"{where}.{key}.{field}" if where else f"{key}.{field}"
            found[key] = {**given, field: change(place, given[field])}
    return found


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
