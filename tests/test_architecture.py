"""The house's rules, checked on the source: each layer imports only downward, no import
cycle anywhere (imports inside functions count), and the code stays simple enough to read
(a complexity gate that counts boolean chains and comprehensions, which ruff's does not)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from radon.complexity import cc_rank, cc_visit
from radon.raw import analyze

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
    ("memsentry.rules", "memsentry.snapshots"),
    ("memsentry.reporters",),
    ("memsentry.report", "memsentry.alarm", "memsentry.tracker"),
    ("memsentry.cli", "memsentry.integrations", "memsentry.__main__", "memsentry"),
    ("pytest_memsentry",),
)
#: The complexity gate. radon grades each function and method by its cyclomatic complexity
#: (each branch, loop, boolean operator, comprehension and except clause adds one): A to B
#: up to 10, C up to 20, then D to F. The packages may have at most this many blocks of
#: grade C per 1,000 source lines (memray has 2.1, pyinstrument 2.3, pytest-memray 2.5), and
#: none worse than C.
MAX_C_PER_THOUSAND = 2.0
WORST_GRADE = "C"


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


def _graded(text: str) -> list[tuple[str, int]]:
    """(name, complexity) of every function and method in ``text``, as ``radon cc`` lists
    them (closures count towards the function that holds them)."""
    # cc_visit lists each class, and each of its methods again on its own: classes are
    # left out, as the command line does.
    return [(block.fullname, block.complexity) for block in cc_visit(text)
            if not hasattr(block, "methods")]


def _complex_blocks() -> tuple[list[str], int]:
    """The blocks of grade C or worse, described, and the source lines of the packages."""
    found: list[str] = []
    lines = 0
    for module, path in sorted(MODULES.items()):
        text = path.read_text(encoding="utf-8")
        lines += analyze(text).sloc
        found += [f"{module}.{name}: {cc_rank(complexity)} ({complexity})"
                  for name, complexity in _graded(text) if cc_rank(complexity) >= "C"]
    return found, lines


def test_the_code_passes_the_complexity_gate() -> None:
    found, lines = _complex_blocks()
    worse = [block for block in found if block.split(": ")[1][0] > WORST_GRADE]
    assert worse == [], "blocks above the worst grade allowed: split them into named steps"
    allowed = MAX_C_PER_THOUSAND * lines / 1000
    assert len(found) <= allowed, (
        f"{len(found)} blocks of grade C in {lines:,} source lines, over the "
        f"{allowed:.0f} the gate allows ({MAX_C_PER_THOUSAND} per 1,000): " + "; ".join(found))


def test_the_gate_counts_boolean_chains_and_comprehensions() -> None:
    # A gate that saw only if-statements would pass on code written denser to fit it.
    chain = "def f(a, b, c, d, e, f, g, h, i, j, k):\n    return " + " and ".join("abcdefghijk")
    assert _graded(chain) == [("f", 11)] and cc_rank(11) == "C"
    loops = "def g(xs):\n    return [x for x in xs if x] + [y for y in xs if y or not y]"
    assert _graded(loops)[0][1] == 6
    methods = "class K:\n    def m(self, a):\n        return 1 if a else 2"
    assert _graded(methods) == [("K.m", 2)]


def test_the_policy_reads_no_clock_torch_or_hook() -> None:
    # What memsentry measures when is decided from plain facts: the policy imports nothing
    # but the standard library's values and arithmetic.
    tree = ast.parse(MODULES["memsentry.record.policy"].read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "enum", "math"}, imported


def test_the_architecture_page_names_every_module_of_record() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    record = sorted(path.name for path in (ROOT / "memsentry" / "record").glob("*.py")
                    if path.name != "__init__.py")
    assert len(record) > 20
    assert [name for name in record if f"`{name}`" not in page] == []


def test_the_checks_see_the_imports_they_judge() -> None:
    # A check that found no edges would pass on anything.
    assert "memsentry.model" in GRAPH["memsentry.rules.growth"]
    assert "memsentry.rules" in GRAPH["memsentry.tracker"]
    assert "memsentry.record.sampler" in GRAPH["memsentry.record.recorder"]
    assert _layer("memsentry.rules.growth") > _layer("memsentry.model")
