"""A griffe extension for the API reference (``mkdocs.yml``): cf_ray's docstrings use Sphinx roles
(``:class:`Checkpointer```, ``:meth:`~Run.summary```) and ``Example::`` blocks, which Markdown would
print as they are. This turns a role into inline code naming its target (the last dotted part when
the target starts with ``~``, as Sphinx shows it) and ``Name::`` into ``Name:`` followed by the
indented block, before mkdocstrings parses the docstring."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|obj|exc):`(~?)([^`]+)`")
_LITERAL_BLOCK = re.compile(r"^(\s*)([A-Z][\w ]*)::$", re.M)


def _role(m: re.Match) -> str:
    target = m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


def rewrite(text: str) -> str:
    """The docstring with its Sphinx roles as inline code and ``Example::`` as ``Example:``."""
    return _LITERAL_BLOCK.sub(r"\1\2:", _ROLE.sub(_role, text))


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: ARG002 (griffe's hook signature)
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
