"""What every section of a scenario shares: the frozen base model, the problems found across
sections (each at its own path) and the small field types (worker indices, group names, link
ends, positive durations)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from netem.profile import Seconds

Loc = tuple[str | int, ...]
Congestion = Literal["cubic", "bbr"]


class Problems(ValueError):
    """Problems found across sections, each at its path relative to the model that found them."""

    def __init__(self, problems: list[tuple[Loc, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{dotted(loc)}: {message}" for loc, message in problems))


def dotted(loc: Loc) -> str:
    """`('topology', 'links', 2, 'profile', 'loss')` -> `topology.links[2].profile.loss`; a key
    that is not a plain name is quoted (`workers["a b"]`)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not re.fullmatch(r"[A-Za-z0-9_-]+", str(part)):
            text += f"[{json.dumps(str(part))}]"
        else:
            text += f".{part}" if text else str(part)
    return text


class Section(BaseModel):
    """A part of a scenario: frozen, unknown fields refused, fields by name or alias."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


def _endpoint(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | str) or value == "":
        raise ValueError(f"expected a worker index or a group name, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"expected a worker index (0 or more) or a group name, got {value}")
    return value


def as_list(value: Any) -> Any:
    """One item or a list of them."""
    return value if isinstance(value, list | tuple) else [value]


Endpoint = Annotated[int | str, BeforeValidator(_endpoint)]
WorkerIndex = Annotated[int, Field(ge=0, strict=True)]
WorkerList = Annotated[list[WorkerIndex], Field(min_length=1), BeforeValidator(as_list)]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"  # a scenario's name: it names the run's files
GROUP_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]*$"
# What each pattern a field has takes, in words, for the message that refuses a string.
PATTERN_WORDS = {
    NAME_PATTERN: "letters, digits, '.', '_' and '-', starting with a letter or a digit (no "
                  "spaces)",
    GROUP_PATTERN: "letters, digits, '.', '_' and '-', starting with a letter or '_' (no spaces)",
}


def _group_name(value: Any) -> Any:
    """A group's name; a number (a worker's index where a group was meant) is refused with how
    to name a group."""
    if isinstance(value, int) and not isinstance(value, bool):
        raise ValueError(f"expected a group's name, got the number {value}: groups are named "
                         f"sets of workers (topology: {{groups: {{east: [{value}]}}}}); use "
                         "the name")
    return value


GroupName = Annotated[str, Field(pattern=GROUP_PATTERN), BeforeValidator(_group_name)]
GroupList = Annotated[list[GroupName], Field(min_length=1), BeforeValidator(as_list)]
PositiveSeconds = Annotated[Seconds, Field(gt=0)]
