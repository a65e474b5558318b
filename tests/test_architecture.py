"""The shape of the package (DESIGN.md §2 and §5, docs/architecture.md), checked on its source:
who may import whom, no import circle, no private name shared across modules, no module-level
mutable state, the core naming no wrapper, and the sizes (files, wrappers, the top-level names).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import steplib
import steplib.events

PACKAGE = Path(steplib.__file__).parent
WRAPPERS = ("accumulate", "amp", "anomaly", "clip", "ddp", "fsdp", "skip", "tap")
WRAPPER_NAMES = {
    "accumulate",
    "amp_wrap",
    "clip",
    "skip_nonfinite",
    "tap",
    "ddp_wrap",
    "fsdp_wrap",
    "detect_anomaly",
    "compile_step",
    "make_pipeline_step",
}


def _modules() -> dict[str, ast.Module]:
    trees = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        trees[name] = ast.parse(path.read_text(), str(path))
    return trees


TREES = _modules()


def _top_level_imports(tree: ast.Module) -> Iterator[tuple[str, list[str]]]:
    """``(module, names)`` of the imports that run when the module is imported (not those
    inside functions or under ``if TYPE_CHECKING:``)."""
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for child in [node, *(ast.walk(node) if isinstance(node, ast.Try) else [])]:
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                yield child.module, [a.name for a in child.names]
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, []


def _steplib_imports(name: str) -> set[str]:
    found = set()
    for module, names in _top_level_imports(TREES[name]):
        if not module.startswith("steplib"):
            continue
        for imported in names:  # `from steplib import errors` imports the module steplib.errors
            if f"{module}.{imported}" in TREES:
                found.add(f"{module}.{imported}")
        found.add(module)
    return found - {name}


def test_the_three_concepts_import_almost_nothing() -> None:
    assert _steplib_imports("steplib.errors") == set()
    # The cadence of every= (steplib.cadence) is the emitter's and every handler's: a leaf
    # that imports errors only.
    assert _steplib_imports("steplib.events") == {"steplib.cadence"}
    assert _steplib_imports("steplib.cadence") == {"steplib.errors"}
    assert _steplib_imports("steplib.fence") == set()
    assert _steplib_imports("steplib.lineage") == {"steplib.errors"}
    assert _steplib_imports("steplib.state") == {
        "steplib.errors",
        "steplib.fence",
        "steplib.lineage",
        "steplib.state_checks",
    }
    assert _steplib_imports("steplib.state_checks") == {"steplib.errors"}
    assert _steplib_imports("steplib.output") == set()
    # The loop asks schedule_ends, after fit_start, whether the state's scheduler can take
    # max_steps more updates (a OneCycleLR ends at its total_steps).
    assert _steplib_imports("steplib.schedule_ends") == {"steplib.errors"}
    assert _steplib_imports("steplib.loop") == {
        "steplib.state",
        "steplib.schedule_ends",
        "steplib.output",
        "steplib.events",
        "steplib.loop_checks",
        "steplib.loop_data",
    }
    assert _steplib_imports("steplib.loop_checks") == set()
    assert _steplib_imports("steplib.loop_data") == set()


def test_handlers_and_checkpoints_never_import_the_loop_or_the_step() -> None:
    for name in TREES:
        if name.startswith(("steplib.handlers", "steplib.checkpoint", "steplib.distributed")):
            bad = {
                m for m in _steplib_imports(name) if m.startswith(("steplib.loop", "steplib.step"))
            }
            assert not bad, f"{name} imports {sorted(bad)}"


def test_there_is_no_import_circle() -> None:
    graph = {name: {m for m in _steplib_imports(name) if m in TREES} for name in TREES}
    # A package's __init__ importing its own modules is not a circle back into it.
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
                pytest.fail(f"import circle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_private_name_is_imported_from_another_module() -> None:
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("steplib"):
                module = node.module or ""
                private = [a.name for a in node.names if a.name.startswith("_")]
                private += [p for p in module.split(".") if p.startswith("_")]
                assert not private, f"{name} imports {private} from {module}"


_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "WeakKeyDictionary", "WeakValueDictionary"}


def test_no_module_level_mutable_state() -> None:
    for name, tree in TREES.items():
        for node in tree.body:
            if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
                continue
            value = node.value
            mutable = isinstance(value, ast.Dict | ast.List | ast.Set | ast.ListComp | ast.DictComp)
            if isinstance(value, ast.Call):
                func = value.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                mutable = called in _MUTABLE_CALLS
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            shown = ", ".join(ast.unparse(t) for t in targets)
            assert not mutable or shown == "__all__", f"{name}: module-level mutable {shown}"


def _code_identifiers(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.name for a in node.names)
            names.update((node.module or "").split("."))
    return names


def test_the_core_names_no_wrapper() -> None:
    for name in (
        "steplib.step.core",
        "steplib.step.phases",
        "steplib.step.plan",
        "steplib.step.parts",
    ):
        named = _code_identifiers(TREES[name]) & (WRAPPER_NAMES | set(WRAPPERS) | {"compile"})
        assert not named, f"{name} names the wrapper(s) {sorted(named)}"


def test_sizes() -> None:
    for path in PACKAGE.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        assert lines <= 400, f"{path.relative_to(PACKAGE.parent)} has {lines} lines"
    for wrapper in WRAPPERS:
        path = PACKAGE / "step" / f"{wrapper}.py"
        assert len(path.read_text().splitlines()) < 150, f"{path.name} is not under 150 lines"


def test_the_top_level_holds_the_everyday_names_only() -> None:
    assert len(steplib.__all__) <= 40, sorted(steplib.__all__)
    assert not [n for n in steplib.__all__ if re.fullmatch(r"_.*", n)]


def test_handlers_register_by_one_convention() -> None:
    # One mechanism: Events.add finds a handler's on_<event> methods. No class defines its own
    # attach (Handler's is the only one), and every class with on_<event> methods is a Handler.
    on_event = {f"on_{name}" for name in steplib.events.EVENT_NAMES}
    own_attach, not_handlers = [], []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if "attach" in methods and (name, node.name) != ("steplib.events", "Handler"):
                own_attach.append(f"{name}.{node.name}")
            bases = {ast.unparse(base) for base in node.bases}
            if methods & on_event and "Handler" not in bases:
                not_handlers.append(f"{name}.{node.name}")
    assert own_attach == [], "register on_<event> methods instead of writing attach"
    assert not_handlers == [], "subclass steplib.events.Handler"


def test_no_tricks_global_exec_or_private_writes() -> None:
    # DESIGN.md §5.11: no `global`, no exec/eval, no write to another object's private
    # attribute (torch's `scheduler._last_lr`, `optimizer._opt_called`: they change between
    # torch versions without notice). An object sets its own (`self._x = ...`).
    found = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.append(f"{name}:{node.lineno}: global {', '.join(node.names)}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in {"exec", "eval"}:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node.func)}(...)")
            for target in _assigned(node):
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr.startswith("_")
                    and not target.attr.startswith("__")
                    and ast.unparse(target.value) not in {"self", "cls"}
                ):
                    found.append(f"{name}:{target.lineno}: {ast.unparse(target)} = ...")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
                attr = node.args[1] if len(node.args) > 1 else None
                if isinstance(attr, ast.Constant) and str(attr.value).startswith("_"):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def _assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []
