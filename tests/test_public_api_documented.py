"""Every public name is documented: a docstring with Args / Returns (Args or Attributes for a
class) and, for a function, an example that doctest runs.

The public names are ``steplib.__all__``, and the ``__all__`` of the subpackages a user imports
from (``steplib.checkpoint``, ``steplib.data``, ``steplib.distributed``, ``steplib.handlers``,
``steplib.testing``, ...).
``make test`` runs the examples themselves (``pytest --doctest-modules steplib``); this test
checks that they exist.

The rules, and why:

* a function needs ``Args:`` when it takes parameters and ``Returns:`` (or ``Yields:``) unless
  it is annotated ``-> None``; and a ``>>>`` example that is neither all ``+SKIP`` nor only a
  comment, because a skipped example is not checked by anything;
* a class needs ``Args:`` or ``Attributes:`` when its constructor takes parameters (a class
  built without arguments documents itself with its docstring and methods);
* an exception class needs only a docstring: its constructor takes the message.

``KNOWN_GAPS`` lists what fails today, each asserted to still fail exactly so: a new name
without documentation fails the test, and so does a gap that was fixed (remove it from the
list, so that it cannot come back). It is empty: every public name is documented. Keep it
empty; it exists so that a gap that cannot be fixed at once is recorded here, with its
reason, rather than by loosening the rules.
"""

from __future__ import annotations

import importlib
import inspect
import types
from typing import Any

import pytest

import steplib

# Public, but not (or not all of them) in steplib.__all__.
SUBPACKAGES = (
    "steplib.distributed",
    "steplib.handlers",
    "steplib.handlers.logging",
    "steplib.losses",
    "steplib.param_groups",
    "steplib.schedules",
    "steplib.step",
    "steplib.sweep",
    "steplib.testing",
)

KNOWN_GAPS: dict[str, set[str]] = {}


def public_names() -> dict[str, Any]:
    """``{name: object}``: top-level names bare, subpackage names qualified; each object once."""
    modules = [steplib]
    modules += [m for m in vars(steplib).values() if isinstance(m, types.ModuleType)]
    modules += [importlib.import_module(name) for name in SUBPACKAGES]
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for module in modules:
        if module is not steplib and not module.__name__.startswith("steplib."):
            continue
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or id(obj) in seen:
                continue  # modules, constants, and names already listed elsewhere
            seen.add(id(obj))
            found[name if module is steplib else f"{module.__name__}.{name}"] = obj
    return found


def problems(obj: Any) -> set[str]:
    """What the docstring of ``obj`` lacks, by the rules above."""
    doc = inspect.getdoc(obj) or ""
    if not doc:
        return {"docstring"}
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return set()
        try:
            takes_arguments = bool(inspect.signature(obj).parameters)
        except (TypeError, ValueError):  # a C type without a signature
            takes_arguments = False
        needs = takes_arguments and "Args:" not in doc and "Attributes:" not in doc
        return {"Args/Attributes"} if needs else set()
    missing = set()
    signature = inspect.signature(obj)
    if signature.parameters and "Args:" not in doc:
        missing.add("Args")
    returns_none = signature.return_annotation in (None, "None")
    if not returns_none and "Returns:" not in doc and "Yields:" not in doc:
        missing.add("Returns")
    if not [e for e in examples_of(doc) if "+SKIP" not in e and not e.startswith("#")]:
        missing.add("doctest")
    return missing


def examples_of(doc: str) -> list[str]:
    """The doctest statements of ``doc``: each ``>>>`` line joined with its ``...`` lines."""
    statements: list[str] = []
    for line in (line.strip() for line in doc.splitlines()):
        if line.startswith(">>>"):
            statements.append(line[4:])
        elif line.startswith("...") and statements:
            statements[-1] += " " + line[4:]
    return statements


NAMES = public_names()


def test_the_walk_sees_the_public_api() -> None:
    assert {"make_train_step", "accumulate", "TrainState", "run"} <= set(NAMES)
    assert "steplib.checkpoint.save" in NAMES and "steplib.distributed.init_distributed" in NAMES
    assert not set(KNOWN_GAPS) - set(NAMES), "KNOWN_GAPS names what is no longer public"


@pytest.mark.parametrize("name", sorted(NAMES))
def test_public_name_is_documented(name: str) -> None:
    found = problems(NAMES[name])
    expected = KNOWN_GAPS.get(name, set())
    if found == expected:
        return
    if not expected:
        pytest.fail(f"{name}: its docstring lacks {sorted(found)}")
    if not found:
        pytest.fail(f"{name} is documented now: remove it from KNOWN_GAPS")
    pytest.fail(f"{name}: lacks {sorted(found)}; KNOWN_GAPS says {sorted(expected)}: update it")
