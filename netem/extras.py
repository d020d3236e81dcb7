"""Packages only some features need are extras of the distribution (`pyproject.toml`): a
feature that lacks its package says which extra brings it, instead of an ImportError from
deep inside."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

DISTRIBUTION = "netem-testbed"


class MissingExtra(ImportError):
    """A feature's package is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module` for `feature`, or raise `MissingExtra` naming `extra`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing(module, extra, feature) from None


def locate(package: str, extra: str, feature: str) -> Path:
    """The installed `package`'s directory, found without importing it (for its data files),
    or `MissingExtra` naming `extra`."""
    try:
        spec = importlib.util.find_spec(package)
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise _missing(package, extra, feature)
    return Path(next(iter(spec.submodule_search_locations)))


def _missing(module: str, extra: str, feature: str) -> MissingExtra:
    package = module.partition(".")[0]
    return MissingExtra(f"{feature} needs {package}, which is not installed: "
                        f"pip install '{DISTRIBUTION}[{extra}]'")
