"""A scenario's validation errors in words: each of pydantic's errors as the field's path in the
file and what is wrong, saying what is allowed there (the fields of the section, with a
did-you-mean or the section a field belongs in; what a pattern takes; the mapping a shorthand
stands for)."""

from __future__ import annotations

import difflib
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from testbed.collectives.registry import kinds
from testbed.scenario.collective import COLLECTIVES
from testbed.scenario.fields import PATTERN_WORDS, Loc, Problems
from testbed.scenario.model import Scenario
from testbed.scenario.sections import COMMAND_JOB, TOP_LEVEL, TRAINING_JOB, CommandJob, job_kind
from testbed.train.config import TrainConfig

# The error types whose message gains the value given (', got 5').
_SHOW_INPUT = ("_type", "_parsing", "greater_than", "greater_than_equal", "less_than",
               "less_than_equal", "too_short", "too_long", "string_pattern_mismatch")
# The error types of a section (a mapping of fields) given as something else.
_NOT_A_MAPPING = ("model_type", "model_attributes_type", "dict_type")


def messages(error: ValidationError, data: dict) -> list[tuple[Loc, str]]:
    """Every problem of `error` (validating the document `data`) as (path, message)."""
    return [found for item in error.errors()
            for found in _messages(item, _clean(item["loc"], data), data)]


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
    ctx, given = item.get("ctx") or {}, item.get("input")
    if kind == "value_error" and isinstance(ctx.get("error"), Problems):
        return [((*loc, *where), text) for where, text in ctx["error"].problems]
    if kind == "extra_forbidden":
        return [(loc, _unknown_field(loc, data))]
    if kind == "missing":
        return [(loc, "required")]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        got = f"unknown collective {ctx['tag']!r}" if "tag" in ctx else "required"
        return [((*loc, "kind"), f"{got}; allowed: {', '.join(kinds())}")]
    if kind == "literal_error":
        return [(loc, f"expected {ctx.get('expected')}, got {given!r}")]
    if kind == "string_pattern_mismatch" and ctx.get("pattern") in PATTERN_WORDS:
        return [(loc, f"expected {PATTERN_WORDS[ctx['pattern']]}, got {given!r}")]
    if kind == "string_type" and isinstance(given, int | float):
        return [(loc, f"expected text, got the number {given!r}: quote it ('{given}')")]
    if kind in _NOT_A_MAPPING and not isinstance(given, dict):
        fields = _fields_at(loc, data)
        allowed = f" of {', '.join(fields)}" if fields else ""
        return [(loc, f"expected a mapping{allowed}, got {given!r}")]
    if kind.endswith(_SHOW_INPUT) and not isinstance(given, dict | list):
        message = f"{message}, got {given!r}"
    return [(loc, message)]


def _unknown_field(loc: Loc, data: dict) -> str:
    """What an unknown field is told: a field of that name it may have meant, or the section
    inside this one it belongs in, and the fields allowed here."""
    name, where = str(loc[-1]), loc[:-1]
    allowed = _fields_at(where, data)
    close = difflib.get_close_matches(name, allowed, n=1)
    owners = [] if close else _sections_with(where, data, name)
    if close:
        hint = f" (did you mean {close[0]!r}?)"
    elif len(owners) == 1:
        hint = f" (a field of {owners[0]}: write {owners[0]}: {{{name}: ...}})"
    elif owners:
        hint = f" (a field of {' and '.join(owners)}: write it in one of them)"
    else:
        hint = ""
    return f"unknown field{hint}; allowed: {', '.join(allowed)}"


def _fields_at(loc: Loc, data: Any) -> list[str]:
    """The field names (aliases where set) allowed at `loc` of a scenario."""
    model = _model_at(loc, data)
    if model is None:
        return []
    names = _names(model)
    return [name for name in names if name not in TOP_LEVEL] if model is TrainConfig else names


def _sections_with(loc: Loc, data: Any, name: str) -> list[str]:
    """The fields at `loc` that are sections themselves with a field `name` (a `delay` beside
    a link's `profile`: it belongs in it)."""
    model = _model_at(loc, data)
    if model is None:
        return []
    return [key for key in _names(model) if name in _fields_at((*loc, key), data)]


def _names(model: type[BaseModel]) -> list[str]:
    """A model's fields by the names a file gives them (their aliases where they have one)."""
    return [info.alias or name for name, info in model.model_fields.items()]


def _model_at(loc: Loc, data: Any) -> type[BaseModel] | None:
    """The model that validates the value at `loc` of a scenario (None: not a model's)."""
    annotation: Any = Scenario
    value: Any = data
    for part in loc:
        model = _model_in(annotation, value)
        if model is not None:
            field = model.model_fields.get(str(part)) or next(
                (info for info in model.model_fields.values() if info.alias == part), None)
            if field is None:
                return None
            annotation = field.annotation
        else:
            annotation = _item(annotation)
        value = value[part] if isinstance(value, dict | list) and _has(value, part) else None
    return _model_in(annotation, value)


def _bare(annotation: Any) -> Any:
    """`annotation` without its `Annotated[...]` layers."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _item(annotation: Any) -> Any:
    """What a list, tuple or dict in `annotation` (or in a union of it) holds."""
    annotation = _bare(annotation)
    for member in (annotation, *get_args(annotation)):
        member = _bare(member)
        if get_origin(member) in (list, tuple, dict):
            return get_args(member)[-1]
    return None


def _has(value: dict | list, part: str | int) -> bool:
    return part in value if isinstance(value, dict) else isinstance(part, int) and part < len(value)


def _model_in(annotation: Any, value: Any) -> type[BaseModel] | None:
    """The model `annotation` is, or the one of its union that validates `value` (X | None, a
    union of collectives picked by kind, a job picked by whether it names a command)."""
    annotation = _bare(annotation)
    if isinstance(annotation, type):
        return annotation if issubclass(annotation, BaseModel) else None
    if get_origin(annotation) not in (Union, UnionType):
        return None
    members = [a for a in map(_bare, get_args(annotation))
               if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(members) > 1 and isinstance(value, dict) and value.get("kind") in COLLECTIVES:
        return COLLECTIVES[value["kind"]]
    if CommandJob in members and isinstance(value, dict):
        return CommandJob if job_kind(value) == COMMAND_JOB else TrainConfig
    return members[0] if len(members) == 1 else None
