"""Packages only some features need are extras of the distribution (`pyproject.toml`): a
feature that lacks its package says which extra brings it, instead of an ImportError from
deep inside."""

from __future__ import annotations

import importlib
from types import ModuleType

DISTRIBUTION = "netem-testbed"


class MissingExtra(ImportError):
    """A feature's package is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module` for `feature`, or raise `MissingExtra` naming `extra`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.partition(".")[0]
        raise MissingExtra(f"{feature} needs {package}, which is not installed: "
                           f"pip install '{DISTRIBUTION}[{extra}]'") from None
