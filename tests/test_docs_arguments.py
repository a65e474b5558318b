"""The docs call steplib's functions with arguments that exist.

A keyword that a function lost (``checkpoint_every(..., step=step)`` after the handlers took the
step from the run) still reads well on a page and fails only when a user copies it. Each
steplib call in README.md and docs/ (code blocks, and inline code such as
``checkpoint_every(dir, every=N, keep_last=)``) is parsed and its keywords are checked against
the signature. In the migration guides' tables only the steplib column is read: the first
names the other library's functions.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import steplib

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md") if "api" not in p.parts)]
)
MISSING = object()


def _resolve(dotted: list[str], aliases: dict[str, str]) -> Any:
    """The object a call names, or ``None`` when it is not steplib's (``MISSING``: it is, but
    the name does not exist)."""
    if dotted[0] not in aliases:
        return None
    path = aliases[dotted[0]].split(".") + dotted[1:]
    for cut in range(len(path), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(path[:cut]))
        except ImportError:
            continue
        for part in path[cut:]:
            found = getattr(found, part, MISSING)
        return found
    return MISSING


def _dotted(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _problems(tree: ast.AST, aliases: dict[str, str]) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            module = getattr(node, "module", None) or ""
            for alias in node.names:
                if isinstance(node, ast.ImportFrom) and module.startswith("steplib"):
                    aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
                elif isinstance(node, ast.Import) and alias.name.startswith("steplib"):
                    name = alias.name if alias.asname else "steplib"
                    aliases[alias.asname or "steplib"] = name
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (dotted := _dotted(node.func)) is None:
            continue
        target = _resolve(dotted, aliases)
        if target is MISSING:
            yield f"{'.'.join(dotted)} does not exist"
        if target is None or target is MISSING or not callable(target):
            continue
        try:
            parameters = inspect.signature(target).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            continue
        for keyword in node.keywords:
            if keyword.arg is not None and keyword.arg not in parameters:
                yield f"{'.'.join(dotted)}() has no argument {keyword.arg}="


def _snippets(page: Path) -> Iterator[tuple[str, str]]:
    """(code, where) for each code block and each inline code span of the page."""
    text = page.read_text()
    for match in re.finditer(r"```(?:python|py)\n(.*?)```", text, re.DOTALL):
        yield (
            textwrap.dedent(match.group(1)),
            f"the block at line {text[: match.start()].count(chr(10)) + 1}",
        )
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for line in prose.splitlines():
        if "migration" in page.parts and line.startswith("| "):
            line = line.rstrip(" |").rsplit(" | ", 1)[-1]  # the steplib column
        for span in re.findall(r"`([^`]+)`", line):
            # `keep_last=,` and `every=N` name a keyword without a value: give it one.
            yield re.sub(r"(\w+)=\s*(?=[,)])", r"\1=None", span).strip(), f"`{span}`"


def test_every_steplib_call_in_the_docs_names_arguments_that_exist() -> None:
    everyday = {name: f"steplib.{name}" for name in steplib.__all__}
    found = []
    for page in PAGES:
        for code, where in _snippets(page):
            try:
                tree = ast.parse(code)
            except SyntaxError:
                continue  # prose in backquotes, or a fragment
            aliases = {"sl": "steplib", "steplib": "steplib"}
            if where.startswith("`"):
                aliases |= everyday  # inline code names the everyday functions bare
            found += [f"{page.relative_to(ROOT)}, {where}: {p}" for p in _problems(tree, aliases)]
    assert not found, "\n".join(found)
