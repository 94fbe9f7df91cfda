"""A griffe extension for the API reference (``mkdocs.yml``): a dataclass field with a
``default_factory`` appears in the class's signature as what the factory returns
(``policy: FrequencyPolicy = FixedInterval(every=50)``), not as griffe's rendering of the
factory's code (``(lambda: FixedInterval(every=50))()``). It must run after griffe's own
``dataclasses`` extension, which builds those signatures: ``mkdocs.yml`` lists that one first."""

from __future__ import annotations

from typing import Any

import griffe


def factory_default(default: Any) -> Any:
    """``(lambda: EXPR)()`` as ``EXPR``; any other default as it is."""
    if isinstance(default, griffe.ExprCall) and not default.arguments:
        function = default.function
        if isinstance(function, griffe.ExprLambda) and not function.parameters:
            return function.body
    return default


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


class DataclassDefaults(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:  # noqa: ARG002 (griffe's hook signature)
        for obj in _walk(pkg):
            if isinstance(obj, griffe.Function):
                for parameter in obj.parameters:
                    parameter.default = factory_default(parameter.default)
