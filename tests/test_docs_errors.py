"""docs/errors.md names every exception class steplib raises, under the module that raises it.

The package is read as source (``ast``), not imported, so a module that does not import (or is
half written) still counts. An exception class is "steplib's" when a ``class`` statement in
the package derives it from an exception (directly or through another steplib class); a raise
site is ``raise X(...)``, ``raise X``, ``raise module.X(...)``, ``raise helper(...)`` where the
module's ``helper`` returns ``X(...)``, and ``warnings.warn(..., X)`` for steplib warnings.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "steplib"
DOC = ROOT / "docs" / "errors.md"

BUILTIN_EXCEPTIONS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}


def _trees() -> dict[str, ast.Module]:
    """``{"steplib.x.y": tree}`` for every module of the package."""
    trees = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        trees[name] = ast.parse(path.read_text(), filename=str(path))
    return trees


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def steplib_exception_classes(trees: dict[str, ast.Module]) -> set[str]:
    """Classes defined in the package that derive from an exception (to a fixed point)."""
    classes = [
        node for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
    ]
    found: set[str] = set()
    while True:
        known = BUILTIN_EXCEPTIONS | found
        more = {c.name for c in classes if any(_name(base) in known for base in c.bases)}
        if more <= found:
            return found
        found |= more


def raised(trees: dict[str, ast.Module], classes: set[str]) -> dict[str, set[str]]:
    """``{module: {class names raised or warned there}}`` for steplib's classes."""
    by_module: dict[str, set[str]] = {}
    for module, tree in trees.items():
        helpers = {  # module functions that build the exception they return
            node.name: {
                _name(ret.value)
                for ret in ast.walk(node)
                if isinstance(ret, ast.Return) and ret.value is not None
            }
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
        }
        names: set[str | None] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                name = _name(node.exc)
                names.add(name)
                if isinstance(node.exc, ast.Call) and name in helpers:
                    names |= {n for n in helpers[name] if n is not None}
            elif isinstance(node, ast.Call) and _name(node.func) == "warn":
                names |= {_name(arg) for arg in node.args[1:]}
                names |= {_name(k.value) for k in node.keywords if k.arg == "category"}
        hits = {name for name in names if name in classes}
        if hits:
            by_module[module] = hits
    return by_module


def doc_sections() -> dict[str, str]:
    """``{module: text of every section whose heading names it in backticks}``."""
    text = DOC.read_text()
    sections: dict[str, str] = {}
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.MULTILINE)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        for module in re.findall(r"`(steplib(?:\.\w+)*)`", heading):
            sections[module] = sections.get(module, "") + body
    return sections


def test_the_scan_finds_the_known_classes_and_raise_sites() -> None:
    trees = _trees()
    classes = steplib_exception_classes(trees)
    assert {"StepLibError", "ConfigError", "LossFnError", "CorruptCheckpointError"} <= classes
    assert "CheckpointWarning" in classes  # a Warning is an exception class too
    sites = raised(trees, classes)
    assert "TooManySkipsError" in sites["steplib.step.phases"]
    assert "CheckpointWarning" in sites["steplib.checkpoint.manifest"]  # warnings.warn(...)
    assert "CorruptCheckpointError" in sites["steplib.checkpoint.storage"]  # via _missing()


def test_every_steplib_exception_class_is_on_the_errors_page() -> None:
    text = DOC.read_text()
    classes = steplib_exception_classes(_trees())
    missing = sorted(name for name in classes if f"`{name}`" not in text)
    assert not missing, f"docs/errors.md does not describe {missing}"


def test_every_module_that_raises_has_a_section_naming_what_it_raises() -> None:
    trees = _trees()
    sections = doc_sections()
    gaps = []
    for module, names in sorted(raised(trees, steplib_exception_classes(trees)).items()):
        if module not in sections:
            gaps.append(f"{module}: no section (a heading with `{module}` in it)")
            continue
        gaps += [f"{module}: {name}" for name in sorted(names) if name not in sections[module]]
    assert not gaps, "docs/errors.md is missing:\n" + "\n".join(gaps)
