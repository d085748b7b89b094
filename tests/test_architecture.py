"""The house's rules, checked on the source: each layer imports only downward, no import
cycle anywhere (imports inside functions count), modules and classes stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("memsentry", "pytest_memsentry")

#: The pipeline, bottom first: a module may import from its own layer's units and below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("memsentry.errors", "memsentry.units", "memsentry.version", "memsentry.usercode",
     "memsentry.paths", "memsentry.settings"),
    ("memsentry.model",),
    ("memsentry.measure",),
    ("memsentry.census",),
    ("memsentry.record",),
    ("memsentry.rules",),
    ("memsentry.reporters",),
    ("memsentry.report", "memsentry.alarm", "memsentry.tracker"),
    ("memsentry.cli", "memsentry.integrations", "memsentry.__main__", "memsentry"),
    ("pytest_memsentry",),
)
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str:
    """The layer unit a module belongs to (its package below ``memsentry``, or itself)."""
    for layer in LAYERS:
        for unit in sorted(layer, key=len, reverse=True):
            if module == unit or module.startswith(unit + "."):
                return unit
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def _layer(module: str) -> int:
    unit = _unit(module)
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _imports(module: str) -> set[str]:
    """The project modules ``module`` imports, at any depth of its code."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    is_package = MODULES[module].name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*parts, base] if base else parts)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    return {t for t in targets if t in MODULES and t != module}


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_layer_and_below(module: str) -> None:
    upward = [t for t in GRAPH[module] if _layer(t) > _layer(module)]
    assert upward == [], f"{module} (layer {_layer(module)}) imports from above: {upward}"


def test_no_import_cycle_between_modules() -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target):], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_no_cycle_between_layer_units() -> None:
    edges = {(_unit(m), _unit(t)) for m, targets in GRAPH.items() for t in targets}
    mutual = sorted((a, b) for a, b in edges if a != b and (b, a) in edges)
    assert mutual == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_and_classes_stay_small(module: str) -> None:
    text = MODULES[module].read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"class {node.name} has {size} lines"


def test_the_checks_see_the_imports_they_judge() -> None:
    # A check that found no edges would pass on anything.
    assert "memsentry.model" in GRAPH["memsentry.rules.growth"]
    assert "memsentry.rules" in GRAPH["memsentry.tracker"]
    assert "memsentry.record.sampler" in GRAPH["memsentry.record.recorder"]
    assert _layer("memsentry.rules.growth") > _layer("memsentry.model")
