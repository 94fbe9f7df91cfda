"""A module that is imported on first attribute access (keeps actor processes light)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _LazyModule:
    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r} ({'loaded' if self._module else 'not loaded'})>"


def lazy_module(name: str) -> Any:
    """A stand-in for ``import name`` that imports ``name`` when an attribute is first read."""
    return _LazyModule(name)
