"""The package's docstrings and comments state the contract, the invariant and the reason; the story
(which issue asked for it, when it changed, what a benchmark measured on one machine) belongs to
the commits and to docs/. A reference to an issue, a date or a benchmark result file in the code
ages the moment the next commit lands, and a reader cannot act on it.

What is checked: every docstring (module, class, function, and the attribute docstrings under
assignments) and every ``#`` comment of ``cf_ray/``. String literals that are data or messages are
not: only text written for the reader of the code.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import cf_ray

ROOT = pathlib.Path(cf_ray.__file__).parent

#: What the story looks like: an issue reference (``#23``, ``issue 16``, ``(#12, #24)``), an ISO date,
#: a benchmark's result file.
STORY = {
    "an issue reference": re.compile(r"(?<![\w&/{])#\d{1,4}\b|\bissues? #?\d+", re.IGNORECASE),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a benchmark result file": re.compile(r"benchmarks/results/"),
}


def _texts(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every docstring and comment of one module."""
    src = path.read_text()
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else []:
            value = stmt.value if isinstance(stmt, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.append((stmt.lineno, value.value))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string.lstrip("#:")))
    return out


def test_docstrings_and_comments_carry_no_issue_numbers_dates_or_benchmark_files():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for line, text in _texts(path):
            for what, pattern in STORY.items():
                m = pattern.search(text)
                if m:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {what} ({m.group(0)!r})")
    assert found == [], "state the contract and the reason; leave the story to the commits:\n" + "\n".join(found)
